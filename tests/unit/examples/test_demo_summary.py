"""The summaries of examples/demo.py and demo_hsdp.py: a check that compared nothing says so and fails.

Run on made-up per-step reports (no process is started); the demos themselves run under ``make demo``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FIRST = {100, 101, 102}  # pids of the first run's groups 0, 1, 2
HEAL_LOG = "2026-01-01 g2r0 INFO torchft_lite: healed: 13.2 MB in 0.4s (33.0 MB/s)\n"


def load(name: str):
    """examples/ is not a package: load the script, with its directory importable (demo_hsdp imports demo)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "examples"))


@pytest.fixture(scope="module")
def demo():
    return load("demo")


@pytest.fixture(scope="module")
def demo_hsdp():
    return load("demo_hsdp")


def row(group: int, step: int, checksum: str, pid: int, participants: int = 3, rank: int = 0) -> dict:
    return {"group": group, "rank": rank, "step": step, "checksum": checksum, "participants": participants,
            "pid": pid}


def first_run(last: int) -> list[dict]:
    return [row(g, step, f"c{step}", 100 + g) for step in range(1, last + 1) for g in range(3)]


def outage(killed: int, resumed_from: int) -> dict:
    return {"killed_step": killed, "resumed_from": resumed_from, "first_commit_seconds": 1.0, "first_pids": FIRST}


def summary(demo, capsys, tmp_path: Path, rows: list[dict], killed: int, resumed_from: int) -> tuple[bool, str]:
    (tmp_path / "group2.2.torchrun.log").write_text(HEAL_LOG)
    ok = demo.summarize(rows, tmp_path, 0.5, 15, outage(killed, resumed_from))
    return ok, capsys.readouterr().out


def test_redone_steps_are_compared_with_their_first_run(demo, capsys, tmp_path):
    resumed = [row(g, step, f"c{step}", 200 + g) for step in range(21, 36) for g in range(3)]
    ok, out = summary(demo, capsys, tmp_path, first_run(25) + resumed, killed=25, resumed_from=20)
    assert ok, out
    assert "redone steps identical         5 of 5 (step, rank) pairs bit-identical to the first time\n" in out
    assert "identical parameters           yes (" in out
    assert "NOT CHECKED" not in out


def test_a_run_that_redid_nothing_says_so_and_fails(demo, capsys, tmp_path):
    resumed = [row(g, step, f"c{step}", 200 + g) for step in range(26, 36) for g in range(3)]
    ok, out = summary(demo, capsys, tmp_path, first_run(25) + resumed, killed=25, resumed_from=25)
    assert not ok
    assert "redone steps identical         NOT CHECKED: no step was redone in this run, nothing to compare" in out
    assert " of 0 " not in out


def test_a_first_redone_step_with_other_groups_leaves_nothing_compared_and_fails(demo, capsys, tmp_path):
    # Group 2 came back late: step 21 had two groups, and every later step inherits their average.
    resumed = [row(g, 21, "late", 200 + g, participants=2) for g in range(2)]
    resumed += [row(g, step, f"other{step}", 200 + g) for step in range(22, 36) for g in range(3)]
    ok, out = summary(demo, capsys, tmp_path, first_run(25) + resumed, killed=25, resumed_from=20)
    assert not ok
    assert "redone steps identical         NOT CHECKED: nothing to compare (the first redone step, 21," in out
    assert " of 0 " not in out


def test_later_steps_with_other_groups_are_left_out_and_counted(demo, capsys, tmp_path):
    resumed = [row(g, step, f"c{step}", 200 + g) for step in range(21, 24) for g in range(3)]
    resumed += [row(g, step, f"other{step}", 200 + g, participants=2) for step in range(24, 36) for g in range(2)]
    ok, out = summary(demo, capsys, tmp_path, first_run(25) + resumed, killed=25, resumed_from=20)
    assert ok, out
    assert ("redone steps identical         3 of 3 (step, rank) pairs bit-identical to the first time; 2 later "
            "pair(s) not compared: from step 24 on a quorum had another number of groups") in out


