"""The heal's HTTP client: a lean HTTP/1.1 client whose response bodies the kernel writes straight into tensors.

Every request a receiver makes of a checkpoint server goes through here:
:func:`get_into` for the state dict, its header, data ranges and checksums,
:func:`post` for the ``done`` report. A ``BufferedProtocol`` gives the event loop
a view of the destination itself (a :class:`BodySink`, see ``_body_sinks``), so a
heal costs one copy (the kernel's) plus one cached read of each block for its
checksum, where aiohttp's client would hand the body over as ``bytes`` to copy
again (the two measured: docs/benchmarks.md, "The heal's HTTP client"). Only what
the checkpoint server answers is understood: a status line, headers with a
``Content-Length``, then exactly that many body bytes, one request per connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import urllib.parse
from typing import Callable, Protocol

from torchft_lite.checkpointing._streams import on_own_thread
from torchft_lite.errors import CheckpointTransferError

__all__ = ["BodySink", "HTTPStatusError", "get_into", "get_into_on_thread", "parse_head", "post"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10
MAX_ERROR_BYTES = 64 << 10
RECEIVE_BUFFER_BYTES = 8 << 20
# Wake the loop only once this many body bytes are queued (or the rest of the body, when less): fewer, larger
# reads. Without it a fast receiver wakes for every 64-256 KiB that arrives, and the per-read work (finding
# the destination, counting) adds up to a fifth of a transfer's time.
LOW_WATER_BYTES = 512 << 10
CONNECT_SECONDS = 10.0
"""How long a reading thread waits for a connection (the one call of its own that abort() can't cut short)."""


class BodySink(Protocol):
    """Where a response body goes."""

    def buffer(self) -> memoryview:
        """A writable, non-empty view for the next body bytes (never past the body's end)."""

    def filled(self, count: int) -> None:
        """``count`` bytes were written at the start of the last :meth:`buffer`."""


class HTTPStatusError(Exception):
    """The server answered something other than 200; ``text`` is the start of its body."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
        self.text = text


class _ErrorText:
    """Collects the start of an error body."""

    def __init__(self, length: int) -> None:
        self.data = bytearray(min(length, MAX_ERROR_BYTES))
        self.count = 0

    def buffer(self) -> memoryview:
        if self.count < len(self.data):
            return memoryview(self.data)[self.count:]
        return memoryview(bytearray(64 << 10))  # the rest is read and dropped

    def filled(self, count: int) -> None:
        self.count = min(len(self.data), self.count + count)


class _Discard:
    """The body of a successful POST: a few words, read and dropped."""

    def __init__(self, length: int) -> None:
        self._scratch = memoryview(bytearray(min(max(length, 1), MAX_ERROR_BYTES)))

    def buffer(self) -> memoryview:
        return self._scratch

    def filled(self, count: int) -> None:
        pass


def parse_head(head: bytes | bytearray) -> tuple[int, dict[str, str], int]:
    """Status, headers (names in lower case) and body length of a response head (without its blank line)."""
    lines = bytes(head).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise CheckpointTransferError(f"not an HTTP response: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "transfer-encoding" in headers or not headers.get("content-length", "").isdigit():
        raise CheckpointTransferError("the checkpoint server's answer has no Content-Length")
    return int(parts[1]), headers, int(headers["content-length"])


def _error_of(status: int, sink: _ErrorText) -> HTTPStatusError:
    return HTTPStatusError(status, bytes(sink.data[:sink.count]).decode(errors="replace"))


class _LowWater:
    """A socket's ``SO_RCVLOWAT``: a blocking read returns once that many bytes are in (or the stream ended).
    Left alone over TLS (``sock`` None), where the socket carries records, not the body's bytes."""

    def __init__(self, sock: socket.socket | None) -> None:
        self._sock, self._count = sock, 1

    def set(self, count: int) -> None:
        count = max(count, 1)
        if self._sock is None or count == self._count:
            return
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, count)
            self._count = count
        except OSError as exc:  # not supported: every read is just smaller
            logger.debug("could not set SO_RCVLOWAT to %d: %r", count, exc)
            self._sock = None


