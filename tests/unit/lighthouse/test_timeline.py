"""The timeline with literal times: what a job's kill, stall and heal leave in the history and the status line."""

from lighthouse.history import History
from lighthouse.quorum_data import Epoch, IssuedQuorum, Member, Status

from lighthouse.timeline import Timeline

READY = (Status.FAST_QUORUM, "fast quorum: all 2 members of quorum 1 rejoined, 2 participants")
IDLE = (Status.NO_PARTICIPANTS, "no participants; 2 healthy replicas heartbeating")
BELOW = (Status.BELOW_MIN_REPLICAS, "waiting: 1 eligible participant, need min_replicas=2")


def quorum(quorum_id: int, now: float, steps: dict[str, int], redone=()) -> IssuedQuorum:
    return IssuedQuorum(quorum_id, tuple(Member(rid, step=step) for rid, step in sorted(steps.items())), now,
                        tuple(redone))


def kinds(timeline: Timeline) -> list[str]:
    return [m.kind for m in timeline.history.markers()]


def train(timeline: Timeline, start: float, steps: range, members: tuple[str, ...], quorum_id: int = 1,
          every: float = 0.1) -> float:
    """Quorums every ``every`` seconds at ``steps``, with the rules' decisions between them; returns the last time."""
    now = start
    for step in steps:
        now = start + (step - steps.start) * every
        timeline.observe(now, *READY, healthy=len(members), participants=len(members))
        timeline.quorum_issued(quorum(quorum_id, now, {rid: step for rid in members}), now)
        timeline.observe(now + every / 2, *IDLE, healthy=len(members), participants=0)
    return now


def status(timeline: Timeline, now: float, decision=IDLE, heartbeat_age=None, joined=None, left_out=()):
    return timeline.status(now, *decision, heartbeat_age or {}, joined or {}, left_out)


def test_training_says_how_many_groups_at_which_step_and_how_fast():
    timeline = Timeline(0.0)
    line = status(timeline, 0.0)
    assert line.state == "idle" and not line.trouble
    last = train(timeline, 1.0, range(0, 100), ("a:1", "b:1"))
    line = status(timeline, last + 0.05, heartbeat_age={"a:1": 0.0, "b:1": 0.0})
    assert line.state == "training" and not line.trouble
    assert line.headline.startswith("training: 2 groups at step 99, ")
    assert 9.5 < line.steps_per_s < 10.5 and line.headline.endswith(f"{line.steps_per_s:.1f} steps/s")
    assert line.detail == IDLE[1]  # the quorum rules' reason, as they said it
    assert kinds(timeline) == []  # a steady job marks nothing
    samples = [s for _, s in timeline.history.samples()]
    assert [s.state for s in samples] == ["waiting"] + ["training"] * (len(samples) - 1)  # from its first quorum
    assert len(samples) >= 9 and samples[0].steps_per_s is None
    assert all(9.0 <= s.steps_per_s <= 11.0 for s in samples[2:])
    assert {s.quorum_size for s in samples[1:]} == {2}


