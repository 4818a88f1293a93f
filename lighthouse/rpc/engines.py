"""A gRPC service as plain handler functions, served by either engine.

``native`` is the kit's own h2c server (:mod:`lighthouse.rpc.h2grpc`, about 2.5x
less server CPU per call); ``grpcio`` is grpc.aio. Handlers take the request's
bytes and a context offering ``peer()`` and ``await abort(code, details)``, and
return (or, streaming, yield) the response's bytes, so the same functions run
on both. Raising ``RpcAbort`` instead of awaiting ``abort`` works on ``native`` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import grpc

from lighthouse.rpc.addresses import split_host_port
from lighthouse.rpc.h2grpc import GrpcServer
from lighthouse.rpc.h2grpc.server import StreamHandler, UnaryHandler

__all__ = ["GRPCIO_OPTIONS", "Service", "start_service"]

GRPCIO_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
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


async def start_service(service: Service, bind: str, engine: str = "native") -> tuple[GrpcServer | grpc.aio.Server, int]:
    """Serve ``service`` on ``bind`` (``HOST:PORT``, port 0 for a free one) until ``await server.stop(grace)``.

    Returns the server and the bound port; a port that cannot be bound raises ``OSError``.
    """
    if engine == "grpcio":
        server = grpc.aio.server(options=GRPCIO_OPTIONS)
        server.add_generic_rpc_handlers((_generic_handler(service),))
        try:
            port = server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise OSError(f"{exc} (address in use?)") from exc
        await server.start()
        return server, port
    if engine != "native":
        raise ValueError(f"unknown gRPC engine {engine!r}: 'native' or 'grpcio'")
    native = GrpcServer()
    for method, handler in service.unary.items():
        native.add_unary(f"/{service.name}/{method}", handler)
    for method, stream in service.server_streams.items():
        native.add_server_stream(f"/{service.name}/{method}", stream)
    host, port = split_host_port(bind)
    return native, await native.start(host, port)


def _identity(data: bytes) -> bytes:
    return data


def _generic_handler(service: Service) -> grpc.GenericRpcHandler:
    """The handlers for grpc.aio (requests and responses stay bytes)."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=_identity, response_serializer=_identity)
        for name, fn in service.unary.items()
    }
    for name, stream in service.server_streams.items():
        handlers[name] = grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=_identity, response_serializer=_identity
        )
    return grpc.method_handlers_generic_handler(service.name, handlers)
