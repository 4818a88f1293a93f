"""HSDP end to end: FSDP2 inside each replica group of 2 ranks, the Manager across 2 groups, real gloo.

``examples/train_hsdp.py`` reports one line per rank and committed step with a
checksum of that rank's shards; group rank r of every group holds shard r, so
the invariant is: at every step, every group's rank r reports the same
checksum. ``hsdp_grad_worker.py`` (next to this file) saves a step's full
parameters and gradients so the cross-group average can be checked against
the gradient of the whole batch of 4 ranks.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import (
    JOB_WAIT as WAIT, TRAIN_HSDP, assert_identical_per_step, read_logs, read_reports, replica_groups, steps_of,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "hsdp_grad_worker.py"


@pytest.mark.parametrize("hook, heal_in_place", [("helper", "1"), ("torchft", "0")])
def test_two_groups_of_two_ranks_hold_identical_shards_at_every_step(tmp_path, hook, heal_in_place):
    """Also: a heal into fresh tensors (TORCHFT_LITE_HEAL_IN_PLACE=0) rebuilds the DTensors on a stand-in mesh,
    which ShardedState puts back on the parameters' own before the optimizer sees them."""
    report = tmp_path / "report.jsonl"
    with replica_groups(tmp_path, min_replicas=2, join_timeout=30.0) as (_, start):
        groups = [start(g, 2, TRAIN_HSDP, ["--steps", "5", "--report", str(report), "--timeout", "15", "--hook", hook,
                                        "--min-replicas", "2"], world_size=2,
                        env={"TORCHFT_LITE_HEAL_IN_PLACE": heal_in_place})
                  for g in (0, 1)]
        for group in groups:
            assert group.wait(WAIT) == [0, 0], f"group {group.group_id} failed; logs in {tmp_path}"
    rows = read_reports(report)
    for g in (0, 1):
        for rank in (0, 1):
            steps = steps_of(rows, g, rank)
            # A group that fails its step-0 heal heals to step 1 from the other instead (it then skips step 1).
            assert steps == sorted(set(steps)) and steps[-1] == 5 and len(steps) >= 4, (g, rank, steps)
    assert assert_identical_per_step(rows) >= 8  # at least 4 steps x 2 shards seen by both groups
    assert {r["participants"] for r in rows} == {2}
    for step in (1, 5):  # the two shards differ: each rank checksums its own shard, not the whole model
        assert len({r["checksum"] for r in rows if r["step"] == step}) == 2
    # The groups start from different seeds: step 0 healed each shard ring from one group to the other.
    assert "healed:" in read_logs(tmp_path, "group*.1.*.log")


