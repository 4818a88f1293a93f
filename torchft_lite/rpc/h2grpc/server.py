"""A small gRPC server (h2c) on asyncio/uvloop for the lighthouse's hot path.

The lighthouse serves tiny requests and identical responses, which this server
answers with one write each; on grpc.aio the lighthouse spent 2.3-2.9x the server
CPU per round (docs/benchmarks.md, "The lighthouse's gRPC engine"), which decides
whether a lighthouse keeps up with 1000 replica groups. Handlers have the shape of
grpc.aio generic handlers over raw bytes, so the same functions run on either
engine (``torchft_lite.rpc.engines``); see :class:`GrpcServer`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import grpc

from torchft_lite.rpc.access import HEADER, Access
from torchft_lite.rpc.addresses import dual_stack_socket
from torchft_lite.rpc.h2grpc import wire
from torchft_lite.rpc.h2grpc.connection import H2Connection
from torchft_lite.rpc.h2grpc.guard import ConnectionGuard
from torchft_lite.rpc.h2grpc.streams import Stream
from torchft_lite.rpc.limits import LimitLog, ServerLimits
from torchft_lite.rpc.refusals import RefusalLog, status_of

logger = logging.getLogger(__name__)

UnaryHandler = Callable[[bytes, "RpcContext"], Awaitable[bytes]]
StreamHandler = Callable[[bytes, "RpcContext"], AsyncIterator[bytes]]

_RESPONSE_HEADERS = wire.encode_headers([(b":status", b"200"), (b"content-type", b"application/grpc")])


def _status_block(code: grpc.StatusCode, details: str = "", trailers_only: bool = False) -> bytes:
    headers = [(b":status", b"200"), (b"content-type", b"application/grpc")] if trailers_only else []
    headers.append((b"grpc-status", str(code.value[0]).encode()))
    if details:
        headers.append((b"grpc-message", wire.percent_encode(details)))
    return wire.encode_headers(headers)


_OK_TRAILERS = _status_block(grpc.StatusCode.OK)
_AUTHORIZATION = HEADER.encode()


class RpcAbort(Exception):
    """Raised by ``context.abort``: finishes the call with ``code``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class RpcContext:
    __slots__ = ("method", "_peer", "timeout")

    def __init__(self, method: str, peer: str, timeout: float | None) -> None:
        self.method = method
        self._peer = peer
        self.timeout = timeout

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise RpcAbort(code, details)


@dataclass(frozen=True)
class _Method:
    handler: Callable
    streaming: bool


