"""The commit fence: literal times, no network (torchft_lite.group_server.lease_fence)."""

from __future__ import annotations

import pytest

from torchft_lite.group_server.lease_fence import CLOCK_RATE_BOUND, EVENT_ALLOWANCE, LeaseFence, margin

T = 2.0  # the lighthouse's heartbeat timeout in these tests
M = margin(T)


def leased(at: float = 10.0) -> LeaseFence:
    """A fence with heartbeats answered every 0.1 s up to ``at`` and a quorum answered at ``at``."""
    fence = LeaseFence()
    for i in range(10):  # the last one sent at at - 0.1
        fence.answered(at - 1.0 + 0.1 * i, at - 0.99 + 0.1 * i, T)
    fence.quorum_answered(at - 0.05, at)
    return fence


def test_margin_is_the_clock_bound_plus_the_event_allowance_and_never_half_the_lease():
    assert margin(5.0) == pytest.approx(CLOCK_RATE_BOUND * 5.0 + EVENT_ALLOWANCE)
    assert margin(0.2) == pytest.approx(0.1)


def test_a_fresh_fence_refuses_until_a_quorum_is_answered():
    fence = LeaseFence()
    assert "no quorum" in fence.refusal(0.0)
    fence.answered(0.0, 0.01, T)
    assert "no quorum" in fence.refusal(0.02)


def test_steady_heartbeats_let_the_step_commit():
    fence = leased()
    for i in range(1, 20):  # heartbeats go on during the step
        fence.answered(10.0 + 0.1 * i, 10.01 + 0.1 * i, T)
    assert fence.refusal(12.0) is None
    assert fence.statistics().refusals == 0


def test_a_group_stopped_past_the_lease_refuses_whatever_it_hears_first():
    # Stopped (SIGSTOP) at 10.05 with a heartbeat in flight; woken at 15.
    vote_first = leased()
    assert "not proven to hold" in vote_first.refusal(15.0)

    heartbeat_first = leased()
    heartbeat_first.answered(10.05, 15.0, T)  # the answer to the heartbeat sent before the stop
    heartbeat_first.answered(15.0, 15.01, T)  # and a fresh one
    why = heartbeat_first.refusal(15.02)
    assert why is not None and "may have lapsed since the step's quorum" in why
    assert heartbeat_first.statistics().holes >= 1


def test_a_stop_shorter_than_the_lease_less_the_margin_is_no_lapse():
    fence = leased()
    fence.answered(10.05, 10.05 + T - M - 0.2, T)  # late, but within the bound of the previous proof
    assert fence.refusal(10.05 + T - M - 0.15) is None


def test_the_lease_runs_from_when_the_call_was_sent_not_when_it_was_answered():
    fence = leased()
    last_sent = 9.95  # the quorum call, after the last heartbeat
    assert fence.refusal(last_sent + T - M - 0.01) is None
    assert fence.refusal(last_sent + T - M + 0.01) is not None


def test_a_hole_before_the_quorum_does_not_count_one_after_does_until_the_next_quorum():
    fence = LeaseFence()
    fence.answered(0.0, 0.01, T)
    fence.answered(5.0, 5.01, T)  # a hole: nothing proved the lease between 1.74 and 5.01
    fence.quorum_answered(5.0, 5.02)
    assert fence.refusal(5.5) is None
    fence.answered(5.1, 9.0, T)  # an answer long after the bound: a lapse was possible after the quorum
    fence.answered(9.0, 9.01, T)
    assert fence.refusal(9.02) is not None
    fence.quorum_answered(9.05, 9.1)  # the next step's quorum has the group again
    assert fence.refusal(9.2) is None


def test_a_lost_lease_is_a_certain_lapse():
    fence = leased()
    fence.lost(10.5, "the lease stream ended")
    fence.answered(10.6, 10.61, T)
    assert "lease stream ended" in fence.refusal(10.7)


def test_without_a_stated_timeout_the_default_lease_is_assumed_and_a_stated_one_wins():
    fence = LeaseFence(default_timeout=5.0)
    fence.answered(0.0, 0.01)
    fence.quorum_answered(0.0, 0.02)
    assert fence.refusal(5.0 - margin(5.0) - 0.01) is None
    stated = LeaseFence(default_timeout=5.0)
    stated.answered(0.0, 0.01, 1.0)
    stated.quorum_answered(0.0, 0.02)
    assert stated.refusal(1.0) is not None
    assert stated.statistics().lease_timeout == 1.0


def test_bad_default_is_refused():
    with pytest.raises(ValueError):
        LeaseFence(default_timeout=0)
