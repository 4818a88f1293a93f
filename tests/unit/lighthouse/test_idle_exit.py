"""``--exit-when-idle``: a job's lighthouse ends once no group was seen for a while after its first quorum."""

from __future__ import annotations

import dataclasses

import pytest

from lighthouse.idle_exit import IdleExit
from lighthouse.view import LighthouseStatistics

_ZERO = {f.name: 0 for f in dataclasses.fields(LighthouseStatistics) if f.type in ("int", int)}


def stats(*, quorums: int = 1, leases: int = 0, heartbeating: int = 0) -> LighthouseStatistics:
    values = dict(_ZERO, quorum_age=None, status="waiting", reason="", last_formation_seconds=None, uptime=0.0)
    values.update(quorums_issued=quorums, leases_held=leases, heartbeating_replicas=heartbeating)
    return LighthouseStatistics(**values)


def test_a_lighthouse_that_never_issued_a_quorum_waits_for_its_job_however_long():
    rule = IdleExit(5.0)
    assert not rule.observe(stats(quorums=0), 0.0)
    assert not rule.observe(stats(quorums=0), 1000.0)


def test_it_exits_after_the_idle_time_and_a_group_that_comes_back_resets_the_count():
    rule = IdleExit(5.0)
    assert not rule.observe(stats(leases=2, heartbeating=2), 0.0)
    assert not rule.observe(stats(), 10.0)       # every group gone: idle from here
    assert not rule.observe(stats(), 14.0)
    assert not rule.observe(stats(heartbeating=1), 14.5)  # a restarted group heartbeats again
    assert not rule.observe(stats(), 15.0)
    assert not rule.observe(stats(), 19.9)
    assert rule.observe(stats(), 20.0)


def test_a_lease_alone_keeps_it_busy():
    rule = IdleExit(1.0)
    assert not rule.observe(stats(leases=1), 0.0)
    assert not rule.observe(stats(leases=1), 100.0)


@pytest.mark.parametrize("seconds", [0.0, -1.0])
def test_the_idle_time_must_be_positive(seconds):
    with pytest.raises(ValueError, match="--exit-when-idle"):
        IdleExit(seconds)