class GrpcServer:
    """Serves registered methods over h2c (or TLS, ALPN h2).

    Handlers: ``async def unary(request: bytes, context) -> bytes`` (:meth:`add_unary`) and
    ``async def server_stream(request: bytes, context) -> AsyncIterator[bytes]`` (:meth:`add_server_stream`);
    ``context`` (an :class:`RpcContext`) offers ``peer()`` and ``await abort(code, details)``.

    Every call passes the server's :class:`~torchft_lite.rpc.access.Access` check (the job token, else loopback
    peers only) before its method is even looked up; a refused call is answered UNAUTHENTICATED or
    PERMISSION_DENIED and counted in :attr:`refusals`, and nothing else happens.
    """

    def __init__(
        self,
        *,
        limits: ServerLimits | None = None,
        access: Access | None = None,
        refusals: RefusalLog | None = None,
        **overrides: int | float | None,
    ) -> None:
        # None: Access(), the secure default (no token: loopback peers only).
        self.access = Access() if access is None else access
        self.refusals = RefusalLog("gRPC server") if refusals is None else refusals
        # The flood limits (torchft_lite.rpc.limits); ``overrides`` replace fields of ``limits`` (or of the
        # defaults), e.g. GrpcServer(max_request_bytes=...). A new value applies to connections made after.
        self.limits = dataclasses.replace(ServerLimits() if limits is None else limits, **overrides)
        self.guard = ConnectionGuard(self, LimitLog("gRPC server"))
        self.connections: set[H2Connection] = set()
        self.protocol_errors = 0
        self._methods: dict[str, _Method] = {}
        self._listener: asyncio.AbstractServer | None = None
        self._calls: set[asyncio.Task] = set()

    @property
    def limits_hit(self) -> dict[str, int]:
        """How often peers hit each flood limit, by name ('rapid_reset', 'ping_flood', 'idle_timeout', ...)."""
        return self.guard.log.counts

    def add_unary(self, path: str, handler: UnaryHandler) -> None:
        self._methods[path] = _Method(handler, streaming=False)

    def add_server_stream(self, path: str, handler: StreamHandler) -> None:
        self._methods[path] = _Method(handler, streaming=True)

    # ------------------------------------------------------------ lifecycle

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (host '' or '::' means every interface, IPv4 too); returns the port.

        ``tls``: serve TLS with this context (``torchft_lite.rpc.tls``; its ALPN must offer ``h2``, which
        gRPC clients require); None serves h2c, plain text, as before.
        """
        loop = asyncio.get_running_loop()
        factory = lambda: H2Connection(self)  # noqa: E731
        # A TLS handshake is bounded as the HTTP/2 preface after it is (asyncio's own default is 60 s).
        secure = {} if tls is None else {"ssl": tls, "ssl_handshake_timeout": self.limits.handshake_timeout}
        if host in ("", "::"):
            # asyncio marks AF_INET6 listeners IPV6_V6ONLY, which would refuse
            # IPv4 clients (127.0.0.1); one dual-stack socket takes both.
            sock = dual_stack_socket(port)
            self._listener = await loop.create_server(factory, sock=sock, backlog=4096, **secure)
        else:
            try:
                self._listener = await loop.create_server(factory, host, port, reuse_address=True, backlog=4096,
                                                          **secure)
            except OSError as exc:
                raise OSError(exc.errno, f"could not bind {host}:{port}: {exc.strerror or exc}") from exc
        self.guard.start()
        return self._listener.sockets[0].getsockname()[1]

    async def stop(self, grace: float) -> None:
        """Stop accepting, let calls in flight finish for ``grace`` seconds, then cut the rest."""
        self.guard.stop()
        if self._listener is not None:
            self._listener.close()
        for connection in list(self.connections):
            connection.go_away()
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=grace)
        for task in list(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=grace)
        for connection in list(self.connections):
            connection.abort()
        if self._listener is not None:
            await self._listener.wait_closed()
            self._listener = None

    # ------------------------------------------------------------ calls

    def dispatch(self, connection: H2Connection, stream: Stream) -> None:
        headers = stream.headers
        if headers.get(b":method") != b"POST":
            connection.trailers_only(stream, wire.encode_headers([(b":status", b"405")]))
            return
        if not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            connection.trailers_only(stream, wire.encode_headers([(b":status", b"415")]))
            return
        path = headers.get(b":path", b"").decode("utf-8", "replace")
        refusal = self.access.check(connection.peer, headers.get(_AUTHORIZATION))
        if refusal is not None:
            self.refusals.note(connection.peer, path, refusal)
            connection.trailers_only(stream, _status_block(status_of(refusal), refusal.message, True))
            return
        method = self._methods.get(path)
        if method is None:
            connection.trailers_only(
                stream, _status_block(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}", True)
            )
            return
        timeout = wire.parse_grpc_timeout(headers.get(b"grpc-timeout", b""))
        context = RpcContext(path, connection.peer, timeout)
        task = asyncio.get_running_loop().create_task(self._call(connection, stream, method, context))
        stream.task = task
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    def reject_oversized(self, connection: H2Connection, stream: Stream, details: str | None = None) -> None:
        details = details or f"request larger than {connection.limits.max_request_bytes} bytes"
        self.guard.log.hit("request_size", connection.peer, f"stream {stream.id}: {details}")
        connection.trailers_only(stream, _status_block(grpc.StatusCode.RESOURCE_EXHAUSTED, details, True))
        connection.reset(stream, wire.NO_ERROR)

    async def _call(self, connection: H2Connection, stream: Stream, method: _Method, context: RpcContext) -> None:
        try:
            try:
                messages = wire.split_grpc_messages(bytes(stream.body))
            except ValueError as exc:
                raise RpcAbort(grpc.StatusCode.INTERNAL, f"malformed request framing: {exc}") from None
            stream.body = bytearray()
            if len(messages) != 1:
                raise RpcAbort(grpc.StatusCode.UNIMPLEMENTED if len(messages) > 1 else grpc.StatusCode.INTERNAL,
                               f"expected one request message, got {len(messages)}")
            compressed, request = messages[0]
            if compressed:
                raise RpcAbort(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported")
            async with asyncio.timeout(context.timeout):
                if method.streaming:
                    async for message in method.handler(request, context):
                        connection.send_messages(stream, _RESPONSE_HEADERS, wire.grpc_message(message))
                    connection.send_response(stream, _RESPONSE_HEADERS, b"", _OK_TRAILERS)
                else:
                    response = await method.handler(request, context)
                    connection.send_response(stream, _RESPONSE_HEADERS, wire.grpc_message(response), _OK_TRAILERS)
        except RpcAbort as abort:
            self._finish_with_status(connection, stream, abort.code, abort.details)
        except TimeoutError:
            self._finish_with_status(connection, stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except asyncio.CancelledError:
            # The peer reset the stream, the connection dropped, or the server is stopping.
            self._finish_with_status(connection, stream, grpc.StatusCode.CANCELLED, "call cancelled")
            raise
        except Exception as exc:
            logger.exception("handler for %s failed", context.method)
            self._finish_with_status(connection, stream, grpc.StatusCode.UNKNOWN,
                                     f"Exception calling application: {exc!r}")

    @staticmethod
    def _finish_with_status(connection: H2Connection, stream: Stream, code: grpc.StatusCode, details: str) -> None:
        if stream.response_started:
            connection.send_response(stream, _RESPONSE_HEADERS, b"", _status_block(code, details))
        else:
            connection.trailers_only(stream, _status_block(code, details, trailers_only=True))

