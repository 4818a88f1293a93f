"""Failures detected in milliseconds (leases, pushed events) and graceful leave, end to end.

The lighthouse runs with a heartbeat timeout and join timeout of 60 s, so a
survivor that goes on committing well within that bound did so because the
lease broke (or the group left), not because a heartbeat expired.
"""

from __future__ import annotations

import signal

import pytest

from tests.integration.helpers import assert_identical_per_step, cluster, read_logs, read_reports, steps_of, wait_for
from torchft_lite.health.watchdog import EXIT_CODE_PREEMPTED

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = dict(heartbeat_timeout=60.0, join_timeout=60.0)
WITHIN = 40.0  # well under the 60 s heartbeat timeout


def last(report, group: int) -> int:
    return max(steps_of(read_reports(report), group), default=0)


def both_training(report, groups: tuple[int, ...] = (0, 1), steps: int = 5):
    return lambda: min(len(steps_of(read_reports(report), g)) for g in groups) >= steps


def test_sigkill_survivors_go_on_before_any_heartbeat_could_expire(tmp_path):
    with cluster(tmp_path, min_replicas=1, **LONG) as (_, add, report):
        survivor, victim = add(0, 2, steps=100000, sleep=0.05), add(1, 2, steps=100000, sleep=0.05)
        wait_for(both_training(report), "both groups training", groups=[survivor, victim])
        victim.kill(signal.SIGKILL)
        at_kill = last(report, 0)
        wait_for(lambda: last(report, 0) >= at_kill + 5, "the survivor to commit 5 steps without the victim",
                 timeout=WITHIN, groups=[survivor])
        rows = read_reports(report)
        assert any(r["participants"] == 1 for r in rows if r["group"] == 0 and r["step"] > at_kill)
        assert assert_identical_per_step(rows) > 0
        lighthouse_log = (tmp_path / "lighthouse.log").read_text()
        assert "lease of train_ddp_1" in lighthouse_log and "treating it as gone now" in lighthouse_log


def test_sigterm_leaves_gracefully_with_the_documented_exit_code(tmp_path):
    with cluster(tmp_path, min_replicas=1, **LONG) as (_, add, report):
        survivor, leaver = add(0, 2, steps=100000, sleep=0.05), add(1, 2, steps=100000, sleep=0.05)
        wait_for(both_training(report), "both groups training", groups=[survivor, leaver])
        leaver.kill(signal.SIGTERM)
        assert leaver.wait(WITHIN) == [EXIT_CODE_PREEMPTED]
        left_at = last(report, 1)
        wait_for(lambda: last(report, 0) >= left_at + 5, "the survivor to commit 5 steps after the leave",
                 timeout=WITHIN, groups=[survivor])
        rows = read_reports(report)
        assert assert_identical_per_step(rows) > 0
        log = read_logs(tmp_path, "group1.*.log")
        assert "leaving on SIGTERM" in log


def test_sigstop_hang_is_survived_and_the_group_heals_after_sigcont(tmp_path):
    # A hung process keeps its connections open: only the heartbeat timeout catches it.
    with cluster(tmp_path, min_replicas=1, heartbeat_timeout=2.0, join_timeout=2.0) as (_, add, report):
        survivor, hung = add(0, 2, steps=100000, sleep=0.05), add(1, 2, steps=100000, sleep=0.05)
        wait_for(both_training(report), "both groups training", groups=[survivor, hung])
        hung.kill(signal.SIGSTOP)
        try:
            at_stop = last(report, 0)
            wait_for(lambda: last(report, 0) >= at_stop + 5, "the survivor to go on without the hung group",
                     groups=[survivor])
        finally:
            hung.kill(signal.SIGCONT)
        resumed_from = last(report, 0)
        wait_for(lambda: last(report, 1) > resumed_from, "the resumed group to heal and commit again",
                 groups=[survivor, hung])
        assert assert_identical_per_step(read_reports(report)) > 0


def test_a_flapping_member_never_stops_the_survivor(tmp_path):
    with cluster(tmp_path, min_replicas=1, **LONG) as (_, add, report):
        survivor, flapper = add(0, 2, steps=100000, sleep=0.05), add(1, 2, steps=100000, sleep=0.05)
        wait_for(both_training(report), "both groups training", groups=[survivor, flapper])
        for cycle in range(3):
            flapper.kill(signal.SIGKILL)
            at_kill = last(report, 0)
            wait_for(lambda: last(report, 0) >= at_kill + 3, f"survivor progress after kill {cycle + 1}",
                     timeout=WITHIN, groups=[survivor])
            before = len(steps_of(read_reports(report), 1))
            flapper.start()
            wait_for(lambda: len(steps_of(read_reports(report), 1)) >= before + 3,
                     f"the flapping group back after restart {cycle + 1}", groups=[survivor, flapper])
        assert assert_identical_per_step(read_reports(report)) > 0


def test_watchdog_exits_a_group_stuck_in_quorum_for_rescheduling(tmp_path):
    from tests.integration.helpers import JOB_WAIT as WAIT, TRAIN_DDP as SCRIPT
    from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup
    from torchft_lite.health.watchdog import EXIT_CODE_RESCHEDULE

    # min_replicas=2 with a single group: its quorum can never form.
    lighthouse = LighthouseProcess(min_replicas=2, log_path=tmp_path / "lighthouse.log").start()
    group = ReplicaGroup(0, 1, lighthouse.address, SCRIPT, ["--steps", "5"], log_dir=tmp_path,
                         env={"TORCHFT_LITE_WATCHDOG_QUORUM_SEC": "3"})
    try:
        group.start()
        assert group.wait(WAIT) == [EXIT_CODE_RESCHEDULE]
        log = (tmp_path / "group0.1.0.log").read_text(errors="replace")
        assert "quorum took more than 3s waiting for the quorum for step 0" in log
        assert "thread stacks" in log
    finally:
        group.stop()
        lighthouse.stop()
