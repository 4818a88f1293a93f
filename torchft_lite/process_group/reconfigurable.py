"""The machinery shared by backends: a c10d communicator rebuilt by every ``configure()``.

``configure()`` tears down the previous communicator and rendezvouses a fresh
c10d backend on a store prefix unique to the new quorum; collectives then run
on that backend until the next ``configure()``.

Failure model: any failure of a collective -- an exception from the call, or a
``Work``/future that completes with an error (a dead peer, a timeout) -- is
translated to :class:`~torchft_lite.errors.CollectiveError` (or
:class:`~torchft_lite.errors.CollectiveTimeout`), aborts the communicator and
marks the group errored. ``errored()`` returns that first error and further
collectives fail fast with it until the next ``configure()``. Lower layers
raise; the Manager decides to skip the step.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchft_lite.errors import CollectiveError, ConfigError
from torchft_lite.work import cuda_devices

from . import _collective_options
from .base import DEFAULT_TIMEOUT, ProcessGroup, ProcessGroupClosed, _check_rank, _check_timeout
from .store import StoreAddress, connect_store, parse_store_addr
from .tracked_work import TrackedWork, translate_error

__all__ = ["ReconfigurableProcessGroup", "as_process_group"]

logger = logging.getLogger(__name__)

_ABORTED = "; the communicator was aborted until the next configure()"


def as_process_group(store: dist.Store, rank: int, world_size: int, backend: dist.Backend,
                     backend_type: dist.ProcessGroup.BackendType, devices: tuple[str, ...]) -> dist.ProcessGroup:
    """A torch ProcessGroup over one c10d ``backend``.

    A backend's own Python binding lacks some collectives
    (``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``);
    the ProcessGroup front has them all and dispatches to the backend.
    """
    group = dist.ProcessGroup(store, rank, world_size)
    group._set_default_backend(backend_type)
    for device in devices:
        group._register_backend(torch.device(device), backend_type, backend)
    return group


# Teardown threads still destroying a communicator, with the time they may take.
_teardowns: dict[threading.Thread, float] = {}
_teardowns_lock = threading.Lock()
# Beyond the collective timeout, for the destructor itself.
_TEARDOWN_GRACE_S = 5.0


def _teardown(holder: list[Any], name: str) -> None:
    try:
        if hasattr(holder[0], "abort"):
            try:
                holder[0].abort()
            except Exception:  # the communicator is dropped below either way
                logger.warning("aborting an old %s communicator failed", name, exc_info=True)
        holder.clear()  # runs the destructor (without the GIL): closes the connections, joins gloo's threads
    finally:
        with _teardowns_lock:
            _teardowns.pop(threading.current_thread(), None)


def _start_teardown(holder: list[Any], name: str, timeout: timedelta) -> None:
    thread = threading.Thread(target=_teardown, args=(holder, name), name="torchft_lite-pg-teardown", daemon=True)
    with _teardowns_lock:
        _teardowns[thread] = time.monotonic() + timeout.total_seconds() + _TEARDOWN_GRACE_S
    thread.start()


@atexit.register
def _finish_teardowns() -> None:
    """At exit, let pending teardowns finish (bounded): a gloo backend destroyed
    mid-destructor by interpreter shutdown aborts the process (std::terminate)."""
    with _teardowns_lock:
        pending = list(_teardowns.items())
    for thread, deadline in pending:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            logger.warning("a process group teardown did not finish before exit")


def _check_tensors(op: str, tensors: list[torch.Tensor]) -> None:
    """Refuse what c10d would get wrong silently: gloo reduces a strided tensor as if it were contiguous."""
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op} takes tensors, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError(f"{op} needs contiguous tensors; got one of shape {tuple(tensor.shape)} with "
                             f"strides {tensor.stride()} (pass tensor.contiguous() and copy the result back)")


def _flat(nested: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    if not isinstance(nested, (list, tuple)) or not all(isinstance(inner, (list, tuple)) for inner in nested):
        raise TypeError(f"expected a list of lists of tensors, got {type(nested).__name__}")
    return [tensor for inner in nested for tensor in inner]


def _tensor_list(op: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{op} takes a list of tensors, got {type(tensors).__name__}")
    return list(tensors)


class ReconfigurableProcessGroup(ProcessGroup):
    """A :class:`ProcessGroup` over a c10d backend rebuilt by every ``configure()``.

    Subclasses provide :meth:`_create_backend`. State (backend, errored,
    rank/size) is guarded by one lock; ``configure()`` calls are serialized by
    another so a slow rendezvous never blocks ``errored()`` or ``abort()``.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self._timeout = _check_timeout(timeout)
        self._lock = threading.Lock()
        self._configure_lock = threading.Lock()
        self._backend: Any = None
        self._errored: CollectiveError | None = None
        self._shut_down = False
        # Bumped by every configure(): a Work of an older communicator that
        # fails late must not mark the new one errored.
        self._generation = 0
        self._rank = 0
        self._world_size = 1
        self._replica_id = ""
        self._address: StoreAddress | None = None

    # -- backend hooks -------------------------------------------------------

    def _create_backend(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Any:
        """Build the c10d backend; blocks at most ``timeout`` until ``world_size`` ranks joined ``store``."""
        raise NotImplementedError

    def _open_store(self, address: StoreAddress, timeout: timedelta) -> Any:
        """What :meth:`_create_backend` rendezvouses on: a client of the store at ``address``, by default."""
        return connect_store(address, timeout)

    def _set_backend_timeout(self, backend: Any, timeout: timedelta) -> None:
        """Make ``timeout`` the backend's default (what send/recv, which take no options, run under)."""
        if hasattr(backend, "set_timeout"):
            backend.set_timeout(timeout)

    def _wait_work(self, work: dist.Work, timeout: timedelta) -> None:
        """Block until ``work`` is done, at most ``timeout``; raise its error."""
        work.wait(timeout)

    def _op_timeout(self) -> timedelta | None:
        """The timeout put in a collective's options (None: leave it to the backend)."""
        return self._timeout

    def _watch(self, work: TrackedWork) -> None:
        """Called with every collective started (a backend without its own timeouts arms one here)."""

    # -- lifecycle -----------------------------------------------------------

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  timeout: timedelta | None = None) -> None:
        address = parse_store_addr(store_addr)
        _check_rank(rank, world_size)
        if timeout is not None:
            _check_timeout(timeout)
        with self._configure_lock:
            with self._lock:
                self._generation += 1
                generation = self._generation
                old, self._backend = [self._backend], None
                self._errored = None
                self._shut_down = False
                self._rank, self._world_size = rank, world_size
                self._replica_id, self._address = replica_id, address
                op_timeout = self._timeout
            rendezvous_timeout = timeout if timeout is not None else op_timeout
            self._retire(old)
            logger.info("replica %s: configuring %s rank %s/%s on %s", replica_id, self.getBackendName(), rank,
                        world_size, address)
            try:
                store = self._open_store(address, rendezvous_timeout)
                backend = self._create_backend(store, rank, world_size, rendezvous_timeout)
                if rendezvous_timeout != op_timeout:
                    self._set_backend_timeout(backend, op_timeout)
            except ConfigError:
                raise
            except Exception as exc:
                what = (f"{self.getBackendName()} rendezvous of {world_size} ranks on store "
                        f"{address.host}:{address.port} prefix {address.prefix!r}")
                error = translate_error(exc, what, rendezvous_timeout)
                with self._lock:
                    if generation == self._generation and self._errored is None:
                        self._errored = error
                raise error from exc
            with self._lock:
                self._backend = backend
        logger.info("replica %s: %s configured, rank %s/%s", replica_id, self.getBackendName(), rank, world_size)

    def abort(self) -> None:
        with self._lock:
            old, self._backend = [self._backend], None
            if self._errored is None:
                self._errored = CollectiveError(f"{self.getBackendName()} was aborted; configure() it again")
        self._discard(old)

    def shutdown(self) -> None:
        with self._lock:
            old, self._backend = [self._backend], None
            self._shut_down = True
        self._discard(old)

    def _retire(self, holder: list[Any]) -> None:
        """Drop the backend a new ``configure()`` replaces (by default: aborted, like any other)."""
        self._discard(holder)

    def _discard(self, holder: list[Any]) -> None:
        """Abort the backend in the one-element list ``holder`` and drop it, on another thread.

        Never blocks the caller, which may be the training thread or a
        backend's own worker thread (a future callback): destroying a gloo
        backend joins its worker threads, which waits for an in-flight
        collective -- up to its timeout when a peer is alive but stuck. The
        caller hands over its only reference inside the list.
        """
        if holder[0] is not None:
            _start_teardown(holder, self.getBackendName(), self._timeout)

    # -- state ---------------------------------------------------------------

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world_size

    def errored(self) -> Exception | None:
        return self._errored

    def set_timeout(self, timeout: timedelta) -> None:
        timeout = _check_timeout(timeout)
        with self._lock:
            self._timeout = timeout
            backend = self._backend
        if backend is not None:
            self._set_backend_timeout(backend, timeout)

    def _describe(self) -> str:
        where = f" on {self._address}" if self._address is not None else ""
        return f"{self.getBackendName()} rank {self._rank}/{self._world_size}{where}"

    def _record_failure(self, generation: int, op: str, exc: BaseException, timeout: timedelta) -> CollectiveError:
        """Translate ``exc``; if it came from the current communicator, mark the group errored and drop it.

        Dropping the communicator closes its connections, so peers blocked on
        this rank fail at once instead of at their timeout: one rank that sees
        the dead peer fails the whole group quickly. (For NCCL the abort also
        releases kernels stuck on the dead peer.)
        """
        traceback.clear_frames(exc.__traceback__)  # finished frames there may hold the backend
        with self._lock:
            first = generation == self._generation and self._errored is None
        error = translate_error(exc, f"{op} on {self._describe()}", timeout, _ABORTED if first else "")
        with self._lock:
            first = generation == self._generation and self._errored is None
            if first:
                self._errored = error
                old, self._backend = [self._backend], None
        if first:
            logger.warning("replica %s: %s", self._replica_id, error)
            self._discard(old)
        return error

    # -- collectives ---------------------------------------------------------

    def _start_collective(self, op: str, call: Callable[[Any], dist.Work], tensors: Sequence[torch.Tensor] = (),
                          outputs: Any = None) -> dist.Work:
        """Start ``call(backend)`` on the current communicator; its Work, tracked (a failure errors the group).

        ``tensors``: every tensor the collective reads or writes (their CUDA devices make its future follow
        the stream rule, ``torchft_lite.work``); ``outputs``: what its future yields when the backend's Work
        has none (see ``TrackedWork``).
        """
        with self._lock:
            backend, generation, timeout, errored = self._backend, self._generation, self._timeout, self._errored
            shut_down = self._shut_down
        if errored is not None:
            raise CollectiveError(f"{op} refused: {self._describe()} is errored until the next configure(): "
                                  f"{errored}") from errored
        if backend is None and shut_down:
            raise ProcessGroupClosed(f"{op} called on {type(self).__name__} after shutdown() and before configure(): "
                                     f"its handle is closed")
        if backend is None:
            raise CollectiveError(f"{op} called on {type(self).__name__} before configure()")
        try:
            work = call(backend)
        except Exception as exc:
            failure = exc
        else:
            tracked = TrackedWork(work, op=op, timeout=timeout, wait=self._wait_work,
                                  on_error=lambda exc, waited: self._record_failure(generation, op, exc, waited),
                                  devices=cuda_devices(list(tensors)), outputs=outputs)
            self._watch(tracked)
            return tracked
        # The error is kept (errored()) with its traceback, which holds this
        # frame: it must not pin the communicator this failure drops.
        del backend
        raise self._record_failure(generation, op, failure, timeout) from failure

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = ReduceOp.SUM) -> dist.Work:
        tensors = _tensor_list("allreduce", tensors)
        _check_tensors("allreduce", tensors)
        options = _collective_options.allreduce_options(opts, self._op_timeout())
        return self._start_collective("allreduce", lambda backend: backend.allreduce(tensors, options), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        tensors = _tensor_list("allreduce_coalesced", tensors)
        _check_tensors("allreduce_coalesced", tensors)
        options = _collective_options.allreduce_coalesced_options(opts, self._op_timeout())
        return self._start_collective("allreduce_coalesced", lambda backend: backend.allreduce_coalesced(
            tensors, options), tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensor: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        _check_tensors("allgather", _flat(output_tensors) + _tensor_list("allgather", input_tensor))
        options = _collective_options.allgather_options(opts, self._op_timeout())
        return self._start_collective("allgather", lambda backend: backend.allgather(
            output_tensors, input_tensor, options), _flat(output_tensors) + list(input_tensor))

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        op = "allgather_into_tensor_coalesced"
        _check_tensors(op, _tensor_list(op, output_tensors) + _tensor_list(op, input_tensors))
        options = _collective_options.allgather_options(opts, self._op_timeout())
        return self._start_collective(op, lambda backend: backend.allgather_into_tensor_coalesced(
            output_tensors, input_tensors, options), list(output_tensors) + list(input_tensors))

    def alltoall_base(self, output_buffer: torch.Tensor, input_buffer: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        _check_tensors("alltoall_base", [output_buffer, input_buffer])
        options = _collective_options.alltoall_options(opts, self._op_timeout())
        return self._start_collective("alltoall_base", lambda backend: backend.alltoall_base(
            output_buffer, input_buffer, list(output_split_sizes), list(input_split_sizes), options),
            [output_buffer, input_buffer])

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = 0) -> dist.Work:
        tensor_list = _tensor_list("broadcast", tensor_list)
        _check_tensors("broadcast", tensor_list)
        options = _collective_options.broadcast_options(opts, self._op_timeout())
        return self._start_collective("broadcast", lambda backend: backend.broadcast(tensor_list, options),
                                      tensor_list)

    def barrier(self, opts: Any = None) -> dist.Work:
        options = _collective_options.barrier_options(opts, self._op_timeout())
        return self._start_collective("barrier", lambda backend: backend.barrier(options))

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        _check_tensors("reduce_scatter", _tensor_list("reduce_scatter", output_tensors) + _flat(input_tensors))
        options = _collective_options.reduce_scatter_options(opts, self._op_timeout())
        return self._start_collective("reduce_scatter", lambda backend: backend.reduce_scatter(
            output_tensors, input_tensors, options), list(output_tensors) + _flat(input_tensors))

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        op = "reduce_scatter_tensor_coalesced"
        _check_tensors(op, _tensor_list(op, output_tensors) + _tensor_list(op, input_tensors))
        options = _collective_options.reduce_scatter_options(opts, self._op_timeout())
        return self._start_collective(op, lambda backend: backend.reduce_scatter_tensor_coalesced(
            output_tensors, input_tensors, options), list(output_tensors) + list(input_tensors))

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        tensors = _tensor_list("send", tensors)
        _check_tensors("send", tensors)
        return self._start_collective(f"send to rank {dst_rank}",
                                      lambda backend: backend.send(tensors, dst_rank, tag), tensors)

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        tensors = _tensor_list("recv", tensors)
        _check_tensors("recv", tensors)
        return self._start_collective(f"recv from rank {src_rank}",
                                      lambda backend: backend.recv(tensors, src_rank, tag), tensors, outputs=tensors)

    def __repr__(self) -> str:
        state = "errored" if self._errored is not None else ("configured" if self._backend is not None else "idle")
        return f"{type(self).__name__}({state}, rank={self._rank}, size={self._world_size}, store={self._address})"
