"""Recovery benchmark: how long survivors stall when a replica group dies, and how fast it rejoins.

N replica groups of examples/train_ddp.py (one rank each, CPU, gloo) train
against a lighthouse with its default heartbeat timeout (5 s). Per trial, the
last group is SIGKILLed; then it is restarted. Measured from the groups'
per-step reports (wall clock):

* stall: from the kill to the first step a survivor commits on a quorum
  without the killed group;
* rejoin: from the restarted process's start to its first committed step
  (import, rendezvous, quorum, live heal), and where that time went: the
  restarted process writes a timeline (``train_ddp.py --timeline``, see
  ``examples/rejoin_timeline.py``) that ``benchmarks/_rejoin_breakdown.py``
  splits into interpreter start, ``import torch``, importing the library,
  ``Manager()`` (store, ManagerServer, lighthouse connect), first quorum,
  process-group configure, heal and first commit, for both libraries. The
  library's own part runs from "torch imported" to the first committed step
  (issue 19's goal for ours: <= 0.5 s, and the whole rejoin below torchft's).

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
``torchft_lite+standby`` (and ``torchft+standby``) restart the killed group
in a warm standby (``torchft_lite.cluster.standby``, started and warmed before each
kill): what a launcher can do about the interpreter and ``import torch``.
Every run also reports what its groups' per-step reports say about the
training itself: ``step_p50_s``, the median time between a group's
consecutive committed steps, and ``divergent_steps`` out of
``compared_steps``, the (step, rank) pairs more than one group committed
whose parameter checksums differ. ``--device cuda`` trains on the GPU
(``train_ddp.py --device cuda``: the groups share the machine's GPUs, gloo
across them); ``benchmarks/gpu_check.py`` runs it with a ~30M-parameter
model, ``--steps-after`` steps past the rejoin and fingerprints on and off.

Prints a table and one JSON line (the last line). Targets: our stall <= 0.5
s with the default heartbeat timeout (issue 5); our rejoin below torchft's and
our part of it <= 0.5 s (issue 19). The default state is about 1 MB
(``--hidden 256``: parameters and AdamW's two moments).

    python benchmarks/recovery_bench.py --groups 2 --trials 3
"""

from __future__ import annotations

import argparse
import compileall
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

from benchmarks._rejoin_breakdown import breakdown, format_table, median_breakdown  # noqa: E402
from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup, free_port  # noqa: E402

SCRIPT = REPO / "examples" / "train_ddp.py"


def divergence(rows: list[dict]) -> tuple[int, int]:
    """``(compared, divergent)``: the (step, rank) pairs more than one group committed, and those of them whose
    groups' parameter checksums differ."""
    sums: dict[tuple[int, int], dict[int, str]] = {}
    for row in rows:
        sums.setdefault((row["step"], row.get("rank", 0)), {})[row["group"]] = row["checksum"]
    shared = [set(by_group.values()) for by_group in sums.values() if len(by_group) > 1]
    return len(shared), sum(len(checksums) > 1 for checksums in shared)


def step_time(rows: list[dict]) -> float | None:
    """The median seconds between a process's consecutive committed steps (None with fewer than two)."""
    gaps, last = [], {}
    for row in sorted(rows, key=lambda r: r["time"]):
        key = (row["group"], row.get("rank", 0), row.get("pid"))
        previous = last.get(key)
        if previous is not None and row["step"] == previous["step"] + 1:
            gaps.append(row["time"] - previous["time"])
        last[key] = row
    return statistics.median(gaps) if gaps else None


def training_summary(rows: list[dict]) -> dict:
    compared, divergent = divergence(rows)
    return {"compared_steps": compared, "divergent_steps": divergent, "step_p50_s": step_time(rows)}


