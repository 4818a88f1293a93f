"""A heal's bytes onto the GPU while the socket is still being read: a small ring of pinned slots, reused.

A receive into GPU tensors hands the socket views into *slots* of one pinned
buffer of ``SLOTS`` x ``SLOT_BYTES``, allocated once per process (:func:`pinned_ring`)
and kept; each filled slot is copied to its GPU target on the recovery stream and
checksummed meanwhile (:class:`Stager`). So the copies to the device overlap the
network, and the host memory a heal pins is the ring's, whatever the state dict's
size (what pinning the whole state cost before: docs/benchmarks.md, "GPUs"). The
ring (:class:`StagingRing`) and the copier (:class:`RecoveryStreamCopier`) are
injected, so the bookkeeping is tested on CPU with a plain copy.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

import torch

from torchft_lite.errors import CheckpointTransferError
from torchft_lite.serialization import checksum, cuda
from torchft_lite.serialization.dtensor import local_of
from torchft_lite.serialization.spec import byte_view

__all__ = ["Copier", "RecoveryStreamCopier", "SLOTS", "SLOT_BYTES", "SLOT_WAIT", "Stager", "StagingRing",
           "pinned_ring", "stager_for"]

SLOT_BYTES = 4 << 20
"""A slot: four default checksum blocks' worth; a copy of it to an H200 takes under 0.1 ms."""
SLOTS = 24
"""96 MiB pinned per process: more slots than a receive opens streams (at most 16), and a few in flight."""
SLOT_WAIT = 60.0
"""Seconds a reader waits for a free slot before the receive fails (the copies to the GPU are stuck)."""


class StagingRing:
    """``slots`` reusable host buffers of ``slot_bytes``, cut from one allocation (``allocate(nbytes)``)."""

    def __init__(self, slots: int, slot_bytes: int, allocate: Callable[[int], torch.Tensor]) -> None:
        if slots < 1 or slot_bytes < 8 or slot_bytes % 8:
            raise ValueError(f"a staging ring needs >= 1 slot of a positive multiple of 8 bytes, got {slots} x "
                             f"{slot_bytes}")
        self.slot_bytes = slot_bytes
        memory = allocate(slots * slot_bytes)
        self._free = [memory[i * slot_bytes:(i + 1) * slot_bytes] for i in range(slots)]
        self.slots = slots
        self._changed = threading.Condition()

    def try_acquire(self) -> torch.Tensor | None:
        """A free slot (a flat uint8 tensor), or None when all are in use."""
        with self._changed:
            return self._free.pop() if self._free else None

    def acquire(self, timeout: float) -> torch.Tensor:
        """A free slot, waiting at most ``timeout`` seconds for one to come back."""
        with self._changed:
            if not self._changed.wait_for(lambda: bool(self._free), timeout):
                raise CheckpointTransferError(
                    f"no staging slot came free within {timeout:g}s: all {self.slots} were still being copied to "
                    f"the GPU")
            return self._free.pop()

    def release(self, slot: torch.Tensor) -> None:
        with self._changed:
            self._free.append(slot)
            self._changed.notify()

    def free(self) -> int:
        """Slots not in use now."""
        with self._changed:
            return len(self._free)


_ring: StagingRing | None = None
_ring_lock = threading.Lock()


