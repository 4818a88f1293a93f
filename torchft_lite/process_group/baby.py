"""Process groups whose communicator lives in a subprocess, so an abort is a kill.

Aborting an in-process NCCL communicator (``ncclCommAbort``) is the weak spot
of in-process fault tolerance: it can hang behind a kernel stuck on a dead
peer, or leave the CUDA context unusable. ``ProcessGroupBabyNCCL`` keeps the
communicator in a child process instead; aborting it is ``SIGKILL``, which
always works, and the trainer's own CUDA context is never touched by NCCL.
``ProcessGroupBabyGloo`` is the same machinery over gloo (for CPU jobs, and
for testing it without a GPU).

How it works:

- A child is started with the group (the Manager waits, bounded, for it to
  be ready before joining its first quorum). ``configure()`` hands a child
  the store address, rank and world size and waits (bounded by the timeout)
  for its rendezvous. When nothing went wrong, the next ``configure()`` builds
  the new communicator in the same child (if it has no operation still
  running); after an error or ``abort()`` the child is killed and the next
  one takes a warm spare (torch imported, first store client made) that was
  started ahead of time.
- Collectives are forwarded over a local socket pair. Tensors are shared, not
  copied: CUDA tensors through CUDA IPC handles, CPU tensors through shared
  memory (a CPU tensor whose storage is not shared yet is moved into shared
  memory in place on first use, as ``Tensor.share_memory_()`` does; one over
  memory torch does not own, from ``frombuffer`` or ``from_blob``, stays
  where it is and goes through a shared copy). Messages on that
  socket are pickled, between this process and its own child only; nothing
  from the network is ever unpickled.
- Before forwarding CUDA tensors the current stream is synchronized, so the
  child reads what the trainer wrote; the child synchronizes its stream before
  it reports an operation done, so the trainer reads what NCCL wrote.
- Every operation has a deadline (the group's timeout). One that overruns, or
  any failure, kills the child and leaves the group errored until the next
  ``configure()``, as with the in-process groups.

The child dies with its parent: it exits when the socket closes.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (registers the pickling of tensors as shared memory / CUDA IPC)
from torch.distributed import ReduceOp

from torchft_lite.errors import CollectiveError, CollectiveTimeout, ConfigError

from .base import DEFAULT_TIMEOUT, ReconfigurableProcessGroup
from .nccl import _DeadlineWatchdog, check_nccl, creating_thread_device
from .store import StoreAddress
from .work import TrackedWork

__all__ = ["ProcessGroupBaby", "ProcessGroupBabyGloo", "ProcessGroupBabyNCCL"]

logger = logging.getLogger(__name__)

# An interpreter importing torch can take a while on a loaded machine; this bounds the wait for a spare to
# report ready, on top of the configure timeout.
CHILD_START_TIMEOUT = timedelta(seconds=120)
_KILL_WAIT_S = 10.0
# Beyond the rendezvous timeout, for the child's answer to arrive.
_CONFIGURE_GRACE_S = 5.0
_REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def _reduce_op_name(op: Any) -> str:
    for name in _REDUCE_OPS:
        if op == getattr(ReduceOp, name):
            return name
    raise ConfigError(f"reduce op {op!r} is not supported by a subprocess process group")


class _Child:
    """One child interpreter (``python -m torchft_lite.process_group._baby_child``), its socket and its reader.

    Every message from the child goes through one reader thread: ``ready``
    (torch imported), the outcome of each ``configure`` (by generation), and
    the outcome of each forwarded operation (by id).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The child must import this very torchft_lite, wherever it was imported from.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "torchft_lite.process_group._baby_child", kind, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = multiprocessing.connection.Connection(ours.detach())
        # CPU tensors travel as file descriptors, fetched from this process's resource sharer: the child
        # authenticates to it with our key.
        self.conn.send_bytes(bytes(multiprocessing.current_process().authkey))
        self._lock = threading.Lock()  # guards the fields below
        self._send_lock = threading.Lock()  # one message at a time on the socket (never taken with _lock held)
        self._ready = threading.Event()
        self._pending: dict[int, _ChildWork] = {}
        self._configures: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._generations = itertools.count(1)
        self.dead: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name=f"torchft_lite-pg-child-{self.pid}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.dead is None and self.process.poll() is None

    # -- from the child

    def _read(self) -> None:
        try:
            self._dispatch()
        except BaseException as exc:  # a bug here must not leave operations waiting for answers never read
            self._died(CollectiveError(f"reading from the process group's subprocess (pid {self.pid}) failed: "
                                       f"{exc!r}"))
            self.kill()

    def _dispatch(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self._died(CollectiveError(f"the process group's subprocess (pid {self.pid}) is gone "
                                           f"(exit code {self.process.poll()})"))
                return
            kind = message[0]
            if kind == "ready":
                self._ready.set()
            elif kind in ("configured", "configure_failed"):
                with self._lock:
                    future = self._configures.pop(message[1], None)
                if future is not None:
                    future.set_result(message)
            else:  # ("done", op id) or ("error", op id, type, text)
                with self._lock:
                    work = self._pending.pop(message[1], None)
                if work is not None:
                    work.finish(None if kind == "done" else _child_error(message[2], message[3]))

    def _died(self, error: BaseException) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = error
            pending, self._pending = list(self._pending.values()), {}
            configures, self._configures = list(self._configures.values()), {}
        for work in pending:
            work.finish(error)
        for future in configures:
            if not future.done():
                future.set_exception(error)
        self._ready.set()

    # -- to the child

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout):
            raise CollectiveTimeout(f"the process group's subprocess (pid {self.pid}) did not start within "
                                    f"{timeout:g}s")
        if self.dead is not None:
            raise self.dead

    def configure(self, store: str, rank: int, world_size: int, timeout: float, device: int | None) -> int:
        """Build a communicator in the child (dropping its previous one); its generation."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.dead is not None:
                raise self.dead
            generation = next(self._generations)
            self._configures[generation] = future
        self._send(("configure", generation, store, rank, world_size, timeout, device))
        try:
            reply = future.result(timeout + _CONFIGURE_GRACE_S)
        except concurrent.futures.TimeoutError as exc:
            raise CollectiveTimeout(f"the {self.kind} rendezvous of {world_size} ranks in subprocess {self.pid} "
                                    f"did not finish within {timeout:g}s") from exc
        if reply[0] == "configure_failed":
            raise _child_error(reply[2], reply[3])
        return generation

    def submit(self, work: "_ChildWork", generation: int, op: str, tensors: list[torch.Tensor],
               args: dict[str, Any]) -> None:
        with self._lock:
            if self.dead is not None:
                raise CollectiveError(f"{op} refused: {self.dead}") from self.dead
            op_id = next(self._ids)
            self._pending[op_id] = work
        try:
            self._send(("op", op_id, generation, op, tensors, args))
        except CollectiveError:
            with self._lock:
                self._pending.pop(op_id, None)
            raise

    def set_timeout(self, seconds: float) -> None:
        if self.dead is None:
            try:
                self._send(("set_timeout", seconds))
            except CollectiveError:
                pass  # the reader reports the death

    def pending(self, generation: int) -> int:
        """How many operations of communicator ``generation`` have not been answered yet."""
        with self._lock:
            return sum(work.generation == generation for work in self._pending.values())

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError) as exc:
            raise CollectiveError(f"could not reach the process group's subprocess (pid {self.pid}): "
                                  f"{exc}") from exc

    def kill(self) -> None:
        """SIGKILL: whatever the child is stuck in, it is gone; its GPU memory and sockets are freed."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("process group subprocess %d did not exit %gs after SIGKILL", self.pid, _KILL_WAIT_S)
        self._died(CollectiveError(f"the process group's subprocess (pid {self.pid}) was killed"))
        self.conn.close()


