"""Sharding a dataset across replica groups and the ranks inside each.

:class:`DistributedSampler` is torch's sampler over ``num_replica_groups *
num_replicas`` shards, where this process reads shard ``group_rank +
num_replicas * replica_rank``. Replica groups come and go, so
``num_replica_groups`` is the most groups the job will ever run, fixed up
front; the shards of a group that is down are simply not read (the sampler is
lossy by design, as torchft's is). Checkpoint the data loader with the model
(e.g. torchdata's StatefulDataLoader) to avoid repeating batches after a heal.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from torchft_lite.errors import ConfigError

__all__ = ["DistributedSampler"]


def _default(name: str, value: int | None, env_var: str, from_dist: Callable[[], int]) -> int:
    """``value`` if given; else the initialized default process group's; else ``$env_var``."""
    if value is not None:
        return value
    if dist.is_available() and dist.is_initialized():
        return from_dist()
    text = os.environ.get(env_var)
    if text is None:
        raise ConfigError(f"DistributedSampler: {name} was not given, torch.distributed is not initialized "
                          f"and ${env_var} is not set; pass {name}= explicitly")
    try:
        return int(text)
    except ValueError as exc:
        raise ConfigError(f"DistributedSampler: ${env_var}={text!r} is not an integer") from exc


def _check_index(name: str, value: int, count_name: str, count: int) -> None:
    for label, number in ((name, value), (count_name, count)):
        if isinstance(number, bool) or not isinstance(number, int):
            raise ConfigError(f"DistributedSampler: {label} must be an int, got {number!r}")
    if count < 1:
        raise ConfigError(f"DistributedSampler: {count_name} must be >= 1, got {count}")
    if not 0 <= value < count:
        raise ConfigError(f"DistributedSampler: {name} must be in [0, {count_name}={count}), got {value}")


class DistributedSampler(_TorchDistributedSampler):
    """torch's DistributedSampler, sharded over replica groups as well as the ranks inside one.

    Args:
        dataset: the dataset to sample from.
        replica_rank: this replica group's index, in ``[0, num_replica_groups)``
            (typically ``$REPLICA_GROUP_ID``).
        num_replica_groups: the most replica groups the job will run
            (typically ``$NUM_REPLICA_GROUPS``); fixed for the job's life.
        group_rank: this process's rank inside its replica group. Default: the
            rank of the initialized default process group, else ``$RANK``.
        num_replicas: the number of ranks in a replica group. Default: the
            world size of the initialized default process group, else
            ``$WORLD_SIZE``.
        shuffle, seed, drop_last: as for torch's sampler; ``shuffle`` and
            ``seed`` must be the same everywhere.

    Raises:
        ConfigError: a rank is out of range, or a default cannot be found.
    """

    def __init__(
        self,
        dataset: Dataset,
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        group_rank = _default("group_rank", group_rank, "RANK", dist.get_rank)
        num_replicas = _default("num_replicas", num_replicas, "WORLD_SIZE", dist.get_world_size)
        _check_index("replica_rank", replica_rank, "num_replica_groups", num_replica_groups)
        _check_index("group_rank", group_rank, "num_replicas", num_replicas)

        self.replica_rank = replica_rank
        self.num_replica_groups = num_replica_groups
        self.group_rank = group_rank
        self.global_rank: int = group_rank + num_replicas * replica_rank
        """The shard this process reads."""
        self.global_world_size: int = num_replicas * num_replica_groups
        """The number of shards."""
        super().__init__(dataset, num_replicas=self.global_world_size, rank=self.global_rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
