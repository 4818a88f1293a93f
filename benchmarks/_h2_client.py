"""A lean gRPC-over-h2c client for the lighthouse benchmark's load generator.

Why: at N=300 simulated replica groups the benchmark was bound by its own
client (grpc.aio spent ~70 ms CPU per round against the server's ~40 ms on the
project's 2-core machine), so the ratio it reported measured the load
generator. This client speaks HTTP/2 with prior knowledge (RFC 9113) and gRPC's
length-prefixed framing directly on an ``asyncio.Protocol``: one connection
per channel, unary calls only, no retries, no TLS, no compression.

What it does implement, because either server may need it:

* flow control both ways: the receive windows it advertises are replenished
  with WINDOW_UPDATE for the connection and for each stream as DATA is
  consumed; request DATA waits for the server's send windows;
* SETTINGS from the server are applied and acknowledged; PING is answered;
* responses split over any number of DATA frames, header blocks split over
  CONTINUATION frames, HPACK with the dynamic table and Huffman coding (the
  ``hpack`` package decodes; requests use static-table and literal fields, so
  the encoder needs no state);
* trailers (or a trailers-only answer) carry grpc-status; anything but OK,
  RST_STREAM, GOAWAY and a lost connection raise :class:`H2CallError`;
* every wait is bounded: connecting, stream slots, send windows and the answer
  share the call's timeout, which also goes to the server as grpc-timeout.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import urllib.parse

import hpack
from hpack.table import HeaderTable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADER = struct.Struct(">BHBBI")  # 24-bit length as 8+16, type, flags, stream id
_U32 = struct.Struct(">I")
_GRPC_PREFIX = struct.Struct(">BI")

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
CANCEL = 0x8
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1


class H2CallError(Exception):
    """A call failed: a gRPC status other than OK, a reset stream or a lost connection."""

    def __init__(self, message: str, grpc_status: int | None = None) -> None:
        super().__init__(message)
        self.grpc_status = grpc_status


class H2CallTimeout(H2CallError, TimeoutError):
    """A call (or connecting) took longer than its timeout."""


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEADER.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal field without indexing, literal name: no dynamic-table state."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _grpc_timeout(seconds: float) -> bytes:
    """grpc-timeout value: at most 8 digits, in the finest unit that fits."""
    for unit, scale in ((b"m", 1e3), (b"S", 1.0), (b"M", 1 / 60), (b"H", 1 / 3600)):
        value = max(1, int(seconds * scale + 0.999))
        if value < 10**8:
            return str(value).encode() + unit
    return b"99999999H"


class _CountedTable(HeaderTable):
    """hpack's dynamic table, counting its changes (insertions and resizes).

    A header block that leaves the count alone decodes the same way for as
    long as the count stands, so its decoding can be reused: a lighthouse
    answers every call with the same few blocks, and decoding them again
    (Huffman strings included, from torchft's server) was ~30 ms of client
    CPU per round at N=300.
    """

    def __init__(self) -> None:
        super().__init__()
        self.changes = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.changes += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, value: int) -> None:
        self.changes += 1
        HeaderTable.maxsize.fset(self, value)


class _HeaderDecoder:
    """``hpack.Decoder`` with a cache of blocks that do not change the table."""

    MAX_CACHED = 256

    def __init__(self) -> None:
        self._decoder = hpack.Decoder()
        self._table = self._decoder.header_table = _CountedTable()
        self._cache: dict[bytes, tuple[int, list[tuple[bytes, bytes]]]] = {}

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        changes = self._table.changes
        cached = self._cache.get(block)
        if cached is not None and cached[0] == changes:
            return cached[1]
        headers = self._decoder.decode(block, raw=True)
        if self._table.changes == changes:  # a pure function of the table as it stands
            if len(self._cache) >= self.MAX_CACHED:
                self._cache.clear()
            self._cache[block] = (changes, headers)
        return headers


class _Stream:
    __slots__ = ("id", "answer", "headers", "body", "recv_window", "send_window", "headers_done")

    def __init__(self, stream_id: int, answer: asyncio.Future, recv_window: int, send_window: int) -> None:
        self.id = stream_id
        self.answer = answer
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.recv_window = recv_window
        self.send_window = send_window
        self.headers_done = False


class _Protocol(asyncio.Protocol):
    """The connection's state: frames in, frames out, streams by id."""

    def __init__(self, channel: "H2Channel") -> None:
        self.channel = channel
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.out: list[bytes] | None = None  # frames to send once this read is handled
        self.decoder = _HeaderDecoder()
        self.continuation: tuple[int, int, bytearray] | None = None  # stream id, first flags, block
        self.closed: H2CallError | None = None
        self.changed = asyncio.Event()  # windows, stream slots or connection state changed
        self.paused = False
        self.drained = asyncio.Event()
        self.drained.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.channel._connection_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f"connection to {self.channel.target} lost" + (f": {exc}" if exc else "")
        if self.closed is not None:  # a GOAWAY (ours or the server's) says why
            reason += f" after: {self.closed}"
        self.channel._fail_all(H2CallError(reason))
        self.transport = None
        self.drained.set()

    def pause_writing(self) -> None:
        self.paused = True
        self.drained.clear()

    def resume_writing(self) -> None:
        self.paused = False
        self.drained.set()

    def write(self, data: bytes) -> None:
        if self.out is not None:
            self.out.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.out = []
        try:
            self._frames()
        except H2CallError as exc:
            self.channel._connection_error(exc)
        except hpack.HPACKError as exc:
            self.channel._connection_error(H2CallError(f"bad HPACK block from {self.channel.target}: {exc}"))
        finally:
            out, self.out = self.out, None
            if out and self.transport is not None:
                self.transport.write(b"".join(out))

    def _frames(self) -> None:
        buffer = self.buffer
        offset = 0
        channel = self.channel
        max_frame = channel.max_frame_size
        while len(buffer) - offset >= 9:
            high, low, kind, flags, stream_id = _HEADER.unpack_from(buffer, offset)
            length = (high << 16) | low
            if length > max_frame:
                raise H2CallError(f"{channel.target} sent a {length}-byte frame, over our {max_frame}")
            end = offset + 9 + length
            if len(buffer) < end:
                break
            payload = bytes(buffer[offset + 9:end])
            offset = end
            channel._frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
            if self.transport is None or self.transport.is_closing():
                break
        del buffer[:offset]


class H2Channel:
    """One HTTP/2 connection to ``host:port`` carrying unary gRPC calls.

    ``recv_window`` is the receive window advertised for the connection and
    for each stream; the default HTTP/2 window (65535) makes a large answer
    take several WINDOW_UPDATE round trips, which the benchmark's tests use.
    """

    def __init__(self, host: str, port: int, *, recv_window: int = 4 * 1024 * 1024,
                 max_frame_size: int = DEFAULT_MAX_FRAME) -> None:
        if not DEFAULT_WINDOW <= recv_window <= MAX_WINDOW:
            raise ValueError(f"recv_window must be in [{DEFAULT_WINDOW}, {MAX_WINDOW}], got {recv_window}")
        if not DEFAULT_MAX_FRAME <= max_frame_size <= 2**24 - 1:
            raise ValueError(f"max_frame_size must be in [{DEFAULT_MAX_FRAME}, {2**24 - 1}], got {max_frame_size}")
        self.host, self.port = host, port
        self.target = f"{host}:{port}"
        self.recv_window = recv_window
        self.max_frame_size = max_frame_size
        self._authority = self.target.encode()
        self._request_blocks: dict[tuple[str, float], bytes] = {}  # literal fields only: reusable as is
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future | None = None
        self._streams: dict[int, _Stream] = {}
        self._next_stream_id = 1
        self._conn_recv_unacked = 0
        self._conn_send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._peer_max_streams = 2**31 - 1

    # ------------------------------------------------------------ public

    async def unary(self, path: str, request: bytes, timeout: float) -> bytes:
        """Call ``path`` with one serialized request message; returns the response message."""
        try:
            async with asyncio.timeout(timeout):
                return await self._unary(path, request, timeout)
        except TimeoutError as exc:
            raise H2CallTimeout(f"{path} on {self.target}: no answer within {timeout:.1f}s") from exc

    async def close(self) -> None:
        protocol = self._protocol
        if protocol is not None and protocol.transport is not None:
            protocol.transport.write(_frame(GOAWAY, 0, 0, _U32.pack(0) + _U32.pack(0)))
            protocol.transport.close()
        self._fail_all(H2CallError(f"channel to {self.target} closed"))

    # ------------------------------------------------------------ calls

    async def _connected(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None:
            if protocol.closed is not None:
                raise protocol.closed
            return protocol
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await loop.create_connection(lambda: _Protocol(self), self.host, self.port)
        except OSError as exc:
            self._connecting = None
            raise H2CallError(f"cannot connect to {self.target}: {exc}") from exc
        return protocol

    def _connection_made(self, protocol: _Protocol) -> None:
        """Called from ``connection_made``, before any byte from the server is handled.

        The preface must precede everything else we send (a SETTINGS ACK
        included), and the server's first frames may be read before the task
        awaiting ``create_connection`` resumes.
        """
        self._protocol = protocol
        settings = {SETTINGS_ENABLE_PUSH: 0, SETTINGS_INITIAL_WINDOW_SIZE: self.recv_window}
        if self.max_frame_size != DEFAULT_MAX_FRAME:
            settings[SETTINGS_MAX_FRAME_SIZE] = self.max_frame_size
        hello = PREFACE + _frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in settings.items()))
        if self.recv_window > DEFAULT_WINDOW:
            hello += _frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.recv_window - DEFAULT_WINDOW))
        protocol.transport.write(hello)

    async def _unary(self, path: str, request: bytes, timeout: float) -> bytes:
        block = self._request_blocks.get((path, timeout))
        if block is None:
            block = self._request_blocks[(path, timeout)] = (
                b"\x83\x86"  # :method POST, :scheme http (static table 3 and 6)
                + _literal(b":path", path.encode()) + _literal(b":authority", self._authority)
                + _literal(b"content-type", b"application/grpc") + _literal(b"te", b"trailers")
                + _literal(b"grpc-timeout", _grpc_timeout(timeout)))
        body = _GRPC_PREFIX.pack(0, len(request)) + request
        protocol = await self._connected()
        while len(self._streams) >= self._peer_max_streams:
            await self._wait_change(protocol)
        if len(block) > self._peer_max_frame:
            raise H2CallError(f"request headers of {len(block)} bytes would need CONTINUATION (not implemented)")
        # No await from taking a stream id to writing its HEADERS: ids must reach
        # the server in increasing order (RFC 9113 5.1.1), and a heartbeat and a
        # quorum call share the connection. Opening them out of order stalled a
        # benchmark round (the server ignored the lower id; it now sends GOAWAY).
        stream_id = self._next_stream_id
        if stream_id > MAX_STREAM_ID:
            raise H2CallError(f"stream ids on the connection to {self.target} are used up")
        self._next_stream_id += 2
        answer = asyncio.get_running_loop().create_future()
        stream = _Stream(stream_id, answer, self.recv_window, self._peer_initial_window)
        self._streams[stream_id] = stream
        out = _frame(HEADERS, END_HEADERS, stream_id, block)
        try:
            sent = 0
            while True:  # DATA within the server's windows and frame size
                n = min(len(body) - sent, stream.send_window, self._conn_send_window, self._peer_max_frame)
                if n > 0:
                    last = sent + n == len(body)
                    out += _frame(DATA, END_STREAM if last else 0, stream_id, body[sent:sent + n])
                    stream.send_window -= n
                    self._conn_send_window -= n
                    sent += n
                    if last:
                        break
                    continue
                protocol.write(out)
                out = b""
                await self._wait_change(protocol)
                if answer.done():
                    break  # the server answered (or reset) before taking the whole request
            if out:
                protocol.write(out)
            if protocol.paused:
                await protocol.drained.wait()
            return await answer
        except BaseException:
            if self._streams.pop(stream_id, None) is not None and protocol.transport is not None:
                protocol.write(_frame(RST_STREAM, 0, stream_id, _U32.pack(CANCEL)))
            raise

    async def _wait_change(self, protocol: _Protocol) -> None:
        if protocol.closed is not None:
            raise protocol.closed
        protocol.changed.clear()
        await protocol.changed.wait()
        if protocol.closed is not None:
            raise protocol.closed

    # ------------------------------------------------------------ frames

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._protocol is not None and self._protocol.continuation is not None and kind != CONTINUATION:
            raise H2CallError(f"{self.target} sent frame type {kind} inside a header block")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            if flags & PADDED:
                payload = self._unpad(payload)
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            if flags & END_HEADERS:
                self._header_block(stream_id, flags, payload)
            else:
                self._protocol.continuation = (stream_id, flags, bytearray(payload))
        elif kind == CONTINUATION:
            pending = self._protocol.continuation
            if pending is None or pending[0] != stream_id:
                raise H2CallError(f"{self.target} sent an unexpected CONTINUATION")
            pending[2].extend(payload)
            if flags & END_HEADERS:
                self._protocol.continuation = None
                self._header_block(stream_id, pending[1], bytes(pending[2]))
        elif kind == SETTINGS:
            if not flags & ACK:
                self._on_settings(payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == PING:
            if not flags & ACK:
                self._protocol.write(_frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if len(payload) != 4 or not stream_id:
                raise H2CallError(f"{self.target} sent a malformed RST_STREAM")
            stream = self._streams.pop(stream_id, None)
            if stream is not None and not stream.answer.done():
                code = _U32.unpack(payload)[0]
                stream.answer.set_exception(H2CallError(f"{self.target} reset stream {stream_id} (code {code})"))
            self._changed()
        elif kind == GOAWAY:
            if len(payload) < 8 or stream_id:
                raise H2CallError(f"{self.target} sent a malformed GOAWAY")
            last_id, code = struct.unpack(">II", payload[:8])
            last_id &= 0x7FFFFFFF
            debug = payload[8:].decode("utf-8", "replace")
            error = H2CallError(f"{self.target} sent GOAWAY (code {code}{': ' + debug if debug else ''})")
            self._protocol.closed = error  # no new streams on this connection
            for sid in [sid for sid in self._streams if sid > last_id]:
                stream = self._streams.pop(sid)
                if not stream.answer.done():
                    stream.answer.set_exception(error)
            self._changed()
        elif kind == PUSH_PROMISE:
            raise H2CallError(f"{self.target} sent PUSH_PROMISE though we disabled push")
        # PRIORITY and unknown frame types are ignored.

    @staticmethod
    def _unpad(payload: bytes) -> bytes:
        if not payload or payload[0] >= len(payload):
            raise H2CallError("malformed padding")
        return payload[1:len(payload) - payload[0]]

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        protocol = self._protocol
        n = len(payload)
        # Connection window: every DATA byte counts, for any stream, open or not.
        self._conn_recv_unacked += n
        if self._conn_recv_unacked >= self.recv_window // 2:
            protocol.write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._conn_recv_unacked)))
            self._conn_recv_unacked = 0
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # a stream we cancelled: its bytes were counted above
        stream.recv_window -= n
        if stream.recv_window < 0:
            raise H2CallError(f"{self.target} overran stream {stream_id}'s receive window")
        if flags & PADDED:
            payload = self._unpad(payload)
        stream.body += payload
        if flags & END_STREAM:
            self._end_stream(stream, None)
        elif stream.recv_window < self.recv_window // 2:
            protocol.write(_frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(self.recv_window - stream.recv_window)))
            stream.recv_window = self.recv_window

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self._protocol.decoder.decode(block)  # always: the HPACK table is per connection
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if not stream.headers_done:
            stream.headers_done = True
            stream.headers = headers
            status = dict(headers).get(b":status")
            if status != b"200":
                self._end_stream(stream, H2CallError(f"{self.target} answered HTTP status {status!r}"))
                return
            if flags & END_STREAM:  # trailers-only
                self._end_stream(stream, headers)
            return
        if not flags & END_STREAM:
            raise H2CallError(f"{self.target} sent a second header block without END_STREAM")
        self._end_stream(stream, headers)

    def _end_stream(self, stream: _Stream, trailers: list[tuple[bytes, bytes]] | H2CallError | None) -> None:
        self._streams.pop(stream.id, None)
        self._changed()
        if stream.answer.done():
            return
        if isinstance(trailers, H2CallError):
            stream.answer.set_exception(trailers)
            return
        if trailers is None:
            stream.answer.set_exception(H2CallError(f"{self.target} ended stream {stream.id} without trailers"))
            return
        fields = dict(trailers)
        status = fields.get(b"grpc-status")
        if status != b"0":
            message = urllib.parse.unquote(fields.get(b"grpc-message", b"").decode("ascii", "replace"))
            code = int(status) if status is not None and status.isdigit() else None
            stream.answer.set_exception(H2CallError(
                f"{self.target} stream {stream.id}: grpc-status {status.decode() if status else None}: {message}", code))
            return
        body = stream.body
        if len(body) < 5:
            stream.answer.set_exception(H2CallError(f"{self.target} stream {stream.id}: no response message"))
            return
        compressed, length = _GRPC_PREFIX.unpack_from(body, 0)
        if compressed or len(body) != 5 + length:
            stream.answer.set_exception(H2CallError(
                f"{self.target} stream {stream.id}: expected one uncompressed message of {length} bytes, "
                f"got {len(body) - 5} bytes (compressed flag {compressed})"))
            return
        stream.answer.set_result(bytes(body[5:]))

    def _on_settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise H2CallError(f"{self.target} sent a malformed SETTINGS frame")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2CallError(f"{self.target} set an initial window over 2^31-1")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self._peer_max_frame = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self._peer_max_streams = value
        self._protocol.write(_frame(SETTINGS, ACK, 0))
        self._changed()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2CallError(f"{self.target} sent a malformed WINDOW_UPDATE")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            self._conn_send_window += increment
        else:
            stream = self._streams.get(stream_id)
            if stream is None:
                return
            stream.send_window += increment
        self._changed()

    def _changed(self) -> None:
        if self._protocol is not None:
            self._protocol.changed.set()

    def _connection_error(self, error: H2CallError) -> None:
        protocol = self._protocol
        if protocol is not None and protocol.transport is not None:
            protocol.write(_frame(GOAWAY, 0, 0, struct.pack(">II", 0, 1) + str(error).encode()[:200]))
            transport = protocol.transport
            out, protocol.out = protocol.out, None
            if out:
                transport.write(b"".join(out))
            transport.close()
        self._fail_all(error)

    def _fail_all(self, error: H2CallError) -> None:
        protocol = self._protocol
        if protocol is not None:
            if protocol.closed is None:
                protocol.closed = error
            protocol.changed.set()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            if not stream.answer.done():
                stream.answer.set_exception(error)