def reports(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def torchft_lighthouse_binary() -> str | None:
    """torchft's lighthouse CLI: beside this interpreter, or in the ``bin`` of a ``sys.path`` entry (where
    ``pip install --target DIR`` puts console scripts, as ``make gpu-check`` installs torchft)."""
    places = [str(Path(sys.executable).parent), *(str(Path(entry) / "bin") for entry in sys.path if entry)]
    return shutil.which("torchft_lighthouse", path=os.pathsep.join(places))


def torchft_available() -> bool:
    if torchft_lighthouse_binary() is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import torchft"], capture_output=True, timeout=120)
    return probe.returncode == 0


class TorchftLighthouse:
    """torchft's own lighthouse CLI on a fixed free port."""

    def __init__(self, min_replicas: int, log_path: Path) -> None:
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        binary = torchft_lighthouse_binary()
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


def restarted_timeline(path: Path, group: ReplicaGroup, launched: float, standby_pid: int | None,
                       timeout: float = 30.0) -> dict:
    """The breakdown of the restarted process's rejoin, from the timeline line it wrote at its first commit;
    ``in_standby``: it is the standby (pid ``standby_pid``) warmed before the kill."""
    pid = group.procs[0].pid
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in reports(path):
            if line["pid"] == pid and line["group"] == group.group_id:
                return {**breakdown(line, launched), "in_standby": pid == standby_pid}
        time.sleep(0.05)
    raise SystemExit(f"group {group.group_id} (pid {pid}) committed but wrote no timeline line to {path} within "
                     f"{timeout:.0f}s; see its log in {path.parent}")


def wait_until(predicate, what: str, timeout: float, groups: list[ReplicaGroup]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        for group in groups:
            if group.procs and not group.alive():
                raise SystemExit(f"group {group.group_id} exited while waiting for {what}")
        time.sleep(0.02)


STANDBY = "+standby"
TORCHFT_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torchft")


def warm_standby(impl: str, group: ReplicaGroup) -> int | None:
    """For a ``+standby`` impl: start the group's next incarnation as a standby and wait until it is warm
    (before the kill, so its warm-up is not timed nor competing with the rejoin); its pid."""
    if not impl.endswith(STANDBY):
        return None
    group.start_standby(TORCHFT_PRELOAD if impl.startswith("torchft+") else None)
    if not group.wait_standby(300):
        raise SystemExit(f"group {group.group_id}'s standby was not warm within 300s")
    return group.standbys[0].pid


def run(impl: str, n: int, trials: int, workdir: Path, scenario: str = "survive", hang_after: float = 120.0,
        hidden: int = 256, *, train_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
        step_sleep: float = 0.02, steps_after: int = 0) -> dict:
    """``impl``: torchft_lite or torchft, optionally with ``+standby``. ``train_args``: more of train_ddp.py's
    flags; ``env``: the groups' extra environment; ``steps_after``: (survive) after each rejoin, train until the
    restarted group has committed this many more steps."""
    workdir.mkdir(parents=True)
    lib = impl.removesuffix(STANDBY)
    report = workdir / "report.jsonl"
    timeline = workdir / "timeline.jsonl"
    min_replicas = n if scenario == "full" else n - 1
    if lib == "torchft":
        lighthouse = TorchftLighthouse(min_replicas=min_replicas, log_path=workdir / "lighthouse.log")
    else:
        lighthouse = LighthouseProcess(min_replicas=min_replicas, join_timeout=60.0, heartbeat_timeout=5.0,
                                       log_path=workdir / "lighthouse.log").start()
    args = ["--impl", lib, "--steps", "1000000", "--step-sleep", str(step_sleep), "--report", str(report),
            "--timeout", "30", "--min-replicas", str(n if scenario == "full" else 1), "--hidden", str(hidden),
            "--timeline", str(timeline), *train_args]
    groups = [ReplicaGroup(g, n, lighthouse.address, SCRIPT, args, log_dir=workdir, env=env) for g in range(n)]
    if scenario == "full":
        try:
            return {**_run_full(impl, n, trials, report, groups, hang_after, timeline),
                    **training_summary(reports(report))}
        finally:
            for group in groups:
                group.stop()
            lighthouse.stop()
    stalls, rejoins, breakdowns = [], [], []
    try:
        for group in groups:
            group.start()
        victim = groups[-1]
        survivors = list(range(n - 1))
        for trial in range(trials):
            start_rows = len(reports(report))
            wait_until(lambda: all(sum(1 for r in reports(report)[start_rows:] if r["group"] == g) >= 10 for g in range(n)),
                       "every group to commit 10 steps", 300, groups)
            standby_pid = warm_standby(impl, victim)
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
            breakdowns.append(restarted_timeline(timeline, victim, started, standby_pid))
            print(f"  {workdir.name} #{trial + 1}: stall {stalls[-1]:.2f}s, rejoin {rejoins[-1]:.2f}s "
                  f"(torch imported -> first commit {breakdowns[-1]['from_torch_s']:.2f}s)", flush=True)
            if steps_after:
                wait_until(lambda: sum(1 for r in reports(report) if r["group"] == n - 1 and r["time"] > started)
                           >= steps_after, f"the restarted group's {steps_after} steps", 600, groups)
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()
    return {"stall_s": stalls, "rejoin_s": rejoins, "breakdowns": breakdowns, **training_summary(reports(report))}


def _run_full(impl: str, n: int, trials: int, report: Path, groups: list[ReplicaGroup], hang_after: float,
              timeline: Path) -> dict:
    """min_replica_size = N: kill the last group, restart it, time until every group commits together."""
    rejoins: list[float] = []
    breakdowns: list[dict] = []
    hung = 0
    for group in groups:
        group.start()
    victim = groups[-1]
    for trial in range(trials):
        start_rows = len(reports(report))
        wait_until(lambda: all(sum(1 for r in reports(report)[start_rows:] if r["group"] == g) >= 10 for g in range(n)),
                   "every group to commit 10 steps", 300, groups)
        standby_pid = warm_standby(impl, victim)
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
            print(f"  {report.parent.name} #{trial + 1}: HUNG ({exc})", flush=True)
            break  # the run can't go on: nothing commits
        rejoins.append(together() - started)
        breakdowns.append(restarted_timeline(timeline, victim, started, standby_pid))
        print(f"  {report.parent.name} #{trial + 1}: rejoin {rejoins[-1]:.2f}s (restart -> every group committing; "
              f"torch imported -> its first commit {breakdowns[-1]['from_torch_s']:.2f}s)", flush=True)
    return {"rejoin_s": rejoins, "hung": hung, "breakdowns": breakdowns}


def merged(runs: list[dict]) -> dict:
    """The trials of several runs of one impl and scenario, with their medians."""
    out: dict = {key: [x for r in runs for x in r[key]] for key in ("rejoin_s", "breakdowns")}
    if "stall_s" in runs[0]:
        out["stall_s"] = [x for r in runs for x in r["stall_s"]]
        out["stall_p50_s"] = statistics.median(out["stall_s"])
    else:
        out["hung"] = sum(r["hung"] for r in runs)
    out["rejoin_p50_s"] = statistics.median(out["rejoin_s"]) if out["rejoin_s"] else None
    out["breakdown"] = median_breakdown(out["breakdowns"]) if out["breakdowns"] else None
    out["compared_steps"] = sum(r["compared_steps"] for r in runs)
    out["divergent_steps"] = sum(r["divergent_steps"] for r in runs)
    step_times = [r["step_p50_s"] for r in runs if r["step_p50_s"] is not None]
    out["step_p50_s"] = statistics.median(step_times) if step_times else None
    return out


def rejoin_targets(results: dict[str, dict]) -> dict[str, bool | None]:
    """Issue 19's rejoin goals, for a plain restart and one from a standby (None: not measured)."""
    theirs = results.get("torchft")
    targets: dict[str, bool | None] = {}
    for impl, prefix in (("torchft_lite", "ours"), ("torchft_lite+standby", "standby")):
        r = results.get(impl)
        from_torch = r["breakdown"]["from_torch_s"] if r else None
        targets[f"{prefix}_from_torch_le_0.5s"] = None if from_torch is None else from_torch <= 0.5
        targets[f"{prefix}_rejoin_below_torchft"] = (None if r is None or theirs is None
                                                      else r["rejoin_p50_s"] < theirs["rejoin_p50_s"])
        targets[f"{prefix}_library_part_below_torchft"] = (
            None if r is None or theirs is None else r["breakdown"]["library_s"] < theirs["breakdown"]["library_s"])
    return targets


def compile_bytecode() -> None:
    """Write the bytecode of this checkout's packages (and the examples' helpers) now, as ``pip install`` does
    for an installed package such as torchft: with ``PYTHONDONTWRITEBYTECODE=1`` (set on some machines) an
    editable install is otherwise compiled from source in every restarted process, which cost this bench
    0.1-0.15 s of each torchft_lite rejoin that a user's installed copy never pays."""
    for package in ("torchft_lite", "lighthouse", "examples"):
        if not compileall.compile_dir(REPO / package, quiet=1):
            raise SystemExit(f"could not compile {REPO / package} to bytecode")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2, help="replica groups (default 2)")
    parser.add_argument("--trials", type=int, default=3, help="kill/restart cycles per implementation (default 3)")
    parser.add_argument("--hidden", type=int, default=256,
                        help="train_ddp.py's --hidden: 256 makes the state (parameters, AdamW moments) about 1 MB "
                             "(default 256)")
    parser.add_argument("--impls", default="torchft_lite,torchft,torchft_lite+standby",
                        help="comma-separated: torchft_lite, torchft (skipped when not installed), either with "
                             "+standby (the killed group restarts in a warm standby) "
                             "(default torchft_lite,torchft,torchft_lite+standby)")
    parser.add_argument("--scenarios", default="survive,full",
                        help="comma-separated: survive (min_replica_size=1: survivors train on), full "
                             "(min_replica_size=N: everyone waits for the restart) (default both)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="train_ddp.py's --device: cuda trains every group on this machine's GPUs (default cpu)")
    parser.add_argument("--hang-after", type=float, default=120.0,
                        help="full scenario: seconds after a restart with no step committed by every group "
                             "before the trial counts as hung (default 120)")
    args = parser.parse_args()
    if args.groups < 2:
        parser.error("--groups must be at least 2")
    unknown = [impl for impl in args.impls.split(",") if impl.removesuffix(STANDBY) not in ("torchft_lite", "torchft")]
    if unknown:
        parser.error(f"--impls: unknown {unknown}")
    scenarios = args.scenarios.split(",")
    if not set(scenarios) <= {"survive", "full"}:
        parser.error(f"--scenarios: unknown {sorted(set(scenarios) - {'survive', 'full'})}")
    workdir = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    print(f"logs in {workdir}")
    compile_bytecode()
    impls = args.impls.split(",")
    if any(impl.removesuffix(STANDBY) == "torchft" for impl in impls) and not torchft_available():
        print("torchft not importable (make bench installs its OpenTelemetry deps): skipped")
        impls = [impl for impl in impls if impl.removesuffix(STANDBY) != "torchft"]
    # One trial of each impl in turn, each on a fresh cluster: the load of this shared machine drifts, and
    # interleaving spreads it over the impls instead of handing one all of a busy minute.
    runs: dict[tuple[str, str], list[dict]] = {}
    for trial in range(args.trials):
        for scenario in scenarios:
            for impl in impls:
                if scenario == "full" and any(r["hung"] for r in runs.get((impl, "full"), [])):
                    continue  # it hung once: its survivors can't commit, more trials tell nothing new
                runs.setdefault((impl, scenario), []).append(
                    run(impl, args.groups, 1, workdir / f"{impl}-{scenario}-{trial + 1}", scenario,
                        args.hang_after, args.hidden, train_args=("--device", args.device)))
    results = {impl: merged(runs[(impl, "survive")]) for impl in impls if (impl, "survive") in runs}
    full = {impl: merged(runs[(impl, "full")]) for impl in impls if (impl, "full") in runs}
    if results:
        print(f"\nsurvive (min_replica_size=1)\n{'impl':<22}{'stall p50 s':>13}{'rejoin p50 s':>14}{'step p50 s':>12}"
              f"{'divergent':>11}   all stalls / rejoins")
        for impl, r in results.items():
            step = f"{r['step_p50_s']:.3f}" if r["step_p50_s"] is not None else "-"
            print(f"{impl:<22}{r['stall_p50_s']:>13.2f}{r['rejoin_p50_s']:>14.2f}{step:>12}"
                  f"{r['divergent_steps']:>5}/{r['compared_steps']:<5}   "
                  f"{[round(x, 2) for x in r['stall_s']]} / {[round(x, 2) for x in r['rejoin_s']]}")
    if full:
        print(f"\nfull (min_replica_size={args.groups})\n{'impl':<22}{'rejoin p50 s':>14}{'hung':>6}   all rejoins")
        for impl, r in full.items():
            p50 = f"{r['rejoin_p50_s']:.2f}" if r["rejoin_p50_s"] is not None else "-"
            print(f"{impl:<22}{p50:>14}{r['hung']:>6}   {[round(x, 2) for x in r['rejoin_s']]}")
    if results:
        print(f"\nrejoin breakdown (survive: restarted process -> its first committed step)\n"
              f"{format_table({impl: r['breakdown'] for impl, r in results.items()})}")
    ours = results.get("torchft_lite")
    summary_targets = rejoin_targets(results)
    summary = {"groups": args.groups, "trials": args.trials, "hidden": args.hidden, "device": args.device,
               "heartbeat_timeout_s": 5.0,
               "results": results, "full": full, "target_stall_s": 0.5,
               "target_met": ours is not None and ours["stall_p50_s"] <= 0.5 and max(ours["stall_s"]) <= 0.5,
               "rejoin_targets_met": summary_targets,
               "full_rejoins": all(r["hung"] == 0 for r in full.values())}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