def test_a_redone_step_that_differs_fails(demo, capsys, tmp_path):
    resumed = [row(g, step, f"c{step}" if step < 23 else f"x{step}", 200 + g)
               for step in range(21, 36) for g in range(3)]
    ok, out = summary(demo, capsys, tmp_path, first_run(25) + resumed, killed=25, resumed_from=20)
    assert not ok
    assert "redone steps identical         2 of 5 (step, rank) pairs" in out
    assert "a step redone after the resume differs from its first run" in out


def test_parameters_held_by_one_group_only_are_not_called_identical(demo, capsys, tmp_path):
    rows = [r for r in first_run(25) if r["group"] == 0]
    rows += [row(0, step, f"c{step}", 200) for step in range(21, 36)]
    ok, out = summary(demo, capsys, tmp_path, rows, killed=25, resumed_from=20)
    assert not ok
    assert ("identical parameters           NOT CHECKED: no (step, rank) pair was held by several groups, "
            "nothing to compare") in out
    assert "identical parameters           yes" not in out


@pytest.mark.parametrize("last, newest, ready", [
    (24, 20, True),   # 4 steps to redo, the next checkpoint 6 steps off
    (23, 20, True),
    (27, 20, True),
    (22, 20, False),  # too few steps to redo
    (20, 20, False),  # nothing to redo
    (28, 20, False),  # checkpoint 30 could complete while the groups are killed one by one
    (30, 20, False),
    (25, 10, True),   # checkpoint 20 still being written: more to redo, all with three groups
])
def test_the_whole_job_is_killed_a_few_steps_past_a_checkpoint(demo, last, newest, ready):
    assert demo.ready_to_kill_all(first_run(last), newest, rejoined_at=5) is ready


def test_the_whole_job_is_not_killed_before_a_checkpoint_from_after_the_rejoin(demo):
    assert not demo.ready_to_kill_all(first_run(24), 20, rejoined_at=20)
    assert not demo.ready_to_kill_all(first_run(24), 20, rejoined_at=22)
    assert not demo.ready_to_kill_all(first_run(24), 0, rejoined_at=5)  # no checkpoint yet


def test_the_whole_job_is_not_killed_while_steps_since_the_checkpoint_lacked_a_group(demo):
    rows = first_run(24) + [row(0, 22, "c22", 100, participants=2)]
    assert not demo.ready_to_kill_all(rows, 20, rejoined_at=5)


def hsdp_logs(tmp_path: Path, restart_step: int) -> None:
    (tmp_path / "group0.torchrun.log").write_text("".join(
        f"t g0r{rank} INFO x: served step {restart_step + 2} to replica(s) 1: 10.0 MB\n" for rank in (0, 1)))
    (tmp_path / "group1.2.torchrun.log").write_text("".join(
        f"t g1r{rank} INFO x: healed: 10.0 MB in 0.3s\n" for rank in (0, 1)))


def hsdp_rows(steps: range) -> list[dict]:
    return [row(g, step, f"s{step}r{rank}", 100 + g, participants=2, rank=rank)
            for step in steps for g in range(2) for rank in range(2)]


def test_hsdp_shards_compared_after_the_restart(demo_hsdp, capsys, tmp_path):
    hsdp_logs(tmp_path, restart_step=20)
    assert demo_hsdp.summarize(hsdp_rows(range(1, 31)), tmp_path, 0.5, 12, 20)
    out = capsys.readouterr().out
    assert "identical shards               yes (60 (step, rank) pairs held by both groups, 20 after the restart)" in out


def test_hsdp_nothing_shared_after_the_restart_says_so_and_fails(demo_hsdp, capsys, tmp_path):
    hsdp_logs(tmp_path, restart_step=20)
    rows = hsdp_rows(range(1, 13)) + [r for r in hsdp_rows(range(13, 31)) if r["group"] == 0]
    assert not demo_hsdp.summarize(rows, tmp_path, 0.5, 12, 20)
    out = capsys.readouterr().out
    assert ("identical shards               NOT CHECKED after the restart: no (step, rank) pair after it was held "
            "by both groups, nothing to compare (24 before it)") in out
    assert "identical shards               yes" not in out