def test_a_kill_a_stall_and_a_heal_leave_their_markers_and_the_status_line_follows():
    timeline = Timeline(0.0)
    last = train(timeline, 0.0, range(0, 50), ("a:1", "b:1"))
    killed = last + 0.1
    timeline.gone("b:1", "lease ended: its connection to the lighthouse closed", killed)
    timeline.observe(killed + 0.1, *BELOW, healthy=1, participants=1)
    line = status(timeline, killed + 0.5, BELOW, {"a:1": 0.1}, {"a:1": killed + 0.1})
    assert line.state == "training"  # half a second is no stall at 10 steps/s... yet
    stalled_at = killed + 2.9
    timeline.observe(stalled_at, *BELOW, healthy=1, participants=1)
    line = status(timeline, stalled_at, BELOW, {"a:1": 0.1}, {"a:1": killed + 0.1})
    assert line.state == "stalled" and line.trouble
    assert line.headline == ("stalled 3.0 s: 1 eligible participant, need min_replicas=2; b gone 2.9 s ago "
                             "(lease ended: its connection to the lighthouse closed)")
    assert line.since == last

    back = killed + 5.9  # b restarted as a new process: same group, new id, at step 0
    timeline.observe(back, *READY, healthy=2, participants=2)
    timeline.quorum_issued(quorum(2, back, {"a:1": 49, "b:2": 0}), back)
    line = status(timeline, back + 0.5, IDLE, {"a:1": 0.1, "b:2": 0.1})
    assert line.state == "healing" and not line.trouble
    assert line.headline == "healing b from a (49 steps behind, 0.5 s so far)"
    assert [h.replica_id for h in line.healing] == ["b:2"]
    timeline.observe(back + 1.2, *IDLE, healthy=2, participants=0)
    healed = back + 1.5
    timeline.quorum_issued(quorum(2, healed, {"a:1": 50, "b:2": 50}), healed)
    line = status(timeline, healed + 0.05, IDLE, {"a:1": 0.0, "b:2": 0.0})
    assert line.state == "training" and line.headline.startswith("training: 2 groups at step 50")

    assert kinds(timeline) == ["gone", "stall", "back", "stall", "heal"]
    gone, stall, came_back, stall_in_heal, heal = timeline.history.markers()
    assert (gone.kind, gone.replica_id, gone.t) == ("gone", "b:1", killed)
    assert gone.text == ("b gone: lease ended: its connection to the lighthouse closed (in quorum 1, at step 49)")
    assert stall.kind == "stall" and stall.t == last and stall.duration == back - last
    assert stall.text == ("6.0 s without a quorum after step 49; gone meanwhile: b; the quorum rules last said: "
                          "waiting: 1 eligible participant, need min_replicas=2")
    assert (came_back.kind, came_back.replica_id) == ("back", "b:2")
    assert came_back.text == ("b back in quorum 2 at step 0, 5.9 s after it was gone (lease ended: its connection "
                              "to the lighthouse closed)")
    assert (heal.kind, heal.t, heal.duration, heal.steps) == ("heal", back, 1.5, 49)
    assert heal.text == "b healed 49 steps from a in 1.5 s (quorum 2)"
    assert stall_in_heal.kind == "stall" and stall_in_heal.t == back  # the others waited for the heal
    stats = timeline.statistics(healed + 0.05)
    assert (stats.stalls, stats.heals, stats.groups_gone, stats.groups_back) == (2, 1, 1, 1)
    assert stats.heal_seconds == 1.5 and stats.state == "training"

    states = [s.state for _, s in timeline.history.samples()]
    assert states.index("stalled") < states.index("healing")
    assert {"training", "stalled", "healing"} <= set(states)


def test_waiting_for_stragglers_names_them_with_their_heartbeat_age():
    timeline = Timeline(0.0)
    last = train(timeline, 0.0, range(0, 20), ("a:1", "b:1", "c:1"))
    waiting = (Status.WAITING_FOR_STRAGGLERS, "waiting for 1 straggler, 55.9 s of join timeout left (2 of 3 "
               "healthy replicas joined)")
    now = last + 4.2
    timeline.observe(now, *waiting, healthy=3, participants=2)
    line = status(timeline, now, waiting, {"a:1": 0.1, "b:1": 3.1, "c:1": 0.2, "x:1": 0.3},
                  {"a:1": now - 4, "c:1": now - 4}, left_out={"x:1"})
    assert line.headline == "stalled 4.2 s: waiting for b (heartbeat 3.1 s old)"
    assert line.detail == waiting[1]


def test_nobody_asking_for_a_quorum_is_a_stall_while_groups_live_and_stopped_once_none_does():
    timeline = Timeline(0.0)
    last = train(timeline, 0.0, range(0, 20), ("a:1", "b:1"))
    line = status(timeline, last + 2.0, IDLE, {"a:1": 0.5, "b:1": 0.5})
    assert line.state == "stalled"
    assert line.headline == "stalled 2.0 s: no group asked for the next quorum after step 19"
    timeline.observe(last + 30.0, Status.NO_PARTICIPANTS, "no participants; 0 healthy replicas heartbeating", 0, 0)
    line = status(timeline, last + 30.0)
    assert line.state == "stopped" and not line.trouble
    assert line.headline == "stopped: no replica group is heartbeating; the last quorum (2 groups at step 19) was 30.0 s ago"


def test_slow_steps_are_not_stalls():
    timeline = Timeline(0.0)
    last = train(timeline, 0.0, range(0, 10), ("a:1", "b:1"), every=8.0)
    assert status(timeline, last + 20.0, IDLE, {"a:1": 1.0}).state == "training"  # under 3 x 8 s
    assert kinds(timeline) == []
    assert status(timeline, last + 25.0, IDLE, {"a:1": 1.0}).state == "stalled"