class _ResponseProtocol(asyncio.BufferedProtocol):
    """One response, its body read into the sink's views.

    Over TLS (``tls``: an ``ssl.SSLContext``, which the receiver passes for ``https://`` sources or when the job
    sets TLS) the event loop decrypts straight into the same views: still one copy. Only ``SO_RCVLOWAT`` is left
    alone there (``low_water=False``), since the socket then carries more bytes (records) than the body, some
    already read into the TLS layer.
    """

    def __init__(self, sink_for: Callable[[int], BodySink], low_water: bool = True) -> None:
        self._sink_for = sink_for
        self._use_low_water = low_water
        self._scratch = memoryview(bytearray(MAX_HEAD_BYTES))
        self._head = bytearray()
        self._sink: BodySink | None = None
        self._remaining = 0
        self.status = 0
        self.headers: dict[str, str] = {}
        """The response's headers, names in lower case."""
        self.transport: asyncio.Transport | None = None
        self._low_water = _LowWater(None)  # the socket's, once connected
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._low_water = _LowWater(transport.get_extra_info("socket") if self._use_low_water else None)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._sink is None or self.done.done():
            return self._scratch
        return self._sink.buffer()[:self._remaining]  # never read past the body

    def buffer_updated(self, nbytes: int) -> None:
        if self.done.done():
            return  # bytes after the body (or after a failure) are dropped
        try:
            if self._sink is None:
                self._head += self._scratch[:nbytes]
                self._parse_head()
            else:
                self._sink.filled(nbytes)
                self._consumed(nbytes)
        except Exception as exc:  # a bad answer or a refused byte: this request fails with it
            self._fail(exc)

    def _parse_head(self) -> None:
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD_BYTES:
                raise CheckpointTransferError(f"the response head exceeds {MAX_HEAD_BYTES} bytes")
            return
        self.status, self.headers, self._remaining = parse_head(self._head[:end])
        self._sink = self._sink_for(self._remaining) if self.status == 200 else _ErrorText(self._remaining)
        body = memoryview(self._head)[end + 4:]
        while len(body) and self._remaining and not self.done.done():
            destination = self._sink.buffer()
            count = min(len(destination), len(body), self._remaining)
            destination[:count] = body[:count]
            self._sink.filled(count)
            self._consumed(count)
            body = body[count:]
        self._head = bytearray()
        self._consumed(0)

    def _consumed(self, count: int) -> None:
        self._remaining -= count
        if self._remaining < 0:
            raise CheckpointTransferError("the server sent more body bytes than it declared")
        # never above what is still to come: the last bytes must wake the loop too
        self._low_water.set(min(LOW_WATER_BYTES, self._remaining) if self.status == 200 else 1)
        if self._remaining == 0 and self._sink is not None and not self.done.done():
            if self.status == 200:
                self.done.set_result(None)
            else:
                assert isinstance(self._sink, _ErrorText)
                self.done.set_exception(_error_of(self.status, self._sink))

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if self._sink is None:
            self.done.set_exception(ConnectionResetError(f"the connection closed before an answer ({exc!r})"))
        else:
            self.done.set_exception(CheckpointTransferError(
                f"checkpoint truncated: the connection closed with {self._remaining} body bytes missing"))


async def get_into(url: str, params: dict[str, str], headers: dict[str, str],
                   sink_for: Callable[[int], BodySink], *, tls: ssl.SSLContext | None = None) -> dict[str, str]:
    """GET ``url``; a 200 body of ``n`` bytes goes into ``sink_for(n)``; returns the response's headers.

    Header names are in lower case (a source's ``X-Checkpoint-Streams``, say).

    Any other status raises :class:`HTTPStatusError`. ``sink_for`` (and the
    sink) may raise to refuse the body; the connection is then aborted.
    Cancelling the call aborts the connection. ``tls``: connect with TLS
    (required for an ``https://`` URL; also used for ``http://`` when given).
    """
    return await _request("GET", url, params, headers, sink_for, tls)


async def post(url: str, params: dict[str, str], headers: dict[str, str], *,
               tls: ssl.SSLContext | None = None) -> None:
    """POST an empty body to ``url``; any status but 200 raises :class:`HTTPStatusError`."""
    await _request("POST", url, params, headers, _Discard, tls)


