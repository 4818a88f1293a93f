"""What a chaos run proves: the checks over the groups' reports and logs, and the summary.

The reports (one JSON line per committed step and rank) are split into *job
epochs* at every kill-all: every process is dead when a kill-all is recorded,
so a row written before its time belongs to the epoch it ended and a row
written after it to the next one. Within an epoch:

* at every committed step, group rank r of every group holds bit-identical parameters;
* no process commits a step twice, no step is skipped, and every step's
  ``batches_committed`` is the running sum of the participants (from the
  value at the step the epoch resumed from);

and across a kill-all, the new epoch's first committed step is C+1, where C is
the newest complete checkpoint on disk at the kill, and every process that
committed step C+1 logged ``resumed from step C``. Any other new epoch the
lighthouse starts (its ``epoch N of the job starts`` line) is an unplanned
rewind: committed steps redone after faults of single groups.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from bisect import bisect_left
from collections import defaultdict
from pathlib import Path

__all__ = ["complete_checkpoints", "heal_and_stall_figures", "print_summary", "read_reports", "verify"]

_STEP_DIR = re.compile(r"^step-(\d{12})$")
_RESUME_LINE = re.compile(r"\] (?:resumed from step (\d+)|no checkpoint: starting fresh)")
_EPOCH_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*epoch \d+ of the job starts: the highest step "
                         r"a quorum reached goes from (\d+) down to (\d+) because (.*?)(?:; the next quorum|$)")


def read_reports(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a SIGKILL mid-write; the step is verified from the other ranks/groups
    return rows


def complete_checkpoints(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, newest first: a ``step-N`` directory whose
    MANIFEST.json reads back and names step N (the README's definition, read independently of the library)."""
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    steps = []
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if not match:
            continue
        try:
            manifest = json.loads((entry / "MANIFEST.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and manifest.get("step") == int(match.group(1)):
            steps.append(int(match.group(1)))
    return sorted(steps, reverse=True)


def split_epochs(rows: list[dict], kill_alls: list[dict]) -> list[list[dict]]:
    """The rows of each job epoch: epoch k holds the rows written between kill-all k-1 and kill-all k."""
    bounds = [event["at"] for event in kill_alls]
    epochs: list[list[dict]] = [[] for _ in range(len(bounds) + 1)]
    for row in rows:
        epochs[bisect_left(bounds, row["time"])].append(row)
    return epochs


def _check_epoch(index: int, rows: list[dict], first_step: int, batches_before: int | None) -> dict[str, list]:
    """The invariants within one epoch that resumed at ``first_step - 1``; steps are named [epoch, step]."""
    sums: dict[tuple[int, int], set[str]] = defaultdict(set)
    participants: dict[int, set[int]] = defaultdict(set)
    batches: dict[int, set[int]] = defaultdict(set)
    per_process: dict[tuple[int, int], list[int]] = defaultdict(list)
    for row in rows:
        sums[(row["step"], row["rank"])].add(row["checksum"])
        participants[row["step"]].add(row["participants"])
        batches[row["step"]].add(row["batches_committed"])
        per_process[(row["pid"], row["rank"])].append(row["step"])
    steps = sorted(participants)
    last = steps[-1] if steps else first_step - 1
    found = {
        "divergent_steps": sorted({step for (step, _), seen in sums.items() if len(seen) > 1}),
        "duplicated_steps": sorted({s for done in per_process.values() for s in done if done.count(s) > 1}),
        "missing_steps": sorted(set(range(first_step, last + 1)) - set(steps)),
        "inconsistent_steps": [s for s in steps if len(participants[s]) > 1 or len(batches[s]) > 1],
        "batch_accounting_errors": [],
    }
    running = batches_before
    for s in range(first_step, last + 1):
        if running is None or s not in participants or len(participants[s]) > 1:
            continue
        running += next(iter(participants[s]))
        if batches[s] != {running}:
            found["batch_accounting_errors"].append(s)
    return {key: [[index, s] for s in value] for key, value in found.items()}


def _batches_at(epochs: list[list[dict]], step: int) -> int | None:
    """``batches_committed`` at ``step`` in the latest epoch that reported it (the one whose checkpoint it is)."""
    if step == 0:
        return 0
    for rows in reversed(epochs):
        values = {r["batches_committed"] for r in rows if r["step"] == step}
        if values:
            return values.pop() if len(values) == 1 else None
    return None


def _log_of(row: dict, starts: list[dict], workdir: Path) -> Path | None:
    """The log of the process that wrote ``row``: the latest start of its pid before the row."""
    for start in reversed(starts):
        if row["pid"] in start["pids"] and start["at"] <= row["time"]:
            return workdir / f"group{start['group']}.{start['incarnation']}.{start['pids'].index(row['pid'])}.log"
    return None


def _resumed_from(log: Path) -> int | None | str:
    """The step a process says it resumed from, None if it started fresh, "" if it said neither."""
    try:
        match = _RESUME_LINE.search(log.read_text(errors="replace"))
    except OSError:
        return ""
    if match is None:
        return ""
    return int(match.group(1)) if match.group(1) else None


def _lighthouse_epochs(log: Path) -> list[tuple[float, int, int, str]]:
    """(wall time, from step, to step, why) of every new epoch the lighthouse (any of its incarnations) started."""
    if not log.exists():
        return []
    found = []
    for line in log.read_text(errors="replace").splitlines():
        match = _EPOCH_LINE.match(line)
        if match:
            when = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000
            found.append((when, int(match.group(3)), int(match.group(4)), match.group(5)))
    return found


def _check_kill_all(k: int, event: dict, rows: list[dict], starts: list[dict], workdir: Path) -> list[str]:
    """Errors of kill-all ``k``: where epoch k+1 (``rows``) started and what its first processes resumed from."""
    c = event["checkpoint"]
    if not rows:
        return [f"kill-all {k + 1}: nothing committed after it (killed at step {event['killed_step']})"]
    first = min(r["step"] for r in rows)
    errors = []
    if first != c + 1:
        errors.append(f"kill-all {k + 1}: the new epoch's first committed step is {first}, not {c + 1} (the newest "
                      f"complete checkpoint at the kill was step {c}; killed at step {event['killed_step']})")
    for row in rows:
        if row["step"] != c + 1:
            continue
        log = _log_of(row, starts, workdir)
        said = _resumed_from(log) if log is not None else ""
        if said != c:
            what = {None: "started fresh", "": "logged no resume"}.get(said, f"resumed from step {said}")
            errors.append(f"kill-all {k + 1}: group {row['group']} rank {row['rank']} (pid {row['pid']}) committed "
                          f"step {c + 1} but {what}, not from step {c}")
    return errors


def verify(rows: list[dict], kill_alls: list[dict], starts: list[dict], workdir: Path) -> dict:
    """Every check, from the reports, the groups' logs and the lighthouse's log.

    ``kill_alls``: what the run recorded at each kill-all (``at``, wall time with every process dead;
    ``killed_step``; ``checkpoint``, the newest complete one then). ``starts``: every group start
    (``at``, ``group``, ``incarnation``, ``pids`` by rank)."""
    epochs = split_epochs(rows, kill_alls)
    found: dict[str, list] = defaultdict(list)
    kill_errors: list[str] = []
    events = []
    for k, epoch_rows in enumerate(epochs):
        resumed_at = kill_alls[k - 1]["checkpoint"] if k else 0
        batches_before = _batches_at(epochs[:k], resumed_at)
        if batches_before is None:
            kill_errors.append(f"kill-all {k}: no single batches_committed reported at step {resumed_at}, where "
                               "the new epoch resumed")
        for key, value in _check_epoch(k, epoch_rows, resumed_at + 1, batches_before).items():
            found[key].extend(value)
    for k, event in enumerate(kill_alls):
        after = epochs[k + 1]
        kill_errors.extend(_check_kill_all(k, event, after, starts, workdir))
        recovered = min((r["time"] for r in after), default=None)
        events.append({"killed_step": event["killed_step"], "checkpoint": event["checkpoint"],
                       "redone": event["killed_step"] - event["checkpoint"], "lighthouse": event["lighthouse"],
                       "recovery_s": None if recovered is None else round(recovered - event["at"], 2)})
    # A kill-all's epoch starts between the kill and the new epoch's first commit (0.5 s of slack: the
    # lighthouse's log stamps milliseconds), or the next kill-all when nothing was committed in between.
    windows = []
    for k, event in enumerate(kill_alls):
        ends = min((r["time"] for r in epochs[k + 1]), default=None)
        if ends is None:
            ends = kill_alls[k + 1]["at"] if k + 1 < len(kill_alls) else float("inf")
        windows.append((event["at"], ends + 0.5, event["checkpoint"]))
    unplanned = [f"{time.strftime('%H:%M:%S', time.localtime(when))}: the lighthouse took the job from step "
                 f"{from_step} down to {to_step} because {why}"
                 for when, from_step, to_step, why in _lighthouse_epochs(workdir / "lighthouse.log")
                 if not any(start <= when <= end and to_step == c for start, end, c in windows)]
    last_rows = epochs[-1] or [{"step": kill_alls[-1]["checkpoint"] if kill_alls else 0}]
    commits = sum(len({r["step"] for r in epoch_rows}) for epoch_rows in epochs)
    recoveries = [e["recovery_s"] for e in events if e["recovery_s"] is not None]
    return {"committed_steps": max(r["step"] for r in last_rows), "commits": commits,
            "steps_redone": sum(e["redone"] for e in events),
            "kill_all_recovery_median_s": round(statistics.median(recoveries), 2) if recoveries else None,
            "kill_all_recovery_max_s": max(recoveries, default=None),
            "divergent_steps": found["divergent_steps"], "duplicated_steps": found["duplicated_steps"],
            "missing_steps": found["missing_steps"], "inconsistent_steps": found["inconsistent_steps"],
            "batch_accounting_errors": found["batch_accounting_errors"][:20],
            "kill_alls": events, "kill_all_errors": kill_errors, "unplanned_rewinds": unplanned}


def heal_and_stall_figures(workdir: Path, rows: list[dict], kill_alls: list[dict]) -> dict:
    """Heals and their bytes (from the groups' logs) and stalls: gaps between committed steps over 1 s
    (a kill-all's gap runs from the last step before it to the first after it)."""
    heals, heal_mb = 0, 0.0
    for log in workdir.glob("group*.log"):
        for match in re.finditer(r"healed: ([\d.]+) MB", log.read_text(errors="replace")):
            heals += 1
            heal_mb += float(match.group(1))
    first_commit: dict[tuple[int, int], float] = {}
    for k, epoch_rows in enumerate(split_epochs(rows, kill_alls)):
        for row in epoch_rows:
            key = (k, row["step"])
            first_commit[key] = min(first_commit.get(key, row["time"]), row["time"])
    times = [first_commit[key] for key in sorted(first_commit)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    stalls = [g for g in gaps if g > 1.0]
    return {"heals": heals, "heal_mb": round(heal_mb, 1), "stalls_over_1s": len(stalls),
            "longest_stall_s": round(max(gaps, default=0.0), 2), "stalled_s": round(sum(stalls), 1)}


def print_summary(args, faults: dict, restarts: int, checks: dict, figures: dict, outcome: dict, ok: bool) -> None:
    events = checks["kill_alls"]
    print("\n================ chaos summary ================")
    print(f"seed / groups x ranks          {args.seed} / {args.groups} x {args.ranks}")
    print(f"process group                  {args.pg}")
    every = f"every {args.checkpoint_every} steps" if args.checkpoint_every else "off"
    print(f"durable checkpoints            {every}")
    print(f"faults injected                {sum(faults.values())} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(faults.items()))})")
    print(f"group restarts                 {restarts}")
    print(f"heals (bytes)                  {figures['heals']} ({figures['heal_mb']:.0f} MB)")
    print(f"stalls over 1 s                {figures['stalls_over_1s']} ({figures['stalled_s']:.0f} s in all, "
          f"longest {figures['longest_stall_s']:.1f} s)")
    print(f"committed steps                {checks['committed_steps']}"
          + (f" ({checks['commits']} commits in {len(events) + 1} job epochs)" if events else ""))
    if events:
        redone = ", ".join(f"{e['killed_step']}->{e['checkpoint']}" for e in events[:6])
        print(f"kill-all faults                {len(events)} (killed at step -> resumed from: {redone}"
              f"{', ...' if len(events) > 6 else ''})")
        print(f"steps redone                   {checks['steps_redone']}")
        if checks["kill_all_recovery_max_s"] is not None:
            print(f"kill to first step after       median {checks['kill_all_recovery_median_s']:.1f} s, "
                  f"max {checks['kill_all_recovery_max_s']:.1f} s")
        print(f"kill-all resume errors         {len(checks['kill_all_errors'])}")
    print(f"unplanned rewinds              {len(checks['unplanned_rewinds'])}")
    print(f"divergent steps                {len(checks['divergent_steps'])}")
    print(f"duplicated / missing steps     {len(checks['duplicated_steps'])} / {len(checks['missing_steps'])}")
    print(f"batch accounting errors        {len(checks['batch_accounting_errors'])}")
    print(f"hangs                          {len(outcome['hangs'])}")
    print(f"efficiency                     {outcome['efficiency']:.0%} "
          f"({outcome['chaos_steps_per_s']:.1f} vs {outcome['baseline_steps_per_s']:.1f} steps/s fault-free)")
    print(f"verdict                        {'PASS' if ok else 'FAIL'}")
    print("================================================")
    for error in (checks["kill_all_errors"] + checks["unplanned_rewinds"])[:10]:
        print(f"  {error}")
