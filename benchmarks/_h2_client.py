"""A lean gRPC-over-h2c client for the lighthouse benchmark's load generator.

Why: at N=300 simulated replica groups the benchmark was bound by its own
client (grpc.aio spent ~70 ms CPU per round against the server's ~40 ms on the
project's 2-core machine), so the ratio it reported measured the load
generator. This client speaks HTTP/2 with prior knowledge (RFC 9113) and gRPC's
length-prefixed framing directly on an ``asyncio.Protocol``: one connection
per channel, unary calls only, no compression; TLS when given an
``ssl.SSLContext`` (whose ALPN offers ``h2``), for ``lighthouse_bench --tls``.

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
* a connection is used once the server's SETTINGS arrived; until then
  failures are retried with backoff (as gRPC's wait_for_ready does: torchft's
  server overflows its listen backlog when 1000 groups connect at once, and
  the kernel resets some of those connections); a call in flight is not;
* every wait is bounded: connecting, stream slots, send windows and the answer
  share the call's timeout, which also goes to the server as grpc-timeout.
"""

from __future__ import annotations

import asyncio
import random
import socket
import ssl
import struct
import urllib.parse

import hpack

from benchmarks import _h2_wire as wire


class H2CallError(Exception):
    """A call failed: a gRPC status other than OK, a reset stream or a lost connection."""

    def __init__(self, message: str, grpc_status: int | None = None) -> None:
        super().__init__(message)
        self.grpc_status = grpc_status


class H2CallTimeout(H2CallError, TimeoutError):
    """A call (or connecting) took longer than its timeout."""


