"""A raw HTTP/2 connection for tests that must send what no real client would: floods, resets, trickles.

Frames are built with the server's own ``torchft_lite.rpc.h2grpc.wire`` helpers;
what the server sends back is parsed into :class:`Frame` tuples, and header
blocks are decoded with one HPACK decoder per connection (either engine may
compress its answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Callable, NamedTuple

import hpack

from tests.conftest import WAIT
from torchft_lite.rpc.h2grpc import wire


class Frame(NamedTuple):
    kind: int
    flags: int
    stream_id: int
    payload: bytes
    headers: dict[bytes, bytes] | None = None  # a HEADERS frame's, decoded


def request_headers(path: bytes = b"/torchft.LighthouseService/Heartbeat",
                    extra: list[tuple[bytes, bytes]] | None = None) -> bytes:
    """An HPACK block (literals only) of a gRPC request's headers."""
    return wire.encode_headers([(b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
                                (b":authority", b"localhost"), (b"content-type", b"application/grpc"),
                                (b"te", b"trailers")] + (extra or []))


def call_frames(stream_id: int, message: bytes, path: bytes = b"/torchft.LighthouseService/Heartbeat") -> bytes:
    """HEADERS and one DATA frame (END_STREAM) of a whole unary call."""
    return (wire.frame(wire.HEADERS, wire.END_HEADERS, stream_id, request_headers(path))
            + wire.frame(wire.DATA, wire.END_STREAM, stream_id, wire.grpc_message(message)))


class RawH2:
    """One connection: ``send`` bytes; a reader task parses what comes back into ``frames`` until EOF
    (acknowledging the server's SETTINGS, as every client does); ``wait_for`` a frame or ``closed`` for the
    end. ``close()`` ends both (call it, even on failure)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.frames: list[Frame] = []  # every frame received so far
        self.eof = False
        self._buffer = b""
        self._decoder = hpack.Decoder(1 << 20)
        self._changed = asyncio.Event()
        self._reading = asyncio.get_running_loop().create_task(self._read_all())

    @classmethod
    async def open(cls, port: int, *, preface: bool = True) -> "RawH2":
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT)
        connection = cls(reader, writer)
        if preface:
            connection.send(wire.PREFACE + wire.settings_frame({}))
        return connection

    def send(self, data: bytes) -> None:
        if not self.eof and not self.writer.is_closing():
            self.writer.write(data)

    async def drain(self) -> bool:
        """Wait (up to WAIT) for the written bytes to leave; False if the server closed the connection."""
        try:
            await asyncio.wait_for(self.writer.drain(), WAIT)
            return not self.eof
        except (ConnectionError, OSError):
            return False

    async def _read_all(self) -> None:
        try:
            while chunk := await self.reader.read(1 << 16):
                self._buffer += chunk
                self._parse()
                self._changed.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.eof = True
            self._changed.set()

    def _parse(self) -> None:
        while len(self._buffer) >= 9:
            length, kind, flags, stream_id = wire.parse_frame_header(self._buffer)
            if len(self._buffer) < 9 + length:
                return
            payload = self._buffer[9:9 + length]
            self._buffer = self._buffer[9 + length:]
            headers = self._decode(payload, flags) if kind == wire.HEADERS and flags & wire.END_HEADERS else None
            self.frames.append(Frame(kind, flags, stream_id, payload, headers))
            if kind == wire.SETTINGS and not flags & wire.ACK:  # as any client: the server waits for it
                self.send(wire.frame(wire.SETTINGS, wire.ACK, 0))

    async def wait_for(self, predicate: Callable[[Frame], bool], what: str, timeout: float = WAIT) -> Frame:
        """The first frame (received so far or later) matching ``predicate``; fails naming ``what``."""
        deadline = asyncio.get_running_loop().time() + timeout
        seen = 0
        while True:
            for frame in self.frames[seen:]:
                if predicate(frame):
                    return frame
            seen = len(self.frames)
            left = deadline - asyncio.get_running_loop().time()
            if self.eof or left <= 0:
                raise AssertionError(f"no {what} from the server ({'connection closed' if self.eof else 'timed out'}"
                                     f" after {len(self.frames)} frames)")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def closed(self, timeout: float = WAIT) -> bool:
        """Wait until the server closes the connection; False if it is still open after ``timeout`` seconds."""
        await asyncio.wait({self._reading}, timeout=timeout)
        return self.eof

    def goaway(self) -> tuple[int, bytes] | None:
        """(error code, debug data) of the first GOAWAY received, if any."""
        for frame in self.frames:
            if frame.kind == wire.GOAWAY:
                return struct.unpack(">I", frame.payload[4:8])[0], frame.payload[8:]
        return None

    def _decode(self, payload: bytes, flags: int) -> dict[bytes, bytes]:
        """Decoded as they arrive, in order: HPACK state is per connection."""
        block = wire.strip_padding(payload, flags)
        if flags & wire.PRIORITY_FLAG:
            block = block[5:]
        return dict(self._decoder.decode(block, raw=True))

    def grpc_status(self, stream_id: int) -> int | None:
        """The grpc-status the server ended ``stream_id`` with, if it has."""
        for frame in self.frames:
            if frame.stream_id == stream_id and frame.headers and b"grpc-status" in frame.headers:
                return int(frame.headers[b"grpc-status"])
        return None

    def close(self) -> None:
        self.writer.close()
        self._reading.cancel()
