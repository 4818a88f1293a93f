"""The chaos run's pure parts, without processes: its fault schedule (one per seed, whatever the run),
the kinds a side-by-side run keeps, the rewinds found in made-up reports, and the job's step over time."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks._chaos_checks import find_rewinds, job_step_at, verify
from benchmarks._chaos_cli import parse_args
from benchmarks._chaos_faults import make_schedule

KINDS = ["kill", "term", "hang", "lighthouse"]


def test_one_seed_draws_one_schedule_and_another_seed_another():
    first = make_schedule(7, KINDS, count=50, interval=2.0)
    assert first == make_schedule(7, KINDS, count=50, interval=2.0)
    assert first != make_schedule(8, KINDS, count=50, interval=2.0)
    assert [f.at for f in first] == sorted(f.at for f in first) and first[0].at == 0.0
    assert {f.kind for f in first} == set(KINDS)
    # A fault's own choices come from its own seed: the same for every run that injects it.
    assert first[3].rng().random() == first[3].rng().random()


def test_a_fault_rate_puts_one_fault_in_the_middle_of_each_period():
    schedule = make_schedule(1, KINDS, every=60.0, duration=240.0, first="hang")
    assert [f.at for f in schedule] == [30.0, 90.0, 150.0, 210.0]
    assert schedule[0].kind == "hang"
    assert len(make_schedule(1, KINDS, every=5.0, duration=120.0)) == 24
    with pytest.raises(ValueError, match="duration"):
        make_schedule(1, KINDS, every=5.0)


def test_a_weight_of_zero_never_draws_that_kind():
    schedule = make_schedule(3, ["kill", "kill-all"], weights={"kill-all": 0.0}, count=200, first="kill-all")
    assert [f.kind for f in schedule].count("kill-all") == 1 and schedule[0].kind == "kill-all"


def test_side_by_side_keeps_only_the_kinds_both_take_and_names_the_others():
    args = parse_args(["--impl", "torchft_lite,torchft", "--kinds", "kill,term,hang,lighthouse,kill-all",
                       "--fault-every", "5", "--duration", "60"])
    assert args.kinds == ["kill", "term", "hang", "lighthouse"]
    assert args.skipped_kinds["kill-all"].startswith("torchft:") and "durable checkpoints" in args.skipped_kinds["kill-all"]
    assert args.checkpoint_every == 0  # no kill-all: nothing would read a checkpoint back
    assert args.faults is None


@pytest.mark.parametrize("argv, message", [
    (["--fault-every", "5"], "go together"),
    (["--fault-every", "5", "--duration", "60", "--faults", "3"], "either"),
    (["--impl", "torchft_lite,pytorch"], "--impl"),
    (["--impl", "torchft", "--kinds", "kill-all"], "no fault kind left"),
])
def test_bad_command_lines_say_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


T = 1_700_000_000.0


def rows_of(steps: range, start: float, tag: str, pids=(1, 2), batches_from: int = 0) -> list[dict]:
    """Two one-rank groups committing ``steps`` 0.1 s apart from ``start``, checksums tagged ``tag``."""
    rows = []
    for i, s in enumerate(steps):
        rows += [{"group": g, "rank": 0, "step": s, "checksum": f"{tag}-{s}", "participants": 2,
                  "batches_committed": batches_from + 2 * (i + 1), "time": start + 0.1 * i + 0.001 * g, "pid": pid}
                 for g, pid in enumerate(pids)]
    return rows


def test_a_redo_after_a_restart_is_a_rewind_for_torchft_and_a_failure_for_ours(tmp_path: Path):
    # Steps 1..30, then (10 s later, fresh processes) the job goes on from 24 with other parameters.
    rows = rows_of(range(1, 31), T, "a") + rows_of(range(25, 41), T + 13, "b", pids=(3, 4), batches_from=48)
    rewinds = find_rewinds(rows, [])
    assert [(r["from_step"], r["to_step"]) for r in rewinds] == [(30, 24)]
    theirs = verify(rows, [], [], tmp_path, rewinds_allowed=True)
    assert theirs["divergent_steps"] == [] and theirs["duplicated_steps"] == [] and theirs["missing_steps"] == []
    assert theirs["batch_accounting_errors"] == [] and theirs["steps_redone"] == 6
    assert theirs["committed_steps"] == 40 and theirs["commits"] == 30 + 16
    ours = verify(rows, [], [], tmp_path)
    assert len(ours["divergent_steps"]) == 6 and ours["rewinds"] == rewinds
    # Net progress counts the redone steps once: the job is at 30 before the redo and at 40 at the end.
    restarts = theirs["restarts"]
    assert job_step_at(rows, restarts, T + 10) == 30 and job_step_at(rows, restarts, T + 13.05) == 25
    assert job_step_at(rows, restarts, T + 100) == 40
    # In batches: 2 per step; the redo goes on from the 48 committed at step 24, not from the 60 at step 30.
    assert job_step_at(rows, restarts, T + 10, "batches_committed") == 60
    assert job_step_at(rows, restarts, T + 100, "batches_committed") == 80
    # Between a restart and its epoch's first commit: what the epoch resumed from.
    restart = [{"at": T + 12, "resumed": 24}]
    assert job_step_at(rows, restart, T + 12.5) == 24
    assert job_step_at(rows, restart, T + 12.5, "batches_committed") == 48
    assert job_step_at(rows, restarts, T + 100, "batches_committed") == 80


def test_two_states_at_one_step_of_one_quorum_are_a_divergence_even_where_redoing_is_allowed(tmp_path: Path):
    rows = rows_of(range(1, 21), T, "a")
    rows[-1]["checksum"] = "forked"  # group 1 at step 20, a millisecond after group 0
    assert find_rewinds(rows, []) == []
    checks = verify(rows, [], [], tmp_path, rewinds_allowed=True)
    assert checks["divergent_steps"] == [[0, 20]] and checks["steps_redone"] == 0


def test_a_late_row_of_the_same_commit_is_no_rewind(tmp_path: Path):
    # Group 1 was stopped between committing step 10 and writing its row: it writes it 30 s later.
    rows = [r for r in rows_of(range(1, 21), T, "a") if r["group"] == 0 or r["step"] < 10]
    rows.append({**rows[18], "group": 1, "time": T + 30, "pid": 2})
    assert rows[18]["step"] == 10 and rows[18]["group"] == 0
    assert find_rewinds(rows, []) == []
    assert verify(rows, [], [], tmp_path, rewinds_allowed=True)["divergent_steps"] == []


def test_going_back_to_the_lineage_left_behind_is_a_rewind_that_throws_work_away(tmp_path: Path):
    # torchft after a lighthouse restart: fresh groups start over from 0 while the holder of step 30 is
    # away; when it is back, everyone heals from it and the 10 steps committed since are thrown away.
    rows = (rows_of(range(1, 31), T, "a") + rows_of(range(1, 11), T + 13, "b", pids=(3, 4))
            + rows_of(range(31, 41), T + 20, "c", batches_from=60))
    assert [(r["from_step"], r["to_step"]) for r in find_rewinds(rows, [])] == [(30, 0), (10, 30)]
    checks = verify(rows, [], [], tmp_path, rewinds_allowed=True)
    assert checks["missing_steps"] == [] and checks["batch_accounting_errors"] == [] and checks["divergent_steps"] == []
    assert checks["steps_redone"] == 30 and checks["steps_thrown_away"] == 10
    assert job_step_at(rows, checks["restarts"], T + 100) == 40
