"""One HTTP/2 (h2c, prior knowledge) server connection carrying gRPC calls.

An ``asyncio.Protocol``: frames are parsed as bytes arrive, complete requests
are handed to its owner (a :class:`ConnectionOwner`, the ``GrpcServer``) and answers are
written back respecting the peer's flow-control windows and frame size. Only what a
gRPC server needs is implemented: no server push, no client streaming, no
HTTP/1.1 (a peer that does not start with the HTTP/2 preface is disconnected).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Protocol

import hpack

from lighthouse.rpc.h2grpc import wire
from lighthouse.rpc.h2grpc.streams import STREAM_RECV_WINDOW, Stream
from lighthouse.rpc.h2grpc.wire import ProtocolError

logger = logging.getLogger(__name__)

CONN_RECV_WINDOW = 16 * 1024 * 1024
MAX_HEADER_BLOCK = 64 * 1024
MAX_HEADER_LIST = 16 * 1024


class ConnectionOwner(Protocol):
    """What a connection needs from the server that accepted it; declared here so this module imports no server."""

    connections: set[H2Connection]  # a connection adds itself when made and leaves when lost
    protocol_errors: int  # counted up by a connection closed for the peer's protocol error
    max_concurrent_streams: int
    max_request_bytes: int  # of one call
    max_connection_request_bytes: int  # of the calls one connection holds open together
    handshake_timeout: float  # seconds a new connection has to send the HTTP/2 preface

    def dispatch(self, connection: H2Connection, stream: Stream) -> None: ...  # a whole request: start its call
    def reject_oversized(self, connection: H2Connection, stream: Stream, details: str | None = None) -> None: ...


class H2Connection(asyncio.Protocol):
    def __init__(self, server: ConnectionOwner) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self._buffer = bytearray()
        self._preface_seen = False
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_LIST
        self._continuation: tuple[int, int, bytearray] | None = None  # stream id, flags, block
        self._streams: dict[int, Stream] = {}
        self._last_stream_id = 0
        self._recv_window = CONN_RECV_WINDOW
        self._recv_unacked = 0
        # Stream windows are never reopened: each must take one byte past the largest request body
        # (a message and its 5-byte prefix) so that a larger one reaches the size check and is refused;
        # with less, its sender stalled on a closed window until its deadline, or forever.
        self._stream_window = max(STREAM_RECV_WINDOW, server.max_request_bytes + 6)
        # Request bytes of the streams still open (receiving, or answered later): the connection
        # window is reopened as data arrives, so without this bound one peer could make us hold
        # max_concurrent_streams * max_request_bytes (16 GiB).
        self._in_flight = 0
        self._send_window = wire.DEFAULT_WINDOW
        self._peer_initial_window = wire.DEFAULT_WINDOW
        self._peer_max_frame = wire.DEFAULT_MAX_FRAME
        self._blocked: dict[int, Stream] = {}
        self._paused = False
        self._going_away = False
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._corked: list[bytes] | None = None  # writes gathered while handling one read

    # ------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        address = transport.get_extra_info("peername")
        if isinstance(address, tuple):
            family = "ipv6" if ":" in address[0] else "ipv4"
            self.peer = f"{family}:{address[0]}:{address[1]}"
        self.server.connections.add(self)
        loop = asyncio.get_running_loop()
        self._handshake_timer = loop.call_later(self.server.handshake_timeout, self._handshake_expired)
        self._write(wire.server_settings(self.server.max_concurrent_streams, self._stream_window, MAX_HEADER_LIST,
                                         CONN_RECV_WINDOW))

    def _handshake_expired(self) -> None:
        if not self._preface_seen and self.transport is not None:
            logger.warning("closing connection from %s: no HTTP/2 preface within %.0fs",
                           self.peer, self.server.handshake_timeout)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self.server.connections.discard(self)
        for stream in self._streams.values():
            if stream.task is not None:
                stream.task.cancel()
        self._streams.clear()
        self._blocked.clear()
        self.transport = None

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._flush_blocked()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        # Everything this read makes us send (ACKs, window updates, resets)
        # goes out in one write: one syscall instead of one per frame.
        self._corked = []
        try:
            self._process()
        except ProtocolError as exc:
            self._fail(exc.code, str(exc))
        except hpack.HPACKError as exc:
            self._fail(wire.COMPRESSION_ERROR, f"bad header block: {exc}")
        finally:
            self._uncork()

    def _uncork(self) -> None:
        corked, self._corked = self._corked, None
        if corked and self.transport is not None:
            self.transport.write(b"".join(corked))

    # ------------------------------------------------------------ reading

    def _process(self) -> None:
        buffer = self._buffer
        offset = 0
        if not self._preface_seen:
            if len(buffer) < len(wire.PREFACE):
                if not wire.PREFACE.startswith(bytes(buffer)):
                    raise ProtocolError("not an HTTP/2 (h2c prior knowledge) client")
                return
            if buffer[:len(wire.PREFACE)] != wire.PREFACE:
                raise ProtocolError("not an HTTP/2 (h2c prior knowledge) client")
            self._preface_seen = True
            offset = len(wire.PREFACE)
        while len(buffer) - offset >= 9 and self.transport is not None:
            length, kind, flags, stream_id = wire.parse_frame_header(buffer, offset)
            if length > wire.DEFAULT_MAX_FRAME:
                raise ProtocolError(f"frame of {length} bytes exceeds our max frame size", wire.FRAME_SIZE_ERROR)
            end = offset + 9 + length
            if len(buffer) < end:
                break
            payload = bytes(buffer[offset + 9:end])
            offset = end
            self._frame(kind, flags, stream_id, payload)
        del buffer[:offset]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is not None and kind != wire.CONTINUATION:
            raise ProtocolError("expected CONTINUATION")
        if kind == wire.DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == wire.HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == wire.CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == wire.SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == wire.WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == wire.PING:
            if len(payload) != 8 or stream_id:
                raise ProtocolError("malformed PING", wire.FRAME_SIZE_ERROR)
            if not flags & wire.ACK:
                self._write(wire.frame(wire.PING, wire.ACK, 0, payload))
        elif kind == wire.RST_STREAM:
            if len(payload) != 4 or not stream_id:
                raise ProtocolError("malformed RST_STREAM", wire.FRAME_SIZE_ERROR)
            self._close_stream(stream_id, cancel=True)
        elif kind == wire.GOAWAY:
            self._going_away = True  # the peer sends no new calls; ours finish normally
        elif kind == wire.PRIORITY:
            if len(payload) != 5:
                raise ProtocolError("malformed PRIORITY", wire.FRAME_SIZE_ERROR)
        elif kind == wire.PUSH_PROMISE:
            raise ProtocolError("clients must not send PUSH_PROMISE")
        # Unknown frame types are ignored, as the protocol requires.

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise ProtocolError(f"HEADERS on invalid stream {stream_id}")
        payload = wire.strip_padding(payload, flags)
        if flags & wire.PRIORITY_FLAG:
            payload = payload[5:]
        if flags & wire.END_HEADERS:
            self._header_block(stream_id, flags, payload)
        else:
            self._continuation = (stream_id, flags, bytearray(payload))

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuation is None or self._continuation[0] != stream_id:
            raise ProtocolError("unexpected CONTINUATION")
        block = self._continuation[2]
        block += payload
        if len(block) > MAX_HEADER_BLOCK:
            raise ProtocolError("header block too large", wire.ENHANCE_YOUR_CALM)
        if flags & wire.END_HEADERS:
            first_flags = self._continuation[1]
            self._continuation = None
            self._header_block(stream_id, first_flags, bytes(block))

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        # Always decode, even for streams we refuse: the HPACK table is per connection.
        headers = self._decoder.decode(block, raw=True)
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client end its request
            if stream.request_done:
                raise ProtocolError(f"HEADERS after the end of stream {stream_id}", wire.STREAM_CLOSED)
            if not flags & wire.END_STREAM:
                raise ProtocolError("client trailers without END_STREAM")
            self._request_complete(stream)
            return
        if stream_id <= self._last_stream_id:
            if any(name == b":method" for name, _ in headers):
                # A new request on an id below one the peer already opened: that
                # id was implicitly closed (RFC 9113 5.1.1) and can never be
                # answered. Ignoring it left the caller waiting forever on an idle
                # connection (a load generator that took a stream id before an
                # await and wrote HEADERS after a later stream's stalled a whole
                # benchmark round); torchft's server (h2) answers GOAWAY too.
                raise ProtocolError(f"stream {stream_id} opened after stream {self._last_stream_id}: "
                                    "stream ids must increase")
            return  # trailers for a stream we already closed or refused; ignore
        self._last_stream_id = stream_id
        if self._going_away or len(self._streams) >= self.server.max_concurrent_streams:
            self._write(wire.rst_stream(stream_id, wire.REFUSED_STREAM))
            return
        stream = Stream(stream_id, self._peer_initial_window, self._stream_window)
        stream.headers = dict(headers)
        self._streams[stream_id] = stream
        if flags & wire.END_STREAM:
            self._request_complete(stream)

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError("DATA on stream 0")
        self._recv_window -= len(payload)
        if self._recv_window < 0:
            raise ProtocolError("peer overran the connection window", wire.FLOW_CONTROL_ERROR)
        self._recv_unacked += len(payload)
        if self._recv_unacked >= CONN_RECV_WINDOW // 2:
            self._write(wire.window_update(0, self._recv_unacked))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream_id:
                raise ProtocolError(f"DATA on idle stream {stream_id}")
            return  # closed or refused stream: counted above, otherwise ignored
        if stream.request_done:
            self._reset(stream, wire.STREAM_CLOSED)
            return
        stream.recv_window -= len(payload)
        data = wire.strip_padding(payload, flags)
        if stream.recv_window < 0 or len(stream.body) + len(data) > self.server.max_request_bytes + 5:
            self.server.reject_oversized(self, stream)
            return
        if self._in_flight + len(data) > self.server.max_connection_request_bytes:
            self.server.reject_oversized(self, stream, f"this connection's calls in flight hold more than "
                                                       f"{self.server.max_connection_request_bytes} request bytes")
            return
        stream.body += data
        stream.received += len(data)
        self._in_flight += len(data)
        if flags & wire.END_STREAM:
            self._request_complete(stream)

    def _request_complete(self, stream: Stream) -> None:
        stream.request_done = True
        self.server.dispatch(self, stream)

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ProtocolError("SETTINGS on a stream")
        if flags & wire.ACK:
            if payload:
                raise ProtocolError("SETTINGS ACK with a payload", wire.FRAME_SIZE_ERROR)
            return
        for key, value in wire.parse_settings(payload):
            if key == wire.SETTINGS_INITIAL_WINDOW_SIZE:
                if value > wire.MAX_WINDOW:
                    raise ProtocolError("initial window too large", wire.FLOW_CONTROL_ERROR)
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self._streams.values():
                    stream.send_window += delta  # applies to open streams too
            elif key == wire.SETTINGS_MAX_FRAME_SIZE:
                if not wire.DEFAULT_MAX_FRAME <= value <= 2**24 - 1:
                    raise ProtocolError("invalid max frame size")
                self._peer_max_frame = value
        self._write(wire.frame(wire.SETTINGS, wire.ACK, 0))
        self._flush_blocked()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError("malformed WINDOW_UPDATE", wire.FRAME_SIZE_ERROR)
        increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
        if increment == 0:
            raise ProtocolError("WINDOW_UPDATE of 0")
        if stream_id == 0:
            self._send_window += increment
            if self._send_window > wire.MAX_WINDOW:
                raise ProtocolError("connection window overflow", wire.FLOW_CONTROL_ERROR)
            self._flush_blocked()
            return
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            self._flush(stream)

    # ------------------------------------------------------------ writing

    def _write(self, data: bytes) -> None:
        if self._corked is not None:
            self._corked.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    def _close(self) -> None:
        self._uncork()
        if self.transport is not None:
            self.transport.close()

    def send_response(self, stream: Stream, headers: bytes, messages: bytes, trailers: bytes) -> None:
        """Send response headers (if not sent yet), DATA ``messages`` and the trailers."""
        if self._streams.get(stream.id) is not stream:
            return  # reset by the peer or the connection is gone
        out = b""
        if not stream.response_started:
            stream.response_started = True
            out = wire.frame(wire.HEADERS, wire.END_HEADERS, stream.id, headers)
        trailer_frame = wire.frame(wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, stream.id, trailers)
        size = len(messages)
        if (not stream.pending and not self._paused and size <= self._peer_max_frame
                and size <= stream.send_window and size <= self._send_window):
            # Fast path: the whole answer in one write.
            if size:
                out += wire.frame(wire.DATA, 0, stream.id, messages)
                stream.send_window -= size
                self._send_window -= size
            self._write(out + trailer_frame)
            self._finish(stream)
            return
        if out:
            self._write(out)
        if size:
            stream.pending.append(memoryview(messages))
        stream.trailers = trailer_frame
        self._flush(stream)

    def send_messages(self, stream: Stream, headers: bytes, messages: bytes) -> None:
        """Send response headers if needed and DATA, keeping the stream open (server streaming)."""
        if self._streams.get(stream.id) is not stream:
            return
        if not stream.response_started:
            stream.response_started = True
            self._write(wire.frame(wire.HEADERS, wire.END_HEADERS, stream.id, headers))
        stream.pending.append(memoryview(messages))
        self._flush(stream)

    def trailers_only(self, stream: Stream, block: bytes) -> None:
        """An answer made of one HEADERS frame (errors before any message)."""
        if self._streams.get(stream.id) is not stream:
            return
        if stream.response_started:
            raise RuntimeError("trailers_only after the response started")
        stream.response_started = True
        self._write(wire.frame(wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, stream.id, block))
        self._finish(stream)

    def _flush(self, stream: Stream) -> None:
        pending = stream.pending
        while pending and not self._paused:
            chunk = pending[0]
            n = min(len(chunk), stream.send_window, self._send_window, self._peer_max_frame)
            if n <= 0:
                self._blocked[stream.id] = stream
                return
            self._write(wire.frame(wire.DATA, 0, stream.id, bytes(chunk[:n])))
            stream.send_window -= n
            self._send_window -= n
            if n == len(chunk):
                pending.popleft()
            else:
                pending[0] = chunk[n:]
        if pending:
            self._blocked[stream.id] = stream
            return
        self._blocked.pop(stream.id, None)
        if stream.trailers is not None:
            self._write(stream.trailers)
            self._finish(stream)

    def _flush_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send_window <= 0 or self._paused:
                return
            self._flush(stream)

    def _finish(self, stream: Stream) -> None:
        if self._streams.pop(stream.id, None) is stream:
            self._in_flight -= stream.received
        self._blocked.pop(stream.id, None)
        if self._going_away and not self._streams and self.transport is not None:
            self._close()

    def _reset(self, stream: Stream, code: int) -> None:
        self._write(wire.rst_stream(stream.id, code))
        self._close_stream(stream.id, cancel=True)

    def reset(self, stream: Stream, code: int) -> None:
        if self._streams.get(stream.id) is stream:
            self._reset(stream, code)

    def _close_stream(self, stream_id: int, cancel: bool) -> None:
        stream = self._streams.pop(stream_id, None)
        self._blocked.pop(stream_id, None)
        if stream is not None:
            self._in_flight -= stream.received
        if stream is not None and cancel and stream.task is not None:
            stream.task.cancel()

    def _fail(self, code: int, message: str) -> None:
        logger.warning("closing HTTP/2 connection from %s: %s", self.peer, message)
        self.server.protocol_errors += 1
        self._write(wire.goaway(self._last_stream_id, code, message.encode()[:200]))
        self._close()

    def go_away(self) -> None:
        """Tell the peer to send no new calls; close once ours are answered."""
        if self.transport is None or self._going_away:
            return
        self._going_away = True
        self._write(wire.goaway(self._last_stream_id, wire.NO_ERROR))
        if not self._streams:
            self._close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
