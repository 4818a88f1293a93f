"""Fingerprints of sharded (DTensor) state: each rank fingerprints its own shards, and a group folds its ranks'.

With FSDP2 inside a group every rank holds a different shard of each
parameter. Nothing is gathered: a rank's fingerprint covers its local tensors
only (the meshes here have no process groups, so a collective could not even
run), and the group's fingerprint is the fold of its ranks', as for DDP.
"""

from __future__ import annotations

import json

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.conftest import cpu_mesh, dtensor
from tests.unit.helpers import flip_bit, rank_fingerprint
from torchft_lite.health.fingerprint import fingerprint_of
from torchft_lite.health.fingerprint_vote import differing_ranks, first_difference, group_fingerprint, parse_fingerprint

ROWS, COLS = 5, 3  # 5 rows over 2 ranks: uneven shards, as FSDP2 makes them (3 rows and 2)


def full_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(ROWS, COLS, generator=generator) for name in ("weight", "exp_avg")}


def rank_state(rank: int, full: dict[str, torch.Tensor]) -> dict:
    """Group rank ``rank``'s state: its Shard(0) of each weight, a replicated bias, an integer step."""
    mesh = cpu_mesh([0, 1], ("fsdp",), rank)

    def shard(tensor: torch.Tensor) -> DTensor:
        return dtensor(tensor.tensor_split(2)[rank].clone(), mesh, [Shard(0)], tensor.shape)

    bias = dtensor(torch.ones(COLS), mesh, [Replicate()], (COLS,))
    return {"model": {"layer.weight": shard(full["weight"]), "layer.bias": bias},
            "optim": {"state": {0: {"exp_avg": shard(full["exp_avg"]), "step": torch.tensor(7)}}}}


def locals_of(state: dict) -> dict:
    """The same state with every DTensor replaced by its local tensor."""
    if isinstance(state, DTensor):
        return state._local_tensor
    if isinstance(state, dict):
        return {key: locals_of(value) for key, value in state.items()}
    return state


def test_a_rank_fingerprints_its_local_shards_and_nothing_else():
    full = full_weights()
    for rank in (0, 1):
        sharded = rank_state(rank, full)
        fingerprint = fingerprint_of(sharded)
        assert fingerprint == fingerprint_of(locals_of(sharded))  # exactly its local tensors
        shard_rows = 3 if rank == 0 else 2
        assert fingerprint.nbytes == (2 * shard_rows * COLS + COLS) * 4  # two shards and the bias, not 2 x 5 rows
    assert fingerprint_of(rank_state(0, full)).digest != fingerprint_of(rank_state(1, full)).digest


def test_a_group_folds_its_ranks_shard_fingerprints_and_a_flip_in_one_shard_names_that_rank():
    full = full_weights()
    ranks = [rank_state(0, full), rank_state(1, full)]
    healthy = group_fingerprint(4, [rank_fingerprint(4, state) for state in ranks])
    assert healthy == group_fingerprint(4, [rank_fingerprint(4, rank_state(r, full)) for r in (0, 1)])
    flip_bit(ranks[1]["optim"]["state"][0]["exp_avg"]._local_tensor, index=2)
    flipped = group_fingerprint(4, [rank_fingerprint(4, state) for state in ranks])
    a = parse_fingerprint(json.dumps({"fingerprint": healthy}))
    b = parse_fingerprint(json.dumps({"fingerprint": flipped}))
    assert a.digest != b.digest and differing_ranks(a, b) == [1]
    assert fingerprint_of(ranks[0]).runs[first_difference(a.sums, b.sums)][0] == "optim.state.0.exp_avg"


def test_the_heal_log_counts_a_ranks_shards_not_the_full_tensors():
    from torchft_lite.core.healer import tensor_bytes

    full = full_weights()
    state = rank_state(1, full)
    # rank 1 holds 2 of 5 rows of each weight, the whole replicated bias and the integer step
    assert tensor_bytes(state) == (2 * 2 * COLS + COLS) * 4 + 8
    assert tensor_bytes(locals_of(state)) == tensor_bytes(state)
