"""Process groups that wrap another one: forward everything, change one thing.

- :class:`ProcessGroupWrapper`: forwards every call to the wrapped group; the
  base for the others (and for a user's own wrappers, through
  :meth:`ProcessGroupWrapper._wrap_work`).
- :class:`ErrorSwallowingProcessGroupWrapper`: an allreduce that fails is
  recorded (``error()``), not raised, and later allreduces are skipped until
  the next reconfigure -- for model code that cannot handle errors itself.
- :class:`FakeProcessGroupWrapper`: fails the future of the next allreduce
  with an error a test chooses.
- :class:`ManagedProcessGroup`: allreduces go through a Manager (so a failure
  votes the step down instead of raising), and ``size()`` is the number of
  replicas in this step's quorum.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllreduceCoalescedOptions, AllreduceOptions

from torchft_lite.errors import CollectiveError, ConfigError

from .base import DEFAULT_TIMEOUT, ProcessGroup, _check_timeout
from .handles import ReconfigureOptions
from .tracked_work import CompletedWork

if TYPE_CHECKING:
    from torchft_lite.manager import Manager

__all__ = ["ErrorSwallowingProcessGroupWrapper", "FakeProcessGroupWrapper", "ManagedProcessGroup",
           "ProcessGroupWrapper"]

logger = logging.getLogger(__name__)


class ProcessGroupWrapper(ProcessGroup):
    """Forwards every collective and lifecycle call to ``pg``.

    Args:
        timeout: the timeout set on ``pg`` (when given) and reported while
            there is none.
        pg: the wrapped group: one of ours (reconfigurable), or any torch
            process group (collectives only; it cannot be reconfigured).
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT, pg: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self._timeout = _check_timeout(timeout)
        self._pg = pg

    @property
    def parent(self) -> dist.ProcessGroup:
        """The wrapped group."""
        if self._pg is None:
            raise CollectiveError(f"{type(self).__name__}: process group not initialized (no pg to wrap)")
        return self._pg

    def _ours(self, what: str) -> ProcessGroup:
        parent = self.parent
        if not isinstance(parent, ProcessGroup):
            raise ConfigError(f"{type(self).__name__} wraps a {type(parent).__name__}, which cannot {what}")
        return parent

    def _wrap_work(self, work: Any, op: str) -> Any:
        """Hook: what a collective returns, given the wrapped group's Work for ``op``."""
        return work

    # -- membership and state: the wrapped group's ---------------------------

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  timeout: timedelta | None = None) -> None:
        self._ours("be configured").configure(store_addr, replica_id, rank, world_size, timeout)

    def set_rank_info(self, replica_id: str, group_rank: int, group_world_size: int,
                      global_rank: int | None = None) -> None:
        super().set_rank_info(replica_id, group_rank, group_world_size, global_rank)
        if isinstance(self._pg, ProcessGroup):
            self._pg.set_rank_info(replica_id, group_rank, group_world_size, global_rank)

    def _handle_id(self) -> str:
        return self._pg._handle_id() if isinstance(self._pg, ProcessGroup) else super()._handle_id()

    def get_reconfigure_handle(self) -> str:
        return self._ours("be reconfigured").get_reconfigure_handle()

    def reconfigure(self, opts: ReconfigureOptions) -> dist.Work:
        return self._ours("be reconfigured").reconfigure(opts)

    def rank(self) -> int:
        return self.parent.rank()

    def size(self) -> int:
        return self.parent.size()

    def getBackendName(self) -> str:
        parent = self.parent
        return parent.getBackendName() if isinstance(parent, ProcessGroup) else parent._get_backend_name()

    def errored(self) -> Exception | None:
        return self._pg.errored() if isinstance(self._pg, ProcessGroup) else None

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = _check_timeout(timeout)
        if self._pg is not None:
            self._pg.set_timeout(timeout)

    def abort(self) -> None:
        if self._pg is not None:
            self._pg.abort()

    def shutdown(self) -> None:
        if self._pg is not None:
            self._pg.shutdown()

    # -- collectives ---------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = ReduceOp.SUM) -> Any:
        return self._wrap_work(self.parent.allreduce(tensors, opts), "allreduce")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = AllreduceCoalescedOptions() if opts is None else opts  # torch's own groups want options
        return self._wrap_work(self.parent.allreduce_coalesced(tensors, opts), "allreduce_coalesced")

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensor: list[torch.Tensor],
                  opts: Any = None) -> Any:
        args = (output_tensors, input_tensor) if opts is None else (output_tensors, input_tensor, opts)
        return self._wrap_work(self.parent.allgather(*args), "allgather")

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        args = (output_tensors, input_tensors) if opts is None else (output_tensors, input_tensors, opts)
        return self._wrap_work(self.parent.allgather_into_tensor_coalesced(*args), "allgather_into_tensor_coalesced")

    def alltoall_base(self, output_buffer: torch.Tensor, input_buffer: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        args = (output_buffer, input_buffer, output_split_sizes, input_split_sizes)
        return self._wrap_work(self.parent.alltoall_base(*args, *(() if opts is None else (opts,))), "alltoall_base")

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = 0) -> Any:
        return self._wrap_work(self.parent.broadcast(tensor_list, opts), "broadcast")

    def barrier(self, opts: Any = None) -> Any:
        return self._wrap_work(self.parent.barrier(*(() if opts is None else (opts,))), "barrier")

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        args = (output_tensors, input_tensors) if opts is None else (output_tensors, input_tensors, opts)
        return self._wrap_work(self.parent.reduce_scatter(*args), "reduce_scatter")

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        args = (output_tensors, input_tensors) if opts is None else (output_tensors, input_tensors, opts)
        return self._wrap_work(self.parent.reduce_scatter_tensor_coalesced(*args), "reduce_scatter_tensor_coalesced")

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> Any:
        return self._wrap_work(self.parent.send(tensors, dst_rank, tag), "send")

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> Any:
        return self._wrap_work(self.parent.recv(tensors, src_rank, tag), "recv")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pg={self._pg!r})"


