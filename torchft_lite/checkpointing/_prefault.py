"""Populate fresh destination pages in bulk just before the socket writes into them.

A receive into fresh tensors (no state dict of the receiver's own to land
in) allocates them when the header arrives; their pages do not exist yet.
Left alone, the kernel's copy out of the socket faults them in one 4 KiB
page at a time, inside the receive call on the event loop, where each fault
is dearer than the copy of its bytes (the socket is locked meanwhile, and in
this VM a fault also exits to the hypervisor). ``madvise(MADV_POPULATE_WRITE)``
(Linux 5.14+) makes a whole range present in one call, as a write would,
without changing a byte of it; the receiver calls :func:`populate` on each
checksum block of a fresh tensor just before the block's first bytes are
read into it (``TensorWriter.buffer_at``).

Measured with ``benchmarks/heal_bench.py`` (1 GiB into a fresh process, 2
shared cores): the first transfer went from 0.72-1.06 s to 0.56-0.57 s and
the receiver's CPU from 0.82-0.86 to 0.59-0.60 s per GiB. Populating on one
or two threads running ahead of the writes instead cost more CPU
(0.66-0.73 s per GiB) and was no faster: on two cores the threads take
their turn from the two event loops doing the transfer. Elsewhere (another
OS, a kernel without it) nothing is populated, and pages fault as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import sys
import threading

__all__ = ["PAGE_BYTES", "populate", "supported"]

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
PAGE_BYTES = 4096

_madvise = None
_unsupported = sys.platform != "linux"
_lock = threading.Lock()


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
