"""Reconfigurable NCCL process group (CUDA tensors).

NCCL's own watchdog, on a timeout, tears the whole process down by default --
the opposite of what a fault-tolerant job wants. So collectives here carry no
per-call timeout (NCCL falls back to its communicator's, set well above ours),
and a :class:`_DeadlineWatchdog` thread fails and aborts any collective still
running after our timeout. Aborting the communicator (``ncclCommAbort``)
releases kernels stuck on a dead peer; the group then stays errored until the
next ``configure()``, which builds a fresh communicator.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from torchft_lite.errors import CollectiveTimeout, ConfigError

from .base import DEFAULT_TIMEOUT
from .reconfigurable import ReconfigurableProcessGroup, as_process_group
from .tracked_work import TrackedWork

__all__ = ["ProcessGroupNCCL", "check_nccl", "create_nccl_backend", "creating_thread_device"]

logger = logging.getLogger(__name__)

# NCCL's own timeout is this many times ours, so our watchdog always acts first.
_NCCL_TIMEOUT_FACTOR = 4
_WATCHDOG_IDLE_EXIT_S = 30.0


class _DeadlineWatchdog:
    """One daemon thread that calls ``on_expiry(work)`` for works not completed by their deadline.

    The thread starts with the first watched work and exits after
    ``_WATCHDOG_IDLE_EXIT_S`` with nothing to watch.
    """

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._name = name
        self._clock = clock
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, TrackedWork, Callable[[TrackedWork], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, work: TrackedWork, timeout: timedelta, on_expiry: Callable[[TrackedWork], None]) -> None:
        deadline = self._clock() + timeout.total_seconds()
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), work, on_expiry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _next_expired(self) -> tuple[TrackedWork, Callable[[TrackedWork], None]] | None:
        """Wait for the earliest deadline; None when idle long enough to exit."""
        with self._cond:
            idle_since = self._clock()
            while True:
                now = self._clock()
                if not self._heap:
                    if now - idle_since >= _WATCHDOG_IDLE_EXIT_S:
                        self._thread = None
                        return None
                    self._cond.wait(_WATCHDOG_IDLE_EXIT_S)
                    continue
                deadline, _, work, on_expiry = self._heap[0]
                if work.is_completed():
                    heapq.heappop(self._heap)
                elif deadline <= now:
                    heapq.heappop(self._heap)
                    return work, on_expiry
                else:
                    self._cond.wait(min(deadline - now, 1.0))

    def _run(self) -> None:
        while (expired := self._next_expired()) is not None:
            work, on_expiry = expired
            try:
                on_expiry(work)
            except Exception:
                logger.exception("the NCCL watchdog failed to abort an overdue collective")


def check_nccl() -> None:
    """Raise :class:`ConfigError` unless this process can run NCCL."""
    if not torch.cuda.is_available():
        raise ConfigError("NCCL needs a CUDA device, and torch.cuda.is_available() is False; "
                          "use ProcessGroupGloo on CPU-only machines")
    if not dist.is_nccl_available():
        raise ConfigError(f"this torch build ({torch.__version__}) has no NCCL; use ProcessGroupGloo")


def creating_thread_device() -> int:
    """The CUDA device current on the calling thread (0 without CUDA).

    Read when a group is made, on the trainer's thread, after its
    ``torch.cuda.set_device``: ``configure()`` runs on another thread (the
    Manager's control plane), whose current device is always 0.
    """
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def create_nccl_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                        device: int) -> dist.ProcessGroup:
    """A connected NCCL communicator on CUDA ``device`` whose own timeout never fires before ours.

    Fronted by a torch ProcessGroup, which has every collective (the
    backend's own binding lacks the coalesced tensor ones).
    """
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout * _NCCL_TIMEOUT_FACTOR
    # Non-blocking communicators can be aborted while another thread is
    # inside an NCCL call; blocking ones can deadlock the abort.
    options.config.blocking = False
    backend = dist.ProcessGroupNCCL(store, rank, world_size, options)
    # Connect now, inside configure()'s timeout, not lazily in the first collective.
    backend.eager_connect_single_device(torch.device("cuda", device))
    return as_process_group(store, rank, world_size, backend, dist.ProcessGroup.BackendType.NCCL, ("cuda",))


class ProcessGroupNCCL(ReconfigurableProcessGroup):
    """An NCCL process group rebuilt by every ``configure()``.

    Constructing one needs no GPU; ``configure()`` raises
    :class:`~torchft_lite.errors.ConfigError` when CUDA or NCCL is missing.
    The group uses the CUDA device current when it is constructed (call
    ``torch.cuda.set_device`` first).

    Args:
        timeout: bounds the rendezvous and every collective; an overdue
            collective is failed and the communicator aborted.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._watchdog = _DeadlineWatchdog(name="torchft_lite-nccl-watchdog")
        self._device = creating_thread_device()

    def getBackendName(self) -> str:
        return "torchft-nccl"

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  timeout: timedelta | None = None) -> None:
        check_nccl()
        super().configure(store_addr, replica_id, rank, world_size, timeout)

    def _create_backend(self, store: dist.Store, rank: int, world_size: int,
                        timeout: timedelta) -> dist.ProcessGroup:
        return create_nccl_backend(store, rank, world_size, timeout, self._device)

    def _set_backend_timeout(self, backend: dist.ProcessGroup, timeout: timedelta) -> None:
        backend.set_timeout(timeout * _NCCL_TIMEOUT_FACTOR)  # NCCL's own stays behind our watchdog

    def _op_timeout(self) -> timedelta | None:
        return None  # the watchdog enforces ours; see the module docstring

    def _watch(self, work: TrackedWork) -> None:
        timeout = self._timeout
        self._watchdog.watch(work, timeout, lambda overdue: overdue.mark_failed(
            CollectiveTimeout(f"NCCL collective still running after {timeout.total_seconds():g}s")))