class _ErrorSwallowingWork(dist.Work):
    """A Work whose failure is reported to its wrapper and replaced by ``default_result``."""

    def __init__(self, pg: "ErrorSwallowingProcessGroupWrapper", work: dist.Work, default_result: Any) -> None:
        super().__init__()
        self._pg = pg
        self._work = work
        self._default_result = default_result

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as exc:  # recorded on the wrapper (error()), which skips later allreduces
            self._pg.report_error(exc)
        return True

    def get_future(self) -> torch.futures.Future:
        def result_or_default(future: torch.futures.Future) -> Any:
            try:
                return future.value()
            except Exception as exc:  # recorded on the wrapper, as in wait()
                self._pg.report_error(exc)
                return self._default_result

        return self._work.get_future().then(result_or_default)


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Allreduce never raises: a failure is recorded and the tensors are left as they are.

    After an error every allreduce is skipped (a completed Work of the input
    tensors) until the group is configured or reconfigured again. The
    recorded error is ``error()``; it is logged once.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._error: Exception | None = None
        self._error_lock = threading.Lock()

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  timeout: timedelta | None = None) -> None:
        self._clear_error()
        super().configure(store_addr, replica_id, rank, world_size, timeout)

    def reconfigure(self, opts: ReconfigureOptions) -> dist.Work:
        self._clear_error()
        return super().reconfigure(opts)

    def _clear_error(self) -> None:
        with self._error_lock:
            self._error = None

    def report_error(self, e: Exception) -> None:
        """Record ``e``: allreduces are skipped until the next (re)configure."""
        with self._error_lock:
            first = self._error is None
            self._error = e
        if first:
            logger.warning("%s: skipping allreduces until the next reconfigure after: %s", type(self).__name__, e)

    def error(self) -> Exception | None:
        """The error recorded since the last (re)configure, or None."""
        return self._error

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = ReduceOp.SUM) -> dist.Work:
        if self._error is not None:
            return CompletedWork(tensors)
        try:
            work = super().allreduce(tensors, opts)
        except Exception as exc:  # recorded (error()); the step's tensors stay as they are
            self.report_error(exc)
            return CompletedWork(tensors)
        return _ErrorSwallowingWork(self, work, tensors)


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """For tests: ``report_future_error(e)`` makes the future of the next allreduce fail with ``e``."""

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._future_error: Exception | None = None

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  timeout: timedelta | None = None) -> None:
        self._future_error = None
        super().configure(store_addr, replica_id, rank, world_size, timeout)

    def reconfigure(self, opts: ReconfigureOptions) -> dist.Work:
        self._future_error = None
        return super().reconfigure(opts)

    def report_future_error(self, e: Exception) -> None:
        """Fail the future of the next allreduce with ``e``."""
        self._future_error = e

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = ReduceOp.SUM) -> dist.Work:
        work = super().allreduce(tensors, opts)
        error, self._future_error = self._future_error, None
        return work if error is None else _FailingFutureWork(work, error)


