"""crc32 of tensor bytes: in parallel slices, joined with ``crc32_combine``.

``zlib.crc32`` releases the GIL for large buffers, so slices of the data run
on a small thread pool at once; the slices' crcs are then joined into each
tensor's crc with :func:`crc32_combine` (zlib's algorithm, over GF(2)), which
also lets a receiver checksum the pieces of a tensor in whatever order and on
whatever stream they arrive, without a second pass over the bytes.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import zlib
from typing import Callable, Sequence

from torchft_lite.errors import CheckpointError

__all__ = ["checksums", "crc32_combine", "executor"]

SLICE_BYTES = 8 << 20
_INLINE_BYTES = 4 << 20  # below this, a thread pool costs more than it saves
_POLYNOMIAL = 0xEDB88320  # crc32's, reflected

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _times(matrix: Sequence[int], vector: int) -> int:
    """``matrix * vector`` over GF(2); ``matrix`` is 32 columns."""
    total = 0
    index = 0
    while vector:
        if vector & 1:
            total ^= matrix[index]
        vector >>= 1
        index += 1
    return total


def _square(matrix: Sequence[int]) -> list[int]:
    return [_times(matrix, column) for column in matrix]


def _zero_operators() -> list[list[int]]:
    """Operator ``k`` advances a crc over ``2**k`` zero bytes, for k in [0, 64)."""
    one_bit = [_POLYNOMIAL] + [1 << n for n in range(31)]
    operator = _square(_square(_square(one_bit)))  # 8 zero bits
    operators = [operator]
    for _ in range(63):
        operator = _square(operator)
        operators.append(operator)
    return operators


_operators: list[list[int]] | None = None


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The crc32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    global _operators
    if length2 <= 0:
        return crc1
    if _operators is None:
        _operators = _zero_operators()  # about 10 ms, once per process
    bit = 0
    while length2:
        if length2 & 1:
            crc1 = _times(_operators[bit], crc1)
        length2 >>= 1
        bit += 1
    return crc1 ^ crc2


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process's crc32 threads (zlib drops the GIL, so they run beside the event loop)."""
    global _pool
    with _lock:
        if _pool is None:
            workers = max(2, min(8, os.cpu_count() or 2))
            _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="torchft-crc32")
        return _pool


def checksums(views: Sequence[memoryview], should_stop: Callable[[], bool] | None = None) -> list[int]:
    """The crc32 of each view, its slices computed in parallel.

    ``should_stop`` is polled before each slice; when it turns true the work
    is abandoned with ``CheckpointError``.
    """
    def crc(view: memoryview) -> int:
        if should_stop is not None and should_stop():
            raise CheckpointError("checksum abandoned: the state dict was released")
        return zlib.crc32(view)

    if sum(len(view) for view in views) <= _INLINE_BYTES:
        return [crc(view) for view in views]
    pool = executor()
    jobs = [[(len(view[start:start + SLICE_BYTES]), pool.submit(crc, view[start:start + SLICE_BYTES]))
             for start in range(0, len(view), SLICE_BYTES)] for view in views]
    try:
        results = []
        for slices in jobs:
            total = 0
            for length, job in slices:
                total = crc32_combine(total, job.result(), length)
            results.append(total)
        return results
    finally:
        for slices in jobs:
            for _, job in slices:
                job.cancel()
