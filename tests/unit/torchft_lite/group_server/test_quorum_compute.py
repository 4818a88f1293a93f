"""The pure quorum computation: ranks, stores and heal assignments."""

import json

import pytest

from torchft_lite.group_server.quorum_compute import QuorumMember, compute_quorum_result, heal_sources_of, member_data


def members(*steps: int, failures: int = 0) -> list[QuorumMember]:
    return [
        QuorumMember(f"replica_{i}", f"addr_{i}", f"store_{i}", step, commit_failures=failures if i == 0 else 0)
        for i, step in enumerate(steps)
    ]


def test_all_up_to_date_nobody_heals():
    result = compute_quorum_result(7, members(5, 5, 5), "replica_1", group_rank=0)
    assert (result.quorum_id, result.replica_rank, result.replica_world_size) == (7, 1, 3)
    assert (result.max_step, result.max_world_size, result.max_replica_rank) == (5, 3, 1)
    assert not result.heal and result.recover_dst_replica_ranks == []
    assert result.store_address == "store_0"  # group rank 0 -> first up-to-date member
    assert result.replica_ids == ["replica_0", "replica_1", "replica_2"]


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
    assert not source.heal and source.recover_dst_replica_ranks == [1]
    other = compute_quorum_result(1, quorum, "replica_2", group_rank=0)
    assert other.recover_dst_replica_ranks == []


def test_group_rank_offsets_the_source_and_the_store():
    quorum = members(3, 2, 3)
    result = compute_quorum_result(1, quorum, "replica_1", group_rank=1)
    assert result.recover_src_replica_rank == 2
    assert result.store_address == "store_2"


def test_several_behind_replicas_are_spread_over_sources():
    quorum = members(9, 9, 0, 0, 4)
    sources = [compute_quorum_result(1, quorum, f"replica_{i}", 0).recover_src_replica_rank for i in [2, 3, 4]]
    assert sources == [0, 1, 0]
    dsts = {i: compute_quorum_result(1, quorum, f"replica_{i}", 0).recover_dst_replica_ranks for i in [0, 1]}
    assert dsts == {0: [2, 4], 1: [3]}


def test_init_sync_at_step_zero_heals_everyone_from_the_primary():
    quorum = members(0, 0, 0)
    results = [compute_quorum_result(1, quorum, f"replica_{i}", 0) for i in range(3)]
    assert [r.heal for r in results] == [False, True, True]
    assert results[0].recover_dst_replica_ranks == [1, 2]
    # without init_sync nobody heals at step 0
    assert not any(compute_quorum_result(1, quorum, f"replica_{i}", 0, init_sync=False).heal for i in range(3))


def test_init_sync_primary_follows_group_rank():
    quorum = members(0, 0)
    assert compute_quorum_result(1, quorum, "replica_1", 1).recover_dst_replica_ranks == [0]
    assert compute_quorum_result(1, quorum, "replica_0", 1).recover_src_replica_rank == 1


def test_commit_failures_is_the_max_over_members():
    assert compute_quorum_result(1, members(1, 1, failures=3), "replica_1", 0).commit_failures == 3


def test_not_a_member_is_a_clear_error():
    with pytest.raises(ValueError, match="replica_9.*not a member of quorum 4"):
        compute_quorum_result(4, members(1), "replica_9", 0)
    with pytest.raises(ValueError, match="no members"):
        compute_quorum_result(4, [], "replica_0", 0)


# ---------------------------------------------------------------- striping over several sources


def striped(steps, heal_sources, group_rank=0, **kw):
    """Every member's result, with ``heal_sources`` an int (all alike) or one value per member."""
    per_member = heal_sources if isinstance(heal_sources, (list, tuple)) else [heal_sources] * len(steps)
    quorum = [
        QuorumMember(f"replica_{i}", f"addr_{i}", f"store_{i}", step, heal_sources=k)
        for i, (step, k) in enumerate(zip(steps, per_member))
    ]
    return [compute_quorum_result(1, quorum, f"replica_{i}", group_rank, **kw) for i in range(len(steps))]


def assert_sources_and_destinations_agree(results) -> None:
    """What each source serves is exactly who lists it as a source: the HTTP server waits for that many."""
    for rank, result in enumerate(results):
        pulling = list(dst for dst, r in enumerate(results) if rank in r.recover_src_replica_ranks)
        assert result.recover_dst_replica_ranks == pulling
        assert result.recover_src_replica_ranks[:1] == (
            [] if result.recover_src_replica_rank is None else [result.recover_src_replica_rank])
        assert result.recover_src_manager_addresses == list(f"addr_{s}" for s in result.recover_src_replica_ranks)


@pytest.mark.parametrize("group_rank", [0, 1, 2])
def test_one_source_is_torchfts_assignment_unchanged(group_rank):
    steps = (9, 9, 0, 0, 4, 9)
    plain = [compute_quorum_result(1, members(*steps), f"replica_{i}", group_rank) for i in range(len(steps))]
    for one, default in zip(striped(steps, 1, group_rank), plain):
        assert one == default
        assert one.recover_src_replica_ranks == ([] if not one.heal else [one.recover_src_replica_rank])


