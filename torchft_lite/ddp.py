"""``DistributedDataParallel(manager, module)``: DDP whose gradients go through the Manager.

torch's DDP does the bucketing and overlaps communication with backward; a
comm hook replaces its allreduce with ``manager.allreduce`` across replica
groups. Its own process group is a private one-rank gloo group (DDP needs one
to construct); the Manager syncs initial weights (``init_sync``), so DDP's
start-up broadcast has nothing to do. That group answers for CPU and CUDA
modules alike: DDP checks a CUDA module's parameters, and (with
``find_unused_parameters``) exchanges which were used, through the group's
backend for the parameters' device type.

``PureDistributedDataParallel`` does without torch's reducer: one
``manager.allreduce`` per gradient, as each is accumulated. Simple, and slow
for real models.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn import parallel

from torchft_lite.work import ManagedWork, completed_future

if TYPE_CHECKING:
    from torchft_lite.manager import Manager

__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]


# The device types DDP's private group serves. gloo takes CUDA tensors by staging them through host memory; with one
# rank nothing crosses a wire. Registered whether or not this torch has CUDA, so a CPU test can check it.
SINGLE_RANK_DEVICE_TYPES = ("cpu", "cuda")


def _single_rank_group() -> ProcessGroup:
    """A one-rank torch process group, over gloo, for every device type DDP may hold parameters on."""
    store = dist.HashStore()
    group = ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=60))
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    for device_type in SINGLE_RANK_DEVICE_TYPES:
        group._register_backend(torch.device(device_type), ProcessGroup.BackendType.GLOO, backend)
    return group


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torch DDP with gradients averaged across replica groups by ``manager``."""

    def __init__(self, manager: "Manager", module: nn.Module, **kwargs: Any) -> None:
        kwargs.setdefault("find_unused_parameters", True)  # torchft's default; steps may skip layers
        super().__init__(module, process_group=_single_rank_group(), **kwargs)
        self.register_comm_hook(manager, _comm_hook)


def _comm_hook(manager, bucket):  # unannotated: DDP rejects string annotations here
    """Average the bucket across replica groups through ``manager`` (a torch future of the bucket)."""
    return _bucket_future(manager.allreduce(bucket.buffer()), bucket.buffer())


def _bucket_future(work: Any, bucket: torch.Tensor) -> torch.futures.Future:
    """The future DDP waits on for one bucket, from whatever ``Manager.allreduce`` returned.

    Ours (:class:`~torchft_lite.work.ManagedWork`) has a future that never
    raises and needs no waiting here, so communication overlaps backward.
    A torchft-style managed work builds its future chain only in ``wait()``,
    which returns False after reporting a failure to its manager: then the
    bucket is handed back as it is (the step will not commit) instead of
    failing backward. Its future is a lazy proxy; the real future inside it
    is the one DDP can wait on.
    """
    if isinstance(work, ManagedWork):
        return work.get_future()
    if not work.wait():
        return completed_future(bucket)  # CUDA-aware for a GPU bucket (the stream rule)
    future = work.get_future()
    inner = getattr(future, "_fut", None)
    return inner if isinstance(inner, torch.futures.Future) else future


class PureDistributedDataParallel(nn.Module):
    """``module`` with each gradient allreduced through ``manager`` as soon as it is accumulated.

    No reducer and no buckets: one ``manager.allreduce`` per parameter per
    backward, each averaged in place when it completes (the Manager's
    futures never raise; ``should_commit`` waits for them). Prefer
    :class:`DistributedDataParallel` for real models.
    """

    def __init__(self, manager: "Manager", module: nn.Module) -> None:
        super().__init__()
        self.module = module

        def allreduce_grad(param: torch.Tensor) -> None:
            if param.grad is not None:
                manager.allreduce(param.grad)

        for param in module.parameters():
            param.register_post_accumulate_grad_hook(allreduce_grad)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
