"""The parent's side of a subprocess process group: one child interpreter, and the operations forwarded to it.

:class:`_Child` owns the child (``python -m torchft_lite.process_group._child_main``),
its socket and the thread reading its answers. :class:`_ChildBackend` stands
in for a c10d backend: each collective becomes one message naming the
operation, the tensors (shared, not copied; see :func:`_share`) and plain
arguments, and a :class:`_ChildWork` that completes when the child answers.
Nested tensor lists travel flat, with the sizes to regroup them.
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
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (registers the pickling of tensors as shared memory / CUDA IPC)
from torch.distributed import ReduceOp

from torchft_lite.errors import CollectiveError, CollectiveTimeout, ConfigError

__all__ = ["_Child", "_ChildBackend", "_ChildWork"]

logger = logging.getLogger(__name__)
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
    """One child interpreter (``python -m torchft_lite.process_group._child_main``), its socket and its reader.

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
                [sys.executable, "-m", "torchft_lite.process_group._child_main", kind, str(theirs.fileno())],
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
        # The reader must be done with the socket before its descriptor is closed: closed under a blocked
        # recv, the number could be reused (by the next child's socket) and read from. Shutting the socket
        # down wakes the reader with an end of file, whatever state the child left it in.
        try:
            with socket.socket(fileno=os.dup(self.conn.fileno())) as duplicate:
                duplicate.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already
        if threading.current_thread() is not self._reader:
            self._reader.join(_KILL_WAIT_S)
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

    def _submit(self, op: str, groups: list[list[torch.Tensor]], args: dict[str, Any], result: Any) -> _ChildWork:
        """Forward ``op`` on the tensor lists ``groups``; they travel flat, with their sizes to regroup them."""
        tensors = [tensor for group in groups for tensor in group]
        shared, copy_back = _share(tensors)
        for device in {t.device for t in tensors if t.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # the child must see what this process wrote
        work = _ChildWork(op, self.generation, result, shared, copy_back)
        self.child.submit(work, self.generation, op, shared, dict(args, sizes=[len(group) for group in groups]))
        return work

    @staticmethod
    def _reduce_args(options: Any) -> dict[str, Any]:
        return {"op": _reduce_op_name(options.reduceOp), "timeout": options.timeout.total_seconds()}

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> _ChildWork:
        return self._submit("allreduce", [tensors], self._reduce_args(options), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], options: Any) -> _ChildWork:
        return self._submit("allreduce_coalesced", [tensors], self._reduce_args(options), tensors)

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> _ChildWork:
        args = {"root": options.rootRank, "root_tensor": options.rootTensor, "timeout": options.timeout.total_seconds()}
        return self._submit("broadcast", [tensors], args, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  options: Any) -> _ChildWork:
        args = {"timeout": options.timeout.total_seconds()}
        return self._submit("allgather", [input_tensors, *output_tensors], args, output_tensors)

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                        options: Any) -> _ChildWork:
        args = {"timeout": options.timeout.total_seconds()}
        return self._submit("allgather_into_tensor_coalesced", [output_tensors, input_tensors], args, output_tensors)

    def alltoall_base(self, output_buffer: torch.Tensor, input_buffer: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], options: Any) -> _ChildWork:
        args = {"output_splits": list(output_split_sizes), "input_splits": list(input_split_sizes),
                "timeout": options.timeout.total_seconds()}
        return self._submit("alltoall_base", [[output_buffer, input_buffer]], args, [output_buffer])

    def barrier(self, options: Any) -> _ChildWork:
        return self._submit("barrier", [], {"timeout": options.timeout.total_seconds()}, None)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       options: Any) -> _ChildWork:
        return self._submit("reduce_scatter", [output_tensors, *input_tensors], self._reduce_args(options),
                            output_tensors)

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                        options: Any) -> _ChildWork:
        return self._submit("reduce_scatter_tensor_coalesced", [output_tensors, input_tensors],
                            self._reduce_args(options), output_tensors)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> _ChildWork:
        return self._submit("send", [tensors], {"peer": dst_rank, "tag": tag}, None)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> _ChildWork:
        return self._submit("recv", [tensors], {"peer": src_rank, "tag": tag}, tensors)

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