def test_two_sources_each_behind_replica_pulls_from_two_consecutive_up_to_date_peers():
    results = striped((9, 9, 0, 0, 4, 9), 2)  # up to date: 0, 1, 5; behind: 2, 3, 4
    assert [r.recover_src_replica_ranks for r in results] == [[], [], [0, 1], [1, 5], [5, 0], []]
    assert [r.recover_src_replica_rank for r in results[2:5]] == [0, 1, 5]  # the single-source choice, first
    assert results[0].recover_dst_replica_ranks == [2, 4]
    assert results[1].recover_dst_replica_ranks == [2, 3]
    assert results[5].recover_dst_replica_ranks == [3, 4]
    assert_sources_and_destinations_agree(results)


@pytest.mark.parametrize("group_rank", [0, 1, 2, 3])
def test_three_sources_agree_for_every_group_rank(group_rank):
    results = striped((7, 3, 7, 7, 2, 7), 3, group_rank)  # up to date: 0, 2, 3, 5
    assert_sources_and_destinations_agree(results)
    for result in (results[1], results[4]):
        assert result.heal and len(set(result.recover_src_replica_ranks)) == 3
    assert results[1].recover_src_replica_ranks == list([0, 2, 3, 5][(group_rank + j) % 4] for j in range(3))


def test_the_smallest_advertised_heal_sources_wins():
    steps = (5, 5, 5, 1)
    assert striped(steps, [3, 2, 3, 3])[3].recover_src_replica_ranks == [0, 1]
    # a member advertising nothing (torchft's, or ours with the default) keeps everyone on one source
    mixed = striped(steps, [3, 1, 3, 3])
    assert mixed[3].recover_src_replica_ranks == [0]
    assert [r.recover_dst_replica_ranks for r in mixed[:3]] == [[3], [], []]
    assert_sources_and_destinations_agree(mixed)


def test_fewer_up_to_date_peers_than_heal_sources_uses_each_once():
    results = striped((4, 4, 1, 1), 5)
    assert [r.recover_src_replica_ranks for r in results[2:]] == [[0, 1], [1, 0]]
    assert_sources_and_destinations_agree(results)
    alone = striped((4, 1), 3)
    assert alone[1].recover_src_replica_ranks == [0] and alone[0].recover_dst_replica_ranks == [1]


def test_init_sync_at_step_zero_has_one_source_whatever_is_advertised():
    results = striped((0, 0, 0), 2)  # only the primary is up to date at step 0
    assert [r.recover_src_replica_ranks for r in results] == [[], [0], [0]]
    assert_sources_and_destinations_agree(results)


@pytest.mark.parametrize("data,expected", [
    ("", 1), ('{"heal_sources": 2}', 2), ('{"heal_sources": 0}', 1), ('{"heal_sources": -3}', 1),
    ('{"heal_sources": true}', 1), ('{"heal_sources": "2"}', 1), ('{"heal_sources": 2.0}', 1),
    ("[2]", 1), ("not json", 1), ('{"other": 1}', 1), ("[" * 100_000, 1),
])
def test_heal_sources_of_member_data(data, expected):
    assert heal_sources_of(data) == expected


def test_member_data_merges_into_json_and_advertises_nothing_for_one():
    assert member_data(1) == "" and member_data(1, "opaque") == "opaque"
    assert heal_sources_of(member_data(3)) == 3
    merged = member_data(2, '{"team": "a"}')
    assert json.loads(merged) == {"team": "a", "heal_sources": 2}
    with pytest.raises(ValueError, match="not a JSON object"):
        member_data(2, "opaque")
    with pytest.raises(ValueError, match=">= 1"):
        member_data(0)


def test_each_group_rank_gets_every_members_handle_for_that_rank_in_replica_rank_order():
    quorum = [QuorumMember(f"replica_{i}", f"addr_{i}", f"store_{i}", 5, world_size=2,
                           reconfigure_handles=(f"h{i}-r0", f"h{i}-r1")) for i in (2, 0, 1)]
    for group_rank in (0, 1):
        result = compute_quorum_result(1, quorum, "replica_1", group_rank)
        assert result.reconfigure_handles == [f"h{i}-r{group_rank}" for i in (0, 1, 2)]
    # A member that sent none leaves a gap the Manager names; when nobody sent any there are none.
    quorum[0] = QuorumMember("replica_2", "addr_2", "store_2", 5, world_size=2)
    assert compute_quorum_result(1, quorum, "replica_1", 0).reconfigure_handles == ["h0-r0", "h1-r0", ""]
    bare = [QuorumMember(f"replica_{i}", f"addr_{i}", f"store_{i}", 5) for i in range(2)]
    assert compute_quorum_result(1, bare, "replica_1", 0).reconfigure_handles == []
