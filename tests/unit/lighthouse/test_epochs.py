"""The stale-quorum guard's way out (holders, new epochs) and the fence after one, with literal timestamps."""

import json

import pytest

from lighthouse.epochs import MAX_FENCED, StaleReplica, group_of, resumed_from_of
from lighthouse.quorum import Member, QuorumState, Status
from tests.unit.helpers import issue, quorum_state


def beat(s: QuorumState, now: float, *replica_ids: str) -> None:
    """The background heartbeats of waiting replicas (their managers send them every fraction of a second)."""
    for replica_id in replica_ids:
        s.heartbeat(replica_id, now)


def blocked(s: QuorumState, now: float):
    decision, _ = s.decide(now)
    assert decision.status is Status.BEHIND_COMMITTED and decision.quorum is None, decision.reason
    assert decision.epoch is None and s.epoch is None
    return decision


def finished_job(**kw) -> QuorumState:
    """An earlier job reached step 300 with quorum 1 at t=0, then went away (no more heartbeats)."""
    s = quorum_state(join_timeout=0.0, **kw)
    s.join(Member("old-a", step=300), 0.0)
    s.join(Member("old-b", step=300), 0.0)
    assert issue(s, 0.0).quorum.quorum_id == 1
    assert s.epochs.holders == {"old-a", "old-b"} and s.epochs.holders_seen_at == 0.0
    return s


class TestHolderTimeout:
    def test_a_following_job_at_step_0_waits_out_the_holder_timeout_then_starts_an_epoch(self):
        s = finished_job()
        s.join(Member("new-a", step=0), 10.0)
        decision = blocked(s, 10.0)
        assert "no participant holds step 300" in decision.reason
        assert "in 20.0s unless one comes back" in decision.reason
        assert decision.wake_at == 30.0
        s.join(Member("new-b", step=0), 29.9)
        beat(s, 29.9, "new-a")
        blocked(s, 29.9)

        beat(s, 30.0, "new-a", "new-b")
        decision = issue(s, 30.0)
        epoch = decision.epoch
        assert (epoch.number, epoch.started_at, epoch.from_step, epoch.to_step) == (1, 30.0, 300, 0)
        assert "no holder of step 300 seen for 30.0s" in epoch.reason
        assert decision.quorum.replica_ids == ("new-a", "new-b") and decision.quorum.quorum_id == 2
        assert s.max_step == 0 and s.epoch is epoch
        # the job goes on: steps advance from 0, nothing is guarded against the old 300 any more
        s.join(Member("new-a", step=1), 31.0)
        s.join(Member("new-b", step=1), 31.0)
        assert issue(s, 31.0).quorum.quorum_id == 2 and s.max_step == 1

    def test_a_holder_that_keeps_heartbeating_keeps_the_guard_up(self):
        s = finished_job()
        s.join(Member("new", step=0), 1.0)
        for t in range(1, 101):
            s.heartbeat("old-a", float(t))  # alive, just not joining (say, stuck before its next step)
            beat(s, float(t), "new")
            decision = blocked(s, float(t))
        assert decision.wake_at == 130.0
        beat(s, 129.9, "new")
        blocked(s, 129.9)  # its heartbeat expired at 105, but a holder was seen 29.9 s ago
        beat(s, 130.0, "new")
        assert issue(s, 130.0).epoch.to_step == 0

    def test_a_holder_that_joins_again_lifts_the_guard_the_normal_way(self):
        s = finished_job()
        s.join(Member("new", step=0), 10.0)
        blocked(s, 10.0)
        beat(s, 29.0, "new")
        s.join(Member("old-b", step=301), 29.0)
        decision = issue(s, 29.0)
        assert decision.epoch is None and decision.quorum.replica_ids == ("new", "old-b") and s.max_step == 301

    def test_a_restart_that_restored_the_step_knows_no_holders_and_counts_from_its_start(self):
        s = quorum_state(join_timeout=0.0, started_at=100.0, max_step=300, last_quorum_id=17,
                         restart_evidence="its state dir holds quorum id 17")
        assert s.epochs.holders == frozenset() and s.epochs.holders_seen_at == 100.0
        s.join(Member("fresh", step=0), 101.0)
        decision = blocked(s, 101.0)
        assert "seen in the 1.0s since the lighthouse started" in decision.reason and decision.wake_at == 130.0
        beat(s, 130.0, "fresh")
        decision = issue(s, 130.0)
        assert decision.epoch.from_step == 300 and decision.quorum.quorum_id == 18
        assert "no holder of step 300 seen in the 30.0s since the lighthouse started" in decision.epoch.reason

    def test_never_while_a_holder_may_still_be_healthy(self):
        s = finished_job(holder_timeout=1.0, heartbeat_timeout=5.0)
        s.join(Member("new", step=0), 2.0)
        assert blocked(s, 2.0).wake_at == 5.0  # the holders' heartbeats from t=0 count until t=5
        beat(s, 5.0, "new")
        assert issue(s, 5.0).epoch is not None

    def test_below_min_replicas_no_epoch_starts(self):
        s = finished_job(min_replicas=2)
        s.join(Member("new", step=0), 100.0)
        decision, _ = s.decide(100.0)
        assert decision.status is Status.BELOW_MIN_REPLICAS and s.epoch is None and s.max_step == 300

    def test_the_epochs_first_quorum_gets_a_new_id_even_with_the_previous_members(self):
        s = quorum_state(join_timeout=0.0)
        s.join(Member("a", step=300), 0.0)
        s.join(Member("b", step=250), 0.0)
        assert issue(s, 0.0).quorum.quorum_id == 1
        s.forget("a")  # the only holder dies
        s.join(Member("b", step=250), 1.0)
        beat(s, 30.0, "b", "c")  # healthy, not joining: the split-brain guard holds the epoch's first quorum
        decision, _ = s.decide(30.0)
        assert decision.epoch is not None and decision.status is Status.SPLIT_BRAIN_GUARD and s.max_step == 250
        s.join(Member("a", step=200), 31.0)  # back with the same id, from an older checkpoint
        decision = issue(s, 31.0)
        assert decision.status is Status.FAST_QUORUM and decision.quorum.replica_ids == ("a", "b")
        assert decision.quorum.quorum_id == 2, "a new epoch must never reuse the previous quorum id"