def _child_error(error_type: str, text: str) -> BaseException:
    error_class = TimeoutError if error_type in ("TimeoutError", "CollectiveTimeout") else RuntimeError
    return error_class(f"{error_type} in the subprocess: {text}")


class _ChildWork(dist.Work):
    """One operation forwarded to the child: done when the child says so, or failed."""

    def __init__(self, op: str, generation: int, result: Any, keep: list[torch.Tensor],
                 copy_back: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.op = op
        self.generation = generation
        self._result = result
        self._keep = keep  # the child maps these tensors' memory until it reports
        self._copy_back = copy_back  # (staged copy, the caller's tensor)
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()

    def finish(self, error: BaseException | None) -> None:
        if self._done.is_set():
            return
        if error is None:
            try:
                for staged, target in self._copy_back:
                    target.copy_(staged)
            except Exception as exc:
                error = exc
        self._error = error
        self._keep, self._copy_back = [], []
        self._done.set()
        if error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise TimeoutError(f"{self.op} in the process group's subprocess timed out")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        return self._error


class _ChildBackend:
    """Stands in for a c10d backend: each call is forwarded to the child's communicator of one generation."""

    def __init__(self, child: _Child, generation: int, description: str) -> None:
        self.child = child
        self.generation = generation
        self._description = description
        self._kill_on_abort = True

    def _submit(self, op: str, tensors: list[torch.Tensor], args: dict[str, Any], result: Any) -> _ChildWork:
        shared, copy_back = _share(tensors)
        for device in {t.device for t in tensors if t.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # the child must see what this process wrote
        work = _ChildWork(op, self.generation, result, shared, copy_back)
        self.child.submit(work, self.generation, op, shared, args)
        return work

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> _ChildWork:
        args = {"op": _reduce_op_name(options.reduceOp), "timeout": options.timeout.total_seconds()}
        return self._submit("allreduce", tensors, args, tensors)

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> _ChildWork:
        args = {"root": options.rootRank, "root_tensor": options.rootTensor, "timeout": options.timeout.total_seconds()}
        return self._submit("broadcast", tensors, args, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  options: Any) -> _ChildWork:
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise ConfigError("a subprocess process group's allgather takes one input tensor and one output list")
        flat = list(input_tensors) + list(output_tensors[0])
        args = {"outputs": len(output_tensors[0]), "timeout": options.timeout.total_seconds()}
        return self._submit("allgather", flat, args, output_tensors)

    def barrier(self, options: Any) -> _ChildWork:
        return self._submit("barrier", [], {"timeout": options.timeout.total_seconds()}, None)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> _ChildWork:
        return self._submit("send", tensors, {"peer": dst_rank, "tag": tag}, None)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> _ChildWork:
        return self._submit("recv", tensors, {"peer": src_rank, "tag": tag}, tensors)

    def set_timeout(self, timeout: timedelta) -> None:
        self.child.set_timeout(timeout.total_seconds())

    def retire(self) -> bool:
        """Hand the child on to the next communicator, if it is idle; whether it was.

        A child with operations still running is not reused: they could go
        on writing into the trainer's (shared) tensors after the step that
        issued them was given up, and its old communicator would take until
        they time out to go away. It is killed instead (by :meth:`abort`).
        """
        if self.child.pending(self.generation):
            return False
        self._kill_on_abort = False
        return True

    def abort(self) -> None:
        """Kill the child (unless :meth:`retire` handed it on); every operation still pending fails."""
        if self._kill_on_abort:
            self.child.kill()


def _share(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The tensors to send (each shareable with the child) and the staged copies to copy back afterwards."""
    shared, copy_back = [], []
    for tensor in tensors:  # tensors, contiguous: the group's collectives have checked
        if tensor.is_cuda or tensor.is_shared():
            shared.append(tensor)
            continue
        if tensor.device.type != "cpu":
            raise ConfigError(f"a subprocess process group cannot share a {tensor.device.type} tensor")
        if tensor.untyped_storage().resizable():  # torch owns the memory: move it into shared memory, once
            shared.append(tensor.share_memory_())
        else:  # memory torch does not own (from_blob, frombuffer) must stay where it is: use a shared copy
            staged = tensor.clone().share_memory_()
            shared.append(staged)
            copy_back.append((staged, tensor))
    return shared, copy_back


class ProcessGroupBaby(ReconfigurableProcessGroup):
    """A :class:`ReconfigurableProcessGroup` whose communicator runs in a child process.

    Subclasses name the backend (``_KIND``). See the module docstring.

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
        self._watchdog = _DeadlineWatchdog(name=f"torchft_lite-{self._KIND}-baby-watchdog")
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

    def spare_pid(self) -> int | None:
        """The pid of the warm spare child (None when there is none)."""
        spare = self._spare
        return spare.pid if spare is not None else None


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """gloo in a child process (CPU tensors). See :mod:`torchft_lite.process_group.baby`."""

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

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        check_nccl()
        super().configure(store_addr, replica_id, rank, world_size)
