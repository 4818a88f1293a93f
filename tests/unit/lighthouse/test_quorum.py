"""The quorum rules, with literal timestamps (no clock, no network)."""

import pytest

from lighthouse.quorum import Member, QuorumConfig, QuorumState, Status
from tests.unit.helpers import issue, quorum_state


def join(s: QuorumState, now: float, *ids: str, **kw) -> None:
    for rid in ids:
        s.join(Member(rid, **kw), now)


class TestHealth:
    def test_healthy_while_younger_than_timeout(self):
        s = quorum_state(heartbeat_timeout=5.0)
        s.heartbeat("a", 100.0)
        assert s.is_healthy("a", 104.9)
        assert not s.is_healthy("a", 105.0)

    def test_expire_forgets_stale_heartbeats_and_reports_them(self):
        s = quorum_state(heartbeat_timeout=5.0)
        s.heartbeat("a", 0.0)
        s.heartbeat("b", 3.0)
        assert s.expire(4.0) == []
        assert s.expire(5.0) == ["a"]
        assert s.num_heartbeating == 1
        s.heartbeat("b", 7.0)  # refreshed: survives past its first deadline
        assert s.expire(9.0) == []
        assert s.expire(12.0) == ["b"]

    def test_joining_counts_as_heartbeat(self):
        s = quorum_state()
        join(s, 1.0, "a")
        assert s.is_healthy("a", 1.0)

    def test_time_going_backwards_is_clamped(self):
        s = quorum_state(heartbeat_timeout=5.0)
        s.heartbeat("a", 10.0)
        s.heartbeat("b", 2.0)  # treated as 10.0
        assert s.expire(14.9) == []
        assert sorted(s.expire(15.0)) == ["a", "b"]

    def test_memory_stays_bounded_as_replicas_come_and_go(self):
        s = quorum_state(heartbeat_timeout=1.0)
        for i in range(10_000):
            s.heartbeat(f"r{i}", i * 0.1)
            if i % 100 == 0:
                s.decide(i * 0.1)
        s.decide(10_000 * 0.1)
        assert s.num_heartbeating <= 11


class TestMinReplicasAndSplitBrain:
    def test_waits_for_min_replicas(self):
        s = quorum_state(min_replicas=2)
        join(s, 0.0, "a")
        decision, _ = s.decide(0.0)
        assert decision.status is Status.BELOW_MIN_REPLICAS
        assert "need min_replicas=2" in decision.reason
        join(s, 0.5, "b")
        q = issue(s, 0.5).quorum
        assert q.replica_ids == ("a", "b")

    def test_split_brain_guard_needs_strictly_more_than_half(self):
        s = quorum_state(min_replicas=1)
        for rid in "abcd":
            s.heartbeat(rid, 0.0)
        join(s, 0.0, "a", "b")
        decision, _ = s.decide(0.1)
        assert decision.status is Status.SPLIT_BRAIN_GUARD
        assert "not more than half of 4 healthy replicas" in decision.reason
        join(s, 0.2, "c")
        decision, _ = s.decide(0.2)
        assert decision.status is Status.WAITING_FOR_STRAGGLERS  # 3 of 4 passes the guard

    def test_unhealthy_participants_do_not_count(self):
        s = quorum_state(min_replicas=2, heartbeat_timeout=5.0)
        join(s, 0.0, "a")
        join(s, 6.0, "b")
        decision, expired = s.decide(6.0)
        assert expired == ["a"]
        assert decision.status is Status.BELOW_MIN_REPLICAS
        s.heartbeat("a", 6.5)  # alive again: counts again without rejoining
        q = issue(s, 6.5).quorum
        assert q.replica_ids == ("a", "b")


