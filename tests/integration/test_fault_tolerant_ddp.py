"""End to end: real lighthouse, real gloo, several training processes per test.

Each test runs ``examples/train_ddp.py`` replica groups (see
``torchft_lite.cluster.local``) and reads their per-step reports: one JSON line
per committed step with a checksum of the parameters. Bit-identical
parameters across groups at every common step is the core invariant.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.integration.helpers import (
    JOB_WAIT as WAIT, assert_identical_per_step, cluster, read_logs, read_reports, steps_of, wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_three_groups_train_to_identical_parameters(tmp_path):
    with cluster(tmp_path, min_replicas=3, join_timeout=30.0) as (_, add, report):
        groups = [add(g, 3, steps=15) for g in range(3)]
        for group in groups:
            assert group.wait(WAIT) == [0], f"group {group.group_id} failed; logs in {tmp_path}"
        rows = read_reports(report)
        for g in range(3):
            assert steps_of(rows, g) == list(range(1, 16))
        assert assert_identical_per_step(rows) == 15
        assert {r["participants"] for r in rows} == {3}  # every step had all three groups


def test_two_groups_of_two_ranks_train_to_identical_parameters(tmp_path):
    with cluster(tmp_path, min_replicas=2, join_timeout=30.0) as (_, add, report):
        groups = [add(g, 2, steps=10, world_size=2) for g in range(2)]
        for group in groups:
            assert group.wait(WAIT) == [0, 0], f"group {group.group_id} failed; logs in {tmp_path}"
        rows = read_reports(report)
        for g in range(2):
            for rank in range(2):
                assert steps_of(rows, g, rank) == list(range(1, 11))
        assert assert_identical_per_step(rows) == 20  # 10 steps x 2 ranks


@pytest.mark.parametrize("pg", ["gloo", "baby-gloo"])
def test_killed_group_leaves_survivors_committing_and_is_healed_on_restart(tmp_path, pg):
    with cluster(tmp_path, min_replicas=1, join_timeout=1.0, heartbeat_timeout=1.0) as (_, add, report):
        survivor = add(0, 2, steps=400, sleep=0.05, pg=pg)
        victim = add(1, 2, steps=400, sleep=0.05, pg=pg)
        wait_for(lambda: min(len(steps_of(read_reports(report), g)) for g in (0, 1)) >= 5,
                 "both groups' 5th step", groups=[survivor, victim])
        victim.kill(signal.SIGKILL)
        killed_at = max(steps_of(read_reports(report), 0), default=0)
        wait_for(lambda: max(steps_of(read_reports(report), 0)) >= killed_at + 10,
                 "the survivor to commit 10 steps without the killed group", groups=[survivor])
        rows = read_reports(report)
        assert any(r["participants"] == 1 for r in rows if r["group"] == 0), "survivor never trained alone"

        victim.start()
        restarted_before = len(steps_of(read_reports(report), 1))
        wait_for(lambda: len(steps_of(read_reports(report), 1)) >= restarted_before + 5,
                 "the restarted group to commit 5 steps", groups=[survivor, victim])
        rows = read_reports(report)
        first_after = steps_of(rows, 1)[restarted_before]
        assert first_after > killed_at, "the restarted group did not resume from the healed step"
        assert assert_identical_per_step(rows) > 0
        survivor.kill(signal.SIGKILL)
        victim.kill(signal.SIGKILL)
        logs = read_logs(tmp_path, "group1.2.*.log")
        assert "healed:" in logs


@pytest.mark.parametrize("pg, ranks", [("gloo", 1), ("baby-gloo", 2)])
def test_restarted_group_rejoins_when_min_replica_size_counts_every_group(tmp_path, pg, ranks):
    """min_replica_size = number of groups: the survivor can't commit alone, and the
    restarted group's heal step can't commit either (it does not count while it
    heals). The heal must outlive that step, or the pair loops for good."""
    with cluster(tmp_path, min_replicas=2, join_timeout=5.0, heartbeat_timeout=1.0) as (_, add, report):
        groups = [add(g, 2, steps=100000, sleep=0.05, pg=pg, world_size=ranks, min_replicas=2) for g in (0, 1)]
        wait_for(lambda: min(len(steps_of(read_reports(report), g)) for g in (0, 1)) >= 5,
                 "both groups' 5th step", groups=groups)
        groups[1].kill(signal.SIGKILL)
        time.sleep(2.0)  # the survivor notices and stalls: nothing commits without the second group
        stalled_at = max(steps_of(read_reports(report), 0))
        groups[1].start()
        wait_for(lambda: min(max(steps_of(read_reports(report), g, rank), default=0)
                             for g in (0, 1) for rank in range(ranks)) >= stalled_at + 5,
                 "both groups, every rank, 5 steps past the stall", groups=groups)
        for group in groups:
            group.kill(signal.SIGKILL)
        rows = read_reports(report)
        assert {r["participants"] for r in rows} == {2}, "a step committed with fewer than min_replica_size"
        assert assert_identical_per_step(rows) > 0
        logs = read_logs(tmp_path, "group1.2.*.log")
        assert "healed:" in logs


def test_late_joiner_heals_at_step_above_zero(tmp_path):
    with cluster(tmp_path, min_replicas=1, join_timeout=1.0) as (_, add, report):
        early = add(0, 2, steps=100000, sleep=0.05)
        wait_for(lambda: len(steps_of(read_reports(report), 0)) >= 10, "the first group's 10th step", groups=[early])
        late = add(1, 2, steps=100000, sleep=0.05)
        wait_for(lambda: len(steps_of(read_reports(report), 1)) >= 10, "the late group's 10th step", groups=[early, late])
        early.kill(signal.SIGKILL)
        late.kill(signal.SIGKILL)
        rows = read_reports(report)
        assert steps_of(rows, 1)[0] > 10, "the late group did not start from the healed step"
        assert assert_identical_per_step(rows) >= 5  # the steps both groups committed
        logs = read_logs(tmp_path, "group1.1.*.log")
        assert "healed:" in logs


def test_lighthouse_restart_mid_run_is_survived(tmp_path):
    with cluster(tmp_path, min_replicas=2, join_timeout=5.0) as (lighthouse, add, report):
        groups = [add(0, 2, steps=400, sleep=0.05), add(1, 2, steps=400, sleep=0.05)]
        wait_for(lambda: min(len(steps_of(read_reports(report), g)) for g in (0, 1)) >= 5, "5 steps", groups=groups)
        lighthouse.kill()
        before = max(steps_of(read_reports(report), 0))
        time.sleep(1.0)
        lighthouse.start()
        wait_for(lambda: min(max(steps_of(read_reports(report), g)) for g in (0, 1)) >= before + 10,
                 "10 more steps after the lighthouse restart", groups=groups)
        assert assert_identical_per_step(read_reports(report)) > 0


def test_late_group_heals_from_two_up_to_date_groups_at_once(tmp_path):
    striping = {"TORCHFT_LITE_HEAL_SOURCES": "2"}
    with cluster(tmp_path, min_replicas=1, join_timeout=2.0) as (_, add, report):
        early = [add(g, 3, steps=100000, sleep=0.05, env=striping) for g in (0, 1)]
        wait_for(lambda: min(len(steps_of(read_reports(report), g)) for g in (0, 1)) >= 10,
                 "both early groups' 10th step", groups=early)
        late = add(2, 3, steps=100000, sleep=0.05, env=striping)
        wait_for(lambda: len(steps_of(read_reports(report), 2)) >= 5, "the late group's 5th step",
                 groups=[*early, late])
        for group in (*early, late):
            group.kill(signal.SIGKILL)
        rows = read_reports(report)
        assert steps_of(rows, 2)[0] > 10, "the late group did not start from the healed step"
        assert assert_identical_per_step(rows) >= 5

        def log(group: int) -> str:
            return read_logs(tmp_path, f"group{group}.1.*.log")

        assert re.search(r"healed: .* from replica\(s\) 0, 1\n", log(2)), "the late group did not stripe"
        for group in (0, 1):  # each source served part of it (replica 2 is the late group)
            served = [float(mb) for mb in re.findall(r"served step \d+ to replica\(s\) 2: ([\d.]+) MB", log(group))]
            assert served and max(served) > 0, f"group {group} served nothing to the late group"


def test_a_group_with_nan_gradients_is_left_out_and_every_group_stays_identical_and_finite(tmp_path):
    """The non-finite guard (torchft_lite.health.nonfinite), end to end, with three groups: group 0 poisons two steps'
    loss with NaN (``--inject-nan-at``, fewer than the 3 in a row that would end it); its gradients are left
    out, the three groups commit the same steps, and nothing is NaN."""
    with cluster(tmp_path, min_replicas=3, join_timeout=30.0) as (_, add, report):
        groups = [add(0, 3, steps=8, min_replicas=3, extra=("--inject-group", "0", "--inject-nan-at", "3",
                                                            "--inject-nan-times", "2")),
                  add(1, 3, steps=8, min_replicas=3),
                  add(2, 3, steps=8, min_replicas=3)]
        for group in groups:
            assert group.wait(WAIT) == [0], f"group {group.group_id} failed; logs in {tmp_path}"
    rows = read_reports(report)
    logs = read_logs(tmp_path, "group0.*.log")
    assert logs.count("injected NaN into the loss") == 2 and logs.count("left out of the average") == 2
    for g in (0, 1, 2):
        assert steps_of(rows, g) == list(range(1, 9))  # every step committed, with all three groups
    assert {r["participants"] for r in rows} == {3}
    assert assert_identical_per_step(rows) == 8
    poisoned = sorted(r["step"] for r in rows if r["loss"] != r["loss"])
    assert poisoned == [4, 5]  # only group 0's own loss at the attempts at steps 3 and 4 (committed as 4, 5)


def test_nan_gradients_k_steps_in_a_row_end_the_group_with_exit_code_65_and_the_others_go_on(tmp_path):
    """``max_nonfinite_steps`` (3 by default) NaN steps in a row: of three groups, the poisoned one leaves with
    EXIT_CODE_BAD_REPLICA; the other two go on without it, identical at every step. (Quorums need two groups,
    so the poisoned group never trains alone, and the two healthy ones still make one after it has gone.)"""
    with cluster(tmp_path, min_replicas=2, join_timeout=30.0) as (lighthouse, add, report):
        bad = add(0, 3, steps=10, sleep=0.05, min_replicas=2,
                  extra=("--inject-group", "0", "--inject-nan-at", "2", "--inject-nan-times", "5"))
        # The poisoned group must be in the first quorum: started late on a loaded machine, it joined the
        # other two at step 7, and their 10 steps ended before its third NaN step.
        wait_for(lambda: "need min_replicas=2" in lighthouse.log_path.read_text(errors="replace"),
                 "group 0 to ask the lighthouse for the first quorum", groups=[bad])
        good = [add(g, 3, steps=10, sleep=0.05, min_replicas=2) for g in (1, 2)]
        assert bad.wait(WAIT) == [65], f"logs in {tmp_path}"
        for group in good:
            assert group.wait(WAIT) == [0], f"group {group.group_id} failed; logs in {tmp_path}"
    logs = read_logs(tmp_path, "group0.*.log")
    assert logs.count("injected NaN into the loss") == 3 and "3 steps in a row" in logs
    rows = read_reports(report)
    last_bad = max(steps_of(rows, 0), default=0)
    assert last_bad < 10  # the poisoned group stopped early
    for g in (1, 2):
        steps = steps_of(rows, g)
        assert steps[-1] == 10 and any(step > last_bad for step in steps), f"group {g} committed {steps}"
    assert assert_identical_per_step(rows) >= 1  # never diverged, and the healthy groups shared steps
