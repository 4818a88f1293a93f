"""Process groups whose communicator lives in a subprocess, so an abort is a kill.

Aborting an in-process NCCL communicator (``ncclCommAbort``) is the weak spot
of in-process fault tolerance: it can hang behind a kernel stuck on a dead
peer, or leave the CUDA context unusable. ``ProcessGroupBabyNCCL`` keeps the
communicator in a child process instead; aborting it is ``SIGKILL``, which
always works, and the trainer's own CUDA context is never touched by NCCL.
``ProcessGroupBabyGloo`` is the same machinery over gloo (for CPU jobs, and
for testing it without a GPU).

How it works:

- Each ``configure()`` takes a child process that was started ahead of time
  (a warm spare that has already imported torch), hands it the store address,
  rank and world size, and waits (bounded by the timeout) for it to finish
  the rendezvous. The previous child is killed. A new spare starts at once,
  so the next reconfiguration does not wait for an interpreter to start.
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
from .nccl import _DeadlineWatchdog, check_nccl
from .store import StoreAddress
from .work import TrackedWork

__all__ = ["ProcessGroupBaby", "ProcessGroupBabyGloo", "ProcessGroupBabyNCCL"]

logger = logging.getLogger(__name__)

# An interpreter importing torch can take a while on a loaded machine; this bounds the wait for a spare to
# report ready, on top of the configure timeout.
CHILD_START_TIMEOUT = timedelta(seconds=120)
_KILL_WAIT_S = 10.0
_REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def _reduce_op_name(op: Any) -> str:
    for name in _REDUCE_OPS:
        if op == getattr(ReduceOp, name):
            return name
    raise ConfigError(f"reduce op {op!r} is not supported by a subprocess process group")


class _Child:
    """One child interpreter (``python -m torchft_lite.process_group._baby_child``) and its socket."""

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
        self._ready = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float) -> None:
        if self._ready:
            return
        reply = self.receive(timeout, "the process group's subprocess to start")
        if reply != ("ready",):
            raise CollectiveError(f"the process group's subprocess (pid {self.pid}) sent {reply!r} instead of ready")
        self._ready = True

    def receive(self, timeout: float, what: str) -> Any:
        """The child's next message, waiting at most ``timeout`` seconds for ``what``."""
        try:
            if not self.conn.poll(timeout):
                raise CollectiveTimeout(f"waited {timeout:g}s for {what} (pid {self.pid})")
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            raise CollectiveError(f"the process group's subprocess (pid {self.pid}) died while waiting for "
                                  f"{what} (exit code {self.process.poll()})") from exc

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: whatever the child is stuck in, it is gone; its GPU memory and sockets are freed."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("process group subprocess %d did not exit %gs after SIGKILL", self.pid, _KILL_WAIT_S)
        self.conn.close()


class _ChildWork(dist.Work):
    """One operation forwarded to the child: done when the child says so, or failed."""

    def __init__(self, op: str, result: Any, keep: list[torch.Tensor],
                 copy_back: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.op = op
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
    """Stands in for a c10d backend: each call is forwarded to the child that holds the communicator."""

    def __init__(self, child: _Child, description: str) -> None:
        self._child = child
        self._description = description
        self._pending: dict[int, _ChildWork] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name=f"torchft_lite-pg-child-{child.pid}", daemon=True)
        self._reader.start()

    # -- results

    def _read(self) -> None:
        while True:
            try:
                message = self._child.conn.recv()
            except (EOFError, OSError):
                code = self._child.process.poll()
                self._fail_all(CollectiveError(f"{self._description}: the subprocess (pid {self._child.pid}) is "
                                               f"gone (exit code {code})"))
                return
            kind, op_id = message[0], message[1]
            with self._lock:
                work = self._pending.pop(op_id, None)
            if work is None:
                continue
            if kind == "done":
                work.finish(None)
            else:
                _, _, error_type, text = message
                error_class = TimeoutError if error_type == "TimeoutError" else RuntimeError
                work.finish(error_class(f"{error_type} in the subprocess: {text}"))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = error
            pending, self._pending = list(self._pending.values()), {}
        for work in pending:
            work.finish(error)

    # -- forwarding

    def _submit(self, op: str, tensors: list[torch.Tensor], args: dict[str, Any], result: Any) -> _ChildWork:
        shared, copy_back = _share(tensors)
        if any(t.is_cuda for t in tensors):
            for device in {t.device for t in tensors if t.is_cuda}:
                torch.cuda.current_stream(device).synchronize()  # the child must see what this process wrote
        work = _ChildWork(op, result, shared, copy_back)
        with self._lock:
            if self._dead is not None:
                raise CollectiveError(f"{op} refused: {self._dead}") from self._dead
            op_id = next(self._ids)
            self._pending[op_id] = work
            try:
                self._child.conn.send(("op", op_id, op, shared, args))
            except (OSError, ValueError) as exc:
                self._pending.pop(op_id, None)
                raise CollectiveError(f"{self._description}: could not reach the subprocess "
                                      f"(pid {self._child.pid}): {exc}") from exc
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
        with self._lock:
            if self._dead is None:
                try:
                    self._child.conn.send(("set_timeout", -1, timeout.total_seconds()))
                except (OSError, ValueError):
                    pass  # the reader thread reports the child's death

    def abort(self) -> None:
        """Kill the child; every operation still pending fails."""
        self._child.kill()
        self._fail_all(CollectiveError(f"{self._description} was aborted (subprocess {self._child.pid} killed)"))


