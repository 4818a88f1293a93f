"""c10d collective options: accept what callers pass (options, a ReduceOp, a root rank, None), build fresh ones.

A fresh options object per call: the caller's is never mutated, and a group
timeout is filled in only where the caller left the per-call one unset.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)

__all__ = [
    "allgather_options",
    "allreduce_coalesced_options",
    "allreduce_options",
    "alltoall_options",
    "barrier_options",
    "broadcast_options",
    "reduce_scatter_options",
]


def _with_timeout(options: Any, timeout: timedelta | None) -> Any:
    # c10d marks an unset per-call timeout with a negative value.
    if timeout is not None and options.timeout < timedelta(0):
        options.timeout = timeout
    return options


def _is_reduce_op(opts: Any) -> bool:
    return isinstance(opts, (ReduceOp, ReduceOp.RedOpType))


def _reduce_options(op: str, opts: Any, factory: Callable[[], Any], accepted: tuple[type, ...],
                    timeout: timedelta | None) -> Any:
    options = factory()
    if opts is None:
        pass  # SUM, c10d's default
    elif isinstance(opts, accepted):
        options.reduceOp = opts.reduceOp
        options.timeout = opts.timeout
    elif _is_reduce_op(opts):
        options.reduceOp = opts
    else:
        names = " or ".join(cls.__name__ for cls in accepted)
        raise TypeError(f"{op} opts must be {names} or a ReduceOp, got {type(opts).__name__}")
    return _with_timeout(options, timeout)


def allreduce_options(opts: Any, timeout: timedelta | None) -> AllreduceOptions:
    return _reduce_options("allreduce", opts, AllreduceOptions, (AllreduceOptions, AllreduceCoalescedOptions), timeout)


def allreduce_coalesced_options(opts: Any, timeout: timedelta | None) -> AllreduceCoalescedOptions:
    return _reduce_options("allreduce_coalesced", opts, AllreduceCoalescedOptions,
                           (AllreduceCoalescedOptions, AllreduceOptions), timeout)


def reduce_scatter_options(opts: Any, timeout: timedelta | None) -> ReduceScatterOptions:
    return _reduce_options("reduce_scatter", opts, ReduceScatterOptions, (ReduceScatterOptions,), timeout)


def broadcast_options(opts: Any, timeout: timedelta | None) -> BroadcastOptions:
    options = BroadcastOptions()
    if opts is None:
        pass  # root 0
    elif isinstance(opts, BroadcastOptions):
        options.rootRank = opts.rootRank
        options.rootTensor = opts.rootTensor
        options.timeout = opts.timeout
    elif isinstance(opts, int) and not isinstance(opts, bool):
        options.rootRank = opts
    else:
        raise TypeError(f"broadcast opts must be BroadcastOptions or a root rank, got {type(opts).__name__}")
    return _with_timeout(options, timeout)


def _timeout_only(op: str, opts: Any, factory: Callable[[], Any], timeout: timedelta | None) -> Any:
    options = factory()
    if opts is not None:
        if not isinstance(opts, factory):
            raise TypeError(f"{op} opts must be {factory.__name__}, got {type(opts).__name__}")
        options.timeout = opts.timeout
    return _with_timeout(options, timeout)


def allgather_options(opts: Any, timeout: timedelta | None) -> AllgatherOptions:
    return _timeout_only("allgather", opts, AllgatherOptions, timeout)


def alltoall_options(opts: Any, timeout: timedelta | None) -> AllToAllOptions:
    return _timeout_only("alltoall_base", opts, AllToAllOptions, timeout)


def barrier_options(opts: Any, timeout: timedelta | None) -> BarrierOptions:
    options = _timeout_only("barrier", opts, BarrierOptions, timeout)
    if opts is not None and opts.device_ids:
        options.device_ids = list(opts.device_ids)  # NCCL's barrier runs on these devices
    return options
