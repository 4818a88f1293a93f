"""The pure quorum computation: ranks, stores and heal assignments."""

import pytest

from torchft_lite._quorum_compute import QuorumMember, compute_quorum_result


def members(*steps: int, failures: int = 0) -> list[QuorumMember]:
    return [
        QuorumMember(f"replica_{i}", f"addr_{i}", f"store_{i}", step, commit_failures=failures if i == 0 else 0)
        for i, step in enumerate(steps)
    ]


def test_all_up_to_date_nobody_heals():
    result = compute_quorum_result(7, members(5, 5, 5), "replica_1", group_rank=0)
    assert (result.quorum_id, result.replica_rank, result.replica_world_size) == (7, 1, 3)
    assert (result.max_step, result.max_world_size, result.max_replica_rank) == (5, 3, 1)
    assert not result.heal and result.recover_dst_replica_ranks == ()
    assert result.store_address == "store_0"  # group rank 0 -> first up-to-date member
    assert result.replica_ids == ("replica_0", "replica_1", "replica_2")


def test_members_are_ranked_by_replica_id_not_arrival_order():
    shuffled = list(reversed(members(1, 1, 1)))
    result = compute_quorum_result(1, shuffled, "replica_0", group_rank=0)
    assert result.replica_rank == 0


def test_behind_replica_heals_from_an_up_to_date_peer():
    quorum = members(3, 2, 3)
    behind = compute_quorum_result(1, quorum, "replica_1", group_rank=0)
    assert behind.heal and behind.recover_src_replica_rank == 0
    assert behind.recover_src_manager_address == "addr_0"
    assert behind.max_replica_rank is None and behind.max_world_size == 2
    source = compute_quorum_result(1, quorum, "replica_0", group_rank=0)
    assert not source.heal and source.recover_dst_replica_ranks == (1,)
    other = compute_quorum_result(1, quorum, "replica_2", group_rank=0)
    assert other.recover_dst_replica_ranks == ()


def test_group_rank_offsets_the_source_and_the_store():
    quorum = members(3, 2, 3)
    result = compute_quorum_result(1, quorum, "replica_1", group_rank=1)
    assert result.recover_src_replica_rank == 2
    assert result.store_address == "store_2"


def test_several_behind_replicas_are_spread_over_sources():
    quorum = members(9, 9, 0, 0, 4)
    sources = [compute_quorum_result(1, quorum, f"replica_{i}", 0).recover_src_replica_rank for i in (2, 3, 4)]
    assert sources == [0, 1, 0]
    dsts = {i: compute_quorum_result(1, quorum, f"replica_{i}", 0).recover_dst_replica_ranks for i in (0, 1)}
    assert dsts == {0: (2, 4), 1: (3,)}


def test_init_sync_at_step_zero_heals_everyone_from_the_primary():
    quorum = members(0, 0, 0)
    results = [compute_quorum_result(1, quorum, f"replica_{i}", 0) for i in range(3)]
    assert [r.heal for r in results] == [False, True, True]
    assert results[0].recover_dst_replica_ranks == (1, 2)
    # without init_sync nobody heals at step 0
    assert not any(compute_quorum_result(1, quorum, f"replica_{i}", 0, init_sync=False).heal for i in range(3))


def test_init_sync_primary_follows_group_rank():
    quorum = members(0, 0)
    assert compute_quorum_result(1, quorum, "replica_1", 1).recover_dst_replica_ranks == (0,)
    assert compute_quorum_result(1, quorum, "replica_0", 1).recover_src_replica_rank == 1


def test_commit_failures_is_the_max_over_members():
    assert compute_quorum_result(1, members(1, 1, failures=3), "replica_1", 0).commit_failures == 3


def test_not_a_member_is_a_clear_error():
    with pytest.raises(ValueError, match="replica_9.*not a member of quorum 4"):
        compute_quorum_result(4, members(1), "replica_9", 0)
    with pytest.raises(ValueError, match="no members"):
        compute_quorum_result(4, [], "replica_0", 0)
