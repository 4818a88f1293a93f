"""A lean HTTP/1.1 GET whose response body the kernel writes straight into tensor memory.

aiohttp's client hands a body over as ``bytes`` objects, which the receiver
would then copy into its tensors: two user-space copies of every byte. Here a
``BufferedProtocol`` gives the event loop a view of the destination itself
(:class:`BodySink`), so a heal costs one copy (the kernel's) plus one cached
read of each block for its checksum.

Only what the checkpoint server answers is understood: a status line, headers
with a ``Content-Length``, then exactly that many body bytes, one request per
connection (``Connection: close``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.parse
from typing import Any, Callable, Protocol

from torchft_lite.checkpointing._decode import TensorWriter
from torchft_lite.checkpointing._format import PREFIX_SIZE, Path, parse_header, unpack_prefix
from torchft_lite.errors import CheckpointTransferError

__all__ = ["BodySink", "BytesSink", "DataSink", "EncodedSink", "HTTPStatusError", "get_into"]

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10
MAX_ERROR_BYTES = 64 << 10
RECEIVE_BUFFER_BYTES = 8 << 20
# Wake the loop only once this many body bytes are queued (or the rest of the body, when less): fewer, larger
# reads. Without it a fast receiver wakes for every 64-256 KiB that arrives, and the per-read work (finding
# the destination, counting) adds up to a fifth of a transfer's time.
LOW_WATER_BYTES = 512 << 10


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


class _GetProtocol(asyncio.BufferedProtocol):
    def __init__(self, sink_for: Callable[[int], BodySink]) -> None:
        self._sink_for = sink_for
        self._scratch = memoryview(bytearray(MAX_HEAD_BYTES))
        self._head = bytearray()
        self._sink: BodySink | None = None
        self._remaining = 0
        self.status = 0
        self.transport: asyncio.Transport | None = None
        self._low_water = 1  # the socket's SO_RCVLOWAT
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

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
        except Exception as exc:  # a bad answer or a refused byte: this GET fails with it
            self._fail(exc)

    def _parse_head(self) -> None:
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD_BYTES:
                raise CheckpointTransferError(f"the response head exceeds {MAX_HEAD_BYTES} bytes")
            return
        lines = bytes(self._head[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise CheckpointTransferError(f"not an HTTP response: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "transfer-encoding" in headers or not headers.get("content-length", "").isdigit():
            raise CheckpointTransferError("the checkpoint server's answer has no Content-Length")
        self.status = int(parts[1])
        self._remaining = int(headers["content-length"])
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
        self._set_low_water(min(LOW_WATER_BYTES, self._remaining) if self.status == 200 else 1)
        if self._remaining == 0 and self._sink is not None and not self.done.done():
            if self.status == 200:
                self.done.set_result(None)
            else:
                assert isinstance(self._sink, _ErrorText)
                text = bytes(self._sink.data[:self._sink.count]).decode(errors="replace")
                self.done.set_exception(HTTPStatusError(self.status, text))

    def _set_low_water(self, count: int) -> None:
        """Never above what is still to come: the last bytes must wake the loop too."""
        count = max(count, 1)
        if count == self._low_water or self.transport is None:
            return
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, count)
            self._low_water = count
        except OSError as exc:  # not supported (then it was never raised either): every read is just smaller
            logger.debug("could not set SO_RCVLOWAT to %d: %r", count, exc)

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
                   sink_for: Callable[[int], BodySink]) -> None:
    """GET ``url``; a 200 body of ``n`` bytes goes into ``sink_for(n)``.

    Any other status raises :class:`HTTPStatusError`. ``sink_for`` (and the
    sink) may raise to refuse the body; the connection is then aborted.
    Cancelling the call aborts the connection.
    """
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or parsed.hostname is None:
        raise CheckpointTransferError(f"not an http:// URL: {url!r}")
    host, port = parsed.hostname, parsed.port or 80
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(lambda: _GetProtocol(sink_for), host, port)
    try:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
            except OSError as exc:  # the kernel's default then; only throughput suffers
                logger.debug("could not enlarge the receive buffer: %r", exc)
        authority = f"[{host}]" if ":" in host else host
        target = (parsed.path or "/") + ("?" + urllib.parse.urlencode(params) if params else "")
        lines = [f"GET {target} HTTP/1.1", f"Host: {authority}:{port}", "Connection: close",
                 "Accept-Encoding: identity", *(f"{name}: {value}" for name, value in headers.items())]
        transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        await protocol.done
    finally:
        if protocol.done.done() and not protocol.done.cancelled() and protocol.done.exception() is None:
            transport.close()
        else:
            transport.abort()


class BytesSink:
    """A small body (a header, a list of checksums) collected whole into memory."""

    def __init__(self, length: int) -> None:
        self.data = bytearray(length)
        self._count = 0

    def buffer(self) -> memoryview:
        return memoryview(self.data)[self._count:]

    def filled(self, count: int) -> None:
        self._count += count


class DataSink:
    """Data bytes ``[start, end)`` of a response body, straight into the writer's tensors, then their checksums."""

    def __init__(self, writer: TensorWriter, start: int, end: int) -> None:
        self._writer = writer
        self._start = start
        self._position = start
        self._end = end
        self._trailer = memoryview(bytearray(writer.expected_trailer_bytes(start, end)))
        self._got = 0

    @property
    def length(self) -> int:
        """The body's length: the data range and its blocks' checksums."""
        return self._end - self._start + len(self._trailer)

    @property
    def received(self) -> int:
        """Body bytes received so far (data, then checksums): how far a striping receiver's stream has got."""
        return self._position - self._start + self._got

    def buffer(self) -> memoryview:
        if self._position < self._end:
            return self._writer.buffer_at(self._position, self._end)
        return self._trailer[self._got:]

    def filled(self, count: int) -> None:
        if self._position < self._end:
            self._writer.filled(self._position, count)
            self._position += count
            return
        self._got += count
        if self._got == len(self._trailer):
            self._writer.expect(self._start, self._end, self._trailer)


