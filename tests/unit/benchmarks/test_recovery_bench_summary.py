"""What benchmarks/recovery_bench.py reads off the groups' per-step reports, with literal rows."""

from __future__ import annotations

import pytest

from benchmarks.recovery_bench import divergence, step_time, training_summary


def row(group: int, step: int, checksum: str, time: float, pid: int = 1, rank: int = 0) -> dict:
    return {"group": group, "step": step, "checksum": checksum, "time": time, "pid": pid + group, "rank": rank}


def test_steps_committed_by_more_than_one_group_are_compared_and_the_different_ones_counted():
    rows = [row(0, 1, "a", 1.0), row(1, 1, "a", 1.0), row(2, 1, "a", 1.0),
            row(0, 2, "b", 2.0), row(1, 2, "x", 2.0),  # group 1 diverged at step 2
            row(0, 3, "c", 3.0)]  # only group 0 committed step 3: nothing to compare it with
    assert divergence(rows) == (2, 1)


def test_ranks_are_compared_with_the_same_rank_of_other_groups():
    rows = [row(0, 1, "r0", 1.0, rank=0), row(1, 1, "r0", 1.0, rank=0),
            row(0, 1, "r1", 1.0, rank=1), row(1, 1, "r1", 1.0, rank=1)]
    assert divergence(rows) == (2, 0)


def test_step_time_is_the_median_gap_between_a_processes_consecutive_steps():
    rows = [row(0, 1, "a", 10.0), row(0, 2, "a", 10.1), row(0, 3, "a", 10.3),
            row(1, 5, "a", 20.0, pid=7), row(1, 7, "a", 25.0, pid=7),  # a gap of two steps (a heal) is no step time
            row(1, 8, "a", 25.1, pid=7)]
    assert step_time(rows) == pytest.approx(0.1)
    assert training_summary([]) == {"compared_steps": 0, "divergent_steps": 0, "step_p50_s": None}
