"""DistributedSampler: shards over (replica group, group rank), defaults, validation."""

from __future__ import annotations

import itertools

import pytest

from torchft_lite.data import DistributedSampler
from torchft_lite.errors import ConfigError

DATASET = list(range(103))  # not a multiple of the shard count, on purpose


def shards(groups: int, ranks: int, **kwargs) -> dict[tuple[int, int], list[int]]:
    return {
        (replica, rank): list(DistributedSampler(DATASET, replica_rank=replica, num_replica_groups=groups,
                                                 group_rank=rank, num_replicas=ranks, **kwargs))
        for replica, rank in itertools.product(range(groups), range(ranks))
    }


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_and_cover_the_dataset(shuffle: bool) -> None:
    by_shard = shards(groups=3, ranks=2, shuffle=shuffle, drop_last=True)
    seen = [i for indices in by_shard.values() for i in indices]
    assert len(seen) == len(set(seen)), "a sample is in two shards"
    assert len(DATASET) - len(seen) < 6, "drop_last drops fewer samples than there are shards"
    assert {len(indices) for indices in by_shard.values()} == {len(DATASET) // 6}

    padded = shards(groups=3, ranks=2, shuffle=shuffle)
    assert set(itertools.chain(*padded.values())) == set(DATASET)


def test_global_rank_is_group_rank_plus_replicas_times_replica_rank() -> None:
    sampler = DistributedSampler(DATASET, replica_rank=2, num_replica_groups=4, group_rank=1, num_replicas=3)
    assert (sampler.global_rank, sampler.global_world_size) == (7, 12)
    assert (sampler.rank, sampler.num_replicas) == (7, 12)
    unshuffled = DistributedSampler(DATASET, 2, 4, group_rank=1, num_replicas=3, shuffle=False, drop_last=True)
    assert list(unshuffled) == DATASET[:96][7::12]


def test_set_epoch_reorders_deterministically() -> None:
    def order(epoch: int, replica: int = 1, seed: int = 0) -> list[int]:
        sampler = DistributedSampler(DATASET, replica_rank=replica, num_replica_groups=2, group_rank=0,
                                     num_replicas=1, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(0) == order(0)
    assert order(1) == order(1)
    assert order(0) != order(1)
    assert order(0, seed=1) != order(0)
    # Every epoch the shards still partition the dataset (the shuffle is global, so
    # which samples a shard gets changes with the epoch too).
    for epoch in (0, 1):
        both = order(epoch, replica=0) + order(epoch, replica=1)
        assert len(both) == len(set(both)) == len(DATASET) - 1


def test_group_rank_and_size_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = DistributedSampler(DATASET, replica_rank=1, num_replica_groups=2)
    assert (sampler.group_rank, sampler.global_rank, sampler.global_world_size) == (1, 3, 4)


def test_missing_defaults_name_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"group_rank.*\$RANK"):
        DistributedSampler(DATASET, replica_rank=0, num_replica_groups=1)
    with pytest.raises(ConfigError, match=r"num_replicas.*\$WORLD_SIZE"):
        DistributedSampler(DATASET, replica_rank=0, num_replica_groups=1, group_rank=0)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="not an integer"):
        DistributedSampler(DATASET, replica_rank=0, num_replica_groups=1, group_rank=0)


@pytest.mark.parametrize("kwargs", [
    {"replica_rank": 2, "num_replica_groups": 2, "group_rank": 0, "num_replicas": 1},
    {"replica_rank": -1, "num_replica_groups": 2, "group_rank": 0, "num_replicas": 1},
    {"replica_rank": 0, "num_replica_groups": 0, "group_rank": 0, "num_replicas": 1},
    {"replica_rank": 0, "num_replica_groups": 2, "group_rank": 1, "num_replicas": 1},
    {"replica_rank": "0", "num_replica_groups": 2, "group_rank": 0, "num_replicas": 1},
])
def test_out_of_range_ranks_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        DistributedSampler(DATASET, **kwargs)
