"""HTTP/2 and gRPC wire details for the benchmark's lean client (benchmarks/_h2_client.py).

Pure functions and constants, no I/O: frame encoding, the request header
fields (HPACK literals, so no encoder state), grpc-timeout values, and an HPACK
decoder that reuses the decoding of blocks that leave the dynamic table alone.
"""

from __future__ import annotations

import struct

import hpack
from hpack.table import HeaderTable

from torchft_lite.rpc.h2grpc.wire import _hpack_int  # the server's encoder: one HPACK integer codec

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = struct.Struct(">BHBBI")  # 24-bit length as 8+16, type, flags, stream id
U32 = struct.Struct(">I")
GRPC_PREFIX = struct.Struct(">BI")

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


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return FRAME_HEADER.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal field without indexing, literal name: no dynamic-table state."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def grpc_timeout(seconds: float) -> bytes:
    """grpc-timeout value: at most 8 digits, in the finest unit that fits."""
    for unit, scale in ((b"m", 1e3), (b"S", 1.0), (b"M", 1 / 60), (b"H", 1 / 3600)):
        value = max(1, int(seconds * scale + 0.999))
        if value < 10**8:
            return str(value).encode() + unit
    return b"99999999H"


class CountedTable(HeaderTable):
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


class HeaderDecoder:
    """``hpack.Decoder`` with a cache of blocks that do not change the table."""

    MAX_CACHED = 256

    def __init__(self) -> None:
        self._decoder = hpack.Decoder()
        self._table = self._decoder.header_table = CountedTable()
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
