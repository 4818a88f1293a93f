"""StragglerQuorumState: the quorum rules with straggler flags and opt-in eviction, on literal times."""

from __future__ import annotations

import logging

import pytest

from lighthouse.quorum import Member, QuorumConfig
from lighthouse.stragglers.rules import StragglerQuorumState
from lighthouse.stragglers.scores import ComputeSample, StragglerConfig

FAST, SLOW = 100.0, 500.0


class Job:
    """Replica groups that join each round at the same step, advertising their compute time of the last one."""

    def __init__(self, min_replicas=1, evict=True, patience=3, heartbeat_timeout=5.0) -> None:
        self.state = StragglerQuorumState(
            QuorumConfig(min_replicas, join_timeout=10.0, heartbeat_timeout=heartbeat_timeout),
            StragglerConfig(threshold=2.0, patience=patience, evict=evict))
        self.now = 0.0
        self.step = 0

    def round(self, times: dict[str, float | None]) -> tuple[str, ...] | None:
        """Everyone in ``times`` joins (a compute time of None: no sample); returns the quorum issued, if any."""
        self.now += 1.0
        self.step += 1
        for rid, ms in times.items():
            compute = None if ms is None else ComputeSample(ms, self.step)
            self.state.join(Member(rid, step=self.step, compute=compute), self.now)
        decision, _ = self.state.decide(self.now)
        return None if decision.quorum is None else decision.quorum.replica_ids

    def rounds_until(self, predicate, times, limit=20) -> int:
        for n in range(1, limit + 1):
            self.round(times)
            if predicate():
                return n
        pytest.fail(f"not within {limit} rounds")


def test_a_flagged_group_is_left_out_then_readmitted_after_the_cooldown_and_heals(caplog):
    job = Job()
    caplog.set_level(logging.INFO, logger="lighthouse.stragglers.rules")
    for _ in range(3):
        assert job.round({"a": FAST, "b": FAST, "x": FAST}) == ("a", "b", "x")
    slow = {"a": FAST, "b": FAST, "x": SLOW}
    assert job.rounds_until(lambda: job.state.is_evicted("x"), slow) == 4  # patience + 1 slow quorums
    assert "straggler x flagged" in caplog.text and "evicting straggler x" in caplog.text
    x_step = job.step + 1
    # Left out: the others get their quorum at once (no join timeout waited for x), x's call waits.
    assert job.round(slow) == ("a", "b")
    assert job.state.is_heartbeating("x") and job.state.is_healthy("x", job.now)
    decision = job.state.evaluate(job.now)
    assert "left out as stragglers: x (readmitted after 2 more quorums)" in decision.reason
    assert job.round({"a": FAST, "b": FAST}) == ("a", "b")  # x still waits in its first call
    job.state.heartbeat("x", job.now)
    assert job.round({"a": FAST, "b": FAST}) == ("a", "b")  # the cooldown's 3rd quorum: x readmitted
    assert "readmitting straggler x on probation" in caplog.text
    # Its waiting call is joined: the next quorum has it again, behind (it heals).
    assert job.round({"a": FAST, "b": FAST}) == ("a", "b", "x")
    members = {m.replica_id: m for m in job.state.previous_quorum.members}
    assert members["x"].step == x_step < members["a"].step
    stats = job.state.straggler_statistics()
    assert (stats.evictions, stats.readmissions, dict(stats.evicted)) == (1, 1, {})


def test_without_eviction_a_flagged_group_is_only_reported(caplog):
    job = Job(evict=False)
    caplog.set_level(logging.WARNING, logger="lighthouse.stragglers.rules")
    for _ in range(10):
        assert job.round({"a": FAST, "b": FAST, "x": SLOW}) == ("a", "b", "x")
    assert job.state.stragglers.is_flagged("x") and not job.state.is_evicted("x")
    assert "only reported" in caplog.text
    assert job.state.straggler_statistics().evictions == 0


def test_two_groups_never_evict_and_min_replicas_is_respected(caplog):
    caplog.set_level(logging.WARNING, logger="lighthouse.stragglers.rules")
    job = Job(patience=1)
    for _ in range(8):
        assert job.round({"a": FAST, "x": 900.0}) == ("a", "x")  # 2 groups: the relative score stays below 2
    job = Job(min_replicas=3, patience=1)
    for _ in range(8):
        assert job.round({"a": FAST, "b": FAST, "x": SLOW}) == ("a", "b", "x")
    assert job.state.stragglers.is_flagged("x")
    kept = job.state.straggler_statistics().kept_in
    assert "below min_replicas=3" in kept["x"]
    assert caplog.text.count("stays in the quorum") == 1  # once per reason, not every quorum


def test_never_more_than_a_minority_is_left_out(caplog):
    caplog.set_level(logging.WARNING, logger="lighthouse.stragglers.rules")
    job = Job(patience=1)
    times = {"a": FAST, "b": FAST, "c": FAST, "x": SLOW, "y": SLOW}
    most = 0
    for _ in range(8):
        job.round(times)
        most = max(most, len(job.state.straggler_statistics().evicted))
    assert most == 2  # 2 of 5 at once: the 3 left are a majority
    # x is evicted again and again (1, 2, 4, 8 quorums); while it is out for 8, y turns slow too.
    job = Job(patience=1)
    times = {"a": FAST, "b": FAST, "x": SLOW, "y": FAST}
    while job.state.straggler_statistics().evictions < 4:
        job.round(times)
    times["y"] = SLOW
    for _ in range(3):
        job.round(times)
    assert job.state.is_evicted("x") and job.state.stragglers.is_flagged("y") and not job.state.is_evicted("y")
    assert "leave 2 of 4 healthy groups in, not a strict majority" in job.state.straggler_statistics().kept_in["y"]
    assert "straggler y is flagged but stays in the quorum" in caplog.text