class TestJoinTimeout:
    def test_waits_for_stragglers_until_join_timeout_from_first_join(self):
        s = quorum_state(min_replicas=1, join_timeout=10.0, heartbeat_timeout=100.0)
        s.heartbeat("c", 0.0)
        join(s, 1.0, "a")
        join(s, 5.0, "b")
        s.heartbeat("c", 9.0)
        decision, _ = s.decide(10.6)
        assert decision.status is Status.WAITING_FOR_STRAGGLERS
        assert decision.reason.startswith("waiting for 1 straggler, 0.4 s of join timeout left")
        assert decision.wake_at == 11.0
        q = issue(s, 11.0).quorum
        assert q.replica_ids == ("a", "b")
        assert s.quorums_issued == 1

    def test_all_healthy_joined_issues_without_waiting(self):
        s = quorum_state(min_replicas=1, join_timeout=1000.0)
        s.heartbeat("c", 0.0)
        join(s, 0.0, "a", "b")
        assert s.decide(0.0)[0].status is Status.WAITING_FOR_STRAGGLERS
        join(s, 0.1, "c")
        assert issue(s, 0.1).quorum.replica_ids == ("a", "b", "c")

    def test_retry_keeps_original_join_time(self):
        s = quorum_state(min_replicas=1, join_timeout=10.0, heartbeat_timeout=100.0)
        s.heartbeat("z", 0.0)
        join(s, 0.0, "a", "b")
        join(s, 8.0, "a")  # same replica calling again must not extend the wait
        assert s.decide(9.9)[0].status is Status.WAITING_FOR_STRAGGLERS
        assert s.decide(10.0)[0].quorum.replica_ids == ("a", "b")


class TestFastQuorum:
    def test_fast_quorum_when_all_previous_members_rejoin(self):
        s = quorum_state(min_replicas=2, join_timeout=100.0)
        join(s, 0.0, "a", "b")
        first = issue(s, 0.0).quorum
        s.heartbeat("c", 1.0)  # healthy but not joining: a slow path would wait for it
        join(s, 2.0, "b", "a")
        decision, _ = s.decide(2.0)
        assert decision.status is Status.FAST_QUORUM
        assert decision.quorum.replica_ids == ("a", "b")
        assert decision.quorum.quorum_id == first.quorum_id  # same members: same id

    def test_fast_quorum_ignores_split_brain_and_min_replicas(self):
        s = quorum_state(min_replicas=1, join_timeout=100.0)
        join(s, 0.0, "a")
        issue(s, 0.0).quorum
        for rid in "bc":
            s.heartbeat(rid, 1.0)
        join(s, 1.0, "a")
        assert s.decide(1.0)[0].status is Status.FAST_QUORUM

    def test_fast_quorum_includes_new_participants(self):
        s = quorum_state(min_replicas=1)
        join(s, 0.0, "b", "a")
        first = issue(s, 0.0).quorum
        join(s, 1.0, "c", "b", "a")
        q = issue(s, 1.0).quorum
        assert q.replica_ids == ("a", "b", "c")
        assert q.quorum_id == first.quorum_id + 1

    def test_missing_member_means_no_fast_quorum(self):
        s = quorum_state(min_replicas=1, join_timeout=5.0)
        join(s, 0.0, "a", "b", "c")
        issue(s, 0.0).quorum
        join(s, 1.0, "a", "b")
        decision, _ = s.decide(1.0)
        assert decision.status is Status.WAITING_FOR_STRAGGLERS  # c still heartbeating
        assert issue(s, 5.0).quorum.replica_ids == ("a", "b")


class TestShrinkOnly:
    def test_shrink_only_admits_only_previous_members(self):
        s = quorum_state(min_replicas=1)
        join(s, 0.0, "a", "b")
        first = issue(s, 0.0).quorum
        join(s, 1.0, "c")
        s.join(Member("a", shrink_only=True), 1.0)
        join(s, 1.0, "b")
        q = issue(s, 1.0).quorum
        assert q.replica_ids == ("a", "b")
        assert q.quorum_id == first.quorum_id
        # c was left out and keeps waiting for the next quorum.
        assert [m.replica_id for m, _ in s.participants()] == ["c"]

    def test_without_previous_quorum_shrink_only_has_no_effect(self):
        s = quorum_state(min_replicas=1)
        s.join(Member("a", shrink_only=True), 0.0)
        assert issue(s, 0.0).quorum.replica_ids == ("a",)