class EncodedSink:
    """Prefix, header and (unless ``header_only``) data and checksums of one state dict, as a body of ``length``."""

    def __init__(self, url: str, step: int, length: int, targets: dict[Path, Any], *,
                 header_only: bool) -> None:
        if length < PREFIX_SIZE:
            raise CheckpointTransferError(f"checkpoint truncated: {url} sent a {length}-byte answer")
        self._url, self._step, self._length, self._header_only = url, step, length, header_only
        self._targets = targets
        self._pending = memoryview(bytearray(PREFIX_SIZE))
        self._got = 0
        self._prefix = b""
        self._crc: int | None = None
        self._data: DataSink | None = None
        self.writer: TensorWriter | None = None
        self.header_bytes = b""
        """The prefix and header as received: a striped heal compares its other sources' headers with them."""

    def buffer(self) -> memoryview:
        if self._data is not None:
            return self._data.buffer()
        return self._pending[self._got:]

    def filled(self, count: int) -> None:
        if self._data is not None:
            self._data.filled(count)
            return
        self._got += count
        if self._got < len(self._pending):
            return
        if self._crc is None:
            self._prefix = bytes(self._pending)
            length, self._crc = unpack_prefix(self._prefix)
            self._pending, self._got = memoryview(bytearray(length)), 0
            if length:
                return
        header_end = PREFIX_SIZE + len(self._pending)
        if self._header_only and self._length != header_end:
            raise CheckpointTransferError(f"{self._url} sent {self._length - header_end} bytes after the header")
        header_json = bytes(self._pending)
        header = parse_header(header_json, self._crc,
                                   following=None if self._header_only else self._length - header_end)
        if header.step != self._step:
            raise CheckpointTransferError(f"{self._url} sent step {header.step}, expected step {self._step}")
        self.header_bytes = self._prefix + header_json
        self.writer = TensorWriter(header, self._targets)
        if header.data_bytes and not self._header_only:
            self._data = DataSink(self.writer, 0, header.data_bytes)

    def complete_writer(self) -> TensorWriter:
        """The tensor writer, once the body has ended; the header must have been whole."""
        if self.writer is None:
            raise CheckpointTransferError(f"checkpoint truncated: {self._url} ended inside the header")
        return self.writer
