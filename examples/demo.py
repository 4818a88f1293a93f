"""The demo behind `make demo`: fault-tolerant DDP surviving a SIGKILL, healed live, then the whole job lost.

A lighthouse and three replica groups of examples/train_ddp.py, each launched
with torchrun (2 ranks each), train on CPU. Mid-run one group is
SIGKILLed; the others keep committing steps without it. The group is then
restarted: it is healed from a live peer (state dict over HTTP) and trains on
in lockstep. Then every group and the lighthouse are SIGKILLed at once (a
power cut), a few steps past a durable checkpoint taken while all three groups
trained (one group writes one every 10 steps): restarted, the job resumes from
it. The restarted lighthouse waits for all three groups (min_replicas 3), so
the steps done again have the groups they had the first time. The summary says
what happened and checks that every group holds bit-identical parameters at
every step they committed, and that the steps done again after the resume are
bit-identical to the first time. A check that found nothing to compare says so
and fails the demo. Exit code 0 when all checks pass.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup, job_token_env  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "train_ddp.py"
GROUPS = 3
CHECKPOINT_EVERY = 10
HEALED = re.compile(r"healed: ([\d.]+) MB in ([\d.]+)s \(([\d.]+) MB/s\)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--direct", action="store_true", help="launch ranks directly instead of with torchrun")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="MLP width; sets the state dict healed (1024: ~13 MB with AdamW state)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per replica group (default 2)")
    parser.add_argument("--timeout", type=float, default=100.0, help="give up on any phase after this many seconds")
    parser.add_argument("--workdir", help="keep logs and reports here (default: a temporary directory)")
    return parser.parse_args()


def reports(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def last_step(rows: list[dict], group: int) -> int:
    return max((r["step"] for r in rows if r["group"] == group), default=0)


def start_lighthouse(workdir: Path, min_replicas: int, port: int = 0) -> LighthouseProcess:
    return LighthouseProcess(min_replicas=min_replicas, join_timeout=2.0, heartbeat_timeout=2.0, port=port,
                             log_path=workdir / "lighthouse.log").start()


def wait_for(what: str, predicate, groups: list[ReplicaGroup], timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        for group in groups:
            if not group.alive():
                raise SystemExit(f"demo failed: group {group.group_id} exited while waiting for {what}")
        if time.monotonic() - started > timeout:
            raise SystemExit(f"demo failed: timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)
    print(f"  ... {what} ({time.monotonic() - started:.1f}s)", flush=True)
    return time.monotonic()


def main() -> int:
    args = parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="torchft-lite-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "report.jsonl"
    print(f"torchft_lite demo: logs and per-step reports in {workdir}")
    lighthouse = start_lighthouse(workdir, min_replicas=2)
    lighthouses = [lighthouse]  # the whole-job outage restarts it as a new one on the same port
    print(f"lighthouse at {lighthouse.address} (min_replicas=2, heartbeat timeout 2s); every call carries the job "
          f"token ({'a random one made for this run' if job_token_env() else 'yours, from TORCHFT_LITE_TOKEN/_FILE'})")
    checkpoints = workdir / "checkpoints"
    train_args = ["--steps", "1000000", "--step-sleep", "0.05", "--hidden", str(args.hidden), "--report", str(report),
                  "--timeout", "10", "--checkpoint-dir", str(checkpoints),
                  "--checkpoint-every", str(CHECKPOINT_EVERY)]
    groups = [ReplicaGroup(g, 3, lighthouse.address, SCRIPT, train_args, world_size=args.ranks,
                           use_torchrun=not args.direct, log_dir=workdir) for g in range(3)]
    ok = False
    try:
        for group in groups:
            group.start()
        launcher = "direct" if args.direct else "torchrun"
        print(f"3 replica groups started ({args.ranks} rank(s) each, {launcher})")
        wait_for("all groups past step 15", lambda: min(last_step(reports(report), g) for g in range(3)) >= 15,
                 groups, args.timeout)
        victim = groups[2]
        victim.kill(signal.SIGKILL)
        killed_at = time.monotonic()
        step_at_kill = last_step(reports(report), 0)
        print(f"SIGKILLed replica group 2 at step ~{step_at_kill}")
        resumed = wait_for(
            "survivors committing without group 2",
            lambda: any(r["participants"] == 2 and r["step"] > step_at_kill for r in reports(report) if r["group"] == 0),
            groups[:2], args.timeout)
        stall = resumed - killed_at
        wait_for("survivors 15 steps further", lambda: last_step(reports(report), 0) >= step_at_kill + 15,
                 groups[:2], args.timeout)
        first_life = {r["pid"] for r in reports(report)}
        victim.start()
        restart_step = last_step(reports(report), 0)
        print(f"restarted replica group 2 (survivors at step {restart_step})")

        def rejoined() -> list[int]:  # the steps group 2's new ranks committed (the survivors moved on meanwhile)
            return [r["step"] for r in reports(report) if r["group"] == 2 and r["rank"] == 0
                    and r["pid"] not in first_life]

        wait_for("group 2 healed and 10 steps in lockstep", lambda: len(rejoined()) >= 10, groups, args.timeout)
        outage = whole_job_outage(lighthouses, workdir, groups, report, checkpoints, min(rejoined()), args.timeout)
        rows = reports(report)
        ok = summarize(rows, workdir, stall, step_at_kill, outage)
    finally:
        for group in groups:
            group.stop()
        for each in lighthouses:
            each.stop()
    return 0 if ok else 1


def ready_to_kill_all(rows: list[dict], newest: int, rejoined_at: int, every: int = CHECKPOINT_EVERY) -> bool:
    """Whether a whole-job SIGKILL now leaves steps to redo that all groups took the first time.

    ``newest``: the newest complete durable checkpoint's step; ``rejoined_at``: group 2's first step after its
    restart. The checkpoint must be from after that, every step committed since it must have had all groups,
    and group 0 must be 3 to ``every - 3`` steps past a multiple of ``every``: at least 3 steps to redo, and
    no checkpoint that could complete at the step the kill lands on while the groups are killed one by one.
    """
    last = last_step(rows, 0)
    since = [r["participants"] for r in rows if r["step"] > newest]
    return (newest > rejoined_at and 3 <= last % every <= every - 3 and bool(since)
            and all(p == GROUPS for p in since))


def whole_job_outage(lighthouses: list[LighthouseProcess], workdir: Path, groups: list[ReplicaGroup], report: Path,
                     checkpoints: Path, rejoined_at: int, timeout: float) -> dict:
    """SIGKILL every group and the lighthouse, restart them all, and wait for the resumed job to pass that step."""
    from torchft_lite.durable._layout import Layout

    layout = Layout(checkpoints)

    def newest_complete() -> int:
        complete = layout.complete()
        return complete[0].step if complete else 0

    wait_for("a durable checkpoint taken with all 3 groups, a few steps back",
             lambda: ready_to_kill_all(reports(report), newest_complete(), rejoined_at), groups, timeout)
    lighthouse = lighthouses[-1]
    killed_step = last_step(reports(report), 0)
    before = {r["pid"] for r in reports(report)}
    for group in groups:
        group.kill(signal.SIGKILL)
    lighthouse.kill()
    newest = newest_complete()
    print(f"SIGKILLed every replica group and the lighthouse at step ~{killed_step} "
          f"(newest complete durable checkpoint: step {newest})")
    killed_at = time.monotonic()
    # The same port, so the groups' TORCHFT_LIGHTHOUSE stays right. min_replicas 3: no quorum until every
    # group is back, so each redone step has the groups it had the first time (a late group would otherwise
    # leave the first steps to two groups, which average other batches, and every later step inherits that).
    lighthouses.append(start_lighthouse(workdir, min_replicas=GROUPS, port=lighthouse.port))
    for group in groups:
        group.start()
    print(f"restarted the lighthouse (min_replicas={GROUPS}: the resumed job waits for every group) and all 3 groups")

    def resumed_rows() -> list[dict]:
        return [r for r in reports(report) if r["pid"] not in before]

    first = wait_for("the resumed job's first committed step", lambda: bool(resumed_rows()), groups, timeout)
    wait_for(f"the resumed job 10 steps past step {killed_step}",
             lambda: min(last_step(resumed_rows(), g) for g in range(3)) >= killed_step + 10, groups, timeout)
    return {"killed_step": killed_step, "resumed_from": newest, "first_commit_seconds": first - killed_at,
            "first_pids": before}


def summarize(rows: list[dict], workdir: Path, stall: float, step_at_kill: int, outage: dict) -> bool:
    # Group rank r of every replica group forms one data-parallel ring (as in
    # torchft), so parameters are compared per (step, group rank) across groups,
    # within each run of the job (before and after the whole-job outage).
    by_step: dict[tuple[bool, int, int], set[str]] = defaultdict(set)
    groups_at: dict[tuple[bool, int, int], set[int]] = defaultdict(set)
    participants: dict[tuple[bool, int, int], set[int]] = defaultdict(set)
    for row in rows:
        key = (row["pid"] in outage["first_pids"], row["step"], row["rank"])
        by_step[key].add(row["checksum"])
        groups_at[key].add(row["group"])
        participants[key].add(row["participants"])
    diverged = sorted(key[1:] for key, sums in by_step.items() if len(sums) > 1)
    # A step redone after the resume matches its first run when every step since the resume had as many
    # groups both times: the SIGKILLs of the outage land one group at a time, so the last steps before it may
    # have had fewer, and a group that joins the resumed job late leaves its first steps with fewer too. A
    # step with other groups averages other batches, and every later step inherits that.
    candidates = [(step, rank) for (first, step, rank) in by_step if not first and (True, step, rank) in by_step]
    other_groups = [step for step, rank in candidates
                    if participants[(True, step, rank)] != participants[(False, step, rank)]]
    redone = [(step, rank) for step, rank in candidates if not other_groups or step < min(other_groups)]
    redone_same = sum(by_step[(True, step, rank)] == by_step[(False, step, rank)] for step, rank in redone)
    heals = [HEALED.search(line) for log in workdir.glob("group2.2.*.log")
             for line in log.read_text(errors="replace").splitlines()]
    heals = [m for m in heals if m]
    group2_steps = sorted(r["step"] for r in rows if r["group"] == 2)
    resumed_at = next((s for s in group2_steps if s > step_at_kill + 1), None)
    print("\n================ summary ================")
    print(f"steps committed (max)          {max(step for _, step, _ in by_step)}")
    print(f"failures survived              1 (SIGKILL of replica group 2 at step ~{step_at_kill})")
    print(f"survivors' stall after kill    {stall:.1f}s (until a step committed without group 2)")
    if heals:
        mb, seconds, rate = heals[0].groups()
        print(f"heal                           {mb} MB in {seconds}s ({rate} MB/s), group 2 rejoined at step {resumed_at}")
    else:
        print("heal                           NOT FOUND in group 2's logs")
    lost = outage["killed_step"] - outage["resumed_from"]
    print(f"whole-job outage               every group and the lighthouse SIGKILLed at step ~{outage['killed_step']}; "
          f"resumed from the durable checkpoint of step {outage['resumed_from']} ({lost} steps redone), first "
          f"step committed {outage['first_commit_seconds']:.1f}s after the kill")
    if redone:
        cut = (f"; {len(candidates) - len(redone)} later pair(s) not compared: from step {min(other_groups)} on a "
               f"quorum had another number of groups" if other_groups else "")
        print(f"redone steps identical         {redone_same} of {len(redone)} (step, rank) pairs bit-identical to the "
              f"first time{cut}")
    elif candidates:
        print(f"redone steps identical         NOT CHECKED: nothing to compare (the first redone step, "
              f"{min(other_groups)}, had another number of groups than the first time, and every later step "
              f"inherits that)")
    else:
        print("redone steps identical         NOT CHECKED: no step was redone in this run, nothing to compare")
    checked = sum(1 for groups in groups_at.values() if len(groups) > 1)
    if checked or diverged:
        print(f"identical parameters           {'yes' if not diverged else 'NO'} ({checked} (step, rank) pairs held by "
              f"several groups{'; diverged at ' + str(diverged[:5]) if diverged else ''})")
    else:
        print("identical parameters           NOT CHECKED: no (step, rank) pair was held by several groups, nothing "
              "to compare")
    print("==========================================")
    resumed = outage["resumed_from"] > 0
    if not resumed:
        print("the job did NOT resume from a durable checkpoint")
    if redone_same != len(redone):
        print("a step redone after the resume differs from its first run")
    return not diverged and bool(heals) and resumed and bool(redone) and redone_same == len(redone) and checked > 0


if __name__ == "__main__":
    sys.exit(main())
