"""What a chaos run prints: each implementation's summary, the side-by-side table, and the goal.

The goal (issue 19, ``--check``): under the same fault schedule, torchft_lite's
efficiency (committed steps per second under faults over its own fault-free
rate) is ahead of torchft's, and torchft_lite's checks pass with no divergent
step. torchft's own checks are shown, not enforced: a redone step is counted
(its lighthouse keeps no record of the job's step), a divergence is shown as one.
"""

from __future__ import annotations

__all__ = ["goal", "print_side_by_side", "print_summary", "short_checks"]

FAILING = ("divergent_steps", "duplicated_steps", "missing_steps", "inconsistent_steps", "batch_accounting_errors",
           "kill_all_errors", "unplanned_rewinds")


def failures(checks: dict, outcome: dict, rewinds_allowed: bool) -> list[str]:
    """The checks a run failed, by name (empty: it passed). Rewinds fail only where they are not allowed."""
    failed = [key for key in FAILING if checks[key]]
    if checks["rewinds"] and not rewinds_allowed:
        failed.append("rewinds")
    if outcome["hangs"]:
        failed.append("hangs")
    return failed


def short_checks(checks: dict) -> dict:
    """The checks for the JSON line: counts, and the first few steps of each kind of violation."""
    short: dict = {}
    for key, value in checks.items():
        if key == "restarts":
            continue
        if isinstance(value, list):
            short[key], short[f"{key}_first"] = len(value), value[:10]
        else:
            short[key] = value
    return short


def print_summary(args, impl: str, result: dict) -> None:
    checks, figures, outcome = result["checks"], result["figures"], result["outcome"]
    faults, events = result["faults"], checks["kill_alls"]
    print(f"\n================ chaos summary: {impl} ================")
    print(f"seed / groups x ranks          {args.seed} / {args.groups} x {args.ranks}")
    print(f"process group                  {args.pg}")
    every = f"every {args.checkpoint_every} steps" if args.checkpoint_every and impl == "torchft_lite" else "off"
    print(f"durable checkpoints            {every}")
    print(f"faults injected                {sum(faults.values())} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(faults.items()))})"
          + (f"; {outcome['not_injected']} not injected by the end" if outcome["not_injected"] else ""))
    print(f"group restarts                 {result['restarts']}")
    mb = f" ({figures['heal_mb']:.0f} MB)" if figures["heal_mb"] is not None else ""
    print(f"heals (bytes)                  {figures['heals']}{mb}")
    print(f"stalls over 1 s                {figures['stalls_over_1s']} ({figures['stalled_s']:.0f} s in all, "
          f"longest {figures['longest_stall_s']:.1f} s)")
    print(f"committed steps                {checks['committed_steps']}"
          + (f" ({checks['commits']} commits in {len(checks['restarts']) + 1} job epochs)"
             if checks["restarts"] else ""))
    if events:
        redone = ", ".join(f"{e['killed_step']}->{e['checkpoint']}" for e in events[:6])
        print(f"kill-all faults                {len(events)} (killed at step -> resumed from: {redone}"
              f"{', ...' if len(events) > 6 else ''})")
        if checks["kill_all_recovery_max_s"] is not None:
            print(f"kill to first step after       median {checks['kill_all_recovery_median_s']:.1f} s, "
                  f"max {checks['kill_all_recovery_max_s']:.1f} s")
        phases = figures.get("kill_all_phases")
        if phases:
            print(f"  where it goes (median over the {phases['samples']} restarted processes that made the first step):")
            print(f"    {'restart delay':<16} {phases['restart_delay_s']:6.2f} s  the scheduler's (this harness: 0.5-3 s)")
            for name, seconds in phases["phases"].items():
                if seconds is not None:
                    print(f"    {name:<16} {seconds:6.2f} s")
        print(f"kill-all resume errors         {len(checks['kill_all_errors'])}")
    rewinds = ", ".join(f"{r['from_step']}->{r['to_step']}" for r in checks["rewinds"][:6])
    print(f"rewinds (from reports)         {len(checks['rewinds'])}" + (f" ({rewinds})" if rewinds else ""))
    print(f"steps redone / thrown away     {checks['steps_redone']} / {checks['steps_thrown_away']}")
    print(f"unplanned rewinds (lighthouse) {len(checks['unplanned_rewinds'])}")
    print(f"divergent steps                {len(checks['divergent_steps'])}")
    print(f"duplicated / missing steps     {len(checks['duplicated_steps'])} / {len(checks['missing_steps'])}")
    print(f"batch accounting errors        {len(checks['batch_accounting_errors'])}")
    print(f"hangs                          {len(outcome['hangs'])}")
    print(f"efficiency                     {outcome['efficiency']:.0%} "
          f"({outcome['chaos_steps_per_s']:.1f} vs {outcome['baseline_steps_per_s']:.1f} steps/s fault-free; "
          f"in batches committed {outcome['batch_efficiency']:.0%})")
    failed = result["failed"]
    print(f"verdict                        {'PASS' if not failed else 'FAIL: ' + ', '.join(failed)}")
    print("=" * (49 + len(impl)))
    for error in (checks["kill_all_errors"] + checks["unplanned_rewinds"])[:10]:
        print(f"  {error}")


