"""Chaos run: inject faults on a seeded schedule and prove nothing is lost; compare with torchft.

Runs a lighthouse and N replica groups of examples/train_ddp.py (CPU, gloo,
small model; ``--ranks`` per group) and, between two fault-free phases that
set the baseline speed, injects faults from a schedule drawn from ``--seed``:

  kill        SIGKILL a whole replica group (restarted after a delay, like a scheduler)
  kill-rank   SIGKILL one rank of a group (the supervisor then replaces the group, as torchrun would)
  term        SIGTERM a group: it leaves gracefully (exit 143) and is restarted
  hang        SIGSTOP a group for a few seconds, then SIGCONT
  hang-before-vote  the same, aimed: each rank of the group stops itself once its next step's
              gradients were exchanged, before the commit vote (SIGUSR1 arms it; see
              train_ddp.py --inject-stop-on-usr1); SIGCONT a few seconds after every rank stopped
  partition   cut a group off the network for a few seconds (each group runs in its own
              network namespace behind a veth pair; the host side is set down, then up)
  lighthouse  SIGKILL the lighthouse and restart it on the same port
  kill-all    SIGKILL every group at once (in half the draws the lighthouse too, counted as
              kill-all+lighthouse) and restart them all after a delay: the job resumes
              from the newest complete durable checkpoint and redoes the steps after it

Either ``--faults`` faults a mean ``--interval`` apart, or a fault rate:
``--fault-every S --duration D``, one fault in the middle of every S seconds of
a D-second chaos phase, over which the efficiency is measured.

``--impl torchft_lite,torchft`` runs the very same schedule (drawn once from
the seed: kinds, times, targets, durations) against each implementation in
turn, each with its own lighthouse (torchft's is its ``torchft_lighthouse``,
with the same settings) and its own fault-free baseline, and prints them side
by side. The kinds are then those every implementation supports; the others
are named in the output (torchft has no durable checkpoints, so no kill-all).

With kill-all among the kinds, the groups save a durable checkpoint every
``--checkpoint-every`` steps (0: none, and no kill-all). The lighthouse runs as
a production one should: min_replicas = a majority of the groups, a 1 s join
timeout and a 2 s heartbeat timeout (ours also a --state-dir, so a restart
remembers the highest committed step, and its startup grace).

Verified from the groups' per-step reports (one JSON line per committed step
and rank, with a parameter checksum), split into job epochs at the kill-alls
(and, for torchft, at the rewinds the reports show; see benchmarks/_chaos_checks.py):

* at every committed step of an epoch, group rank r of every group holds bit-identical parameters;
* within an epoch, no step is committed twice by one process, none is skipped, and every
  step's ``batches_committed`` is the running sum of the participants;
* after a kill-all the job goes on from step C+1, C the newest complete checkpoint at the kill;
  no other rewind (torchft's are counted as steps redone instead);
* no hang: every group makes progress within ``--progress-timeout`` after the last fault;
* efficiency: net progress (redone steps count once) per second under faults / fault-free
  (the phases before and after the faults together); also in batches committed, which counts
  a group that is down or healing while the others commit without it.

Prints each implementation's summary, the side-by-side table and one JSON
line (the last line). Exit code 1 when torchft_lite's checks fail (torchft's
are shown; they gate the exit code only when it runs alone); with ``--check``
also when issue 19's goal fails: efficiency ahead of torchft's, no divergent step.

    python benchmarks/chaos.py --seed 1 --faults 200
    python benchmarks/chaos.py --impl torchft_lite,torchft --fault-every 5 --duration 120 --check
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._chaos_checks import (  # noqa: E402
    complete_checkpoints, heal_and_stall_figures, job_step_at, kill_all_phases, read_reports, verify,
)
from benchmarks._chaos_cli import parse_args  # noqa: E402
from benchmarks._chaos_faults import Fault, Network, make_schedule  # noqa: E402
from benchmarks._chaos_impls import make_lighthouse, torchft_missing  # noqa: E402
from benchmarks._chaos_report import failures, goal, print_side_by_side, print_summary, short_checks  # noqa: E402
from torchft_lite.cluster.local import ReplicaGroup  # noqa: E402

SCRIPT = REPO / "examples" / "train_ddp.py"


class Chaos:
    """One implementation's run of the schedule: its lighthouse and groups, the faults, the supervisor."""

    def __init__(self, args: argparse.Namespace, impl: str, workdir: Path, schedule: list[Fault]) -> None:
        self.args, self.impl, self.workdir = args, impl, workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.report = self.workdir / "report.jsonl"
        self.timelines = self.workdir / "timelines.jsonl"  # one line per process at its first commit
        if self.report.exists():  # its rows, logs and checkpoints would mix with this run's
            raise SystemExit(f"{self.workdir} holds a previous run's report.jsonl; use an empty --workdir")
        self.checkpoints = self.workdir / "checkpoints"
        self.network = Network(args.groups, hostnames=impl == "torchft") if "partition" in args.kinds else None
        self.lighthouse = make_lighthouse(impl, groups=args.groups, workdir=self.workdir,
                                          host="0.0.0.0" if self.network else "127.0.0.1")
        self.pending = list(schedule)
        self.supervisor_rng = random.Random(f"{args.seed}/supervisor")  # for what no fault chose
        self.partitioned: dict[int, float] = {}  # group -> when to reconnect it
        self.groups: list[ReplicaGroup] = []
        self.down: dict[int, float] = {}  # group -> when to restart it
        self.hung: dict[int, float] = {}  # group -> when to SIGCONT it
        self.arming: dict[int, tuple[float, float]] = {}  # hang-before-vote: group -> (give up at, stop for)
        self.leaving: dict[int, tuple[float, float]] = {}  # SIGTERMed group -> (restart delay, kill deadline)
        # Groups with a SIGKILLed rank, until the supervisor replaces them: their state is lost already, so they
        # are no holder of the latest step (a fault in the same tick could otherwise take the last live one).
        self.rank_lost: set[int] = set()
        self.faults: Counter[str] = Counter()
        self.restarts = 0
        self.starts: list[dict] = []  # every group start: its pids by rank, for the checker to find a row's log
        self.kill_alls: list[dict] = []  # what the checker needs of each kill-all (see _chaos_checks.verify)

    def say(self, message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} [{self.impl}] {message}", flush=True)

    def start(self) -> None:
        if self.network:
            self.network.setup()
        self.lighthouse.start()
        train = ["--impl", self.impl, "--steps", "100000000", "--step-sleep", "0.02", "--report", str(self.report),
                 "--timeout", "10", "--pg", self.args.pg, "--timeline", str(self.timelines)]
        if "hang-before-vote" in self.args.kinds:
            train.append("--inject-stop-on-usr1")
        if self.args.checkpoint_every:
            train += ["--checkpoint-dir", str(self.checkpoints), "--checkpoint-every", str(self.args.checkpoint_every)]
        for g in range(self.args.groups):
            env = {"TORCHFT_QUORUM_RETRIES": "3"}
            where: dict = {}
            lighthouse = self.lighthouse.address
            if self.network:
                # Not loopback: the job token torchft_lite.cluster.local gives every process it starts admits them.
                env.update(self.network.env(g))
                port = lighthouse.rsplit(":", 1)[1]
                lighthouse = f"http://{self.network.host_ip(g)}:{port}"
                where = dict(store_host=self.network.host_ip(g), advertise=self.network.group_ip(g),
                             prefix=self.network.prefix(g))
            group = ReplicaGroup(g, self.args.groups, lighthouse, SCRIPT, train,
                                 world_size=self.args.ranks, log_dir=self.workdir, env=env, **where)
            self.groups.append(group)
            self.start_group(g)

    def stop(self) -> None:
        for g in list(self.arming):
            self.groups[g].signal_ranks(signal.SIGUSR2)
        for g in [*self.hung, *self.arming]:
            self.groups[g].kill(signal.SIGCONT)
        for group in self.groups:
            # Every rank at once, as a scheduler stops a job: signalled one by one (stop() alone), a
            # rank saving a checkpoint before it leaves would wait for ranks not yet told to leave.
            group.kill(signal.SIGTERM)
        for group in self.groups:
            group.stop()
        self.lighthouse.stop()
        if self.network:
            self.network.teardown()

    def start_group(self, g: int) -> None:
        group = self.groups[g].start()
        self.starts.append({"at": time.time(), "group": g, "incarnation": group.incarnation,
                            "pids": [p.pid for p in group.procs]})

    def epoch_rows(self) -> list[dict]:
        """The rows of the current job epoch: written since the last kill-all."""
        since = self.kill_alls[-1]["at"] if self.kill_alls else 0.0
        return [r for r in read_reports(self.report) if r["time"] > since]

    def committed(self) -> int:
        """The job's step: the highest of this epoch (the step resumed from, before its first commit)."""
        resumed = self.kill_alls[-1]["checkpoint"] if self.kill_alls else 0
        return max((r["step"] for r in self.epoch_rows()), default=resumed)

    def supervise(self, now: float) -> None:
        """Restart groups that are due, resume hung ones, replace groups that lost a rank."""
        for g, (give_up, duration) in list(self.arming.items()):
            group = self.groups[g]
            if group.stopped():  # every rank stopped itself after its exchange: hold it, as a hang
                del self.arming[g]
                self.hung[g] = now + duration
                self.say(f"group {g}: every rank stopped itself after its exchange; SIGCONT in {duration:.1f}s")
            elif now >= give_up or not group.alive():
                group.signal_ranks(signal.SIGUSR2)  # disarm, and wake the ranks that did stop
                group.kill(signal.SIGCONT)
                del self.arming[g]
                self.say(f"group {g}: not every rank reached its exchange; hang-before-vote called off")
        for g, when in list(self.hung.items()):
            if now >= when:
                self.groups[g].kill(signal.SIGCONT)
                del self.hung[g]
                self.say(f"group {g}: SIGCONT")
        for g, when in list(self.partitioned.items()):
            if now >= when:
                self.network.cut(g, connected=True)
                del self.partitioned[g]
                self.say(f"group {g}: reconnected")
        for g, group in enumerate(self.groups):
            if g in self.down or g in self.hung or g in self.arming:
                if g in self.down and now >= self.down[g]:
                    group.stop()
                    self.start_group(g)
                    self.restarts += 1
                    del self.down[g]
                    self.say(f"group {g}: restarted (incarnation {group.incarnation})")
                continue
            codes = [p.poll() for p in group.procs]
            if g in self.leaving and now >= self.leaving[g][1] and None in codes:
                self.say(f"group {g}: still running 30 s after its SIGTERM; SIGKILL")
                group.kill(signal.SIGKILL)
                codes = [p.poll() for p in group.procs]
            if any(code is not None for code in codes):
                # A rank exited: the rest of the group can't go on (torchrun would restart them all).
                group.kill(signal.SIGKILL)
                delay = self.leaving.pop(g, (self.supervisor_rng.uniform(0.5, 2.0), 0.0))[0]
                self.down[g] = now + delay
                self.rank_lost.discard(g)
                self.say(f"group {g}: ranks exited {codes}; replacing it")

    def inject(self, now: float, fault: Fault) -> bool:
        """Inject ``fault`` unless it can't be now; whether it was."""
        kind, rng = fault.kind, fault.rng()
        if kind == "kill-all":
            return self.kill_all(now, rng)
        live = [g for g in range(len(self.groups))
                if g not in self.down and g not in self.hung and g not in self.partitioned and g not in self.leaving
                and g not in self.rank_lost and g not in self.arming]
        if kind != "lighthouse" and len(live) < 2:
            return False  # keep at least one group training, or there is nothing to verify
        candidates = live
        if kind == "hang-before-vote":
            # Only a group each of whose ranks committed a step: a rank still starting has no SIGUSR1 handler
            # yet, and the signal would kill it (a crash, not this fault).
            trained = {r["pid"] for r in self.epoch_rows()}
            candidates = [g for g in live if all(p.pid in trained for p in self.groups[g].procs)]
            if not candidates:
                return False
        if kind == "lighthouse":
            self.faults[kind] += 1
            self.lighthouse.kill()
            self.say(f"fault {sum(self.faults.values())}: lighthouse killed")
            time.sleep(rng.uniform(0.2, 1.5))
            self.lighthouse.start()
            self.say("lighthouse restarted")
            return True
        g = rng.choice(candidates)
        group = self.groups[g]
        # Destroying the only live copy of the latest committed state makes the job redo steps: the
        # lighthouse refuses a quorum of older state until its holder timeout, then starts a new epoch
        # from it (a checkpoint's, or step 0). With checkpoints, a hang or a cut of that copy is not injected
        # either, though the lighthouse waits for a holder whose group has not restarted.
        # Only a kill-all may rewind the job: the checker counts any other new epoch as a failure.
        guarded = ("kill", "kill-rank", "term") + (("hang", "hang-before-vote", "partition")
                                                   if self.args.checkpoint_every else ())
        if kind in guarded and not self.another_holder(g, live):
            return False
        self.faults[kind] += 1
        if kind == "kill":
            group.kill(signal.SIGKILL)
            self.down[g] = now + rng.uniform(0.5, 3.0)
        elif kind == "kill-rank":
            rng.choice(group.procs).kill()
            self.rank_lost.add(g)
        elif kind == "term":
            group.kill(signal.SIGTERM)
            self.leaving[g] = (rng.uniform(0.5, 2.0), now + 30.0)  # (restart delay, SIGKILL if not gone by)
        elif kind == "hang":
            group.kill(signal.SIGSTOP)
            self.hung[g] = now + rng.uniform(1.0, 5.0)
        elif kind == "hang-before-vote":
            group.signal_ranks(signal.SIGUSR1)
            self.arming[g] = (now + 15.0, rng.uniform(1.0, 5.0))
        elif kind == "partition":
            self.network.cut(g, connected=False)
            self.partitioned[g] = now + rng.uniform(1.0, 5.0)
        self.say(f"fault {sum(self.faults.values())}: {kind} group {g}")
        return True

    def kill_all(self, now: float, rng: random.Random) -> bool:
        """SIGKILL every group (and the lighthouse in half the draws), as a power cut would; the
        supervisor restarts them all after the usual delay, and they resume from the newest
        checkpoint. Not before the job committed a step since the last kill-all, nor before a checkpoint."""
        if not self.epoch_rows() or not complete_checkpoints(self.checkpoints):
            return False
        with_lighthouse = "lighthouse" in self.args.kinds and rng.random() < 0.5
        for group in self.groups:
            group.kill(signal.SIGKILL)  # a hung group too: SIGKILL needs no SIGCONT
        if with_lighthouse:
            self.lighthouse.kill()
        at = time.time()  # every process is dead: rows before it are the old epoch's, rows after the new one's
        killed_step, on_disk = self.committed(), complete_checkpoints(self.checkpoints)
        self.kill_alls.append({"at": at, "killed_step": killed_step, "checkpoint": on_disk[0],
                               "lighthouse": with_lighthouse})
        self.hung.clear()
        self.arming.clear()
        self.leaving.clear()
        self.rank_lost.clear()
        for g in range(len(self.groups)):  # down ones too: a scheduler restarts the whole job
            self.down[g] = now + rng.uniform(0.5, 3.0)
        kind = "kill-all+lighthouse" if with_lighthouse else "kill-all"
        self.faults[kind] += 1
        self.say(f"fault {sum(self.faults.values())}: {kind} at step {killed_step}; the newest complete "
                 f"checkpoint is step {on_disk[0]} (on disk: {on_disk[:4]})")
        if with_lighthouse:
            time.sleep(rng.uniform(0.2, 1.5))
            self.lighthouse.start()
        return True

    def run(self) -> dict:
        """Baseline, faults, recovery; the wall times the efficiency is measured between, and the hangs."""
        self.start()
        self.say(f"{self.args.groups} groups of {self.args.ranks} rank(s); baseline for {self.args.baseline:.0f}s")
        deadline = time.monotonic() + 300
        while self.committed() < 5:
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.impl}: no steps committed within 300s; logs in {self.workdir}")
            time.sleep(0.2)
        base_start = time.time()
        time.sleep(self.args.baseline)
        chaos_start, chaos_mono = time.time(), time.monotonic()
        ends = chaos_mono + self.args.duration if self.args.duration else None
        while (self.pending if ends is None else time.monotonic() < ends):
            now = time.monotonic()
            self.supervise(now)
            # A fault that can't be injected yet waits at the head: every run injects the same faults in order.
            while self.pending and now >= chaos_mono + self.pending[0].at and self.inject(now, self.pending[0]):
                self.pending.pop(0)
            time.sleep(0.05)
        chaos_end = time.time()
        # Let everything come back, then demand progress from every group.
        while self.down or self.hung or self.arming or self.partitioned or self.leaving or self.rank_lost:
            self.supervise(time.monotonic())
            time.sleep(0.05)
        marks = {g: self.last_step_of(g) for g in range(len(self.groups))}
        settle_deadline = time.monotonic() + self.args.progress_timeout
        waiting = set(marks)
        while waiting and time.monotonic() < settle_deadline:
            self.supervise(time.monotonic())
            waiting = {g for g in waiting if self.last_step_of(g) <= marks[g]}
            time.sleep(0.2)
        if ends is None:  # --faults: the efficiency runs until every group is back
            chaos_end = time.time()
        # A second fault-free window once every group is back: this machine's load drifts over minutes, and a
        # baseline taken on both sides of the faults is what they are measured against, not one side's luck.
        after_start = time.time()
        if not waiting:
            time.sleep(self.args.baseline)
        return {"base_start": base_start, "chaos_start": chaos_start, "chaos_end": chaos_end,
                "after_start": after_start, "after_end": time.time(), "not_injected": len(self.pending),
                "hangs": sorted(waiting)}

    def another_holder(self, g: int, live: list[int]) -> bool:
        """Whether a live group other than ``g`` holds the latest committed step (of this epoch)."""
        rows = self.epoch_rows()
        latest = max((r["step"] for r in rows), default=0)
        for other in live:
            pids = {p.pid for p in self.groups[other].procs}
            if other != g and any(r["step"] == latest and r["pid"] in pids for r in rows):
                return True
        return False

    def last_step_of(self, group: int) -> int:
        return max((r["step"] for r in self.epoch_rows() if r["group"] == group), default=0)


