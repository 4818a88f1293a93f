"""A gRPC service as plain handler functions, served by either engine.

``native`` is the kit's own h2c server (:mod:`torchft_lite.rpc.h2grpc`, about 2.5x
less server CPU per call); ``grpcio`` is grpc.aio. Handlers take the request's
bytes and a context offering ``peer()`` and ``await abort(code, details)``, and
return (or, streaming, yield) the response's bytes, so the same functions run
on both. Raising ``RpcAbort`` instead of awaiting ``abort`` works on ``native`` only.

Both engines answer only the callers the ``access`` policy admits (the job
token, else loopback peers only): the check runs before any handler, a
refused call ends UNAUTHENTICATED or PERMISSION_DENIED, and ``refusals``
counts it (the lighthouse's ``/metrics`` reads the counts).

Both engines also hold every peer to the flood limits of a
:class:`~torchft_lite.rpc.limits.ServerLimits` (connections, streams, PING and
SETTINGS floods, rapid reset, idle and slow connections, header and message
sizes): ``native`` all of them, ``grpcio`` those grpc has a channel argument
for (:func:`~torchft_lite.rpc.limits.grpcio_options` lists what it lacks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Union

import grpc

from torchft_lite.rpc.access import HEADER, Access
from torchft_lite.rpc.addresses import split_host_port
from torchft_lite.rpc.h2grpc import GrpcServer
from torchft_lite.rpc.h2grpc.server import StreamHandler, UnaryHandler
from torchft_lite.rpc.limits import ServerLimits, grpcio_options
from torchft_lite.rpc.refusals import RefusalLog, status_of
from torchft_lite.rpc.tls import ALPN_GRPC, TlsSettings

__all__ = ["GRPCIO_OPTIONS", "RefusalLog", "Server", "Service", "start_service"]

Server = Union[GrpcServer, grpc.aio.Server]
"""What :func:`start_service` returns, by engine; both stop with ``await server.stop(grace)``."""

# grpc.aio server options besides the flood limits (start_service adds those: limits.grpcio_options).
GRPCIO_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
    # Since grpcio 1.82 the core sheds calls (as a bare CANCELLED, before any
    # handler runs) once more than 1000 are queued for the Python server; a round
    # of N Quorum calls plus heartbeats exceeds that at N~1000.
    ("grpc.server.max_pending_requests", 100_000),
    ("grpc.server.max_pending_requests_hard_limit", 200_000),
]


@dataclass(frozen=True)
class Service:
    """One gRPC service: its full name (``package.Service``) and a handler per method name."""

    name: str
    unary: Mapping[str, UnaryHandler]
    server_streams: Mapping[str, StreamHandler] = field(default_factory=dict)


async def start_service(service: Service, bind: str, engine: str = "native", *, access: Access = Access(),
                        refusals: RefusalLog | None = None, limits: ServerLimits | None = None,
                        tls: TlsSettings | None = None) -> tuple[Server, int]:
    """Serve ``service`` on ``bind`` (``HOST:PORT``, port 0 for a free one) until ``await server.stop(grace)``,
    to the callers ``access`` admits (the default: no token, loopback peers only); refused calls are
    counted in ``refusals`` (one of its own when None), each peer held to ``limits`` (None: the defaults).

    With ``tls`` holding a certificate (``TlsSettings.serving``), both engines serve TLS only (ALPN h2);
    otherwise plain h2c.

    Returns the server and the bound port; a port that cannot be bound raises ``OSError``.
    """
    secure = tls is not None and tls.serving
    refusals = RefusalLog(service.name) if refusals is None else refusals
    limits = ServerLimits() if limits is None else limits
    if engine == "grpcio":
        server = grpc.aio.server(options=GRPCIO_OPTIONS + grpcio_options(limits))
        server.add_generic_rpc_handlers((_generic_handler(service, access, refusals),))
        try:
            port = server.add_secure_port(bind, tls.grpc_server_credentials()) if secure \
                else server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise OSError(f"{exc} (address in use?)") from exc
        await server.start()
        return server, port
    if engine != "native":
        raise ValueError(f"unknown gRPC engine {engine!r}: 'native' or 'grpcio'")
    native = GrpcServer(access=access, refusals=refusals, limits=limits)
    for method, handler in service.unary.items():
        native.add_unary(f"/{service.name}/{method}", handler)
    for method, stream in service.server_streams.items():
        native.add_server_stream(f"/{service.name}/{method}", stream)
    host, port = split_host_port(bind)
    return native, await native.start(host, port, tls.server_context(ALPN_GRPC) if secure else None)


def _identity(data: bytes) -> bytes:
    return data


async def _admit(context: grpc.aio.ServicerContext, method: str, access: Access, refusals: RefusalLog) -> None:
    """Abort the call (before its handler runs) unless ``access`` admits its peer and token."""
    authorization = next((value for key, value in context.invocation_metadata() or () if key == HEADER), None)
    refusal = access.check(context.peer(), authorization)
    if refusal is not None:
        refusals.note(context.peer(), method, refusal)
        await context.abort(status_of(refusal), refusal.message)


def _guarded_unary(handler: UnaryHandler, method: str, access: Access, refusals: RefusalLog) -> UnaryHandler:
    async def guarded(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await _admit(context, method, access, refusals)
        return await handler(request, context)

    return guarded


def _guarded_stream(handler: StreamHandler, method: str, access: Access, refusals: RefusalLog) -> StreamHandler:
    async def guarded(request: bytes, context: grpc.aio.ServicerContext):
        await _admit(context, method, access, refusals)
        async for message in handler(request, context):
            yield message

    return guarded


def _generic_handler(service: Service, access: Access, refusals: RefusalLog) -> grpc.GenericRpcHandler:
    """The handlers for grpc.aio (requests and responses stay bytes), each behind the access check.

    (Not a server interceptor: grpc.aio's interceptors see the metadata but not the peer.)
    """
    handlers = {}
    for name, fn in service.unary.items():
        guarded = _guarded_unary(fn, f"/{service.name}/{name}", access, refusals)
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=_identity, response_serializer=_identity
        )
    for name, stream in service.server_streams.items():
        guarded_stream = _guarded_stream(stream, f"/{service.name}/{name}", access, refusals)
        handlers[name] = grpc.unary_stream_rpc_method_handler(
            guarded_stream, request_deserializer=_identity, response_serializer=_identity
        )
    return grpc.method_handlers_generic_handler(service.name, handlers)
