"""A process group that talks to no one: for tests and single-replica runs."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
)

from .base import ProcessGroup, _check_rank
from .work import CompletedWork

__all__ = ["ProcessGroupDummy"]


class ProcessGroupDummy(ProcessGroup):
    """Every collective completes at once and leaves its tensors unchanged.

    ``rank`` and ``world`` are only reported by ``rank()`` and ``size()`` (a
    later ``configure()`` replaces them); nothing is exchanged, so an
    allreduce returns each rank's own values. ``configure()`` touches no store.
    """

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        _check_rank(rank, world)
        self._rank = rank
        self._world = world
        self.configure_count = 0
        """How many times ``configure()`` was called (tests read it)."""

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        _check_rank(rank, world_size)
        self._rank, self._world = rank, world_size
        self.configure_count += 1

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world

    def getBackendName(self) -> str:
        return "torchft-dummy"

    def set_timeout(self, timeout: timedelta) -> None:
        pass

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp = ReduceOp.SUM) -> dist.Work:
        return CompletedWork(tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensor: list[torch.Tensor],
                  opts: AllgatherOptions | None = None) -> dist.Work:
        for outputs, tensor in zip(output_tensors, input_tensor):
            for output in outputs:
                output.copy_(tensor)
        return CompletedWork(output_tensors)

    def broadcast(self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | int = 0) -> dist.Work:
        return CompletedWork(tensor_list)

    def barrier(self, opts: BarrierOptions | None = None) -> dist.Work:
        return CompletedWork()

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        return CompletedWork()

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        return CompletedWork(tensors)

    def __repr__(self) -> str:
        return f"ProcessGroupDummy(rank={self._rank}, size={self._world})"
