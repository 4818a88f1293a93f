"""Property-based tests of compute_quorum_result: every member's view of one random quorum, checked together.

A quorum is a list of members with distinct replica ids (the lighthouse keys
participants by id) and random steps, ties included; each test computes the
result of every member for a group rank and checks that the views agree:

* ranks are the positions in replica-id order: a permutation of 0..n-1, and
  the same whatever order the members arrive in;
* a member heals exactly when it is behind the max step (or, with
  ``init_sync`` at step 0, when it is not the primary); each of its sources
  (one, or the smallest ``heal_sources`` any member advertises when striping)
  is at the max step, does not heal itself, and lists it among its
  destinations, and every destination a source lists names that source back;
* first sources share the behind members round-robin (counts differ by at
  most one), and consecutive group ranks of a behind member start from
  different sources when there are several;
* every member of a group rank rendezvous on one store, an up-to-date
  member's.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from hypothesis import assume, given, settings, strategies as st

from torchft_lite.group_server.quorum_compute import (
    QuorumMember, QuorumResult, compute_quorum_result, heal_sources_of, member_data,
)

INT64 = st.integers(-(2**63), 2**63 - 1)
steps = st.one_of(st.integers(0, 3), st.integers(0, 3), st.just(0), INT64)


@st.composite
def quorums(draw, min_size: int = 1, max_size: int = 9) -> list[QuorumMember]:
    ids = draw(st.lists(st.text(max_size=6), min_size=min_size, max_size=max_size, unique=True))
    return [
        QuorumMember(
            replica_id=rid,
            address=f"http://manager-{i}:1",
            store_address=f"store-{i}:2",
            step=draw(steps),
            world_size=draw(st.integers(0, 4)),
            commit_failures=draw(st.sampled_from([0, 0, 1, 2**62])),
            heal_sources=draw(st.sampled_from([1, 1, 1, 2, 3, 0, -5, 2**62])),
        )
        for i, rid in enumerate(ids)
    ]


group_ranks = st.integers(0, 7)


def views(members: list[QuorumMember], group_rank: int, init_sync: bool, quorum_id: int = 7) -> dict[str, QuorumResult]:
    return {m.replica_id: compute_quorum_result(quorum_id, members, m.replica_id, group_rank, init_sync)
            for m in members}


SETTINGS = settings(max_examples=400, deadline=None, derandomize=True)


@SETTINGS
@given(members=quorums(), group_rank=group_ranks, init_sync=st.booleans())
def test_ranks_world_size_and_max_step_agree_across_members(members, group_rank, init_sync):
    results = views(members, group_rank, init_sync)
    ordered = sorted(members, key=lambda m: m.replica_id)
    max_step = max(m.step for m in members)
    at_max = [m.replica_id for m in ordered if m.step == max_step]
    assert sorted(r.replica_rank for r in results.values()) == list(range(len(members)))
    for rank, member in enumerate(ordered):
        result = results[member.replica_id]
        assert result.replica_rank == rank
        assert result.replica_world_size == len(members)
        assert result.replica_ids == list(m.replica_id for m in ordered)
        assert result.quorum_id == 7
        assert (result.max_step, result.max_world_size) == (max_step, len(at_max))
        expected_max_rank = at_max.index(member.replica_id) if member.step == max_step else None
        assert result.max_replica_rank == expected_max_rank
        assert result.commit_failures == max(m.commit_failures for m in members)


@SETTINGS
@given(members=quorums(), group_rank=group_ranks, init_sync=st.booleans())
def test_every_behind_member_heals_from_an_up_to_date_source_that_lists_it(members, group_rank, init_sync):
    results = views(members, group_rank, init_sync)
    ordered = sorted(members, key=lambda m: m.replica_id)
    by_rank = {rank: results[m.replica_id] for rank, m in enumerate(ordered)}
    max_step = max(m.step for m in members)

    healing = {rank for rank, r in by_rank.items() if r.heal}
    stripes = min(min(max(m.heal_sources, 1) for m in members), len(members) - len(healing))
    for rank, result in by_rank.items():
        member = ordered[rank]
        assert result.heal == (result.recover_src_replica_rank is not None)
        if member.step < max_step:
            assert result.heal, f"rank {rank} at step {member.step} < {max_step} does not heal"
        if init_sync and max_step == 0:
            # Everyone starts from the same weights: all but one (the primary) heal.
            assert len(healing) == len(members) - 1
        elif member.step == max_step:
            assert not result.heal
        if result.heal:
            src = result.recover_src_replica_rank
            assert src != rank and src not in healing, "a source that is itself healing"
            assert ordered[src].step == max_step
            assert result.recover_src_manager_address == ordered[src].address
            assert result.recover_dst_replica_ranks == []  # a healing member serves nobody
            # Striping: min(heal_sources) distinct up-to-date sources (as many as there are, at most), the
            # primary first, and each one lists this member among its destinations.
            srcs = result.recover_src_replica_ranks
            assert srcs[0] == src and len(set(srcs)) == len(srcs) == stripes
            assert result.recover_src_manager_addresses == list(ordered[s].address for s in srcs)
            for s in srcs:
                assert s not in healing and rank in by_rank[s].recover_dst_replica_ranks
        else:
            assert result.recover_src_manager_address == ""
            assert result.recover_src_replica_ranks == result.recover_src_manager_addresses == []
        for dst in result.recover_dst_replica_ranks:
            assert rank in by_rank[dst].recover_src_replica_ranks
        assert len(set(result.recover_dst_replica_ranks)) == len(result.recover_dst_replica_ranks)

    # Round-robin: every up-to-date member is the first source of, give or take one, the same number of peers.
    primaries = Counter(r.recover_src_replica_rank for r in by_rank.values() if r.heal)
    firsts = [primaries.get(rank, 0) for rank in by_rank if rank not in healing]
    assert sum(firsts) == len(healing)
    assert max(firsts) - min(firsts) <= 1


@SETTINGS
@given(members=quorums(), group_rank=group_ranks, init_sync=st.booleans())
def test_a_group_rank_rendezvous_on_one_store_of_an_up_to_date_member(members, group_rank, init_sync):
    results = views(members, group_rank, init_sync)
    stores = {r.store_address for r in results.values()}
    assert len(stores) == 1
    (store,) = stores
    holder = next(m for m in members if m.store_address == store)
    assert holder.step == max(m.step for m in members)
    assert not results[holder.replica_id].heal


@st.composite
def quorums_with_several_holders(draw) -> tuple[list[QuorumMember], str]:
    """A quorum with at least two members at the max step and one behind; returns it and a behind id."""
    members = draw(quorums(min_size=3))
    max_step = draw(st.integers(1, 2**63 - 1))
    holders = draw(st.integers(2, len(members) - 1))
    order = draw(st.permutations(range(len(members))))
    steps_of = {i: max_step if n < holders else draw(st.integers(-(2**63), max_step - 1))
                for n, i in enumerate(order)}
    members = [QuorumMember(m.replica_id, m.address, m.store_address, steps_of[i]) for i, m in enumerate(members)]
    return members, members[order[-1]].replica_id


@SETTINGS
@given(quorum=quorums_with_several_holders(), group_rank=group_ranks)
def test_consecutive_group_ranks_of_a_behind_member_heal_from_different_sources(quorum, group_rank):
    members, behind = quorum
    here = compute_quorum_result(1, members, behind, group_rank, init_sync=False)
    there = compute_quorum_result(1, members, behind, group_rank + 1, init_sync=False)
    assert here.heal and there.heal
    assert here.recover_src_replica_rank != there.recover_src_replica_rank


@SETTINGS
@given(members=quorums(), group_rank=group_ranks, init_sync=st.booleans(), shuffle_seed=st.integers(0, 2**32 - 1))
def test_the_order_members_arrive_in_changes_nothing(members, group_rank, init_sync, shuffle_seed):
    shuffled = list(members)
    random.Random(shuffle_seed).shuffle(shuffled)
    assert views(shuffled, group_rank, init_sync) == views(members, group_rank, init_sync)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(members=quorums(), outsider=st.text(max_size=6), group_rank=st.integers(-(2**63), -1))
def test_bad_arguments_are_value_errors(members, outsider, group_rank):
    assume(outsider not in {m.replica_id for m in members})
    with pytest.raises(ValueError, match="not a member"):
        compute_quorum_result(1, members, outsider, 0)
    with pytest.raises(ValueError, match="group_rank"):
        compute_quorum_result(1, members, members[0].replica_id, group_rank)
    with pytest.raises(ValueError, match="no members"):
        compute_quorum_result(1, [], outsider, 0)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.one_of(
    st.text(max_size=40),
    json_values.map(json.dumps),
    st.builds(lambda v: json.dumps({"heal_sources": v}), json_values),
    st.integers(1, 5000).map(lambda depth: "[" * depth + "]" * depth),  # nested past the recursion limit
    st.integers(1, 5000).map(lambda digits: '{"heal_sources": ' + "9" * digits + "}"),
))
def test_heal_sources_of_any_member_data_is_a_positive_int(data):
    """``QuorumMember.data`` is another group's opaque text: whatever it holds, heal_sources_of answers >= 1."""
    value = heal_sources_of(data)
    assert type(value) is int and value >= 1


@settings(max_examples=300, deadline=None, derandomize=True)
@given(heal_sources=st.integers(1, 2**63 - 1), extra=st.dictionaries(st.text(max_size=8), json_values, max_size=3))
def test_member_data_round_trips_and_keeps_the_other_keys(heal_sources, extra):
    extra.pop("heal_sources", None)
    data = member_data(heal_sources, json.dumps(extra) if extra else "")
    assert heal_sources_of(data) == heal_sources
    if heal_sources > 1:
        assert {k: v for k, v in json.loads(data).items() if k != "heal_sources"} == json.loads(json.dumps(extra))
