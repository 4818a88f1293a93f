"""Populate fresh destination pages in bulk just before the socket writes into them.

A receive into fresh tensors allocates them when the header arrives; their pages
do not exist yet. Left alone, the kernel's copy out of the socket faults them in
one 4 KiB page at a time, inside the receive call on the event loop, where each
fault is dearer than the copy of its bytes (the socket is locked meanwhile, and in
a VM a fault also exits to the hypervisor). ``madvise(MADV_POPULATE_WRITE)``
(Linux 5.14+, :func:`populate`) makes a range present in one call without changing
a byte; a :class:`Populator` does it ahead of the writes. Elsewhere nothing is
populated, and pages fault as before. What it saved: docs/benchmarks.md ("Heals").
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import logging
import sys
import threading
from typing import Sequence

__all__ = ["PAGE_BYTES", "POPULATE_THREADS", "Populator", "populate", "supported"]

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
PAGE_BYTES = 4096
POPULATE_THREADS = 2

_madvise = None
_unsupported = sys.platform != "linux"
_lock = threading.Lock()
_threads: concurrent.futures.ThreadPoolExecutor | None = None


def _libc_madvise():
    global _madvise, _unsupported
    with _lock:
        if _madvise is None and not _unsupported:
            try:
                function = ctypes.CDLL(None, use_errno=True).madvise  # a CDLL call releases the GIL
                function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                function.restype = ctypes.c_int
                _madvise = function
            except (OSError, AttributeError) as exc:
                logger.debug("no madvise in this process's C library (%r): fresh pages fault on write", exc)
                _unsupported = True
        return _madvise


def supported() -> bool:
    """Whether this process populates pages (false once the kernel has refused ``MADV_POPULATE_WRITE``)."""
    return not _unsupported and _libc_madvise() is not None


def populate(address: int, length: int) -> bool:
    """Make the pages holding bytes ``[address, address + length)`` present, never changing what they hold.

    Every page holding one of those bytes must be mapped and writable (it
    is, when the bytes are a live CPU tensor's): a page shared with a
    neighbouring allocation is populated whole, which that allocation
    cannot tell from a page it faulted in itself. Returns whether the pages
    were populated; a failure only means they fault in on write, as without.
    """
    global _unsupported
    madvise = _libc_madvise() if length > 0 and not _unsupported else None
    if madvise is None:
        return False
    first = address // PAGE_BYTES * PAGE_BYTES
    end = -(-(address + length) // PAGE_BYTES) * PAGE_BYTES
    if madvise(first, end - first, MADV_POPULATE_WRITE) == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EINVAL:  # a kernel older than 5.14: none here, ever
        logger.debug("the kernel refuses MADV_POPULATE_WRITE: fresh pages fault on write")
        _unsupported = True
    else:  # ENOMEM, say: the writes then fault, and fail the usual way if they must
        logger.debug("populating %d bytes of a receive's destination failed: %s", end - first,
                     errno.errorcode.get(code, code))
    return False


class Populator:
    """Populates ``blocks`` (``(address, length)`` each, in data order) on :data:`POPULATE_THREADS` threads.

    The threads work ahead of the latest write: from the block after the one
    a writer last asked for (:meth:`claim`; with several streams, ahead of
    each in turn), else from the first block left. ``keep`` (the tensors
    holding the blocks) stays referenced until the threads are done, so they
    never populate memory that was freed. A block is populated once: by a
    thread, or by the writer that claims it first (inline, in
    ``TensorWriter.buffer_at``). Why two threads ahead rather than inline alone:
    with other processes holding memory, one thread's populate took far longer
    (docs/benchmarks.md, "Heals").
    """

    def __init__(self, blocks: Sequence[tuple[int, int] | None], keep: object) -> None:
        self._blocks = blocks  # None: a block left to fault (in place, or too small to be worth a call)
        self._keep = keep
        self._lock = threading.Lock()
        self._next = 0  # no block before this one is left
        self._hint = 0  # where the threads go on: after the latest write, or after their own latest block
        self._stopped = False
        self._pending = sum(block is not None for block in blocks)
        for _ in range(min(POPULATE_THREADS, self._pending)):
            _pool().submit(self._run)

    def claim(self, index: int) -> tuple[int, int] | None:
        """Block ``index``'s ``(address, length)`` if nobody populated it yet (the caller then does), else None."""
        with self._lock:
            self._hint = index + 1
            block = self._blocks[index]
            if block is not None:
                self._take(index)
            return block

    def stop(self) -> None:
        """Populate nothing more (the receive ended); a call under way finishes."""
        with self._lock:
            self._stopped = True

    def _take(self, index: int) -> None:  # with the lock held
        self._blocks[index] = None
        self._pending -= 1
        if self._pending == 0:
            self._keep = None

    def _pick(self) -> int | None:  # with the lock held
        blocks, end = self._blocks, len(self._blocks)
        index = self._hint
        while index < end and blocks[index] is None:
            index += 1
        if index == end:  # nothing left after the latest write: the first block left, if any
            while self._next < end and blocks[self._next] is None:
                self._next += 1
            index = self._next
        return index if index < end else None

    def _run(self) -> None:
        while True:
            with self._lock:
                index = None if self._stopped else self._pick()
                if index is None:
                    self._keep = None
                    return
                block, keep = self._blocks[index], self._keep
                self._take(index)
                self._hint = index + 1
            populate(*block)
            del keep


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _threads
    with _lock:
        if _threads is None:
            _threads = concurrent.futures.ThreadPoolExecutor(POPULATE_THREADS, thread_name_prefix="torchft_lite-populate")
        return _threads
