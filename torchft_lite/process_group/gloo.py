"""Reconfigurable gloo process group (CPU tensors; CUDA tensors are staged through host memory by gloo)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .base import DEFAULT_TIMEOUT
from .reconfigurable import ReconfigurableProcessGroup, as_process_group

__all__ = ["ProcessGroupGloo", "create_gloo_group"]


def create_gloo_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A connected gloo communicator (CPU tensors), fronted by a torch ProcessGroup for every collective."""
    backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)  # gloo stages CUDA tensors through the host
    return as_process_group(store, rank, world_size, backend, dist.ProcessGroup.BackendType.GLOO, devices)


class ProcessGroupGloo(ReconfigurableProcessGroup):
    """A gloo process group rebuilt by every ``configure()``.

    Args:
        timeout: bounds the rendezvous in ``configure()`` and every collective
            (gloo fails an operation that does not complete in time, and
            closes its connections). A dead peer surfaces much sooner: gloo
            sees the closed connection and fails the pending operation.

    gloo picks its network interface as torch does: ``GLOO_SOCKET_IFNAME``
    when set, else the address the hostname resolves to.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)

    def _create_backend(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
        return create_gloo_group(store, rank, world_size, timeout)

    def getBackendName(self) -> str:
        return "torchft-gloo"