def _target(method: str, url: str, params: dict[str, str], headers: dict[str, str],
            tls: ssl.SSLContext | None) -> tuple[str, int, bytes]:
    """Host, port and request bytes of ``method url?params`` (one request per connection)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or parsed.hostname is None:
        raise CheckpointTransferError(f"not an http:// or https:// URL: {url!r}")
    if parsed.scheme == "https" and tls is None:
        raise CheckpointTransferError(f"{url!r} needs TLS, and no TLS context was given")
    host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    authority = f"[{host}]" if ":" in host else host
    target = (parsed.path or "/") + ("?" + urllib.parse.urlencode(params) if params else "")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {authority}:{port}", "Connection: close",
             "Accept-Encoding: identity", *(["Content-Length: 0"] if method == "POST" else []),
             *(f"{name}: {value}" for name, value in headers.items())]
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _enlarge_receive_buffer(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
    except OSError as exc:  # the kernel's default then; only throughput suffers
        logger.debug("could not enlarge the receive buffer: %r", exc)


async def _request(method: str, url: str, params: dict[str, str], headers: dict[str, str],
                   sink_for: Callable[[int], BodySink], tls: ssl.SSLContext | None) -> dict[str, str]:
    host, port, request = _target(method, url, params, headers, tls)
    loop = asyncio.get_running_loop()
    secure = {} if tls is None else {"ssl": tls, "server_hostname": host}
    transport, protocol = await loop.create_connection(lambda: _ResponseProtocol(sink_for, low_water=tls is None),
                                                       host, port, **secure)
    try:
        _enlarge_receive_buffer(transport.get_extra_info("socket"))
        transport.write(request)
        await protocol.done
        return protocol.headers
    finally:
        if protocol.done.done() and not protocol.done.cancelled() and protocol.done.exception() is None:
            transport.close()
        else:
            transport.abort()


# ---------------------------------------------------------------- read on a thread of its own


async def get_into_on_thread(url: str, params: dict[str, str], headers: dict[str, str],
                             sink_for: Callable[[int], BodySink], *, timeout: float,
                             tls: ssl.SSLContext | None = None) -> dict[str, str]:
    """:func:`get_into`, with the socket read on a thread of its own instead of the event loop.

    The thread makes blocking reads straight into the sink's views (one copy, the kernel's, as on the loop),
    so several responses read at once use as many cores, and the control-plane loop stays free. The sink is
    called from that thread: several such reads may share a ``TensorWriter`` only over disjoint blocks. No
    read waits longer than ``timeout`` seconds (the heal's time left: a backstop, should nobody cancel).
    Cancelling the call shuts the socket down and returns once the thread has stopped writing into the sink.
    """
    host, port, request = _target("GET", url, params, headers, tls)
    reader = _ThreadedResponse(sink_for, timeout)
    return await on_own_thread("torchft-heal-read", reader.abort, reader.run, host, port, request, tls)


class _ThreadedResponse:
    """One response read by blocking calls on one thread; :meth:`abort` (from any thread) makes them return."""

    def __init__(self, sink_for: Callable[[int], BodySink], timeout: float) -> None:
        self._sink_for, self._timeout = sink_for, timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._aborted = False

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # a blocked recv_into returns at once
                except OSError:
                    pass

    def _hold(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self._aborted:
                raise ConnectionAbortedError("the fetch was cancelled")

    def run(self, host: str, port: int, request: bytes, tls: ssl.SSLContext | None) -> dict[str, str]:
        sock = socket.create_connection((host, port), timeout=min(CONNECT_SECONDS, self._timeout))
        try:
            sock.settimeout(self._timeout)  # abort() ends a blocked call sooner: the heal's timeout calls it
            self._hold(sock)
            _enlarge_receive_buffer(sock)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=host)
                self._hold(sock)
            sock.sendall(request)
            return self._read(sock, tls_free=tls is None)
        finally:
            sock.close()

    def _read(self, sock: socket.socket, tls_free: bool) -> dict[str, str]:
        head, scratch = bytearray(), memoryview(bytearray(MAX_HEAD_BYTES))
        while (end := head.find(b"\r\n\r\n")) < 0:
            if len(head) > MAX_HEAD_BYTES:
                raise CheckpointTransferError(f"the response head exceeds {MAX_HEAD_BYTES} bytes")
            count = sock.recv_into(scratch)
            if count == 0:
                raise ConnectionResetError("the connection closed before an answer")
            head += scratch[:count]
        status, headers, remaining = parse_head(head[:end])
        sink = self._sink_for(remaining) if status == 200 else _ErrorText(remaining)
        body = memoryview(head)[end + 4:]
        if len(body) > remaining:
            raise CheckpointTransferError("the server sent more body bytes than it declared")
        while len(body):
            destination = sink.buffer()
            count = min(len(destination), len(body))
            destination[:count] = body[:count]
            sink.filled(count)
            body, remaining = body[count:], remaining - count
        low_water = _LowWater(sock if tls_free else None)
        while remaining:
            low_water.set(min(LOW_WATER_BYTES, remaining))  # fewer, larger reads, as on the loop
            count = sock.recv_into(sink.buffer()[:remaining])
            if count == 0:
                raise CheckpointTransferError(
                    f"checkpoint truncated: the connection closed with {remaining} body bytes missing")
            sink.filled(count)
            remaining -= count
        if status != 200:
            assert isinstance(sink, _ErrorText)
            raise _error_of(status, sink)
        return headers
