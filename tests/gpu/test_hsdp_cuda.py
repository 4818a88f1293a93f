"""HSDP on CUDA: FSDP2 over NCCL inside each group, the Manager over ProcessGroupNCCL across groups.

Two groups of two ranks, one GPU per rank (``CUDA_VISIBLE_DEVICES`` splits
the machine's first four between the groups); the same invariants as the CPU
test in tests/integration/test_hsdp.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import (
    JOB_WAIT as WAIT, TRAIN_HSDP, assert_identical_per_step, read_logs, read_reports, replica_groups, steps_of,
    wait_for,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4,
                       reason="needs 4 CUDA devices: 2 replica groups x 2 ranks, one device per rank. Not on fewer: "
                              "FSDP2's mesh inside a group is NCCL, which refuses two ranks of one communicator on "
                              "one device, and the replica group across groups is NCCL too"),
    pytest.mark.timeout(900),
]

DEVICES = {0: "0,1", 1: "2,3"}


@pytest.mark.parametrize("bf16", [False, True])
def test_two_cuda_groups_hold_identical_shards_at_every_step(tmp_path: Path, bf16: bool):
    report = tmp_path / "report.jsonl"
    extra = ["--bf16"] if bf16 else []
    with replica_groups(tmp_path, min_replicas=2, join_timeout=30.0) as (_, start):
        groups = [start(g, 2, TRAIN_HSDP, ["--device", "cuda", "--steps", "6", "--report", str(report), "--timeout",
                                        "30", "--min-replicas", "2", *extra], world_size=2,
                        env={"CUDA_VISIBLE_DEVICES": DEVICES[g]})
                  for g in (0, 1)]
        for group in groups:
            assert group.wait(WAIT) == [0, 0], f"group {group.group_id} failed; logs in {tmp_path}"
    rows = read_reports(report)
    for g in (0, 1):
        for rank in (0, 1):
            assert steps_of(rows, g, rank)[-1] == 6
    assert assert_identical_per_step(rows) >= 8
    assert {r["participants"] for r in rows} == {2}


def test_a_killed_cuda_rank_takes_its_group_out_and_the_restarted_group_heals_its_shards(tmp_path: Path):
    report = tmp_path / "report.jsonl"
    # NCCL does not notice a dead peer by itself: the partner leaves when its in-group collective times out.
    args = ["--device", "cuda", "--steps", "100000", "--report", str(report), "--timeout", "30",
            "--group-timeout", "60", "--step-sleep", "0.05"]
    with replica_groups(tmp_path, min_replicas=1, join_timeout=1.0, heartbeat_timeout=1.0) as (_, start):
        survivor = start(0, 2, TRAIN_HSDP, args, world_size=2, env={"CUDA_VISIBLE_DEVICES": DEVICES[0]})
        victim = start(1, 2, TRAIN_HSDP, args, world_size=2, env={"CUDA_VISIBLE_DEVICES": DEVICES[1]})
        wait_for(lambda: min(len(steps_of(read_reports(report), g, r)) for g in (0, 1) for r in (0, 1)) >= 3,
                 "every rank's 3rd step", groups=[survivor, victim])
        os.kill(victim.procs[1].pid, signal.SIGKILL)
        wait_for(lambda: victim.procs[0].poll() is not None, "the killed rank's partner to exit", groups=[survivor])
        killed_at = max(steps_of(read_reports(report), 0))
        victim.start()
        wait_for(lambda: all(max(steps_of(read_reports(report), 1, r), default=0) >= killed_at + 5 for r in (0, 1)),
                 "both restarted ranks 5 steps past the kill", groups=[survivor, victim])
        survivor.kill(signal.SIGKILL)
        victim.kill(signal.SIGKILL)
    assert assert_identical_per_step(read_reports(report)) > 0
    for r in (0, 1):
        assert "healed:" in read_logs(tmp_path, f"group1.2.{r}.log"), f"restarted rank {r} never healed"
