"""Fault-tolerant HSDP surviving the SIGKILL of one rank, healed shard by shard.

A lighthouse and two replica groups of examples/train_hsdp.py (2 ranks each,
FSDP2 inside the group, launched with torchrun) train on CPU. Mid-run one
rank of group 1 is SIGKILLed: its partner's next in-group collective fails
and it exits, so the whole group leaves; group 0 keeps committing alone.
Group 1 is then restarted: each of its ranks receives its own shard (model
and AdamW moments) from the same rank of group 0, and trains on in lockstep.
The summary checks that group rank r of both groups held bit-identical shards
at every step both committed. Exit code 0 when all checks pass.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo import last_step, reports, wait_for  # noqa: E402  (next to this script)

from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup, _descendants  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "train_hsdp.py"
SERVED = re.compile(r"served step (\d+) to replica\(s\) 1: ([\d.]+) MB")
HEALED = re.compile(r"healed: [\d.]+ MB in ([\d.]+)s")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--direct", action="store_true", help="launch ranks directly instead of with torchrun")
    parser.add_argument("--dim", type=int, default=256, help="model width (256: 1.65 M parameters, 20 MB with "
                                                            "AdamW's moments, each rank holding half)")
    parser.add_argument("--victim-rank", type=int, choices=[0, 1], default=1,
                        help="the rank of group 1 to SIGKILL (0 also takes the group's ManagerServer; default 1)")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up on any phase after this many seconds")
    parser.add_argument("--workdir", help="keep logs and reports here (default: a temporary directory)")
    return parser.parse_args()


def rank_pids(group: ReplicaGroup, report: Path) -> dict[int, int]:
    """pid of each live rank's training process, from its reports (under torchrun the workers are its children)."""
    alive = {pid for proc in group.procs for pid in (proc.pid, *_descendants(proc.pid))}
    return {r["rank"]: r["pid"] for r in reports(report) if r["group"] == group.group_id and r["pid"] in alive}


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie not yet reaped by its parent counts as exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def log_lines(workdir: Path, pattern: str, group: int, rank: int) -> str:
    """The lines rank ``rank`` of ``group`` logged (torchrun writes both ranks to one file; each line is tagged)."""
    tag = f" g{group}r{rank} "
    return "\n".join(line for log in sorted(workdir.glob(pattern))
                     for line in log.read_text(errors="replace").splitlines() if tag in line)


def main() -> int:
    args = parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="torchft-lite-hsdp-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / "report.jsonl"
    print(f"torchft_lite HSDP demo: logs and per-step reports in {workdir}")
    lighthouse = LighthouseProcess(min_replicas=1, join_timeout=2.0, heartbeat_timeout=2.0,
                                   log_path=workdir / "lighthouse.log").start()
    train_args = ["--steps", "1000000", "--step-sleep", "0.05", "--dim", str(args.dim), "--report", str(report),
                  "--timeout", "10"]
    groups = [ReplicaGroup(g, 2, lighthouse.address, SCRIPT, train_args, world_size=2, use_torchrun=not args.direct,
                           log_dir=workdir) for g in range(2)]
    ok = False
    try:
        for group in groups:
            group.start()
        print(f"2 replica groups of 2 ranks started ({'direct' if args.direct else 'torchrun'}), FSDP2 in each")
        wait_for("both groups past step 10", lambda: min(last_step(reports(report), g) for g in range(2)) >= 10,
                 groups, args.timeout)
        survivor, victim = groups
        pids = rank_pids(victim, report)
        step_at_kill = last_step(reports(report), 0)
        os.kill(pids[args.victim_rank], signal.SIGKILL)
        killed_at = time.monotonic()
        print(f"SIGKILLed rank {args.victim_rank} of replica group 1 at step ~{step_at_kill}")
        partner = pids[1 - args.victim_rank]
        wait_for(f"rank {1 - args.victim_rank} of group 1 to leave", lambda: gone(partner),
                 [survivor], args.timeout)
        resumed = wait_for("group 0 committing alone", lambda: any(
            r["participants"] == 1 and r["step"] > step_at_kill for r in reports(report) if r["group"] == 0),
            [survivor], args.timeout)
        victim.stop()  # what is left of it (torchrun's agent)
        victim.start()
        restart_step = last_step(reports(report), 0)
        print(f"restarted replica group 1 (group 0 at step {restart_step})")
        before = len(reports(report))
        wait_for("group 1 healed and 10 steps in lockstep", lambda: min(
            sum(r["group"] == 1 and r["rank"] == rank for r in reports(report)[before:]) for rank in (0, 1)) >= 10,
            groups, args.timeout)
        ok = summarize(reports(report), workdir, resumed - killed_at, step_at_kill, restart_step)
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()
    return 0 if ok else 1


def summarize(rows: list[dict], workdir: Path, stall: float, step_at_kill: int, restart_step: int) -> bool:
    by_step: dict[tuple[int, int], dict[int, str]] = defaultdict(dict)
    for row in rows:
        by_step[(row["step"], row["rank"])][row["group"]] = row["checksum"]
    diverged = sorted(key for key, sums in by_step.items() if len(set(sums.values())) > 1)
    shared = sum(len(sums) > 1 for sums in by_step.values())
    after = sum(len(sums) > 1 for (step, _), sums in by_step.items() if step > restart_step)
    print("\n================ summary ================")
    print(f"steps committed (max)          {max(step for step, _ in by_step)}")
    print(f"failure survived               SIGKILL of one rank of replica group 1 at step ~{step_at_kill}")
    print(f"group 0's stall after kill     {stall:.1f}s (until a step committed without group 1)")
    healed_all = True
    for rank in (0, 1):
        served = [m for m in SERVED.finditer(log_lines(workdir, "group0.*.log", 0, rank))
                  if int(m.group(1)) > step_at_kill]
        heals = list(HEALED.finditer(log_lines(workdir, "group1.2.*.log", 1, rank)))
        if served and heals:
            print(f"heal of shard {rank}                 {served[-1].group(2)} MB from group 0 rank {rank} in "
                  f"{heals[-1].group(1)}s")
        else:
            healed_all = False
            print(f"heal of shard {rank}                 NOT FOUND in the logs")
    if after or diverged:
        print(f"identical shards               {'yes' if not diverged else 'NO'} ({shared} (step, rank) pairs held by "
              f"both groups, {after} after the restart{'; diverged at ' + str(diverged[:5]) if diverged else ''})")
    else:  # the check that matters here is after the heal; pairs from before it alone don't make a "yes"
        print(f"identical shards               NOT CHECKED after the restart: no (step, rank) pair after it was held "
              f"by both groups, nothing to compare ({shared} before it)")
    print("==========================================")
    return not diverged and healed_all and after > 0


if __name__ == "__main__":
    sys.exit(main())