def reference_gradients(dump: dict, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The gradient of the mean loss over ``batches`` (every rank's), for the dumped full parameters."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_hsdp import TinyDecoder

    from tests.integration.hsdp_grad_worker import SIZES

    model = TinyDecoder(SIZES["vocab"], SIZES["dim"], SIZES["layers"], SIZES["heads"], SIZES["seq_len"])
    model.load_state_dict(dump["params"])
    total = sum(torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) for x, y in batches)
    (total / len(batches)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("hook, reduce_dtype", [("helper", "float32"), ("torchft", "float32"), ("helper", "float16")])
def test_the_hook_averages_each_shard_over_every_rank_of_both_groups(tmp_path, hook, reduce_dtype):
    """FSDP averages inside a group (for float16 it divides before and after the hook), the hook across
    groups: the result must be the gradient of the mean loss over all 4 ranks' batches."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_hsdp import batch_for

    from tests.integration.hsdp_grad_worker import model_args

    out = tmp_path / "dumps"
    out.mkdir()
    with replica_groups(tmp_path, min_replicas=2, join_timeout=30.0) as (_, start):
        groups = [start(g, 2, WORKER, ["--out", str(out), "--steps", "4", "--dump-at", "2", "--hook", hook,
                                       "--reduce-dtype", reduce_dtype], world_size=2) for g in (0, 1)]
        for group in groups:
            assert group.wait(WAIT) == [0, 0], f"group {group.group_id} failed; logs in {tmp_path}"
    dumps = {(g, r): torch.load(out / f"g{g}r{r}.pt", weights_only=True) for g in (0, 1) for r in (0, 1)}
    for dump in dumps.values():  # step 0 healed the groups to one state; step 2 has both, nobody healing
        assert dump["step"] == 2 and dump["participants"] == 2 and not dump["errored"]
        for name, value in dump["params"].items():
            assert torch.equal(value, dumps[(0, 0)]["params"][name]), f"{name} differs before the step"
    batches = [batch_for(2, g, r, model_args(4)) for g in (0, 1) for r in (0, 1)]
    expected = reference_gradients(dumps[(0, 0)], batches)
    tolerance = dict(rtol=1e-4, atol=1e-6) if reduce_dtype == "float32" else dict(rtol=2e-2, atol=2e-4)
    for (g, r), dump in dumps.items():
        for name, grad in dump["grads"].items():
            torch.testing.assert_close(grad, expected[name], **tolerance,
                                       msg=lambda m: f"group {g} rank {r} {name}: {m}")
    # Not the group's own average: the other group's batches moved every gradient.
    own = reference_gradients(dumps[(0, 0)], batches[:2])
    assert not torch.allclose(dumps[(0, 0)]["grads"]["head.weight"], own["head.weight"], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("victim_rank, heal_in_place", [(1, "1"), (0, "0")])
def test_one_killed_rank_takes_its_group_out_and_the_restarted_group_heals_shard_by_shard(tmp_path, victim_rank,
                                                                                           heal_in_place):
    """SIGKILL one rank of group 1: its partner's next in-group collective fails and it exits; group 0
    trains alone; group 1 restarted rejoins, each rank heals its own shard from the same rank of group 0,
    and from then on both groups report identical shards at every step. Killing rank 0 takes the group's
    ManagerServer with it. Healing into fresh tensors, the optimizer's state (AdamW's moments, DTensors)
    arrives on a stand-in mesh and must be put back on the parameters' own, or the next step fails."""
    report = tmp_path / "report.jsonl"
    args = ["--steps", "100000", "--report", str(report), "--timeout", "15", "--step-sleep", "0.05"]
    with replica_groups(tmp_path, min_replicas=1, join_timeout=1.0, heartbeat_timeout=1.0) as (_, start):
        env = {"TORCHFT_LITE_HEAL_IN_PLACE": heal_in_place}
        survivor = start(0, 2, TRAIN_HSDP, args, world_size=2, env=env)
        victim = start(1, 2, TRAIN_HSDP, args, world_size=2, env=env)
        both = [survivor, victim]
        wait_for(lambda: min(len(steps_of(read_reports(report), g, r)) for g in (0, 1) for r in (0, 1)) >= 3,
                 "every rank's 3rd step", groups=both)
        os.kill(victim.procs[victim_rank].pid, signal.SIGKILL)
        partner = victim.procs[1 - victim_rank]
        wait_for(lambda: partner.poll() is not None, "the killed rank's partner to exit", groups=[survivor])
        assert partner.returncode != 0, "the partner of a killed rank exited as if training were done"
        killed_at = max(steps_of(read_reports(report), 0))
        wait_for(lambda: max(steps_of(read_reports(report), 0)) >= killed_at + 5,
                 "group 0 to commit 5 steps alone", groups=[survivor])
        assert any(r["participants"] == 1 for r in read_reports(report) if r["group"] == 0)

        victim.start()
        before = {r: len(steps_of(read_reports(report), 1, r)) for r in (0, 1)}
        wait_for(lambda: all(len(steps_of(read_reports(report), 1, r)) >= before[r] + 5 for r in (0, 1)),
                 "both restarted ranks to commit 5 steps", groups=both)
        survivor.kill(signal.SIGKILL)
        victim.kill(signal.SIGKILL)
    rows = read_reports(report)
    for r in (0, 1):
        first_after = steps_of(rows, 1, r)[before[r]]
        assert first_after > killed_at, f"restarted rank {r} did not resume from the healed step"
        shared_after = [row["step"] for row in rows if row["group"] == 1 and row["rank"] == r
                        and row["step"] >= first_after and row["step"] in set(steps_of(rows, 0, r))]
        assert len(shared_after) >= 3, f"rank {r}: too few steps both groups committed after the heal"
    assert assert_identical_per_step(rows) > 0
    for r in (0, 1):  # each rank of the restarted group healed (its own shard, from group 0's rank r)
        assert "healed:" in read_logs(tmp_path, f"group1.2.{r}.log"), f"restarted rank {r} never healed"
