"""One HTTP/2 (h2c, prior knowledge) server connection carrying gRPC calls.

An ``asyncio.Protocol``: frames are parsed as bytes arrive, complete requests
are handed to its owner (a :class:`ConnectionOwner`, the ``GrpcServer``) and answers are
written back respecting the peer's flow-control windows and frame size. Only what a
gRPC server needs is implemented: no server push, no client streaming, no
HTTP/1.1 (a peer that does not start with the HTTP/2 preface is disconnected).

Every limit of the owner's :class:`~torchft_lite.rpc.limits.ServerLimits` holds here:
the frame budgets (PING, SETTINGS, rapid reset) as frames arrive, the connection cap
when one is made, the deadlines (idle, slowloris) in the guard's sweep (guard.py).
A peer that breaks one gets GOAWAY ENHANCE_YOUR_CALM (idle: NO_ERROR) and is closed.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Protocol

from torchft_lite.rpc.h2grpc import wire
from torchft_lite.rpc.h2grpc.guard import ConnectionGuard, LimitExceeded, SweepState, flood_meters
from torchft_lite.rpc.h2grpc.sending import ResponseWriter
from torchft_lite.rpc.h2grpc.streams import STREAM_RECV_WINDOW, Stream
from torchft_lite.rpc.h2grpc.wire import ProtocolError
from torchft_lite.rpc.limits import ServerLimits

logger = logging.getLogger(__name__)

CONN_RECV_WINDOW = 16 * 1024 * 1024
LINGER = 1.0  # seconds a connection closed for an error reads (and drops) what its peer still sends
MAX_HEADER_BLOCK = 64 * 1024  # encoded, over CONTINUATION frames; the decoded list has ServerLimits' cap


class ConnectionOwner(Protocol):
    """What a connection needs from the server that accepted it; declared here so this module imports no server."""

    connections: set[H2Connection]  # a connection adds itself when made and leaves when lost
    protocol_errors: int  # counted up by a connection closed for the peer's protocol error
    limits: ServerLimits
    guard: ConnectionGuard  # the connection cap, and the count of every limit hit

    def dispatch(self, connection: H2Connection, stream: Stream) -> None: ...  # a whole request: start its call
    def reject_oversized(self, connection: H2Connection, stream: Stream, details: str | None = None) -> None: ...


def _hpack():
    """The HPACK decoder's module, imported by the first connection: loading its Huffman table takes 60-80 ms,
    which a trainer's ManagerServer that no peer ever calls (a one-rank group's) should not wait for."""
    import hpack
    return hpack


_PARTIAL_FRAME = object()  # stalled_input() for bytes of an unfinished frame on a connection with no stream


class H2Connection(ResponseWriter, asyncio.Protocol):
    def __init__(self, server: ConnectionOwner) -> None:
        self.server = server
        self.limits = limits = server.limits  # as they were when the connection was made
        self.transport: asyncio.Transport | None = None
        self.peer = "unknown"
        self._admitted = False  # counted in the guard's connections per host
        self._buffer = bytearray()
        self._preface_seen = False
        self._hpack = hpack = _hpack()
        self._decoder = hpack.Decoder(limits.max_header_list_bytes)
        self._continuation: tuple[int, int, bytearray] | None = None  # stream id, flags, block
        self._streams: dict[int, Stream] = {}
        self._last_stream_id = 0
        self._recv_window = CONN_RECV_WINDOW
        self._recv_unacked = 0
        # Stream windows are never reopened: each must take one byte past the largest request body
        # (a message and its 5-byte prefix) so that a larger one reaches the size check and is refused;
        # with less, its sender stalled on a closed window until its deadline, or forever.
        self._stream_window = max(STREAM_RECV_WINDOW, limits.max_request_bytes + 6)
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
        self._pings, self._settings_frames, self._resets = flood_meters(limits)
        self.sweep = SweepState()  # the guard's notes on this connection

    # ------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        address = transport.get_extra_info("peername")
        if isinstance(address, tuple):
            family = "ipv6" if ":" in address[0] else "ipv4"
            self.peer = f"{family}:{address[0]}:{address[1]}"
        refused = self.server.guard.admit(self.peer)
        if refused is not None:  # over the connection cap: closed at once, holding nothing
            self._write(wire.goaway(0, wire.ENHANCE_YOUR_CALM, refused.encode()))
            self._linger()
            return
        self._admitted = True
        self.server.connections.add(self)
        loop = asyncio.get_running_loop()
        self._handshake_timer = loop.call_later(self.limits.handshake_timeout, self._handshake_expired)
        self._write(wire.server_settings(self.limits.max_concurrent_streams, self._stream_window,
                                         self.limits.max_header_list_bytes, CONN_RECV_WINDOW))

    def _handshake_expired(self) -> None:
        if not self._preface_seen and self.transport is not None:
            self.server.guard.log.hit("handshake_timeout", self.peer,
                                      f"no HTTP/2 preface within {self.limits.handshake_timeout:g}s: closed")
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self.server.connections.discard(self)
        if self._admitted:
            self._admitted = False
            self.server.guard.release(self.peer)
        for stream in self._streams.values():
            if stream.task is not None:
                stream.task.cancel()
        self._streams.clear()
        self._blocked.clear()
        self.transport = None

    def pause_writing(self) -> None:
        # A peer that does not read what we send gets no more of its frames read (each may make us
        # answer: a PING, a SETTINGS, a call), so what it makes us buffer stays bounded.
        self._paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self.transport is not None:
            self.transport.resume_reading()
        self._flush_blocked()

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return  # closing (lingering after a GOAWAY): dropped unread
        self._buffer += data
        # Everything this read makes us send (ACKs, window updates, resets)
        # goes out in one write: one syscall instead of one per frame.
        self._corked = []
        try:
            self._process()
        except LimitExceeded as exc:
            self.fail(exc.code, str(exc), exc.limit)
        except ProtocolError as exc:
            self.fail(exc.code, str(exc))
        except self._hpack.HPACKError as exc:
            self.fail(wire.COMPRESSION_ERROR, f"bad header block: {exc}")
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
                self._pings.spend()
                self._write(wire.frame(wire.PING, wire.ACK, 0, payload))
        elif kind == wire.RST_STREAM:
            if len(payload) != 4 or not stream_id:
                raise ProtocolError("malformed RST_STREAM", wire.FRAME_SIZE_ERROR)
            if stream_id in self._streams:  # a call we had taken on: work thrown away (rapid reset)
                self._resets.spend()
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
            raise LimitExceeded("header_list_size", f"header block over {MAX_HEADER_BLOCK} bytes")
        if flags & wire.END_HEADERS:
            first_flags = self._continuation[1]
            self._continuation = None
            self._header_block(stream_id, first_flags, bytes(block))

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        # Always decode, even for streams we refuse: the HPACK table is per connection.
        try:
            headers = self._decoder.decode(block, raw=True)
        except self._hpack.OversizedHeaderListError:  # the table is now unusable: the connection must go
            raise LimitExceeded("header_list_size", f"header list over {self.limits.max_header_list_bytes} "
                                                    "bytes") from None
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
        if self._going_away or len(self._streams) >= self.limits.max_concurrent_streams:
            self._write(wire.rst_stream(stream_id, wire.REFUSED_STREAM))
            if not self._going_away:
                self.server.guard.log.hit("max_concurrent_streams", self.peer, f"stream {stream_id} refused: "
                                          f"{len(self._streams)} open")
                self._resets.spend()
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
        if stream.recv_window < 0 or len(stream.body) + len(data) > self.limits.max_request_bytes + 5:
            self.server.reject_oversized(self, stream)
            return
        if self._in_flight + len(data) > self.limits.max_connection_request_bytes:
            self.server.reject_oversized(self, stream, f"this connection's calls in flight hold more than "
                                                       f"{self.limits.max_connection_request_bytes} request bytes")
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
        self._settings_frames.spend()
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

    # ------------------------------------------------------------ stream ends

    def _close(self) -> None:
        self._uncork()
        if self.transport is not None:
            transport = self.transport
            if transport.is_closing():
                # Closed already (the peer went, or an earlier close). A second close() of an asyncio TLS transport
                # drops its protocol, and its buffer size and abort() then raise AttributeError.
                return
            transport.close()
            if transport.get_write_buffer_size():  # a peer that does not read must not keep it open
                asyncio.get_running_loop().call_later(self.limits.handshake_timeout, transport.abort)

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

    # What the guard's sweep reads and does (its half of the connection; see guard.GuardedConnection).

    def open_streams(self) -> list[Stream]:
        """The streams taken on and not yet finished."""
        return list(self._streams.values())

    @property
    def last_stream_id(self) -> int:
        """The highest stream id the peer has opened."""
        return self._last_stream_id

    def stalled_input(self) -> object | None:
        """What input is stuck part-way, as an object that stays the same while it is the same input.

        The header block still waiting for its CONTINUATION frames; else, on a connection with no
        open stream, the bytes of an unfinished frame; else None.
        """
        if self._continuation is not None:
            return self._continuation
        return None if self._streams or not self._buffer else _PARTIAL_FRAME

    def stop_receiving(self, stream: Stream) -> None:
        """Ask the peer to stop sending on ``stream`` (RST_STREAM, no error): it was answered already."""
        self._write(wire.rst_stream(stream.id, wire.NO_ERROR))

    def fail(self, code: int, message: str, limit: str | None = None) -> None:
        """GOAWAY ``code`` and close: for a protocol error, or for the flood limit ``limit``."""
        if limit is None:
            logger.warning("closing HTTP/2 connection from %s: %s", self.peer, message)
            self.server.protocol_errors += 1
        else:
            self.server.guard.log.hit(limit, self.peer, f"{message}: GOAWAY ENHANCE_YOUR_CALM")
        self._write(wire.goaway(self._last_stream_id, code, message.encode()[:200]))
        self._linger()

    def _linger(self) -> None:
        """Close after an error's GOAWAY so that the peer gets to read it: FIN after it, then drop what the peer
        still sends for up to LINGER seconds. (Closed with the peer's bytes unread, the socket would answer
        them with a reset, which destroys the GOAWAY and its reason before the peer reads them.)"""
        self._uncork()
        transport, self.transport = self.transport, None  # nothing more is written or parsed
        if transport is None:
            return
        if transport.can_write_eof():
            transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER, transport.abort)

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