def test_the_first_quorum_waits_and_a_new_job_is_no_stall_of_the_old_one():
    timeline = Timeline(0.0)
    timeline.observe(1.0, *BELOW, healthy=1, participants=1)
    line = status(timeline, 3.0, BELOW, {"a:1": 0.1}, {"a:1": 1.0})
    assert line.state == "waiting" and line.trouble
    assert line.headline == "starting: waiting 2.0 s for the first quorum: 1 eligible participant, need min_replicas=2"
    last = train(timeline, 4.0, range(0, 10), ("a:1", "b:1"))
    timeline.quorum_issued(quorum(9, last + 600.0, {"c:1": 0, "d:1": 0}), last + 600.0)
    assert "stall" not in kinds(timeline)  # other groups: another job, not a stall of this one
    assert kinds(timeline).count("joined") == 2


def test_a_heal_that_does_not_finish_is_marked_as_such():
    timeline = Timeline(0.0)
    timeline.quorum_issued(quorum(1, 1.0, {"a:1": 10, "b:1": 0}), 1.0)
    timeline.gone("b:1", "no heartbeat for 5.0s", 2.0)
    assert status(timeline, 2.0).state != "healing"
    timeline.quorum_issued(quorum(1, 3.0, {"a:1": 10, "c:1": 0}), 3.0)
    timeline.quorum_issued(quorum(2, 4.0, {"a:1": 11}), 4.0)
    failed = [m for m in timeline.history.markers() if m.kind == "heal_failed"]
    assert [(m.replica_id, m.t, m.duration, m.steps) for m in failed] == [("b:1", 1.0, 1.0, 10), ("c:1", 3.0, 1.0, 10)]
    assert failed[0].text == "b went while healing from a (no heartbeat for 5.0s)"
    assert failed[1].text == "c's heal from a did not finish: it is not in quorum 2"
    assert timeline.statistics(4.0).heals_failed == 2


def test_epochs_rewinds_evictions_and_a_restart_are_marked():
    timeline = Timeline(0.0, restart_evidence="its state dir holds quorum id 17")
    last = train(timeline, 1.0, range(300, 320), ("a:1",))
    timeline.epoch_started(Epoch(1, last + 1.0, 319, 0, "every replica resumed from a checkpoint"))
    timeline.quorum_issued(quorum(20, last + 1.0, {"a:2": 0, "b:2": 0}), last + 1.0)
    timeline.quorum_issued(quorum(21, last + 2.0, {"a:2": 1, "b:2": 1, "c:1": 1}, redone=[("c:1", 2, 1)]),
                           last + 2.0)
    timeline.left_out({"c:1": "readmitted after 3 more quorums"}, last + 3.0)
    timeline.left_out({}, last + 4.0)
    markers = {m.kind: m for m in timeline.history.markers()}
    assert markers["restart"].text.startswith("lighthouse restarted (its state dir holds quorum id 17)")
    assert markers["epoch"].steps == 319 and "from 319 to 0 because every replica resumed" in markers["epoch"].text
    assert markers["rewind"].text.startswith("c reported step 2, from a lineage the job did not keep")
    assert markers["evicted"].text == "c left out of the next quorums as a straggler; readmitted after 3 more quorums"
    assert markers["readmitted"].text == "c no longer left out as a straggler"
    assert timeline.steps_per_s(last + 2.0) is not None  # the rate starts again after the epoch


def test_samples_fold_a_second_and_keep_its_worst():
    timeline = Timeline(0.0, history=History(capacity=8))
    timeline.quorum_issued(quorum(1, 0.1, {"a:1": 0, "b:1": 0}), 0.1)
    timeline.observe(0.2, *IDLE, healthy=2, participants=0)
    timeline.quorum_issued(quorum(2, 0.3, {"a:1": 1}), 0.3)
    timeline.observe(0.4, *BELOW, healthy=1, participants=1)
    timeline.quorum_issued(quorum(3, 0.5, {"a:1": 2, "b:2": 0}), 0.5)
    timeline.observe(1.0, *IDLE, healthy=2, participants=0)
    (_, first), = timeline.history.samples()
    assert (first.quorums, first.quorum_size, first.healthy, first.participants) == (3, 1, 1, 1)
    assert first.step == 2 and first.state == "healing"
