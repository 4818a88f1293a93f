"""``DistributedDataParallel(manager, module)``: DDP whose gradients go through the Manager.

torch's DDP does the bucketing and overlaps communication with backward; a
comm hook replaces its allreduce with ``manager.allreduce`` across replica
groups. Its own process group is a private one-rank gloo group (DDP needs one
to construct); the Manager syncs initial weights (``init_sync``), so DDP's
start-up broadcast has nothing to do.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn import parallel

if TYPE_CHECKING:
    from torchft_lite.manager import Manager

__all__ = ["DistributedDataParallel"]


def _single_rank_group() -> ProcessGroup:
    store = dist.HashStore()
    group = ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=60))
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torch DDP with gradients averaged across replica groups by ``manager``."""

    def __init__(self, manager: "Manager", module: nn.Module, **kwargs: Any) -> None:
        kwargs.setdefault("find_unused_parameters", True)  # torchft's default; steps may skip layers
        super().__init__(module, process_group=_single_rank_group(), **kwargs)
        self.register_comm_hook(manager, _comm_hook)


def _comm_hook(manager, bucket):  # unannotated: DDP rejects string annotations here
    """Average the bucket across replica groups through ``manager`` (a torch future of the bucket)."""
    return manager.allreduce(bucket.buffer()).get_future()
