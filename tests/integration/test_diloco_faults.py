"""DiLoCo under faults, end to end: examples/train_diloco.py groups, a real lighthouse, real gloo.

Three replica groups train Streaming DiLoCo (2 fragments, a fragment sync
every 5 inner steps); group 2 SIGKILLs itself, either between two syncs or
inside one (after the sync's first collective went through, before its
second started), through the example's ``--inject-group`` flags, so the
moment is the same on every run. Then it is started again.

What must hold, from the groups' reports (one line per committed sync with
checksums of the global parameters and of the outer optimizers' state):

* every group that committed a job step holds the same global parameters
  and outer optimizer state there, the restarted group included (it healed
  both from a survivor, not from its own fresh start);
* the two survivors committed exactly the same syncs: a sync the dead group
  took part in committed for every survivor or for none, and the one it
  died in committed for none (its step was redone by the two survivors);
* the restarted group resumed past the step it died at.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.integration.helpers import JOB_WAIT as WAIT, read_logs, read_reports, replica_groups, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_diloco.py"
VICTIM = 2


def syncs(rows: list[dict], group: int, pid: int | None = None) -> list[dict]:
    return [r for r in rows if r["event"] == "sync" and r["group"] == group and pid in (None, r["pid"])]


def steps(rows: list[dict], group: int) -> list[int]:
    return [r["step"] for r in syncs(rows, group)]


@contextlib.contextmanager
def three_groups(tmp_path: Path, inject: list[str]):
    """Lighthouse and three groups (needing two to commit); group ``VICTIM`` gets ``inject``."""
    report = tmp_path / "report.jsonl"
    args = ["--steps", "100000", "--sync-every", "10", "--fragments", "2", "--hidden", "32", "--min-replicas", "2",
            "--timeout", "15", "--report", str(report), "--log-level", "INFO"]
    with replica_groups(tmp_path, min_replicas=2, join_timeout=10.0, heartbeat_timeout=1.0) as (_, start):
        # The victim starts once both others sync together, so that it dies in a job of three.
        groups = [start(g, 3, SCRIPT, args) for g in range(VICTIM)]
        wait_for(lambda: all(any(r["participants"] == 2 for r in syncs(read_reports(report), g)) for g in range(2)),
                 "groups 0 and 1 to sync together", groups=groups)
        groups.append(start(VICTIM, 3, SCRIPT, args + inject))
        yield groups, report, args


def check_agreement(rows: list[dict]) -> int:
    """One global checksum and one outer-state checksum per job step, over every group; returns the number
    of steps more than one group committed."""
    by_step: dict[int, dict[str, set[str]]] = defaultdict(lambda: {"checksum": set(), "outer_checksum": set()})
    groups_at: dict[int, set[int]] = defaultdict(set)
    for row in rows:
        if row["event"] == "sync":
            for key in ("checksum", "outer_checksum"):
                by_step[row["step"]][key].add(row[key])
            groups_at[row["step"]].add(row["group"])
    for step, sums in sorted(by_step.items()):
        assert len(sums["checksum"]) == 1, f"global parameters differ at step {step}: {sums['checksum']}"
        assert len(sums["outer_checksum"]) == 1, f"outer optimizer state differs at step {step}: {sums}"
    return sum(len(g) > 1 for g in groups_at.values())


@pytest.mark.parametrize("where, inject", [
    ("mid inner loop", ["--kill-at-inner-step", "23"]),  # fragment syncs end inner steps 5, 10, ...: 23 is between
    ("mid sync", ["--kill-in-sync", "4"]),  # in the sync after its 4th committed one
])
def test_a_group_killed_then_restarted_leaves_every_group_agreeing(tmp_path, where, inject):
    with three_groups(tmp_path, ["--inject-group", str(VICTIM), *inject]) as (groups, report, args):
        survivors, victim = groups[:VICTIM], groups[VICTIM]
        # It kills itself: wait for that, then for the survivors to sync on without it.
        deadline = time.monotonic() + WAIT
        while victim.wait(1.0) != [-9]:
            assert victim.wait(0) == [None], f"the victim exited with {victim.wait(0)}, not by its own SIGKILL"
            assert time.monotonic() < deadline, f"the victim did not kill itself {where} within {WAIT:.0f}s"
            for survivor in survivors:
                assert survivor.wait(0) == [None], f"group {survivor.group_id} exited with {survivor.wait(0)}"
        rows = read_reports(report)
        killed = victim.procs[0].pid
        died_at = max(steps(rows, VICTIM), default=0)
        top = max(max(steps(rows, g), default=0) for g in range(VICTIM))
        wait_for(lambda: all(max(steps(read_reports(report), g), default=0) >= top + 4 for g in range(VICTIM)),
                 "both survivors to commit 4 syncs after the kill", groups=survivors)

        victim.script_args = list(args)  # the restarted incarnation does not kill itself again
        victim.start()
        restarted = victim.procs[0].pid
        wait_for(lambda: len(syncs(read_reports(report), VICTIM, restarted)) >= 3,
                 "the restarted group's 3rd committed sync", groups=groups)
        for group in groups:
            group.stop()

    rows = read_reports(report)
    log = read_logs(tmp_path, f"group{VICTIM}.1.*.log")
    assert "injected SIGKILL" in log, f"the victim's log does not show the injected kill {where}"
    shared = check_agreement(rows)
    assert shared >= 5, f"only {shared} job steps were committed by more than one group"

    # The survivors committed the same syncs, one per step, from the first both were in to the last both reported.
    s0, s1 = steps(rows, 0), steps(rows, 1)
    first, last = max(s0[0], s1[0]), min(s0[-1], s1[-1])
    both = [s for s in s0 if first <= s <= last]
    assert both == [s for s in s1 if first <= s <= last] == list(range(first, last + 1)), (s0, s1)
    assert died_at + 4 <= last

    # It died in a job of three: its last committed sync had every group.
    victim_rows = syncs(rows, VICTIM, killed)
    assert len(victim_rows) >= 4 and victim_rows[-1]["participants"] == 3, victim_rows
    # The sync after its last commit (the one it died in, or the next) committed for both survivors
    # without it: no survivor counted the dead group in.
    for g in range(VICTIM):
        first_after = next(r for r in syncs(rows, g) if r["step"] == died_at + 1)
        assert first_after["participants"] == 2, f"group {g} committed step {died_at + 1} with the dead group"

    after = syncs(rows, VICTIM, restarted)
    assert after[0]["step"] > died_at, "the restarted group did not resume from the healed step"
    others = {(r["step"], r["checksum"], r["outer_checksum"]) for g in range(VICTIM) for r in syncs(rows, g)}
    matched = [r["step"] for r in after if (r["step"], r["checksum"], r["outer_checksum"]) in others]
    assert matched, f"no step of the restarted group was also committed by a survivor: {after}"
    restarted_log = read_logs(tmp_path, f"group{VICTIM}.2.*.log")
    assert "healed:" in restarted_log