class TestQuorumId:
    def test_first_quorum_id_follows_the_seed(self):
        s = quorum_state(last_quorum_id=41)
        join(s, 0.0, "a")
        assert issue(s, 0.0).quorum.quorum_id == 42

    def test_id_changes_on_membership_change_and_commit_failures(self):
        s = quorum_state(min_replicas=1, heartbeat_timeout=5.0)
        join(s, 0.0, "a", "b")
        q1 = issue(s, 0.0).quorum
        join(s, 1.0, "a", "b")
        assert issue(s, 1.0).quorum.quorum_id == q1.quorum_id
        s.join(Member("a", commit_failures=2), 2.0)
        join(s, 2.0, "b")
        assert issue(s, 2.0).quorum.quorum_id == q1.quorum_id + 1
        # b dies: after heartbeat expiry a alone forms a new quorum with a new id.
        s.heartbeat("a", 6.0)
        join(s, 8.0, "a")
        q = issue(s, 8.0).quorum
        assert q.replica_ids == ("a",)
        assert q.quorum_id == q1.quorum_id + 2

    def test_members_are_sorted_and_cleared_after_issue(self):
        s = quorum_state(min_replicas=3)
        join(s, 0.0, "c", "a", "b")
        assert issue(s, 0.0).quorum.replica_ids == ("a", "b", "c")
        assert s.num_participants == 0
        assert s.first_joined is None


class TestLeave:
    def test_leaving_participant_is_not_counted(self):
        s = quorum_state(min_replicas=2)
        join(s, 0.0, "a", "b")
        s.leave("b")
        assert s.decide(0.0)[0].status is Status.BELOW_MIN_REPLICAS
        s.leave("nobody")  # harmless


