"""torchft_lite: per-step fault tolerance for PyTorch training, in pure Python.

Drop-in for torchft training scripts (``import torchft_lite as torchft``)::

    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=..., state_dict=...)
    model = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, torch.optim.AdamW(model.parameters()))

Names are resolved lazily so ``import torchft_lite`` stays cheap.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# Training scripts fork (DataLoader workers) and the children never use gRPC, so grpc's fork handlers are only
# a source of stalls. Every module of this package that loads grpc is imported after this line.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

__all__ = [
    "DistributedDataParallel",
    "DistributedSampler",
    "DurableCheckpointer",
    "HealthConfig",
    "Manager",
    "Optimizer",
    "OptimizerWrapper",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ShardedState",
    "WatchdogConfig",
    "WorldSizeMode",
    "average_across_groups",
    "init_group_mesh",
]

_LOCATIONS = {
    "DistributedDataParallel": "torchft_lite.ddp",
    "DistributedSampler": "torchft_lite.data",
    "DurableCheckpointer": "torchft_lite.durable",
    "HealthConfig": "torchft_lite.health.nonfinite",
    "Manager": "torchft_lite.manager",
    "Optimizer": "torchft_lite.optim",
    "OptimizerWrapper": "torchft_lite.optim",
    "ProcessGroupBabyGloo": "torchft_lite.process_group",
    "ProcessGroupBabyNCCL": "torchft_lite.process_group",
    "ProcessGroupGloo": "torchft_lite.process_group",
    "ProcessGroupNCCL": "torchft_lite.process_group",
    "ShardedState": "torchft_lite.hsdp",
    "WatchdogConfig": "torchft_lite.health.watchdog",
    "WorldSizeMode": "torchft_lite.manager",
    "average_across_groups": "torchft_lite.hsdp",
    "init_group_mesh": "torchft_lite.hsdp",
}


def __getattr__(name: str) -> Any:
    module = _LOCATIONS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchft_lite' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