def run_impl(args: argparse.Namespace, impl: str, workdir: Path, schedule: list[Fault]) -> dict:
    """Run the schedule against ``impl`` and check what its groups reported."""
    chaos = Chaos(args, impl, workdir, schedule)
    print(f"\nchaos [{impl}]: seed {args.seed}, {len(schedule)} faults of {args.kinds}; logs in {workdir}", flush=True)
    try:
        outcome = chaos.run()
    finally:
        chaos.stop()
    rows = read_reports(chaos.report)
    rewinds_allowed = impl == "torchft"  # its lighthouse keeps no record of the job's step
    checks = verify(rows, chaos.kill_alls, chaos.starts, workdir, rewinds_allowed=rewinds_allowed)
    restarts = checks["restarts"]
    figures = heal_and_stall_figures(workdir, rows, restarts, impl)
    figures["kill_all_phases"] = kill_all_phases(read_reports(chaos.timelines), chaos.kill_alls, chaos.starts, rows)

    def rate(*windows: tuple[float, float], key: str = "step") -> float:
        done = sum(job_step_at(rows, restarts, end, key) - job_step_at(rows, restarts, start, key)
                   for start, end in windows)
        return done / max(sum(end - start for start, end in windows), 1e-9)

    fault_free = [(outcome["base_start"], outcome["chaos_start"]), (outcome["after_start"], outcome["after_end"])]
    faulted = (outcome["chaos_start"], outcome["chaos_end"])
    baseline, under_faults = rate(*fault_free), rate(faulted)
    batches = [rate(*fault_free, key="batches_committed"), rate(faulted, key="batches_committed")]
    outcome.update(baseline_before_steps_per_s=rate(fault_free[0]), baseline_after_steps_per_s=rate(fault_free[1]))
    outcome.update(baseline_steps_per_s=baseline, chaos_steps_per_s=under_faults,
                   efficiency=under_faults / baseline if baseline else 0.0,
                   batch_efficiency=batches[1] / batches[0] if batches[0] else 0.0,
                   chaos_seconds=outcome["chaos_end"] - outcome["chaos_start"])
    result = {"faults": dict(chaos.faults), "restarts": chaos.restarts, "checks": checks, "figures": figures,
              "outcome": outcome}
    result["failed"] = failures(checks, outcome, rewinds_allowed)
    print_summary(args, impl, result)
    return result


