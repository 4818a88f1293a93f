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
lighthouse starts (its ``a new epoch of the job starts`` line) is an unplanned
rewind: committed steps redone after faults of single groups.

torchft's lighthouse keeps no record of the job's step, so a restarted one (or
a quorum formed while the groups holding the latest step hang) can let the
job redo steps it had committed. Those rewinds are found from the reports
alone (:func:`find_rewinds`); for an implementation allowed to redo steps the
reports are split at them too, so a redone step is counted as redone, while
two states at one step of one epoch are still a divergence.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from bisect import bisect_left
from collections import defaultdict
from pathlib import Path

from benchmarks._rejoin_breakdown import breakdown, median_breakdown

__all__ = ["complete_checkpoints", "find_rewinds", "heal_and_stall_figures", "job_step_at", "kill_all_phases",
           "read_reports", "split_epochs", "verify"]

_STEP_DIR = re.compile(r"^step-(\d{12})$")
_RESUME_LINE = re.compile(r"\] (?:resumed from step (\d+)|no checkpoint: starting fresh)")
_EPOCH_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*a new epoch of the job starts \(number \d+ since this "
                         r"lighthouse started\): the highest step "
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
    MANIFEST.json reads back and names step N (docs/durable.md's definition, read independently of the library)."""
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


def split_epochs(rows: list[dict], restarts: list[dict]) -> list[list[dict]]:
    """The rows of each job epoch: epoch k holds the rows written between restart k-1 and restart k (a
    kill-all, or a rewind; each with its time ``at``)."""
    bounds = [event["at"] for event in restarts]
    epochs: list[list[dict]] = [[] for _ in range(len(bounds) + 1)]
    for row in rows:
        epochs[bisect_left(bounds, row["time"])].append(row)
    return epochs


def find_rewinds(rows: list[dict], kill_alls: list[dict], gap: float = 1.0) -> list[dict]:
    """Where the job went back and redid steps it had committed, from the reports alone: a process commits
    a step it (or, more than ``gap`` seconds before, any process) had already committed with other
    parameters, after the job had reached that step. Rows of one step written within ``gap`` of each other
    are one quorum's commit: if they differ, that is a divergence, not a rewind. Each rewind: ``at`` (just
    before the row that showed it), ``from_step`` (the highest step committed before), ``to_step`` (the
    step the job went on from). Kill-alls start fresh epochs of their own and are not rewinds.

    The job can also go back to a lineage it had left: a quorum that again includes the group holding the
    old, higher step heals everyone from it, and what was committed since the rewind is thrown away. That
    shows as a row whose step is past the epoch's highest + 1 while the step before it was committed in
    an earlier epoch; it is a rewind too, with ``to_step`` above ``from_step``."""
    bounds = [event["at"] for event in kill_alls]
    rewinds: list[dict] = []
    ever: set[int] = set()  # every step committed in this kill-all epoch, in any lineage
    first: dict[tuple[int, int], tuple[str, float]] = {}  # (step, rank) -> its first checksum and time
    own: dict[tuple[int, int], int] = {}  # (pid, rank) -> the last step it committed
    high, epoch = None, 0
    for row in sorted(rows, key=lambda r: r["time"]):
        if bisect_left(bounds, row["time"]) != epoch:
            epoch, high = bisect_left(bounds, row["time"]), None
            first.clear()
            own.clear()
            ever.clear()
        seen = first.get((row["step"], row["rank"]))
        again = own.get((row["pid"], row["rank"]))
        redone = ((seen is not None and seen[0] != row["checksum"] and row["time"] - seen[1] > gap)
                  or (again is not None and row["step"] <= again))
        back = high is not None and row["step"] > high + 1 and row["step"] - 1 in ever
        if (redone and high is not None and row["step"] <= high) or back:
            rewinds.append({"at": row["time"] - 1e-6, "from_step": high, "to_step": row["step"] - 1})
            first.clear()
            own.clear()
            high = None
        first.setdefault((row["step"], row["rank"]), (row["checksum"], row["time"]))
        own[(row["pid"], row["rank"])] = row["step"]
        ever.add(row["step"])
        high = row["step"] if high is None else max(high, row["step"])
    return rewinds


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


def verify(rows: list[dict], kill_alls: list[dict], starts: list[dict], workdir: Path,
           rewinds_allowed: bool = False) -> dict:
    """Every check, from the reports, the groups' logs and the lighthouse's log.

    ``kill_alls``: what the run recorded at each kill-all (``at``, wall time with every process dead;
    ``killed_step``; ``checkpoint``, the newest complete one then). ``starts``: every group start
    (``at``, ``group``, ``incarnation``, ``pids`` by rank). ``rewinds_allowed``: the implementation may
    redo committed steps after a fault (torchft): the rows are split at the rewinds found in them, which
    are counted and shown; otherwise rewinds are left in and fail the checks within their epoch."""
    rewinds = find_rewinds(rows, kill_alls)
    restarts = sorted([{"at": e["at"], "resumed": e["checkpoint"], "kill_all": i} for i, e in enumerate(kill_alls)]
                      + ([{"at": r["at"], "resumed": r["to_step"], "kill_all": None} for r in rewinds]
                         if rewinds_allowed else []), key=lambda r: r["at"])
    epochs = split_epochs(rows, restarts)
    found: dict[str, list] = defaultdict(list)
    kill_errors: list[str] = []
    events = []
    for k, epoch_rows in enumerate(epochs):
        resumed_at = restarts[k - 1]["resumed"] if k else 0
        batches_before = _batches_at(epochs[:k], resumed_at)
        if batches_before is None:
            kill_errors.append(f"epoch {k}: no single batches_committed reported at step {resumed_at}, where "
                               "the new epoch resumed")
        for key, value in _check_epoch(k, epoch_rows, resumed_at + 1, batches_before).items():
            found[key].extend(value)
    windows = []
    for k, restart in enumerate(restarts):
        if restart["kill_all"] is None:
            continue
        event, after = kill_alls[restart["kill_all"]], epochs[k + 1]
        kill_errors.extend(_check_kill_all(restart["kill_all"], event, after, starts, workdir))
        recovered = min((r["time"] for r in after), default=None)
        events.append({"killed_step": event["killed_step"], "checkpoint": event["checkpoint"],
                       "redone": event["killed_step"] - event["checkpoint"], "lighthouse": event["lighthouse"],
                       "recovery_s": None if recovered is None else round(recovered - event["at"], 2)})
        # A kill-all's epoch starts between the kill and the new epoch's first commit (0.5 s of slack: the
        # lighthouse's log stamps milliseconds), or the next restart when nothing was committed in between.
        ends = recovered
        if ends is None:
            ends = restarts[k + 1]["at"] if k + 1 < len(restarts) else float("inf")
        windows.append((event["at"], ends + 0.5, event["checkpoint"]))
    unplanned = [f"{time.strftime('%H:%M:%S', time.localtime(when))}: the lighthouse took the job from step "
                 f"{from_step} down to {to_step} because {why}"
                 for when, from_step, to_step, why in _lighthouse_epochs(workdir / "lighthouse.log")
                 if not any(start <= when <= end and to_step == c for start, end, c in windows)]
    last_rows = epochs[-1] or [{"step": restarts[-1]["resumed"] if restarts else 0}]
    commits = sum(len({r["step"] for r in epoch_rows}) for epoch_rows in epochs)
    recoveries = [e["recovery_s"] for e in events if e["recovery_s"] is not None]
    return {"committed_steps": max(r["step"] for r in last_rows), "commits": commits,
            "steps_redone": (sum(e["redone"] for e in events)
                             + sum(max(0, r["from_step"] - r["to_step"]) for r in rewinds)),
            "steps_thrown_away": sum(r["from_step"] - resumed for r, resumed in _back_to_old_lineages(rewinds)),
            "kill_all_recovery_median_s": round(statistics.median(recoveries), 2) if recoveries else None,
            "kill_all_recovery_max_s": max(recoveries, default=None),
            "divergent_steps": found["divergent_steps"], "duplicated_steps": found["duplicated_steps"],
            "missing_steps": found["missing_steps"], "inconsistent_steps": found["inconsistent_steps"],
            "batch_accounting_errors": found["batch_accounting_errors"][:20],
            "kill_alls": events, "kill_all_errors": kill_errors, "unplanned_rewinds": unplanned,
            "rewinds": rewinds, "restarts": restarts}


# What each library logs when a group has loaded a peer's state (ours says how many MB; torchft does not).
_HEALED = {"torchft_lite": re.compile(r"healed: ([\d.]+) MB"), "torchft": re.compile(r"Loaded state dict\.()")}


def _back_to_old_lineages(rewinds: list[dict]) -> list[tuple[dict, int]]:
    """The rewinds that went back to a lineage left before, each with the step its abandoned lineage started
    from (what was committed after that, up to the rewind's ``from_step``, was thrown away)."""
    found, started = [], 0
    for rewind in rewinds:
        if rewind["to_step"] > rewind["from_step"]:
            found.append((rewind, started))
        started = rewind["to_step"]
    return found


def heal_and_stall_figures(workdir: Path, rows: list[dict], restarts: list[dict], impl: str = "torchft_lite") -> dict:
    """Heals and their bytes (from the groups' logs) and stalls: gaps between committed steps over 1 s
    (a restart's gap, a kill-all's or a rewind's, runs from the last step before it to the first after it)."""
    heals, heal_mb = 0, 0.0
    for log in workdir.glob("group*.log"):
        for match in _HEALED[impl].finditer(log.read_text(errors="replace")):
            heals += 1
            heal_mb += float(match.group(1) or 0.0)
    first_commit: dict[tuple[int, int], float] = {}
    for k, epoch_rows in enumerate(split_epochs(rows, restarts)):
        for row in epoch_rows:
            key = (k, row["step"])
            first_commit[key] = min(first_commit.get(key, row["time"]), row["time"])
    times = [first_commit[key] for key in sorted(first_commit)]
    gaps = [b - a for a, b in zip(times, times[1:])]
    stalls = [g for g in gaps if g > 1.0]
    return {"heals": heals, "heal_mb": round(heal_mb, 1) if impl == "torchft_lite" else None,
            "stalls_over_1s": len(stalls), "longest_stall_s": round(max(gaps, default=0.0), 2),
            "stalled_s": round(sum(stalls), 1)}


def kill_all_phases(timelines: list[dict], kill_alls: list[dict], starts: list[dict], rows: list[dict]) -> dict | None:
    """Where a kill-all's time to the first step after it goes: for each process that was restarted after a
    kill-all and took part in the job's first commit after it (its first commit within 0.5 s of that one),
    the scheduler's restart delay and its rejoin phases (``benchmarks._rejoin_breakdown``, from the timeline
    line it wrote: ``train_ddp.py --timeline``); the median of each over all kill-alls. None without samples.
    ``starts``: the supervisor's group starts (``at``, ``pids`` by rank)."""
    by_pid = {line["pid"]: line for line in timelines if line.get("rank") == 0}
    samples, delays = [], []
    for k, kill in enumerate(kill_alls):
        until = kill_alls[k + 1]["at"] if k + 1 < len(kill_alls) else float("inf")
        first = min((r["time"] for r in rows if kill["at"] < r["time"] < until), default=None)
        if first is None:
            continue
        for start in starts:
            line = by_pid.get(start["pids"][0]) if start["pids"] else None
            if not kill["at"] < start["at"] < first or line is None:
                continue
            if line["events"].get("first_commit", float("inf")) > first + 0.5:
                continue  # restarted in time, but it joined the job later
            samples.append(breakdown(line, launched=start["at"]))
            delays.append(start["at"] - kill["at"])
    if not samples:
        return None
    result = median_breakdown(samples)
    result["restart_delay_s"] = statistics.median(delays)
    return result


def job_step_at(rows: list[dict], restarts: list[dict], when: float, key: str = "step") -> int:
    """The job's step at wall time ``when``: the highest committed in the epoch then under way (steps a
    restart redoes count once), or the step that epoch resumed from before its first commit. With ``key``
    ``batches_committed``: the batches the job had committed then (its goodput in batches, which also
    counts a group that is down, restarting or healing while the others commit without it)."""
    k = bisect_left([event["at"] for event in restarts], when)
    since = restarts[k - 1]["at"] if k else float("-inf")
    resumed = restarts[k - 1]["resumed"] if k else 0
    if key == "step":
        before = resumed
    else:  # the batches at the step the epoch resumed from, as an earlier epoch reported them
        before = max((r[key] for r in rows if r["step"] == resumed and r["time"] <= since), default=0)
    return max((r[key] for r in rows if since < r["time"] <= when), default=before)
