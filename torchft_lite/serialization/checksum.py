"""Block checksums of a checkpoint's data section, cheap enough to run inline.

Every tensor's bytes are cut into blocks of ``block_bytes`` (the last block
of a tensor may be shorter). A block's checksum ("sum64") is the sum, modulo
2**64, of its bytes read as little-endian 64-bit words, the last word padded
with zeros. torch computes it at memory speed (about 10 GB/s per core here,
five times crc32's). The sender computes it just before a block goes out, so
the send copies bytes the sum has just brought into the cache; the receiver
hands each block, once its last byte has landed, to a thread of its own
(:func:`executor`: one per 8 CPUs), so the streams go on reading their sockets.

What it catches: truncation, flipped or zeroed bits, garbage left in a
buffer, and bytes placed at the wrong block (every block has its own sum).
What it does not: words swapped within one block, or deliberate forgery:
it is an integrity check against accidents, not a signature (use the
transport's token on a trusted network for that).
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import threading
from typing import Sequence

import torch

__all__ = ["ALGORITHM", "BLOCK_BYTES", "blocks", "executor", "pack", "sum64", "unpack"]

ALGORITHM = "sum64"
BLOCK_BYTES = 1 << 20
MAX_BLOCK_BYTES = 1 << 30
SUM_BYTES = 8  # one little-endian uint64 per block on the wire
# torch sums at most this many bytes per call: 32768 words, torch's grain size, so each sum runs on the calling
# thread. A larger sum fans out to torch's OpenMP threads, whose spinning takes the core the other side of the
# transfer needs (on two cores that cost a fifth of the heal's speed).
_PIECE_BYTES = 256 << 10
_MASK = (1 << 64) - 1


def sum64(view: memoryview) -> int:
    """The block checksum of ``view``'s bytes."""
    if view.readonly:  # torch only wraps writable memory without a warning; read-only inputs are small
        view = memoryview(bytearray(view))
    whole = len(view) - len(view) % 8
    total = 0
    for start in range(0, whole, _PIECE_BYTES):
        total += int(torch.frombuffer(view[start:min(whole, start + _PIECE_BYTES)], dtype=torch.int64).sum())
    if whole != len(view):
        total += int.from_bytes(view[whole:], "little")  # the zero-padded last word
    return total & _MASK


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()


CPUS_PER_THREAD = 8
"""The receiver sums blocks on one thread per this many usable CPUs (at least one): one thread sums about
10 GB/s, and on a many-core host several streams land bytes at once."""


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The threads a receiver checksums finished blocks on while its streams keep reading their sockets."""
    global _executor
    with _lock:
        if _executor is None:
            try:
                cpus = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):  # not Linux
                cpus = os.cpu_count() or 1
            _executor = concurrent.futures.ThreadPoolExecutor(max(1, cpus // CPUS_PER_THREAD),
                                                              thread_name_prefix="torchft-sum64")
        return _executor


def blocks(extents: Sequence[tuple[int, int]], block_bytes: int) -> list[tuple[int, int, int]]:
    """``(start, end, tensor index)`` of every block, from each tensor's ``(offset, nbytes)``."""
    return [(start, min(start + block_bytes, offset + nbytes), index)
            for index, (offset, nbytes) in enumerate(extents)
            for start in range(offset, offset + nbytes, block_bytes)]


def pack(sums: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(sums)}Q", *sums)


def unpack(data: bytes | memoryview) -> list[int]:
    if len(data) % SUM_BYTES:
        raise ValueError(f"{len(data)} checksum bytes is not a whole number of {SUM_BYTES}-byte sums")
    return list(struct.unpack(f"<{len(data) // SUM_BYTES}Q", data))
