"""Where a rejoin's time goes: phases from a restarted process's timeline (``examples/rejoin_timeline.py``).

Pure functions over the timeline's JSON, so the breakdown is tested without
processes. Each phase ends at an event; one the library did not report
(torchft logs no "quorum answered" when nothing changed, a replica that needs
no heal logs no heal) is None, and its time counts in the next phase that has
an end, so the phases always add up to the whole rejoin.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

__all__ = ["LIBRARY_PHASES", "OURS_FROM", "PHASES", "breakdown", "format_table", "median_breakdown"]

PHASES: list[tuple[str, str, str]] = [
    # (name, the event it ends at, what it is)
    ("launch", "process_start", "the launcher's restart call -> the process exists (fork, exec)"),
    ("interpreter", "script_start", "Python start-up to the script's first line"),
    ("import torch", "torch_imported", "import torch"),
    ("import library", "library_imported", "import the library and the names a trainer uses"),
    ("model and data", "manager_begin", "the script's own set-up (model, optimizer, dataset)"),
    ("Manager()", "manager_constructed", "process group object, Manager: store, ManagerServer, lighthouse connect"),
    ("checkpoint read", "checkpoint_resumed", "the newest durable checkpoint found, read and loaded (--checkpoint-dir)"),
    ("first quorum", "quorum_answered", "-> the lighthouse's first quorum answered"),
    ("configure", "configured", "process group configured for that quorum"),
    ("heal", "heal_applied", "checkpoint metadata, state dict received and applied"),
    ("first commit", "first_commit", "-> the first step committed (collectives, vote)"),
]
OURS_FROM = "torch_imported"
"""Issue 19's "part that is ours" starts when the interpreter has imported torch (it includes the script's own
set-up, whose first ``torch.optim`` optimizer imports ``torch._dynamo``: the same for either library)."""
LIBRARY_PHASES = ("import library", "Manager()", "checkpoint read", "first quorum", "configure", "heal", "first commit")
"""The phases only the library decides (``library_s``): the rest is the same script on the same torch."""


def breakdown(timeline: dict[str, Any], launched: float | None = None) -> dict[str, Any]:
    """Seconds per phase of one process's ``timeline`` line; ``launched``: when the launcher restarted it
    (``time.time()``), else the rejoin is counted from the process's start."""
    events: dict[str, float] = dict(timeline["events"])
    if launched is not None:
        events["launched"] = launched
    start_event = "launched" if launched is not None else "process_start"
    if start_event not in events:
        start_event = "script_start"
    previous = events[start_event]
    phases: dict[str, float | None] = {}
    skipping = launched is None  # without the launch time, the phases before the process start are unknown
    for name, event, _ in PHASES:
        if skipping:
            if event == start_event:
                skipping = False
            phases[name] = None
            continue
        at = events.get(event)
        if at is None:
            phases[name] = None
            continue
        phases[name] = max(0.0, at - previous)
        previous = max(previous, at)
    end = events["first_commit"]
    result: dict[str, Any] = {
        "phases": phases,
        "total_s": end - events[start_event],
        "from_torch_s": end - events[OURS_FROM] if OURS_FROM in events else None,
        "library_s": sum(phases[name] or 0.0 for name in LIBRARY_PHASES),
    }
    if timeline.get("first_step"):
        report = timeline["first_step"]
        result["first_step"] = {key: report[key] for key in ("quorum_s", "compute_s", "allreduce_s", "commit_s",
                                                             "healed_seconds", "healed_bytes") if key in report}
    return result


def median_breakdown(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The median of each phase (over the samples that have it) and of the totals."""
    phases = {}
    for name, _, _ in PHASES:
        values = [s["phases"][name] for s in samples if s["phases"].get(name) is not None]
        phases[name] = statistics.median(values) if values else None
    from_torch = [s["from_torch_s"] for s in samples if s.get("from_torch_s") is not None]
    return {"phases": phases, "total_s": statistics.median(s["total_s"] for s in samples),
            "from_torch_s": statistics.median(from_torch) if from_torch else None,
            "library_s": statistics.median(s["library_s"] for s in samples), "samples": len(samples)}


def format_table(medians: dict[str, dict[str, Any]]) -> str:
    """One column per library: each phase's median in seconds ("-" where the library reported no end)."""
    impls = list(medians)
    width = max(14, *(len(impl) + 2 for impl in impls))

    def row(label: str, values: list[float | None], what: str = "") -> str:
        cells = "".join(f"{'-' if v is None else f'{v:.3f}':>{width}}" for v in values)
        return f"{label:<18}{cells}" + (f"   {what}" if what else "")

    lines = [f"{'phase (median s)':<18}" + "".join(f"{impl:>{width}}" for impl in impls) + "   what"]
    for name, _, what in PHASES:
        lines.append(row(name, [medians[impl]["phases"].get(name) for impl in impls], what))
    lines.append(row("rejoin (sum)", [medians[i]["total_s"] for i in impls]))
    lines.append(row("torch -> commit", [medians[i]["from_torch_s"] for i in impls],
                     "torch imported -> first committed step (the script's set-up included)"))
    lines.append(row("library's part", [medians[i]["library_s"] for i in impls],
                     "the phases only the library decides: " + ", ".join(LIBRARY_PHASES)))
    return "\n".join(lines)
