"""Process groups whose communicator lives in a subprocess, so an abort is a kill.

Aborting an in-process NCCL communicator (``ncclCommAbort``) can hang behind a
kernel stuck on a dead peer, or leave the CUDA context unusable.
``ProcessGroupBabyNCCL`` keeps the communicator in a child process instead:
aborting it is ``SIGKILL``, which always works, and the trainer's own CUDA context
is never touched by NCCL. ``ProcessGroupBabyGloo`` is the same machinery over gloo
(for CPU jobs, and for testing it without a GPU). How it works: :class:`ProcessGroupBaby`.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

from torchft_lite.errors import CollectiveError, CollectiveTimeout, ConfigError

from ._child_link import _Child, _ChildBackend
from .base import DEFAULT_TIMEOUT
from .nccl import _DeadlineWatchdog, check_nccl, creating_thread_device
from .reconfigurable import ReconfigurableProcessGroup
from .store import StoreAddress
from .tracked_work import TrackedWork

__all__ = ["ProcessGroupBaby", "ProcessGroupBabyGloo", "ProcessGroupBabyNCCL"]

logger = logging.getLogger(__name__)

# An interpreter importing torch can take a while on a loaded machine; this bounds the wait for a spare to
# report ready, on top of the configure timeout.
CHILD_START_TIMEOUT = timedelta(seconds=120)


class ProcessGroupBaby(ReconfigurableProcessGroup):
    """A :class:`ReconfigurableProcessGroup` whose communicator runs in a child process.

    Subclasses name the backend (``_KIND``).

    - A child is started with the group (the Manager waits, bounded, for it to
      be ready before joining its first quorum). ``configure()`` hands a child
      the store address, rank and world size and waits (bounded by the timeout)
      for its rendezvous. When nothing went wrong, the next ``configure()`` builds
      the new communicator in the same child (if it has no operation still
      running); after an error or ``abort()`` the child is killed and the next
      one takes a warm spare (torch imported, first store client made) that was
      started ahead of time.
    - Collectives are forwarded over a local socket pair (``_child_link``). Tensors
      are shared, not copied: CUDA tensors through CUDA IPC handles, CPU tensors
      through shared memory (a CPU tensor whose storage is not shared yet is moved
      into shared memory in place on first use, as ``Tensor.share_memory_()`` does;
      one over memory torch does not own, from ``frombuffer`` or ``from_blob``,
      stays where it is and goes through a shared copy). Messages on that socket
      are pickled, between this process and its own child only; nothing from the
      network is ever unpickled.
    - Before forwarding CUDA tensors the current stream is synchronized, so the
      child reads what the trainer wrote; the child synchronizes its stream before
      it reports an operation done, so the trainer reads what NCCL wrote.
    - Every operation has a deadline (the group's timeout). One that overruns, or
      any failure, kills the child and leaves the group errored until the next
      ``configure()``, as with the in-process groups.

    The child dies with its parent: it exits when the socket closes.

    Args:
        timeout: bounds each configure's rendezvous and every operation; an
            operation that overruns kills the child.
    """

    _KIND = ""

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._spare: _Child | None = None
        self._reusable: _Child | None = None  # the child of a communicator retired healthy
        self._children_lock = threading.Lock()
        self._watchdog = _DeadlineWatchdog(name=f"torchft_lite-{self._KIND}-subprocess-watchdog")
        self._device = creating_thread_device()  # configure() runs on another thread, whose device is 0
        if self._can_run():
            self._start_spare()  # warming up while the trainer starts: the first configure takes it

    def _can_run(self) -> bool:
        """Whether a child of this kind can work here (a spare is not started otherwise)."""
        return True

    def wait_warm(self, timeout: timedelta) -> bool:
        """Wait (at most ``timeout``) until a child is ready to configure; the Manager calls this at start.

        Returns whether one is. Never raises: a child that failed to start is
        replaced, and its failure reported, by the next ``configure()``.
        """
        with self._children_lock:
            child = self._reusable or self._spare
        if child is None:
            return False
        try:
            child.wait_ready(timeout.total_seconds())
        except CollectiveError as exc:
            logger.warning("the %s subprocess is not ready: %s", self._KIND, exc)
            return False
        return True

    def _child_for_configure(self) -> _Child:
        """The healthy child of the communicator being replaced, else the warm spare, else a new child."""
        with self._children_lock:
            reusable, self._reusable = self._reusable, None
            if reusable is not None and reusable.alive():
                return reusable
            child, self._spare = self._spare, None
        if reusable is not None:
            reusable.kill()
        if child is None or not child.alive():
            if child is not None:
                child.kill()
            child = _Child(self._KIND)
        return child

    def _start_spare(self) -> None:
        with self._children_lock:
            if self._spare is None or not self._spare.alive():
                self._spare = _Child(self._KIND)

    def _retire(self, holder: list[Any]) -> None:
        backend = holder[0]
        if isinstance(backend, _ChildBackend) and backend.child.alive() and backend.retire():
            with self._children_lock:  # the next communicator is built in the same child: no interpreter to start
                self._reusable = backend.child
        self._discard(holder)  # kills the child unless it was handed on above

    def _open_store(self, address: StoreAddress, timeout: timedelta) -> StoreAddress:
        return address  # the child connects to the store itself

    def _create_backend(self, store: StoreAddress, rank: int, world_size: int,
                        timeout: timedelta) -> _ChildBackend:
        child = self._child_for_configure()
        started = time.monotonic()
        try:
            child.wait_ready(CHILD_START_TIMEOUT.total_seconds())
            device = self._device if self._KIND == "nccl" else None
            generation = child.configure(str(store), rank, world_size, timeout.total_seconds(), device)
        except CollectiveError:  # dead, or stuck in the rendezvous past its timeout: never reuse it
            child.kill()
            raise
        except BaseException:  # the rendezvous failed cleanly in the child: it can host the next one
            with self._children_lock:
                if self._reusable is None:
                    self._reusable = child
                else:
                    child.kill()
            raise
        finally:
            try:
                self._start_spare()  # warm for the configure after an abort
            except Exception as exc:  # out of processes or descriptors: the next configure starts one itself
                logger.warning("could not start a spare %s subprocess: %r", self._KIND, exc)
        logger.debug("%s subprocess %d configured (generation %d) in %.2fs", self._KIND, child.pid, generation,
                     time.monotonic() - started)
        return _ChildBackend(child, generation, f"{self.getBackendName()} rank {rank}/{world_size}")

    def _op_timeout(self) -> timedelta | None:
        return self._timeout

    def _watch(self, work: TrackedWork) -> None:
        timeout = self._timeout
        self._watchdog.watch(work, timeout, lambda overdue: overdue.mark_failed(
            CollectiveTimeout(f"{self._KIND} operation in the subprocess still running after "
                              f"{timeout.total_seconds():g}s; the subprocess is killed")))

    def shutdown(self) -> None:
        super().shutdown()
        with self._children_lock:
            children, self._spare, self._reusable = [self._spare, self._reusable], None, None
        for child in children:
            if child is not None:
                child.kill()

    def child_pid(self) -> int | None:
        """The pid of the child holding the current communicator (None when there is none)."""
        backend = self._backend
        return backend.child.pid if isinstance(backend, _ChildBackend) else None

    def num_active_work(self) -> int:
        """How many operations of the current communicator the child has not answered yet."""
        backend = self._backend
        return backend.child.pending(backend.generation) if isinstance(backend, _ChildBackend) else 0

    def spare_pid(self) -> int | None:
        """The pid of the warm spare child (None when there is none)."""
        spare = self._spare
        return spare.pid if spare is not None else None


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """gloo in a child process (CPU tensors). See :mod:`torchft_lite.process_group.child_process`."""

    _KIND = "gloo"

    def getBackendName(self) -> str:
        return "torchft-baby-gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """NCCL in a child process on the CUDA device current when it is constructed; an abort kills the child.

    Constructing one needs no GPU; ``configure()`` raises
    :class:`~torchft_lite.errors.ConfigError` when CUDA or NCCL is missing.
    """

    _KIND = "nccl"

    def getBackendName(self) -> str:
        return "torchft-baby-nccl"

    def _can_run(self) -> bool:
        try:
            check_nccl()
        except ConfigError:
            return False
        return True

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  timeout: timedelta | None = None) -> None:
        check_nccl()
        super().configure(store_addr, replica_id, rank, world_size, timeout)
