"""What the scheduler recipes' tests share: a job's per-step reports, read while it runs.

Every recipe runs ``examples/train_ddp.py --report FILE``: one JSON line per
committed step and rank, with the parameters' checksum, the process id and the
time. A test kills a group's processes, then reads from the same file that the
group came back (new process ids), healed (its first step is the job's, not
0) and ended identical to the others.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tests.conftest import wait_until_sync
from tests.integration.helpers import REPO, assert_identical_per_step, read_reports

__all__ = ["Rejoin", "assert_identical_per_step", "job_env", "kill_and_rejoin", "pids_of", "read_reports", "rejoin_of",
           "wait_for_rows", "write_token"]

def write_token(path: Path, mode: int = 0o600) -> Path:
    """A fresh job token in the file ``path`` with ``mode``."""
    path.write_text(os.urandom(24).hex())
    path.chmod(mode)
    return path


def job_env() -> dict[str, str]:
    """What a scheduler's job needs from this test run: this checkout first on ``PYTHONPATH``, this
    interpreter's ``python``/``torchrun`` first on ``PATH``; no job token of the test run's own."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHFT_LITE_TOKEN", "TORCHFT_LITE_TOKEN_FILE")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def wait_for_rows(report: Path, predicate: Callable[[list[dict]], bool], what: str, timeout: float,
                  still_running: Callable[[], str | None] = lambda: None) -> list[dict]:
    """The report's rows once ``predicate(rows)`` holds; fails naming ``what`` after ``timeout`` s, or at once
    when ``still_running()`` names why the job can't get there any more (it ended)."""
    rows: list[dict] = []

    def ready() -> bool:
        rows[:] = read_reports(report)
        return predicate(rows)

    wait_until_sync(ready, what, timeout, interval=0.2, failed=still_running)
    return rows


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


def kill_and_rejoin(report: Path, group: int, *, at_step: int, timeout: float,
                    still_running: Callable[[], str | None],
                    kill: Callable[[set[int]], None] | None = None) -> tuple[set[int], Rejoin]:
    """Once ``group`` committed ``at_step``, kill its processes (SIGKILL to each, or ``kill(pids)``), and wait
    until a new process of it committed a step. Returns the killed processes and how the group came back."""
    rows = wait_for_rows(report, lambda rows: any(r["group"] == group and r["step"] >= at_step for r in rows),
                         f"group {group} to commit step {at_step}", timeout, still_running)
    victims = pids_of(rows, group)
    killed_at = time.time()
    if kill is None:
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
    else:
        kill(victims)
    rows = wait_for_rows(report, lambda rows: rejoin_of(rows, group, victims, killed_at) is not None,
                         f"the restarted group {group} to commit a step", timeout, still_running)
    return victims, rejoin_of(rows, group, victims, killed_at)