class _Stream:
    __slots__ = ("id", "answer", "body", "recv_window", "send_window", "headers_done")

    def __init__(self, stream_id: int, answer: asyncio.Future, recv_window: int, send_window: int) -> None:
        self.id = stream_id
        self.answer = answer
        self.body = bytearray()
        self.recv_window = recv_window
        self.send_window = send_window
        self.headers_done = False


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection: frames in and out, streams by id, the windows both ways."""

    def __init__(self, target: str, recv_window: int, max_frame_size: int) -> None:
        self.target = target
        self.recv_window = recv_window
        self.max_frame_size = max_frame_size
        self.transport: asyncio.Transport | None = None
        self.ready = asyncio.get_running_loop().create_future()  # done at the server's first SETTINGS
        self.closed: H2CallError | None = None  # why no new stream may start here
        self.changed = asyncio.Event()  # windows, stream slots or the connection's state changed
        self.drained = asyncio.Event()  # the transport's write buffer is below its high-water mark
        self.drained.set()
        self._buffer = bytearray()
        self._out: list[bytes] | None = None  # frames to send once the current read is handled
        self._decoder = wire.HeaderDecoder()
        self._continuation: tuple[int, int, bytearray] | None = None  # stream id, first flags, block
        self._streams: dict[int, _Stream] = {}
        self._next_stream_id = 1
        self._recv_unacked = 0
        self._send_window = wire.DEFAULT_WINDOW
        self._peer_initial_window = wire.DEFAULT_WINDOW
        self._peer_max_frame = wire.DEFAULT_MAX_FRAME
        self._peer_max_streams = wire.MAX_STREAM_ID

    def usable(self) -> bool:
        return self.closed is None and self.transport is not None and self.ready.done() \
            and not self.ready.cancelled() and self.ready.exception() is None

    # ------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The preface goes first, before any answer to the server's frames
        # (which may be read before create_connection's caller resumes).
        settings = {wire.SETTINGS_ENABLE_PUSH: 0, wire.SETTINGS_INITIAL_WINDOW_SIZE: self.recv_window}
        if self.max_frame_size != wire.DEFAULT_MAX_FRAME:
            settings[wire.SETTINGS_MAX_FRAME_SIZE] = self.max_frame_size
        payload = b"".join(struct.pack(">HI", k, v) for k, v in settings.items())
        hello = wire.PREFACE + wire.frame(wire.SETTINGS, 0, 0, payload)
        if self.recv_window > wire.DEFAULT_WINDOW:
            hello += wire.frame(wire.WINDOW_UPDATE, 0, 0, wire.U32.pack(self.recv_window - wire.DEFAULT_WINDOW))
        self.transport.write(hello)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f"connection to {self.target} lost" + (f": {exc}" if exc else "")
        if self.closed is not None:  # a GOAWAY (ours or the server's) says why
            reason += f" after: {self.closed}"
        self.transport = None
        self._fail(H2CallError(reason))
        self.drained.set()

    def pause_writing(self) -> None:
        self.drained.clear()

    def resume_writing(self) -> None:
        self.drained.set()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._out = []
        try:
            self._frames()
        except H2CallError as exc:
            self._connection_error(exc)
        except hpack.HPACKError as exc:
            self._connection_error(H2CallError(f"bad HPACK block from {self.target}: {exc}"))
        finally:
            out, self._out = self._out, None
            if out and self.transport is not None:
                self.transport.write(b"".join(out))

    def _write(self, data: bytes) -> None:
        if self._out is not None:
            self._out.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    # ------------------------------------------------------------ calls

    async def call(self, block: bytes, body: bytes) -> bytes:
        """One unary call: HEADERS ``block``, DATA ``body``; the answer's message."""
        while len(self._streams) >= self._peer_max_streams:
            await self._wait_change()
        if self.closed is not None:
            raise self.closed
        if len(block) > self._peer_max_frame:
            raise H2CallError(f"request headers of {len(block)} bytes would need CONTINUATION (not implemented)")
        # No await from taking a stream id to writing its HEADERS: ids must reach
        # the server in increasing order (RFC 9113 5.1.1), and a heartbeat and a
        # quorum call share the connection. Opening them out of order stalled a
        # benchmark round (the server ignored the lower id; it now sends GOAWAY).
        stream_id = self._next_stream_id
        if stream_id > wire.MAX_STREAM_ID:
            raise H2CallError(f"stream ids on the connection to {self.target} are used up")
        self._next_stream_id += 2
        answer = asyncio.get_running_loop().create_future()
        stream = _Stream(stream_id, answer, self.recv_window, self._peer_initial_window)
        self._streams[stream_id] = stream
        out = wire.frame(wire.HEADERS, wire.END_HEADERS, stream_id, block)
        try:
            sent = 0
            while True:  # DATA within the server's windows and frame size
                n = min(len(body) - sent, stream.send_window, self._send_window, self._peer_max_frame)
                if n > 0:
                    last = sent + n == len(body)
                    out += wire.frame(wire.DATA, wire.END_STREAM if last else 0, stream_id, body[sent:sent + n])
                    stream.send_window -= n
                    self._send_window -= n
                    sent += n
                    if last:
                        break
                    continue
                self._write(out)
                out = b""
                await self._wait_change()
                if answer.done():
                    break  # the server answered (or reset) before taking the whole request
            if out:
                self._write(out)
            await self.drained.wait()
            return await answer
        except BaseException:
            if self._streams.pop(stream_id, None) is not None:
                self._write(wire.frame(wire.RST_STREAM, 0, stream_id, wire.U32.pack(wire.CANCEL)))
            raise

    async def _wait_change(self) -> None:
        if self.closed is not None:
            raise self.closed
        self.changed.clear()
        await self.changed.wait()
        if self.closed is not None:
            raise self.closed

    def close(self) -> None:
        if self.transport is not None:
            self.transport.write(wire.frame(wire.GOAWAY, 0, 0, struct.pack(">II", 0, 0)))
            self.transport.close()
        self._fail(H2CallError(f"connection to {self.target} closed"))

    # ------------------------------------------------------------ frames

    def _frames(self) -> None:
        buffer = self._buffer
        offset = 0
        while len(buffer) - offset >= 9:
            high, low, kind, flags, stream_id = wire.FRAME_HEADER.unpack_from(buffer, offset)
            length = (high << 16) | low
            if length > self.max_frame_size:
                raise H2CallError(f"{self.target} sent a {length}-byte frame, over our {self.max_frame_size}")
            end = offset + 9 + length
            if len(buffer) < end:
                break
            payload = bytes(buffer[offset + 9:end])
            offset = end
            self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
            if self.transport is None or self.transport.is_closing():
                break
        del buffer[:offset]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is not None and kind != wire.CONTINUATION:
            raise H2CallError(f"{self.target} sent frame type {kind} inside a header block")
        if kind == wire.DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == wire.HEADERS:
            if flags & wire.PADDED:
                payload = _unpad(payload)
            if flags & wire.PRIORITY_FLAG:
                payload = payload[5:]
            if flags & wire.END_HEADERS:
                self._header_block(stream_id, flags, payload)
            else:
                self._continuation = (stream_id, flags, bytearray(payload))
        elif kind == wire.CONTINUATION:
            pending = self._continuation
            if pending is None or pending[0] != stream_id:
                raise H2CallError(f"{self.target} sent an unexpected CONTINUATION")
            pending[2].extend(payload)
            if flags & wire.END_HEADERS:
                self._continuation = None
                self._header_block(stream_id, pending[1], bytes(pending[2]))
        elif kind == wire.SETTINGS:
            if not flags & wire.ACK:
                self._on_settings(payload)
        elif kind == wire.WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == wire.PING:
            if len(payload) != 8 or stream_id:
                raise H2CallError(f"{self.target} sent a malformed PING")
            if not flags & wire.ACK:
                self._write(wire.frame(wire.PING, wire.ACK, 0, payload))
        elif kind == wire.RST_STREAM:
            if len(payload) != 4 or not stream_id:
                raise H2CallError(f"{self.target} sent a malformed RST_STREAM")
            stream = self._streams.pop(stream_id, None)
            if stream is not None and not stream.answer.done():
                code = wire.U32.unpack(payload)[0]
                stream.answer.set_exception(H2CallError(f"{self.target} reset stream {stream_id} (code {code})"))
            self.changed.set()
        elif kind == wire.GOAWAY:
            if len(payload) < 8 or stream_id:
                raise H2CallError(f"{self.target} sent a malformed GOAWAY")
            last_id, code = struct.unpack_from(">II", payload)
            debug = payload[8:].decode("utf-8", "replace")
            error = H2CallError(f"{self.target} sent GOAWAY (code {code}{': ' + debug if debug else ''})")
            self.closed = error  # no new streams here; those up to last_id may still be answered
            for sid in [sid for sid in self._streams if sid > last_id & 0x7FFFFFFF]:
                stream = self._streams.pop(sid)
                if not stream.answer.done():
                    stream.answer.set_exception(error)
            self.changed.set()
        elif kind == wire.PUSH_PROMISE:
            raise H2CallError(f"{self.target} sent PUSH_PROMISE though we disabled push")
        # PRIORITY and unknown frame types are ignored.

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        n = len(payload)
        # The connection window counts every DATA byte, on any stream, open or not.
        self._recv_unacked += n
        if self._recv_unacked >= self.recv_window // 2:
            self._write(wire.frame(wire.WINDOW_UPDATE, 0, 0, wire.U32.pack(self._recv_unacked)))
            self._recv_unacked = 0
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # a stream we cancelled: its bytes were counted above
        stream.recv_window -= n
        if stream.recv_window < 0:
            raise H2CallError(f"{self.target} overran stream {stream_id}'s receive window")
        if flags & wire.PADDED:
            payload = _unpad(payload)
        stream.body += payload
        if flags & wire.END_STREAM:
            self._end_stream(stream, None)
        elif stream.recv_window < self.recv_window // 2:
            increment = self.recv_window - stream.recv_window
            self._write(wire.frame(wire.WINDOW_UPDATE, 0, stream_id, wire.U32.pack(increment)))
            stream.recv_window = self.recv_window

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self._decoder.decode(block)  # always: the HPACK table is per connection
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if not stream.headers_done:
            stream.headers_done = True
            status = dict(headers).get(b":status")
            if status != b"200":
                self._end_stream(stream, H2CallError(f"{self.target} answered HTTP status {status!r}"))
            elif flags & wire.END_STREAM:  # trailers-only
                self._end_stream(stream, headers)
            return
        if not flags & wire.END_STREAM:
            raise H2CallError(f"{self.target} sent a second header block without wire.END_STREAM")
        self._end_stream(stream, headers)

    def _end_stream(self, stream: _Stream, trailers: list[tuple[bytes, bytes]] | H2CallError | None) -> None:
        self._streams.pop(stream.id, None)
        self.changed.set()
        if stream.answer.done():
            return
        where = f"{self.target} stream {stream.id}"
        if isinstance(trailers, H2CallError):
            stream.answer.set_exception(trailers)
            return
        if trailers is None:
            stream.answer.set_exception(H2CallError(f"{where} ended without trailers"))
            return
        fields = dict(trailers)
        status = fields.get(b"grpc-status")
        if status != b"0":
            message = urllib.parse.unquote(fields.get(b"grpc-message", b"").decode("ascii", "replace"))
            code = int(status) if status is not None and status.isdigit() else None
            stream.answer.set_exception(H2CallError(
                f"{where}: grpc-status {status.decode() if status else None}: {message}", code))
            return
        body = stream.body
        if len(body) < 5:
            stream.answer.set_exception(H2CallError(f"{where}: no response message"))
            return
        compressed, length = wire.GRPC_PREFIX.unpack_from(body, 0)
        if compressed or len(body) != 5 + length:
            stream.answer.set_exception(H2CallError(
                f"{where}: expected one uncompressed message of {length} bytes, "
                f"got {len(body) - 5} bytes (compressed flag {compressed})"))
            return
        stream.answer.set_result(bytes(body[5:]))

    def _on_settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise H2CallError(f"{self.target} sent a malformed SETTINGS wire.frame")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == wire.SETTINGS_INITIAL_WINDOW_SIZE:
                if value > wire.MAX_WINDOW:
                    raise H2CallError(f"{self.target} set an initial window over 2^31-1")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif key == wire.SETTINGS_MAX_FRAME_SIZE:
                self._peer_max_frame = value
            elif key == wire.SETTINGS_MAX_CONCURRENT_STREAMS:
                self._peer_max_streams = value
        self._write(wire.frame(wire.SETTINGS, wire.ACK, 0))
        if not self.ready.done():
            self.ready.set_result(None)
        self.changed.set()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2CallError(f"{self.target} sent a malformed WINDOW_UPDATE")
        increment = wire.U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            self._send_window += increment
        else:
            stream = self._streams.get(stream_id)
            if stream is None:
                return
            stream.send_window += increment
        self.changed.set()

    def _connection_error(self, error: H2CallError) -> None:
        if self.transport is not None:
            self._write(wire.frame(wire.GOAWAY, 0, 0, struct.pack(">II", 0, 1) + str(error).encode()[:200]))
            out, self._out = self._out, None
            if out:
                self.transport.write(b"".join(out))
            self.transport.close()
        self._fail(error)

    def _fail(self, error: H2CallError) -> None:
        if self.closed is None:
            self.closed = error
        if not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()  # retrieved: the connecting task reads it, or nobody needs to
        self.changed.set()
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            if not stream.answer.done():
                stream.answer.set_exception(error)