def pinned_ring() -> StagingRing:
    """The process's ring of pinned slots (allocated on first use, then kept for every later receive)."""
    global _ring
    with _ring_lock:
        if _ring is None:
            _ring = StagingRing(SLOTS, SLOT_BYTES,
                                lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        return _ring


class Copier(Protocol):
    """Copies a filled slot into its target; ``start`` returns a function that waits for that copy."""

    def start(self, source: torch.Tensor, target: torch.Tensor) -> Callable[[], None]: ...


class RecoveryStreamCopier:
    """Host-to-device copies on the target's recovery stream, waited for by an event (never the whole device)."""

    def start(self, source: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
        stream = cuda.recovery_stream(target.device)
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event.synchronize


@dataclass
class _Chunk:
    """Data bytes ``[start, end)`` of one block, landing in ``slot`` before they are copied to ``target``."""

    block: int
    start: int
    end: int
    slot: torch.Tensor
    view: memoryview
    target: torch.Tensor
    """The flat bytes of the destination, ``end - start`` of them."""
    pooled: bool
    """The slot is the ring's (an overflow slot is not given back)."""
    got: int = 0


def _is_gpu_target(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and tensor.is_contiguous()


class Stager:
    """One receive's chunks: slots handed to the socket, filled, copied to their targets, summed, given back.

    ``takes(target)`` says which destination tensors are staged (contiguous
    CUDA tensors, by default). The ``TensorWriter`` asks :meth:`buffer_at`
    for where data bytes land, reports :meth:`filled`, and takes each block's
    sum from :meth:`block_sum` once the block is complete.

    A slot holds one *chunk*: a piece of one checksum block, at most a slot long
    (a block of the default 1 MiB is one chunk). Once a chunk has all its bytes,
    one job on the checksum thread copies it into its GPU target on the device's
    recovery stream (``cuda.recovery_stream``, never behind the training step's
    kernels), sums it while the copy runs, waits for the copy, and gives the slot
    back. A block's sum is its chunks' sums added (sum64 adds 8-byte words, and
    chunks start every ``SLOT_BYTES`` of a block, a multiple of 8). When every slot
    is busy the reader waits for one (bounded by ``SLOT_WAIT``), unless none of
    this receive's copies is in flight (then no slot would come back: a stream
    count above the ring's takes an unpinned overflow slot instead).

    What a receive into GPU targets gives up: a target is written as its bytes
    arrive, before the whole transfer is verified, as contiguous CPU targets
    always were (``TensorWriter``: a failed receive may leave targets partly
    overwritten). The copies of a receive that was abandoned and of the next one
    are ordered: one checksum thread runs the jobs in order, and one recovery
    stream per device runs the copies in order.
    """

    def __init__(self, ring: StagingRing, copier: Copier,
                 takes: Callable[[torch.Tensor], bool] = _is_gpu_target,
                 executor: concurrent.futures.Executor | None = None, slot_wait: float = SLOT_WAIT) -> None:
        self._ring, self._copier, self.takes = ring, copier, takes
        self._executor = executor or checksum.executor()
        self._slot_wait = slot_wait
        self._open: dict[int, _Chunk] = {}  # by start: chunks handed out and not yet full
        self._sums: dict[int, list[concurrent.futures.Future[int]]] = {}  # by block: its full chunks' jobs
        self._lock = threading.Lock()  # the jobs' count, against the checksum thread
        self._in_flight = 0  # chunks of the ring's slots being copied: each will give one back
        self._abandoned = threading.Event()

    def _chunk_start(self, block_start: int, offset: int) -> int:
        return block_start + (offset - block_start) // self._ring.slot_bytes * self._ring.slot_bytes

    def buffer_at(self, block: int, block_start: int, block_end: int, offset: int, limit: int,
                  destination: torch.Tensor) -> memoryview:
        """Where data bytes ``[offset, min(limit, end of their chunk))`` of ``block`` land.

        ``destination``: the flat bytes of the target for the whole block
        (``block_end - block_start`` of them, on the device).
        """
        if self._abandoned.is_set():
            raise CheckpointTransferError(f"data byte {offset} arrived after its receive was abandoned")
        start = self._chunk_start(block_start, offset)
        chunk = self._open.get(start)
        if chunk is None:
            end = min(start + self._ring.slot_bytes, block_end)
            slot, pooled = self._slot()
            chunk = self._open[start] = _Chunk(block, start, end, slot, byte_view(slot),
                                               destination[start - block_start:end - block_start], pooled)
        begin = chunk.start + chunk.got
        if offset != begin:
            raise CheckpointTransferError(f"data byte {offset} arrived out of order: bytes [{chunk.start}, "
                                          f"{chunk.end}) of a staged block had {chunk.got} so far")
        return chunk.view[offset - chunk.start:min(limit, chunk.end) - chunk.start]

    def _slot(self) -> tuple[torch.Tensor, bool]:
        slot = self._ring.try_acquire()
        if slot is not None:
            return slot, True
        with self._lock:
            waiting_helps = self._in_flight > 0
        if not waiting_helps:  # every slot is held by a chunk still being read (or another receive): none of
            # this receive's would come back
            return torch.empty(self._ring.slot_bytes, dtype=torch.uint8), False
        return self._ring.acquire(self._slot_wait), True

    def filled(self, block_start: int, offset: int, count: int) -> None:
        """``count`` bytes landed at ``offset`` of the block at ``block_start`` (in the view :meth:`buffer_at`
        handed out for them)."""
        chunk = self._open.get(self._chunk_start(block_start, offset))
        if chunk is None or offset != chunk.start + chunk.got or chunk.got + count > chunk.end - chunk.start:
            raise CheckpointTransferError(f"{count} bytes at data byte {offset} landed outside the staging slot "
                                          f"handed out for them")
        chunk.got += count
        if chunk.got == chunk.end - chunk.start:
            del self._open[chunk.start]
            if chunk.pooled:
                with self._lock:
                    self._in_flight += 1
            self._sums.setdefault(chunk.block, []).append(self._executor.submit(self._copy_and_sum, chunk))

    def _copy_and_sum(self, chunk: _Chunk) -> int:
        """On the checksum thread: copy the chunk to its target, sum it meanwhile, then free its slot."""
        try:
            length = chunk.end - chunk.start
            wait = None if self._abandoned.is_set() else self._copier.start(chunk.slot[:length], chunk.target)
            total = checksum.sum64(chunk.view[:length])
            if wait is not None:
                wait()
            return total
        except Exception as exc:
            raise CheckpointTransferError(f"copying data bytes [{chunk.start}, {chunk.end}) to the GPU failed: "
                                          f"{exc}") from exc
        finally:
            if chunk.pooled:
                self._ring.release(chunk.slot)
                with self._lock:
                    self._in_flight -= 1

    def block_sum(self, block: int) -> concurrent.futures.Future[int]:
        """The sum of a complete block: its chunks' sums added, once each is copied (on the checksum thread)."""
        jobs = self._sums.pop(block, [])
        return self._executor.submit(_added, jobs)

    def forget(self, blocks: Iterable[int]) -> None:
        """These blocks will be received again: drop their chunks still being read (their slots come back)."""
        blocks = set(blocks)
        for start, chunk in list(self._open.items()):
            if chunk.block in blocks:
                del self._open[start]
                self._give_back(chunk)
        for block in blocks:
            self._sums.pop(block, None)  # copies already queued land before the new bytes' (one thread, one stream)

    def abandon(self) -> None:
        """The receive failed (cut off half-way, timed out, or refused at the end): copy nothing more into the
        targets (queued copies are skipped); give back the slots still being read; later bytes are refused."""
        self._abandoned.set()
        for chunk in self._open.values():
            self._give_back(chunk)
        self._open.clear()

    def _give_back(self, chunk: _Chunk) -> None:
        if chunk.pooled:
            self._ring.release(chunk.slot)


def _added(jobs: list[concurrent.futures.Future[int]]) -> int:
    return sum(job.result() for job in jobs) & ((1 << 64) - 1)


def stager_for(targets: Mapping[Any, torch.Tensor] | None) -> Stager | None:
    """A stager over the process's pinned ring when any of ``targets`` is a GPU tensor to stage; else None."""
    if not targets or not any(_is_gpu_target(local_of(t)) for t in targets.values() if isinstance(t, torch.Tensor)):
        return None
    return Stager(pinned_ring(), RecoveryStreamCopier())
