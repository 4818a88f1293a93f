"""The writing half of an HTTP/2 server connection: answers under the peer's flow-control windows.

A mixin of :class:`~torchft_lite.rpc.h2grpc.connection.H2Connection` (kept apart so
each half stays readable): response headers, DATA split to the peer's frame size
and windows, trailers, and the streams blocked on a window until it reopens.
"""

from __future__ import annotations

import asyncio

from torchft_lite.rpc.h2grpc import wire
from torchft_lite.rpc.h2grpc.guard import FloodMeter
from torchft_lite.rpc.h2grpc.streams import Stream


class ResponseWriter:
    """Sending for H2Connection, which sets this state in its ``__init__`` and defines ``_finish``."""

    transport: asyncio.Transport | None
    _streams: dict[int, Stream]
    _blocked: dict[int, Stream]  # streams with DATA waiting for a window
    _paused: bool  # the transport's write buffer is full
    _send_window: int
    _peer_max_frame: int
    _corked: list[bytes] | None  # writes gathered while handling one read
    _pings: FloodMeter  # forgiven whenever we send data

    def _finish(self, stream: Stream) -> None:
        raise NotImplementedError

    def _write(self, data: bytes) -> None:
        if self._corked is not None:
            self._corked.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    def send_response(self, stream: Stream, headers: bytes, messages: bytes, trailers: bytes) -> None:
        """Send response headers (if not sent yet), DATA ``messages`` and the trailers."""
        if self._streams.get(stream.id) is not stream:
            return  # reset by the peer or the connection is gone
        self._pings.count = 0  # an answer: the peer's PINGs may probe a connection that is busy with it
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
        self._pings.count = 0
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