def test_the_evicted_are_readmitted_when_a_remaining_group_dies():
    job = Job(heartbeat_timeout=5.0, patience=3)
    for _ in range(10):
        job.round({"a": FAST, "b": FAST, "x": SLOW})
        if job.state.is_evicted("x"):
            break
    assert job.state.is_evicted("x")
    assert job.round({"a": FAST, "b": FAST, "x": SLOW}) == ("a", "b")
    # b dies (its lease ends): a alone is not a majority of a and x, so x is readmitted at once.
    assert job.state.forget("b")
    decision, _ = job.state.decide(job.now)
    assert not job.state.is_evicted("x")
    assert job.round({"a": FAST}) == ("a", "x")


def test_an_evicted_group_that_stops_heartbeating_is_forgotten_with_its_scores():
    job = Job(heartbeat_timeout=5.0, patience=3)
    job.rounds_until(lambda: job.state.is_evicted("x"), {"a": FAST, "b": FAST, "x": SLOW})
    job.state.leave("x")  # its call was cancelled
    for _ in range(2):  # heartbeats keep it alive past the timeout (the cooldown is 3 quorums)
        job.now += 3.0
        job.state.heartbeat("x", job.now)
        job.round({"a": FAST, "b": FAST})
    assert job.state.is_heartbeating("x") and job.state.stragglers.scores("x") is not None
    job.now += 6.0
    decision, expired = job.state.decide(job.now)
    assert "x" in expired and "x" not in job.state.straggler_statistics().evicted
    assert job.state.stragglers.scores("x") is None and not job.state.is_heartbeating("x")


def test_a_lease_that_ends_forgets_an_evicted_group():
    job = Job(patience=1)
    job.rounds_until(lambda: job.state.is_evicted("x"), {"a": FAST, "b": FAST, "x": SLOW})
    assert job.state.forget("x") is True
    assert job.state.stragglers.scores("x") is None and not job.state.is_evicted("x")
    assert job.state.forget("x") is False


def test_a_group_still_slow_after_readmission_is_evicted_again_for_twice_as_long():
    job = Job(patience=1)
    slow = {"a": FAST, "b": FAST, "x": SLOW}
    cooldowns = []
    for _ in range(40):
        was = job.state.is_evicted("x")
        job.round(slow)
        if job.state.is_evicted("x") and not was:
            cooldowns.append(job.state.straggler_statistics().evicted["x"])
    assert cooldowns[:3] == ["readmitted after 1 more quorum", "readmitted after 2 more quorums",
                             "readmitted after 4 more quorums"]


def test_a_readmitted_group_that_keeps_up_passes_its_probation(caplog):
    caplog.set_level(logging.INFO, logger="lighthouse.stragglers.rules")
    job = Job(patience=2)
    while not job.state.is_evicted("x"):
        job.round({"a": FAST, "b": FAST, "x": SLOW})
    while job.state.is_evicted("x"):
        job.round({"a": FAST, "b": FAST, "x": FAST})
    for _ in range(6):
        assert "x" in job.round({"a": FAST, "b": FAST, "x": FAST})
    assert "straggler x passed its probation" in caplog.text
    assert not job.state.stragglers.is_flagged("x")


def test_members_without_samples_and_garbage_samples_change_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="lighthouse.stragglers.rules")
    job = Job(patience=1)
    for _ in range(6):  # a torchft manager (no sample) among ours
        assert job.round({"a": FAST, "torchft": None, "b": FAST}) == ("a", "b", "torchft")
    assert job.state.stragglers.scores("torchft") is None
    for _ in range(3):
        assert job.state.sample_of("evil", '{"compute_ms": "NaN", "compute_step": 1}') is None
    assert job.state.sample_of("old", '{"resumed_from": 3}') is None
    assert job.state.straggler_statistics().refused_samples == 3
    assert caplog.text.count("ignored the compute time that replica evil advertises") == 1  # rate-limited


def test_the_flags_reach_the_config_and_bad_values_are_refused():
    from lighthouse.config import LighthouseConfig

    parser = LighthouseConfig.arg_parser()
    default = LighthouseConfig.from_args(parser.parse_args(["--min_replicas", "1"]), environ={})
    assert default.straggler_config() == StragglerConfig(threshold=2.0, patience=3, evict=False)
    config = LighthouseConfig.from_args(parser.parse_args(
        ["--min_replicas", "1", "--evict-stragglers", "--straggler-threshold", "3.5", "--straggler-patience", "5"]),
        environ={})
    assert config.straggler_config() == StragglerConfig(threshold=3.5, patience=5, evict=True)
    for argv in (["--straggler-threshold", "1.0"], ["--straggler-threshold", "nan"], ["--straggler-patience", "0"]):
        with pytest.raises(ValueError, match="straggler"):
            LighthouseConfig.from_args(parser.parse_args(["--min_replicas", "1", *argv]), environ={})
