"""HTTP/2 (RFC 9113) and gRPC framing details, as pure functions.

No I/O here: the connection protocol in ``connection.py`` uses these to read
and write frames, and tests exercise them directly.
"""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = struct.Struct(">BHBBI")  # length as 1+2 bytes, type, flags, stream id

# Frame types.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)

# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Settings identifiers.
SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6

# Error codes.
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1


class ProtocolError(Exception):
    """A connection-level HTTP/2 error: answer GOAWAY with ``code`` and close."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    length = len(payload)
    return FRAME_HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id & 0x7FFFFFFF) + payload


def parse_frame_header(data: bytes | bytearray | memoryview, offset: int = 0) -> tuple[int, int, int, int]:
    """(length, type, flags, stream_id) of the 9-byte header at ``offset``."""
    high, low, kind, flags, stream_id = FRAME_HEADER.unpack_from(data, offset)
    return (high << 16) | low, kind, flags, stream_id & 0x7FFFFFFF


def strip_padding(payload: bytes, flags: int) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload:
        raise ProtocolError("PADDED frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ProtocolError("padding longer than the frame")
    return payload[1:len(payload) - pad]


def settings_frame(settings: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in settings.items()))


def server_settings(max_streams: int, stream_window: int, max_header_list: int, connection_window: int) -> bytes:
    """A server's first frames: its SETTINGS (no push), then the connection window opened to ``connection_window``."""
    return settings_frame({
        SETTINGS_MAX_CONCURRENT_STREAMS: max_streams,
        SETTINGS_INITIAL_WINDOW_SIZE: stream_window,
        SETTINGS_MAX_HEADER_LIST_SIZE: max_header_list,
        SETTINGS_ENABLE_PUSH: 0,
    }) + window_update(0, connection_window - DEFAULT_WINDOW)


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise ProtocolError("SETTINGS length is not a multiple of 6", FRAME_SIZE_ERROR)
    return [struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6)]


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, struct.pack(">I", code))


def goaway(last_stream_id: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream_id, code) + debug[:256])


# ------------------------------------------------------------------ HPACK


def _hpack_int(value: int, prefix_bits: int, first_byte: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first_byte | value])
    out = bytearray([first_byte | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """HPACK block of literal-without-indexing fields with literal names.

    Never touches the dynamic table, so a block can be built once and reused on
    any connection whatever the peer's table size.
    """
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value
    return bytes(out)


# ------------------------------------------------------------------ gRPC

GRPC_MESSAGE_HEADER = struct.Struct(">BI")


def grpc_message(payload: bytes) -> bytes:
    """One length-prefixed, uncompressed gRPC message."""
    return GRPC_MESSAGE_HEADER.pack(0, len(payload)) + payload


def split_grpc_messages(body: bytes) -> list[tuple[bool, bytes]]:
    """(compressed, message) for each length-prefixed message in ``body``."""
    messages = []
    offset = 0
    while offset < len(body):
        if len(body) - offset < 5:
            raise ValueError("truncated gRPC message header")
        compressed, length = GRPC_MESSAGE_HEADER.unpack_from(body, offset)
        offset += 5
        if len(body) - offset < length:
            raise ValueError(f"gRPC message of {length} bytes truncated to {len(body) - offset}")
        messages.append((bool(compressed), bytes(body[offset:offset + length])))
        offset += length
    return messages


_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_grpc_timeout(value: bytes) -> float | None:
    """Seconds from a ``grpc-timeout`` header ('100m', '5S'), None if malformed."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(value[-1:])
    return None if unit is None else int(value[:-1]) * unit


def percent_encode(message: str) -> bytes:
    """``grpc-message`` encoding: printable ASCII except '%' as is, the rest %XX."""
    out = bytearray()
    for byte in message.encode("utf-8"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)
