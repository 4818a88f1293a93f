"""Recovery benchmark: how long survivors stall when a replica group dies, and how fast it rejoins.

N replica groups of examples/train_ddp.py (one rank each, CPU, gloo) train
against a lighthouse with its default heartbeat timeout (5 s). Per trial, the
last group is SIGKILLed; then it is restarted. Measured from the groups'
per-step reports (wall clock):

* stall: from the kill to the first step a survivor commits on a quorum
  without the killed group;
* rejoin: from the restarted process's start to its first committed step
  (import, rendezvous, quorum, live heal).

Two scenarios (``--scenarios``):

* ``survive``: ``min_replica_size=1``, the lighthouse's ``min_replicas`` is N-1:
  the survivors train on without the killed group (stall and rejoin above).
* ``full``: ``min_replica_size`` and ``min_replicas`` are N: nothing commits
  without every group, so the survivors wait for the restart. Rejoin is from
  the restart to the first step every group commits together; a run where
  that never happens within ``--hang-after`` seconds is reported as hung
  (this was torchft_lite's bug: the restarted group healed, failed to commit
  its heal step, undid the heal, and looped).

Runs torchft_lite (our lighthouse and Manager) and, when ``torchft`` is
importable with its ``torchft_lighthouse``, torchft (its lighthouse and
Manager) with the very same training script and settings, in the same run.
Prints a table and one JSON line (the last line). Target (issue 5): our
stall <= 0.5 s with the default heartbeat timeout.

    python benchmarks/recovery_bench.py --groups 3 --trials 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from torchft_lite.local_cluster import LighthouseProcess, ReplicaGroup, free_port  # noqa: E402

SCRIPT = REPO / "examples" / "train_ddp.py"


def reports(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def torchft_available() -> bool:
    if shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import torchft"], capture_output=True, timeout=120)
    return probe.returncode == 0


class TorchftLighthouse:
    """torchft's own lighthouse CLI on a fixed free port."""

    def __init__(self, min_replicas: int, log_path: Path) -> None:
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
        self.proc = subprocess.Popen([binary, "--min_replicas", str(min_replicas), "--bind", f"127.0.0.1:{self.port}"],
                                     stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"torchft_lighthouse did not start; see {log_path}")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def wait_until(predicate, what: str, timeout: float, groups: list[ReplicaGroup]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        for group in groups:
            if group.procs and not group.alive():
                raise SystemExit(f"group {group.group_id} exited while waiting for {what}")
        time.sleep(0.02)


def run(impl: str, n: int, trials: int, workdir: Path, scenario: str = "survive", hang_after: float = 120.0) -> dict:
    workdir.mkdir(parents=True)
    report = workdir / "report.jsonl"
    min_replicas = n if scenario == "full" else n - 1
    if impl == "torchft":
        lighthouse = TorchftLighthouse(min_replicas=min_replicas, log_path=workdir / "lighthouse.log")
    else:
        lighthouse = LighthouseProcess(min_replicas=min_replicas, join_timeout=60.0, heartbeat_timeout=5.0,
                                       log_path=workdir / "lighthouse.log").start()
    args = ["--impl", impl, "--steps", "1000000", "--step-sleep", "0.02", "--report", str(report), "--timeout", "30",
            "--min-replicas", str(n if scenario == "full" else 1)]
    groups = [ReplicaGroup(g, n, lighthouse.address, SCRIPT, args, log_dir=workdir) for g in range(n)]
    if scenario == "full":
        try:
            return _run_full(impl, n, trials, report, groups, hang_after)
        finally:
            for group in groups:
                group.stop()
            lighthouse.stop()
    stalls, rejoins = [], []
    try:
        for group in groups:
            group.start()
        victim = groups[-1]
        survivors = list(range(n - 1))
        for trial in range(trials):
            start_rows = len(reports(report))
            wait_until(lambda: all(sum(1 for r in reports(report)[start_rows:] if r["group"] == g) >= 10 for g in range(n)),
                       "every group to commit 10 steps", 300, groups)
            victim.kill(signal.SIGKILL)
            killed = time.time()
            wait_until(lambda: any(r["group"] in survivors and r["time"] > killed and r["participants"] == n - 1
                                   for r in reports(report)), "a survivor's step without the killed group", 300,
                       groups[:-1])
            first = min(r["time"] for r in reports(report)
                        if r["group"] in survivors and r["time"] > killed and r["participants"] == n - 1)
            stalls.append(first - killed)
            started = time.time()
            victim.start()
            wait_until(lambda: any(r["group"] == n - 1 and r["time"] > started for r in reports(report)),
                       "the restarted group's first committed step", 300, groups)
            rejoins.append(min(r["time"] for r in reports(report) if r["group"] == n - 1 and r["time"] > started)
                           - started)
            print(f"  {impl} trial {trial + 1}: stall {stalls[-1]:.2f}s, rejoin {rejoins[-1]:.2f}s", flush=True)
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()
    return {"stall_s": stalls, "rejoin_s": rejoins,
            "stall_p50_s": statistics.median(stalls), "rejoin_p50_s": statistics.median(rejoins)}


def _run_full(impl: str, n: int, trials: int, report: Path, groups: list[ReplicaGroup], hang_after: float) -> dict:
    """min_replica_size = N: kill the last group, restart it, time until every group commits together."""
    rejoins: list[float] = []
    hung = 0
    for group in groups:
        group.start()
    victim = groups[-1]
    for trial in range(trials):
        start_rows = len(reports(report))
        wait_until(lambda: all(sum(1 for r in reports(report)[start_rows:] if r["group"] == g) >= 10 for g in range(n)),
                   "every group to commit 10 steps", 300, groups)
        victim.kill(signal.SIGKILL)
        time.sleep(1.0)  # the survivors notice: nothing commits now
        started = time.time()
        victim.start()

        def together() -> float | None:
            times = [min((r["time"] for r in reports(report) if r["group"] == g and r["time"] > started), default=None)
                     for g in range(n)]
            return None if None in times else max(times)

        try:
            wait_until(lambda: together() is not None, "every group's first step together after the restart",
                       hang_after, groups)
        except SystemExit as exc:
            hung += 1
            print(f"  {impl} full trial {trial + 1}: HUNG ({exc})", flush=True)
            break  # the run can't go on: nothing commits
        rejoins.append(together() - started)
        print(f"  {impl} full trial {trial + 1}: rejoin {rejoins[-1]:.2f}s (restart -> every group committing)",
              flush=True)
    return {"rejoin_s": rejoins, "hung": hung,
            "rejoin_p50_s": statistics.median(rejoins) if rejoins else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=3, help="replica groups (default 3)")
    parser.add_argument("--trials", type=int, default=2, help="kill/restart cycles per implementation (default 2)")
    parser.add_argument("--impls", default="torchft_lite,torchft",
                        help="comma-separated: torchft_lite, torchft (skipped when not installed)")
    parser.add_argument("--scenarios", default="survive,full",
                        help="comma-separated: survive (min_replica_size=1: survivors train on), full "
                             "(min_replica_size=N: everyone waits for the restart) (default both)")
    parser.add_argument("--hang-after", type=float, default=120.0,
                        help="full scenario: seconds after a restart with no step committed by every group "
                             "before the trial counts as hung (default 120)")
    args = parser.parse_args()
    if args.groups < 2:
        parser.error("--groups must be at least 2")
    scenarios = args.scenarios.split(",")
    if not set(scenarios) <= {"survive", "full"}:
        parser.error(f"--scenarios: unknown {sorted(set(scenarios) - {'survive', 'full'})}")
    workdir = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    print(f"logs in {workdir}")
    results: dict[str, dict] = {}
    full: dict[str, dict] = {}
    for impl in args.impls.split(","):
        if impl == "torchft" and not torchft_available():
            print("torchft not importable (make bench installs its OpenTelemetry deps): skipped")
            continue
        if "survive" in scenarios:
            results[impl] = run(impl, args.groups, args.trials, workdir / impl)
        if "full" in scenarios:
            full[impl] = run(impl, args.groups, args.trials, workdir / f"{impl}-full", "full", args.hang_after)
    if results:
        print(f"\nsurvive (min_replica_size=1)\n{'impl':<14}{'stall p50 s':>13}{'rejoin p50 s':>14}   "
              f"all stalls / rejoins")
        for impl, r in results.items():
            print(f"{impl:<14}{r['stall_p50_s']:>13.2f}{r['rejoin_p50_s']:>14.2f}   "
                  f"{[round(x, 2) for x in r['stall_s']]} / {[round(x, 2) for x in r['rejoin_s']]}")
    if full:
        print(f"\nfull (min_replica_size={args.groups})\n{'impl':<14}{'rejoin p50 s':>14}{'hung':>6}   all rejoins")
        for impl, r in full.items():
            p50 = f"{r['rejoin_p50_s']:.2f}" if r["rejoin_p50_s"] is not None else "-"
            print(f"{impl:<14}{p50:>14}{r['hung']:>6}   {[round(x, 2) for x in r['rejoin_s']]}")
    ours = results.get("torchft_lite")
    summary = {"groups": args.groups, "trials": args.trials, "heartbeat_timeout_s": 5.0, "results": results,
               "full": full, "target_stall_s": 0.5,
               "target_met": ours is not None and ours["stall_p50_s"] <= 0.5 and max(ours["stall_s"]) <= 0.5,
               "full_rejoins": all(r["hung"] == 0 for r in full.values())}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