def restarted_groups_job(**kw) -> QuorumState:
    """Replica groups g0 and g1 reached step 300 with quorum 1 at t=0 (ids as Managers name them,
    ``<group>:<process>``), then went away."""
    s = quorum_state(join_timeout=0.0, **kw)
    s.join(Member("g0:old", step=300), 0.0)
    s.join(Member("g1:old", step=300), 0.0)
    assert issue(s, 0.0).quorum.quorum_id == 1
    return s


class TestResumedFromACheckpoint:
    def test_all_holders_restarted_and_resumed_start_an_epoch_once_no_holder_is_healthy(self):
        s = restarted_groups_job()
        s.join(Member("g0:new", step=120, resumed_from=120), 4.0)
        s.join(Member("g1:new", step=120, resumed_from=120), 4.0)
        decision = blocked(s, 4.9)  # a holder was seen 4.9 s ago: it may still be healthy
        assert decision.wake_at == 5.0 and "as every participant resumed from a checkpoint" in decision.reason
        decision = issue(s, 5.0)
        assert (decision.epoch.from_step, decision.epoch.to_step) == (300, 120)
        assert "every participant resumed from a durable checkpoint" in decision.epoch.reason
        assert "every holder's replica group restarted" in decision.epoch.reason
        assert decision.quorum.replica_ids == ("g0:new", "g1:new") and s.max_step == 120

    def test_not_while_a_holder_is_healthy(self):
        s = restarted_groups_job()
        s.heartbeat("g0:old", 10.0)
        s.join(Member("g0:new", step=120, resumed_from=120), 11.0)
        s.join(Member("g1:new", step=120, resumed_from=120), 11.0)
        blocked(s, 11.0)
        blocked(s, 14.9)
        assert issue(s, 15.0).epoch is not None  # g0:old's heartbeat is 5 s old

    def test_not_while_a_holders_group_has_not_restarted(self):
        """g1's holder stopped heartbeating but its group never came back under a new id: it may be hung
        (SIGSTOP, a stuck collective) or cut off, still holding step 300, so only the holder timeout lifts
        the guard. This is how a restarted group and a hung holder once rewound a job by 8 steps."""
        s = restarted_groups_job()
        s.join(Member("g0:new", step=120, resumed_from=120), 4.0)
        s.join(Member("g2:new", step=120, resumed_from=120), 4.0)
        decision = blocked(s, 5.0)
        assert decision.wake_at == 30.0 and "not every holder's replica group restarted" in decision.reason
        beat(s, 29.9, "g0:new", "g2:new")
        blocked(s, 29.9)
        beat(s, 30.0, "g0:new", "g2:new")
        assert "holder timeout" in issue(s, 30.0).epoch.reason

    def test_holders_whose_ids_name_no_group_wait_for_the_holder_timeout(self):
        s = finished_job()  # holders "old-a" and "old-b": nothing tells whether they restarted
        s.join(Member("old-a:2", step=120, resumed_from=120), 4.0)
        s.join(Member("old-b:2", step=120, resumed_from=120), 4.0)
        assert blocked(s, 5.0).wake_at == 30.0

    def test_a_lighthouse_that_knows_no_holders_needs_no_restarted_group(self):
        # restored from its state dir: the step, not who holds it
        s = quorum_state(join_timeout=0.0, max_step=300, started_at=0.0)
        s.join(Member("a", step=120, resumed_from=120), 1.0)
        blocked(s, 4.9)
        assert issue(s, 5.0).epoch.to_step == 120

    @pytest.mark.parametrize("second", [Member("g1:new", step=120), Member("g1:new", step=121, resumed_from=120)],
                             ids=["says-nothing", "committed-since"])
    def test_not_when_only_some_participants_resumed(self, second):
        s = restarted_groups_job()
        s.join(Member("g0:new", step=120, resumed_from=120), 10.0)
        s.join(second, 10.0)
        blocked(s, 10.0)
        beat(s, 29.9, "g0:new", "g1:new")
        blocked(s, 29.9)
        beat(s, 30.0, "g0:new", "g1:new")
        assert issue(s, 30.0).epoch.to_step == second.step  # the holder timeout still lifts it