def main(argv=None) -> int:
    args = parse_args(argv, __doc__)
    missing = torchft_missing() if "torchft" in args.impls else None
    if missing:
        raise SystemExit(f"--impl torchft: {missing}")
    if args.fault_every is not None:
        schedule = make_schedule(args.seed, args.kinds, weights={"kill-all": args.kill_all_weight},
                                 every=args.fault_every, duration=args.duration, first=args.first_fault)
        described = f"one fault every {args.fault_every:g} s for {args.duration:g} s"
    else:
        schedule = make_schedule(args.seed, args.kinds, weights={"kill-all": args.kill_all_weight},
                                 count=args.faults, interval=args.interval, first=args.first_fault)
        described = f"{args.faults} faults, {args.interval:g} s apart on average"
    described += f", seed {args.seed}, {args.groups} groups x {args.ranks} rank(s)"
    root = Path(args.workdir or tempfile.mkdtemp(prefix="torchft-lite-chaos-"))
    # A SIGTERM (a CI timeout, a killed terminal) must still stop the groups and remove the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = {impl: run_impl(args, impl, root / impl, schedule) for impl in args.impls}
    print_side_by_side(results, described)
    verdict = goal(results, missing) if len(args.impls) > 1 or args.check else None
    if verdict is not None:
        print(f"goal (torchft_lite's efficiency ahead of torchft's, no divergent step): "
              f"{'met' if verdict['met'] else 'NOT met: ' + verdict['why']}")
    gate = results.get("torchft_lite") or results[args.impls[0]]
    ok = not gate["failed"]
    summary = {"seed": args.seed, "pg": args.pg, "groups": args.groups, "ranks": args.ranks, "kinds": args.kinds,
               "skipped_kinds": args.skipped_kinds, "schedule": described, "scheduled_faults": len(schedule),
               "fault_every_s": args.fault_every, "duration_s": args.duration, "workdir": str(root),
               "results": {impl: {"faults": r["faults"], "restarts": r["restarts"], **r["figures"],
                                  **short_checks(r["checks"]), **r["outcome"], "failed": r["failed"]}
                           for impl, r in results.items()},
               "goal": verdict, "ok": ok}
    print(json.dumps(summary))
    if not ok:
        return 1
    return 1 if args.check and not verdict["met"] else 0


if __name__ == "__main__":
    sys.exit(main())