def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise H2CallError("malformed padding")
    return payload[1:len(payload) - payload[0]]


class H2Channel:
    """Unary gRPC calls to ``host:port`` over one HTTP/2 connection at a time.

    ``recv_window`` is the receive window advertised for the connection and
    for each stream (the HTTP/2 default, 65535, makes a large answer take
    several wire.WINDOW_UPDATE round trips). A connection that fails before the
    server's wire.SETTINGS arrive is retried with backoff for ``connect_timeout``
    seconds (bounded also by each waiting call's own timeout); a connection
    lost later fails its calls, and the next call opens a new one.
    """

    def __init__(self, host: str, port: int, *, recv_window: int = 4 * 1024 * 1024,
                 max_frame_size: int = wire.DEFAULT_MAX_FRAME, connect_timeout: float = 60.0,
                 tls: ssl.SSLContext | None = None) -> None:
        if not wire.DEFAULT_WINDOW <= recv_window <= wire.MAX_WINDOW:
            raise ValueError(f"recv_window must be in [{wire.DEFAULT_WINDOW}, {wire.MAX_WINDOW}], got {recv_window}")
        if not wire.DEFAULT_MAX_FRAME <= max_frame_size <= 2**24 - 1:
            raise ValueError(f"max_frame_size must be in [{wire.DEFAULT_MAX_FRAME}, {2**24 - 1}], got {max_frame_size}")
        if connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be positive, got {connect_timeout}")
        self.host, self.port = host, port
        self.target = f"{host}:{port}"
        self.recv_window = recv_window
        self.max_frame_size = max_frame_size
        self.connect_timeout = connect_timeout
        self.tls = tls
        self.connect_attempts = 0
        self._authority = self.target.encode()
        self._request_blocks: dict[tuple[str, float], bytes] = {}  # literal fields only: reusable as is
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self._closed = False

    async def unary(self, path: str, request: bytes, timeout: float) -> bytes:
        """Call ``path`` with one serialized request message; returns the response message."""
        block = self._request_blocks.get((path, timeout))
        if block is None:
            block = self._request_blocks[(path, timeout)] = (
                (b"\x83\x87" if self.tls is not None else b"\x83\x86")  # :method POST, :scheme https/http (3, 7/6)
                + wire.literal(b":path", path.encode()) + wire.literal(b":authority", self._authority)
                + wire.literal(b"content-type", b"application/grpc") + wire.literal(b"te", b"trailers")
                + wire.literal(b"grpc-timeout", wire.grpc_timeout(timeout)))
        body = wire.GRPC_PREFIX.pack(0, len(request)) + request
        try:
            async with asyncio.timeout(timeout):
                connection = await self._ready_connection()
                return await connection.call(block, body)
        except TimeoutError as exc:
            raise H2CallTimeout(f"{path} on {self.target}: no answer within {timeout:.1f}s") from exc

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
        if self._connection is not None:
            self._connection.close()

    async def _ready_connection(self) -> _Connection:
        if self._closed:
            raise H2CallError(f"channel to {self.target} closed")
        connection = self._connection
        if connection is not None and connection.usable():
            return connection
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        # Shielded: a caller's timeout must not cancel the attempt others wait on.
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        delay = 0.05
        last_error: Exception | None = None
        try:
            while True:
                connection: _Connection | None = None
                self.connect_attempts += 1
                try:
                    async with asyncio.timeout_at(deadline):
                        secure = {} if self.tls is None else {"ssl": self.tls, "server_hostname": self.host}
                        _, connection = await loop.create_connection(
                            lambda: _Connection(self.target, self.recv_window, self.max_frame_size),
                            self.host, self.port, **secure)
                        await connection.ready
                    self._connection = connection
                    return connection
                except (OSError, H2CallError) as exc:
                    last_error = exc
                    if connection is not None and connection.transport is not None:
                        connection.transport.abort()
                except TimeoutError:
                    if connection is not None and connection.transport is not None:
                        connection.transport.abort()
                    raise H2CallError(f"no HTTP/2 connection to {self.target} within {self.connect_timeout:.1f}s "
                                      f"({self.connect_attempts} attempts; last: {last_error})") from last_error
                except BaseException:  # cancelled by close()
                    if connection is not None and connection.transport is not None:
                        connection.transport.abort()
                    raise
                pause = min(delay * (0.5 + random.random()), max(0.0, deadline - loop.time()))
                await asyncio.sleep(pause)
                delay = min(delay * 2, 1.0)
        finally:
            self._connecting = None