@pytest.mark.parametrize(("replica_id", "group"), [("train_ddp_1:3f2a", "train_ddp_1"), ("a:b:c", "a:b"),
                                                   ("3f2a", None), (":3f2a", None), ("", None)])
def test_the_group_of_a_replica_id_is_what_precedes_its_last_colon(replica_id, group):
    assert group_of(replica_id) == group


class TestOperatorRequest:
    def test_a_request_starts_an_epoch_at_once_when_the_guard_blocks(self):
        s = finished_job()
        s.join(Member("new", step=7), 10.0)
        blocked(s, 10.0)
        s.request_epoch("an operator asked for it (test)")
        decision = issue(s, 10.0)
        assert decision.epoch.reason == "an operator asked for it (test)" and decision.epoch.to_step == 7

    def test_a_request_counts_for_the_next_decision_only(self):
        s = finished_job()
        s.request_epoch("an operator asked for it (too early)")
        decision, _ = s.decide(1.0)  # nothing blocked: the request is dropped
        assert decision.status is Status.NO_PARTICIPANTS
        s.join(Member("new", step=0), 2.0)
        blocked(s, 2.0)


class TestFence:
    def after_epoch(self) -> QuorumState:
        s = finished_job()
        s.join(Member("new-a", step=0), 40.0)
        s.join(Member("new-b", step=0), 40.0)
        assert issue(s, 40.0).epoch is not None
        return s

    def test_a_holder_from_before_the_epoch_is_refused_and_its_heartbeats_ignored(self):
        s = self.after_epoch()
        refused = r"'old-a' is from before the job's current epoch \(number 1 since this lighthouse started.*: it reports step 300, above step 0"
        with pytest.raises(StaleReplica, match=refused) as info:
            s.join(Member("old-a", step=300), 41.0)
        assert "must restart" in str(info.value) and info.value.epoch is s.epoch
        assert s.epochs.is_fenced("old-a") and not s.is_heartbeating("old-a") and s.num_participants == 0
        s.heartbeat("old-a", 41.5)
        assert not s.is_heartbeating("old-a") and s.num_heartbeating == 2
        # restarted from a checkpoint (same id, a step the epoch has reached): accepted again
        s.join(Member("old-a", step=0), 42.0)
        assert not s.epochs.is_fenced("old-a") and s.is_heartbeating("old-a")

    def test_a_new_process_resumed_from_a_checkpoint_committed_in_this_epoch_is_admitted_above_max_step(self):
        s = self.after_epoch()  # its first quorum is id 2, at step 0
        first = s.epoch.first_quorum_id
        assert first == s.quorum_id == 2
        # the job committed step 0 -> 1 under quorum 2, a group saved step 1 as it left, and the whole job was
        # killed: every new process resumes from step 1, above max_step 0, and was in no quorum since
        s.join(Member("next-a", step=1, resumed_from=1, resumed_quorum=first), 41.0)
        s.join(Member("next-b", step=1, resumed_from=1, resumed_quorum=first + 5), 41.0)
        assert s.num_participants == 2
        # a checkpoint of the lineage from before the epoch, or one whose manifest names no quorum: refused
        with pytest.raises(StaleReplica):
            s.join(Member("next-c", step=1, resumed_from=1, resumed_quorum=first - 1), 41.0)
        with pytest.raises(StaleReplica):
            s.join(Member("next-d", step=1, resumed_from=1), 41.0)
        with pytest.raises(StaleReplica):  # it committed since it resumed: its claim is no longer the checkpoint's
            s.join(Member("next-e", step=2, resumed_from=1, resumed_quorum=first), 41.0)

    def test_members_of_the_new_epoch_that_committed_are_not_refused(self):
        s = self.after_epoch()
        s.join(Member("new-a", step=1), 41.0)  # committed step 0 -> 1, above max_step 0
        s.join(Member("new-b", step=1), 41.0)
        assert issue(s, 41.0).quorum.replica_ids == ("new-a", "new-b")
        # all of them expire (a network blip) and come back one step on: still members of the last quorum
        s.expire(100.0)
        s.join(Member("new-a", step=2), 100.0)
        s.join(Member("new-b", step=2), 100.0)
        assert issue(s, 100.0).quorum.replica_ids == ("new-a", "new-b")

    def test_the_admitted_ids_are_kept_only_while_heartbeating_or_in_the_last_quorum(self):
        s = self.after_epoch()
        assert s.epochs.is_admitted("new-b")
        s.forget("new-b")  # still a member of the last quorum: kept
        assert s.epochs.is_admitted("new-b")
        s.join(Member("new-a", step=1), 41.0)
        issue(s, 41.0)  # a quorum without new-b, which is not heartbeating: dropped
        assert not s.epochs.is_admitted("new-b")
        with pytest.raises(StaleReplica):
            s.join(Member("new-b", step=2), 42.0)

    def test_a_waiting_replica_above_the_new_step_is_dropped_when_the_epoch_starts(self):
        s = quorum_state(join_timeout=0.0)
        s.join(Member("h1", step=300), 0.0)
        s.join(Member("h2", step=300), 0.0)
        issue(s, 0.0)
        s.join(Member("h1", step=301), 1.0)  # committed; waits for h2 (not a fast quorum without it)
        s.decide(7.0)  # both heartbeats expire; h1's call is still waiting
        s.join(Member("n", step=0), 20.0)
        blocked(s, 20.0)
        beat(s, 31.0, "n")
        decision = issue(s, 31.0)  # h1 was last seen at 1.0
        assert [m.replica_id for m in decision.fenced] == ["h1"] and decision.quorum.replica_ids == ("n",)
        assert s.epochs.is_fenced("h1") and "h1" not in {m.replica_id for m, _ in s.participants()}

    def test_no_fence_without_an_epoch_in_this_process(self):
        s = quorum_state(join_timeout=0.0, started_at=0.0, max_step=10)
        s.join(Member("a", step=500), 1.0)
        assert issue(s, 1.0).quorum.replica_ids == ("a",)

    def test_the_fenced_ids_are_bounded(self):
        s = self.after_epoch()
        for i in range(MAX_FENCED + 1):
            with pytest.raises(StaleReplica):
                s.join(Member(f"old-{i}", step=300), 41.0)
        assert not s.epochs.is_fenced("old-0") and s.epochs.is_fenced(f"old-{MAX_FENCED}")
        s.heartbeat("old-0", 42.0)  # its heartbeats count again; its Quorum calls are still refused
        assert s.is_heartbeating("old-0")
        with pytest.raises(StaleReplica):
            s.join(Member("old-0", step=300), 42.0)


