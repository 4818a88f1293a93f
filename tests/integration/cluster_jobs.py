"""What the scheduler recipes' tests share: a job's per-step reports, read while it runs.

Every recipe runs ``examples/train_ddp.py --report FILE``: one JSON line per
committed step and rank, with the parameters' checksum, the process id and the
time. A test kills a group's processes, then reads from the same file that the
group came back (new process ids), healed (its first step is the job's, not
0) and ended identical to the others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from tests.integration.test_fault_tolerant_ddp import assert_identical_per_step, read_reports

__all__ = ["Rejoin", "assert_identical_per_step", "pids_of", "read_reports", "rejoin_of", "wait_for_rows"]


def wait_for_rows(report: Path, predicate: Callable[[list[dict]], bool], what: str, timeout: float,
                  still_running: Callable[[], str | None] = lambda: None) -> list[dict]:
    """The report's rows once ``predicate(rows)`` holds; fails naming ``what`` after ``timeout`` s, or at once
    when ``still_running()`` names why the job can't get there any more (it ended)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = read_reports(report)
        if predicate(rows):
            return rows
        gone = still_running()
        if gone is not None:
            pytest.fail(f"{gone} while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def pids_of(rows: list[dict], group: int) -> set[int]:
    """The processes of ``group`` that committed a step so far."""
    return {row["pid"] for row in rows if row["group"] == group}


@dataclass(frozen=True)
class Rejoin:
    seconds: float
    """From the kill to the restarted group's first committed step (its report's time)."""
    first_step: int
    """The first step the restarted group committed: above the kill's step when it healed."""


def rejoin_of(rows: list[dict], group: int, old_pids: set[int], killed_at: float) -> Rejoin | None:
    """How ``group`` came back after its processes ``old_pids`` were killed at ``killed_at`` (wall time);
    None while no new process of it committed a step."""
    new = [row for row in rows if row["group"] == group and row["pid"] not in old_pids]
    if not new:
        return None
    first = min(new, key=lambda row: row["time"])
    return Rejoin(first["time"] - killed_at, first["step"])