class _FailingFutureWork(dist.Work):
    """``work`` whose future fails with ``error`` once ``work`` is done (its wait() still succeeds)."""

    def __init__(self, work: dist.Work, error: Exception) -> None:
        super().__init__()
        self._work = work
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self._work.wait() if timeout is None else self._work.wait(timeout)

    def get_future(self) -> torch.futures.Future:
        def fail(future: torch.futures.Future) -> Any:
            future.value()
            raise self._error

        return self._work.get_future().then(fail)


class _ManagedWorkAdapter(dist.Work):
    """A ``dist.Work`` over what ``Manager.allreduce`` returns (a future that never raises), for torch's C++ callers."""

    def __init__(self, managed: Any) -> None:
        super().__init__()
        self._managed = managed

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._managed.wait()  # bounded by the Manager's own timeout
        return True

    def get_future(self) -> torch.futures.Future:
        return self._managed.get_future()


class ManagedProcessGroup(ProcessGroupWrapper):
    """The Manager's process group, with its allreduce going through the Manager.

    ``allreduce`` calls ``manager.allreduce`` (one tensor): an error is
    reported to the Manager, which votes the step down, and never reaches the
    caller. ``size()`` is the number of replicas in this step's quorum. Other
    collectives go to the Manager's process group as they are.

    It is a group torch's own API takes: ``dist.all_reduce(t, group=ManagedProcessGroup(manager),
    op=ReduceOp.AVG)`` (torchft's FSDP2 all-reduce hook) dispatches here, no registration needed;
    ``torchft_lite.hsdp.average_across_groups`` sets that hook for you.
    """

    def __init__(self, manager: "Manager") -> None:
        super().__init__(pg=manager._pg)
        self._manager = manager

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = ReduceOp.SUM) -> dist.Work:
        if len(tensors) != 1:
            raise ValueError(f"{type(self).__name__}.allreduce takes exactly one tensor, got {len(tensors)}")
        if isinstance(opts, (AllreduceOptions, AllreduceCoalescedOptions)):
            reduce_op = opts.reduceOp
        elif isinstance(opts, (ReduceOp, ReduceOp.RedOpType)):
            reduce_op = opts
        else:
            raise TypeError(f"allreduce opts must be AllreduceOptions or a ReduceOp, got {type(opts).__name__}")
        work = self._manager.allreduce(tensors[0], reduce_op=reduce_op)
        return work if isinstance(work, dist.Work) else _ManagedWorkAdapter(work)

    def size(self) -> int:
        return self._manager.num_participants()

    def getBackendName(self) -> str:
        pg = self._manager._pg
        return pg.getBackendName() if isinstance(pg, ProcessGroup) else pg._get_backend_name()