class TestCounters:
    def test_the_incremental_counters_match_a_recount_after_an_epoch(self):
        s = finished_job()
        s.join(Member("a", step=50), 31.0)
        s.join(Member("b", step=20, resumed_from=20), 31.0)
        s.heartbeat("c", 31.0)
        s.heartbeat("d", 31.0)  # split-brain guard: 2 of 4 healthy is not more than half
        decision, _ = s.decide(31.0)
        assert decision.epoch.to_step == 50 and decision.status is Status.SPLIT_BRAIN_GUARD
        assert (s._healthy_participants, s._healthy_up_to_date, s._healthy_resumed) == (2, 1, 1)
        with pytest.raises(StaleReplica):  # above max_step, never admitted: refused
            s.join(Member("c", step=60), 32.0)
        assert (s._healthy_participants, s._healthy_up_to_date, s._healthy_resumed) == (2, 1, 1)
        s.join(Member("c", step=40), 32.0)
        assert (s._healthy_participants, s._healthy_up_to_date, s._healthy_resumed) == (3, 1, 1)
        assert issue(s, 32.0).quorum.replica_ids == ("a", "b", "c")


@pytest.mark.parametrize("data, expected", [
    ('{"resumed_from": 120}', 120),
    ('{"heal_sources": 2, "resumed_from": 0}', 0),
    (json.dumps({"resumed_from": 2**63 - 1}), 2**63 - 1),
    ("", None),
    ("not json", None),
    ("[1, 2]", None),
    ('"resumed_from"', None),
    ("120", None),
    ("null", None),
    ('{"heal_sources": 2}', None),
    ('{"resumed_from": -1}', None),
    ('{"resumed_from": true}', None),
    ('{"resumed_from": false}', None),
    ('{"resumed_from": 12.0}', None),
    ('{"resumed_from": "12"}', None),
    ('{"resumed_from": null}', None),
    ('{"resumed_from": [12]}', None),
    ('{"resumed_from": {"step": 12}}', None),
    ('{"resumed_from": NaN}', None),
    ('{"resumed_from": Infinity}', None),
    (json.dumps({"resumed_from": 2**63}), None),
    ('{"resumed_from": ' + "9" * 5000 + "}", None),  # past Python's int-parsing digit limit
    ('{"resumed_from": 1' + "0" * 4000 + "}", None),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, None),  # nested past the recursion limit
    ("[" * 100_000, None),
    ('{"resumed_from": 5, "resumed_from": -5}', None),  # the last duplicate wins, as in JSON.parse
    ("\x00\xff\ud800", None),
    ('{"resumed_from": 7}  trailing', None),
])
def test_resumed_from_is_an_int64_step_or_none_and_garbage_never_raises(data, expected):
    assert resumed_from_of(data) == expected