def _cells(result: dict) -> dict[str, str]:
    checks, figures, outcome = result["checks"], result["figures"], result["outcome"]
    mb = f" ({figures['heal_mb']:.0f} MB)" if figures["heal_mb"] is not None else ""
    return {
        "faults injected": f"{sum(result['faults'].values())}" + (f" (+{outcome['not_injected']} not)"
                                                                   if outcome["not_injected"] else ""),
        "group restarts": f"{result['restarts']}",
        "fault-free steps/s": f"{outcome['baseline_steps_per_s']:.1f}",
        "  before / after": f"{outcome['baseline_before_steps_per_s']:.1f} / "
                            f"{outcome['baseline_after_steps_per_s']:.1f}",
        "steps/s under faults": f"{outcome['chaos_steps_per_s']:.1f}",
        "efficiency": f"{outcome['efficiency']:.0%}",
        "batch efficiency": f"{outcome['batch_efficiency']:.0%}",
        "longest stall": f"{figures['longest_stall_s']:.1f} s",
        "stalls over 1 s": f"{figures['stalls_over_1s']} ({figures['stalled_s']:.0f} s)",
        "heals": f"{figures['heals']}{mb}",
        "committed steps": f"{checks['committed_steps']}",
        "rewinds": f"{len(checks['rewinds'])}",
        "steps redone / thrown": f"{checks['steps_redone']} / {checks['steps_thrown_away']}",
        "divergent steps": f"{len(checks['divergent_steps'])}",
        "duplicated / missing": f"{len(checks['duplicated_steps'])} / {len(checks['missing_steps'])}",
        "hangs": f"{len(outcome['hangs'])}",
        "checks": "pass" if not result["failed"] else "FAIL: " + ", ".join(result["failed"]),
    }


def print_side_by_side(results: dict[str, dict], schedule: str) -> None:
    """One column per implementation, the same fault schedule in each."""
    columns = {impl: _cells(result) for impl, result in results.items()}
    width = max(16, *(len(v) for cells in columns.values() for v in cells.values() if not v.startswith("FAIL")))
    print(f"\n======== side by side: {schedule} ========")
    print(f"{'':<24}" + "".join(f"{impl:>{width + 2}}" for impl in columns))
    for row in next(iter(columns.values())):
        print(f"{row:<24}" + "".join(f"{cells[row]:>{width + 2}}" for cells in columns.values()))


def goal(results: dict[str, dict], torchft_missing: str | None) -> dict:
    """Issue 19's goal for this run: ``met`` True/False, and ``why`` when it is not met."""
    ours, theirs = results.get("torchft_lite"), results.get("torchft")
    if ours is None or theirs is None:
        why = torchft_missing or "the goal compares torchft_lite with torchft: run --impl torchft_lite,torchft"
        return {"met": False, "why": why}
    ahead = ours["outcome"]["efficiency"] > theirs["outcome"]["efficiency"]
    divergent = len(ours["checks"]["divergent_steps"])
    reasons = []
    if not ahead:
        reasons.append(f"torchft_lite's efficiency {ours['outcome']['efficiency']:.0%} is not ahead of torchft's "
                       f"{theirs['outcome']['efficiency']:.0%}")
    if divergent:
        reasons.append(f"torchft_lite has {divergent} divergent steps")
    if ours["failed"]:
        reasons.append(f"torchft_lite failed its checks ({', '.join(ours['failed'])})")
    return {"met": not reasons, "efficiency_ahead": ahead, "divergent_steps": divergent,
            "efficiency_ratio": round(ours["outcome"]["efficiency"] / theirs["outcome"]["efficiency"], 3)
            if theirs["outcome"]["efficiency"] else None, "why": "; ".join(reasons) or None}
