"""A process group that talks to no one: for tests and single-replica runs."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .base import ProcessGroup, _check_rank
from .handles import make_handle
from .tracked_work import CompletedWork

__all__ = ["ProcessGroupDummy"]


def _fill(output: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` into ``output`` end to end, as often as it fits (once when their sizes match)."""
    source, target = tensor.reshape(-1), output.view(-1)
    step = source.numel()
    for start in range(0, target.numel() - step + 1, step) if step else ():
        target[start:start + step].copy_(source)


class ProcessGroupDummy(ProcessGroup):
    """Every collective completes at once, as if this rank were alone.

    ``rank`` and ``world`` are only reported by ``rank()`` and ``size()`` (a
    later ``configure()`` replaces them); nothing is exchanged, so an
    allreduce returns each rank's own values and a gather or scatter copies
    this rank's input into the output. ``configure()`` touches no store.
    Every collective returns a :class:`CompletedWork`.
    """

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        _check_rank(rank, world)
        self._rank = rank
        self._world = world
        self.configure_count = 0
        """How many times ``configure()`` (or ``reconfigure()``) was called (tests read it)."""

    @property
    def reconfigure_count(self) -> int:
        """torchft's name for :attr:`configure_count`."""
        return self.configure_count

    def get_reconfigure_handle(self) -> str:
        """A handle naming no store: a reconfigure of this group talks to no one, so it hosts none."""
        info = self._rank_info
        return make_handle(self._handle_id(), "dummy", 0, info.global_rank if info else None)

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  timeout: timedelta | None = None) -> None:
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

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = ReduceOp.SUM) -> dist.Work:
        return CompletedWork(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return CompletedWork(tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensor: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        for outputs, tensor in zip(output_tensors, input_tensor):
            for output in outputs:
                output.copy_(tensor)
        return CompletedWork(output_tensors)

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        for output, tensor in zip(output_tensors, input_tensors):
            _fill(output, tensor)  # every rank's part is this rank's input
        return CompletedWork(output_tensors)

    def alltoall_base(self, output_buffer: torch.Tensor, input_buffer: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        output_buffer.copy_(input_buffer)
        return CompletedWork([output_buffer])

    def broadcast(self, tensor_list: list[torch.Tensor], opts: Any = 0) -> dist.Work:
        return CompletedWork(tensor_list)

    def barrier(self, opts: Any = None) -> dist.Work:
        return CompletedWork()

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        for output, inputs in zip(output_tensors, input_tensors):
            output.copy_(inputs[min(self._rank, len(inputs) - 1)])  # this rank's part, unreduced
        return CompletedWork(output_tensors)

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        for output, tensor in zip(output_tensors, input_tensors):
            parts = tensor.reshape(-1).split(output.numel())
            output.view(-1).copy_(parts[min(self._rank, len(parts) - 1)])  # this rank's part, unreduced
        return CompletedWork(output_tensors)

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        return CompletedWork()

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        return CompletedWork(tensors)