class TestConfig:
    @pytest.mark.parametrize(
        "kwargs, message",
        [
            (dict(min_replicas=0), "min_replicas"),
            (dict(min_replicas=1, join_timeout=-1), "join_timeout"),
            (dict(min_replicas=1, heartbeat_timeout=0), "heartbeat_timeout"),
            (dict(min_replicas=1, heartbeat_timeout=float("nan")), "heartbeat_timeout"),
            (dict(min_replicas=1, holder_timeout=0), "holder_timeout must be > 0"),
            (dict(min_replicas=1, holder_timeout=-1.0), "holder_timeout"),
            (dict(min_replicas=1, holder_timeout=float("inf")), "holder_timeout"),
            (dict(min_replicas=1, holder_timeout="30"), "holder_timeout"),
        ],
    )
    def test_bad_config_raises_value_error(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            QuorumConfig(**kwargs)

    def test_empty_replica_id_rejected(self):
        with pytest.raises(ValueError, match="replica_id"):
            quorum_state().join(Member(""), 0.0)


class TestForget:
    """A broken lease: the replica is gone now, not after heartbeat_timeout."""

    def test_survivors_form_a_quorum_at_once_without_the_forgotten_member(self):
        s = quorum_state(min_replicas=1, join_timeout=60.0, heartbeat_timeout=5.0)
        join(s, 0.0, "a", "b", "c")
        assert issue(s, 0.0).quorum.replica_ids == ("a", "b", "c")
        join(s, 1.0, "a", "b")
        decision, _ = s.decide(1.0)
        assert decision.quorum is None  # c is still healthy: wait for it (join timeout)
        assert s.forget("c")
        quorum = issue(s, 1.0).quorum
        assert quorum.replica_ids == ("a", "b")
        assert not s.is_healthy("c", 1.0) and not s.forget("c")

    def test_a_forgotten_participant_leaves_the_next_quorum(self):
        s = quorum_state(min_replicas=1)
        join(s, 0.0, "a", "b")
        s.forget("b")
        assert s.num_participants == 1 and s.num_healthy_participants == 1
        assert issue(s, 0.0).quorum.replica_ids == ("a",)

    def test_a_later_heartbeat_brings_it_back(self):
        s = quorum_state()
        s.heartbeat("a", 0.0)
        s.forget("a")
        s.heartbeat("a", 1.0)
        assert s.is_healthy("a", 1.0)


class TestStartupGrace:
    """A restarted lighthouse knows nobody: a minority must not form the first quorum alone.
    A first start has nobody to wait for and answers at once, as torchft's lighthouse does."""

    RESTARTED = "its state dir holds quorum id 17"

    def test_a_first_start_answers_a_lone_replica_at_once(self):
        s = QuorumState(QuorumConfig(1, join_timeout=1.0, heartbeat_timeout=5.0, startup_grace=5.0), started_at=100.0)
        join(s, 100.5, "only")
        assert issue(s, 100.5).quorum.replica_ids == ("only",)

    def test_a_restart_holds_the_first_quorum_until_the_grace_passed(self):
        s = QuorumState(QuorumConfig(1, join_timeout=1.0, heartbeat_timeout=5.0, startup_grace=5.0), started_at=100.0,
                        restart_evidence=self.RESTARTED)
        join(s, 100.5, "fresh")
        decision, _ = s.decide(101.0)
        assert decision.quorum is None and decision.status is Status.STARTUP_GRACE
        assert "4.0s left" in decision.reason and self.RESTARTED in decision.reason
        assert decision.wake_at == 105.0
        s.heartbeat("veteran", 102.0)  # a replica that was training re-registers in time
        join(s, 103.0, "veteran")
        assert issue(s, 105.0).quorum.replica_ids == ("fresh", "veteran")

    def test_a_restart_with_no_grace_configured_answers_at_once(self):
        s = QuorumState(QuorumConfig(1, startup_grace=0.0), started_at=0.0, restart_evidence=self.RESTARTED)
        join(s, 0.0, "a")
        assert issue(s, 0.0).quorum.replica_ids == ("a",)

    def test_later_quorums_are_not_delayed(self):
        s = QuorumState(QuorumConfig(1, startup_grace=5.0), started_at=0.0, restart_evidence=self.RESTARTED)
        join(s, 4.0, "a")
        assert issue(s, 5.0).quorum.replica_ids == ("a",)
        join(s, 5.1, "a")
        assert issue(s, 5.1).quorum.replica_ids == ("a",)


class TestStaleQuorumGuard:
    """Replicas that are all behind the highest step already reached must not form a quorum alone."""

    def test_fresh_replicas_wait_for_a_holder_of_the_latest_step(self):
        s = quorum_state(min_replicas=2, join_timeout=1.0, heartbeat_timeout=5.0)
        for rid in ("a", "b", "c"):
            s.join(Member(rid, step=40), 0.0)
        assert issue(s, 0.0).quorum.replica_ids == ("a", "b", "c")
        # a and b die; their replacements start over at step 0 while c is unreachable
        s.forget("a"), s.forget("b"), s.forget("c")
        s.join(Member("a2", step=0), 1.0)
        s.join(Member("b2", step=0), 1.0)
        decision, _ = s.decide(1.0)
        assert decision.quorum is None and decision.status is Status.BEHIND_COMMITTED
        assert "step 40" in decision.reason
        s.join(Member("c", step=41), 2.0)  # the holder is back (it committed once more meanwhile)
        quorum = issue(s, 2.0).quorum
        assert quorum.replica_ids == ("a2", "b2", "c")

    def test_a_behind_replica_with_a_holder_present_is_fine(self):
        s = quorum_state(min_replicas=1)
        s.join(Member("a", step=10), 0.0)
        issue(s, 0.0).quorum
        s.join(Member("a", step=11), 0.5)
        s.join(Member("new", step=0), 0.5)
        assert issue(s, 0.5).quorum.replica_ids == ("a", "new")


# ---------------------------------------------------------------- lineage fence


def _lineage_state() -> QuorumState:
    return quorum_state(join_timeout=1.0, heartbeat_timeout=2.0)


def _issue(state: QuorumState, now: float, *members: Member):
    for member in members:
        state.join(member, now)
    return issue(state, now).quorum


def test_a_member_that_committed_a_step_the_others_redid_without_it_is_given_that_step_to_heal():
    state = _lineage_state()
    _issue(state, 0.0, Member("g", step=7), Member("p", step=7))
    state.heartbeat("p", 2.5)
    state.expire(2.5)  # g hung past the heartbeat timeout: dropped at step 7
    _issue(state, 2.6, Member("p", step=7))  # p redoes step 7 without g
    state.heartbeat("p", 3.0)
    quorum = _issue(state, 3.0, Member("g", step=8), Member("p", step=8))  # g committed 7 on its own
    assert {m.replica_id: m.step for m in quorum.members} == {"g": 7, "p": 8}
    assert quorum.redone_by_others == (("g", 8, 7),)
    # Resolved: the next quorum takes g's step as it is.
    assert _issue(state, 3.5, Member("g", step=8), Member("p", step=8)).redone_by_others == ()


def test_a_member_dropped_after_the_others_went_on_keeps_its_step():
    state = _lineage_state()
    _issue(state, 0.0, Member("g", step=7), Member("p", step=7))
    state.heartbeat("p", 2.5)
    state.expire(2.5)
    _issue(state, 2.6, Member("p", step=8))  # p committed step 7 with g: nobody redid it
    quorum = _issue(state, 3.0, Member("g", step=8), Member("p", step=9))
    assert {m.replica_id: m.step for m in quorum.members} == {"g": 8, "p": 9}
    assert quorum.redone_by_others == ()


def test_a_member_whose_redoing_peers_did_not_get_as_far_keeps_its_step_and_is_the_source():
    state = _lineage_state()
    _issue(state, 0.0, Member("g", step=7), Member("p", step=7))
    state.heartbeat("p", 2.5)
    state.expire(2.5)
    _issue(state, 2.6, Member("p", step=7))  # p tries step 7 again, and that fails too
    quorum = _issue(state, 3.0, Member("g", step=8), Member("p", step=7))
    assert {m.replica_id: m.step for m in quorum.members} == {"g": 8, "p": 7}  # one lineage: p heals from g


def test_a_member_that_did_not_commit_while_gone_is_left_as_it_is():
    state = _lineage_state()
    _issue(state, 0.0, Member("g", step=7), Member("p", step=7))
    state.forget("g")  # its lease ended
    _issue(state, 0.1, Member("p", step=7))
    quorum = _issue(state, 0.5, Member("g", step=7), Member("p", step=8))
    assert {m.replica_id: m.step for m in quorum.members} == {"g": 7, "p": 8}
    assert quorum.redone_by_others == ()


def test_a_member_left_out_as_a_straggler_that_committed_the_step_the_others_redid_is_given_that_step():
    """A chaos run's fork: g0 and g1 in a quorum at step 622; g1 failed the step, g0 committed it and was slow to
    come back; the next quorum (join timeout) redid 622 with g1 and g2; all three then met at 623."""
    state = _lineage_state()
    _issue(state, 0.0, Member("g0", step=622), Member("g1", step=622))
    state.join(Member("g1", step=622), 0.5)
    state.join(Member("g2", step=622), 0.5)
    state.heartbeat("g0", 0.6)  # alive, only slow: a straggler
    decision, _ = state.decide(1.6)  # the join timeout expired without it
    assert decision.quorum is not None and decision.quorum.replica_ids == ("g1", "g2")
    quorum = _issue(state, 1.7, Member("g0", step=623), Member("g1", step=623), Member("g2", step=623))
    assert {m.replica_id: m.step for m in quorum.members} == {"g0": 622, "g1": 623, "g2": 623}
    assert quorum.redone_by_others == (("g0", 623, 622),)