def _share(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The tensors to send (each shareable with the child) and the staged copies to copy back afterwards."""
    shared, copy_back = [], []
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"expected tensors, got {type(tensor).__name__}")
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
        self._spare_lock = threading.Lock()
        self._watchdog = _DeadlineWatchdog(name=f"torchft_lite-{self._KIND}-baby-watchdog")

    def _take_spare(self) -> _Child:
        with self._spare_lock:
            child, self._spare = self._spare, None
        if child is None or not child.alive():
            if child is not None:
                child.kill()
            child = _Child(self._KIND)
        return child

    def _start_spare(self) -> None:
        with self._spare_lock:
            if self._spare is None:
                self._spare = _Child(self._KIND)

    def _open_store(self, address: StoreAddress, timeout: timedelta) -> StoreAddress:
        return address  # the child connects to the store itself

    def _create_backend(self, store: StoreAddress, rank: int, world_size: int,
                        timeout: timedelta) -> _ChildBackend:
        child = self._take_spare()
        try:
            child.wait_ready(CHILD_START_TIMEOUT.total_seconds())
            device = torch.cuda.current_device() if self._KIND == "nccl" else None
            child.conn.send(("configure", str(store), rank, world_size, timeout.total_seconds(), device))
            started = time.monotonic()
            reply = child.receive(timeout.total_seconds() + 5.0, f"{self._KIND} rendezvous of {world_size} ranks")
            if reply[0] != "configured":
                _, _, error_type, text = reply
                error_class = TimeoutError if error_type == "TimeoutError" else RuntimeError
                raise error_class(f"{error_type} in the subprocess: {text}")
        except BaseException:
            child.kill()
            raise
        finally:
            self._start_spare()  # the next configure() takes it, already started
        logger.debug("%s subprocess %d configured in %.2fs", self._KIND, child.pid, time.monotonic() - started)
        return _ChildBackend(child, f"{self.getBackendName()} rank {rank}/{world_size}")

    def _op_timeout(self) -> timedelta | None:
        return self._timeout

    def _watch(self, work: TrackedWork) -> None:
        timeout = self._timeout
        self._watchdog.watch(work, timeout, lambda overdue: overdue.mark_failed(
            CollectiveTimeout(f"{self._KIND} operation in the subprocess still running after "
                              f"{timeout.total_seconds():g}s; the subprocess is killed")))

    def shutdown(self) -> None:
        super().shutdown()
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.kill()

    def child_pid(self) -> int | None:
        """The pid of the child holding the current communicator (None when there is none)."""
        backend = self._backend
        return backend._child.pid if isinstance(backend, _ChildBackend) else None


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """gloo in a child process (CPU tensors). See :mod:`torchft_lite.process_group.baby`."""

    _KIND = "gloo"

    def getBackendName(self) -> str:
        return "torchft-baby-gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """NCCL in a child process on this process's current CUDA device; an abort kills the child.

    Constructing one needs no GPU; ``configure()`` raises
    :class:`~torchft_lite.errors.ConfigError` when CUDA or NCCL is missing.
    """

    _KIND = "nccl"

    def getBackendName(self) -> str:
        return "torchft-baby-nccl"

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        check_nccl()
        super().configure(store_addr, replica_id, rank, world_size)
