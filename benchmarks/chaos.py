"""Chaos run: inject faults on a seeded random schedule and prove nothing is lost.

Runs a lighthouse and N replica groups of examples/train_ddp.py (CPU, gloo,
small model; ``--ranks`` per group) and, after a fault-free phase that sets
the baseline speed, injects faults until ``--faults`` have been injected:

  kill        SIGKILL a whole replica group (restarted after a delay, like a scheduler)
  kill-rank   SIGKILL one rank of a group (the supervisor then replaces the group, as torchrun would)
  term        SIGTERM a group: it leaves gracefully (exit 143) and is restarted
  hang        SIGSTOP a group for a few seconds, then SIGCONT
  partition   cut a group off the network for a few seconds (each group runs in its own
              network namespace behind a veth pair; the host side is set down, then up)
  lighthouse  SIGKILL the lighthouse and restart it on the same port
  kill-all    SIGKILL every group at once (in half the draws the lighthouse too, counted as
              kill-all+lighthouse) and restart them all after a delay: the job resumes
              from the newest complete durable checkpoint and redoes the steps after it

The groups save a durable checkpoint every ``--checkpoint-every`` steps
(0: none, and no kill-all). The lighthouse runs as a production one should:
min_replicas = a majority of the groups, a --state-dir (so a restart remembers
the highest committed step), its startup grace, and a 2 s heartbeat timeout.

Verified from the groups' per-step reports (one JSON line per committed step
and rank, with a parameter checksum), split into job epochs at the kill-alls
(see benchmarks/_chaos_checks.py):

* at every committed step of an epoch, group rank r of every group holds bit-identical parameters;
* within an epoch, no step is committed twice by one process, none is skipped, and every
  step's ``batches_committed`` is the running sum of the participants;
* after a kill-all the job goes on from step C+1, C the newest complete checkpoint at the kill;
  no other rewind (a new epoch the lighthouse starts without a kill-all);
* no hang: every group makes progress within ``--progress-timeout`` after the last fault;
* efficiency: net progress (steps redone after a kill-all count once) per second under
  faults / fault-free.

Prints a summary table and one JSON line (the last line); exit code 0 when
every check passed.

    python benchmarks/chaos.py --seed 1 --faults 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._chaos_checks import (complete_checkpoints, heal_and_stall_figures, print_summary,  # noqa: E402
                                      read_reports, verify)
from torchft_lite.local_cluster import LighthouseProcess, ReplicaGroup  # noqa: E402

SCRIPT = REPO / "examples" / "train_ddp.py"
KINDS = ("kill", "kill-rank", "term", "hang", "partition", "lighthouse", "kill-all")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault schedule (default 1)")
    parser.add_argument("--faults", type=int, default=200, help="faults to inject (default 200)")
    parser.add_argument("--groups", type=int, default=3, help="replica groups (default 3)")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per group, the same for all (default 1)")
    parser.add_argument("--pg", choices=["gloo", "baby-gloo"], default="gloo",
                        help="the groups' process group: gloo in the trainer, or in a child process (default gloo)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds to use (default {','.join(KINDS)})")
    parser.add_argument("--interval", type=float, default=2.0, help="mean seconds between faults (default 2)")
    parser.add_argument("--baseline", type=float, default=15.0, help="fault-free seconds first (default 15)")
    parser.add_argument("--progress-timeout", type=float, default=120.0,
                        help="a live group must commit within this after the last fault (default 120)")
    parser.add_argument("--checkpoint-every", type=int, default=20,
                        help="the groups save a durable checkpoint every this many steps; 0: none, and no "
                             "kill-all faults (default 20)")
    parser.add_argument("--kill-all-weight", type=float, default=1.0,
                        help="weight of kill-all in the draw of each fault's kind, each other kind weighing 1 "
                             "(default 1; 0 with --first-fault kill-all: exactly one)")
    parser.add_argument("--first-fault", choices=KINDS,
                        help="inject this kind first (tried at each fault time until it can be), then draw as usual")
    parser.add_argument("--workdir", help="logs, reports and checkpoints (default: a temporary directory)")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    if args.checkpoint_every < 0 or args.kill_all_weight < 0:
        parser.error("--checkpoint-every and --kill-all-weight must be >= 0")
    if "kill-rank" in kinds and args.ranks < 2:
        kinds.remove("kill-rank")  # needs a group with more than one rank
    if "kill-all" in kinds and not args.checkpoint_every:
        kinds.remove("kill-all")  # with nothing on disk, a job that lost every copy starts over
    args.skipped_kinds = {}  # kind -> why it can't run here; in the summary, so no caller misses it
    if "partition" in kinds:
        why = Network.unavailable()
        if why:
            print(f"partition faults skipped: {why}", flush=True)
            kinds.remove("partition")
            args.skipped_kinds["partition"] = why
    if args.first_fault and args.first_fault not in kinds:
        parser.error(f"--first-fault {args.first_fault} is not among the kinds in use ({', '.join(kinds)})")
    args.kinds = kinds
    return args


class Network:
    """One network namespace per replica group, joined to the host by a veth pair.

    Group i lives at 10.<net>.<i>.2 and reaches the host (the lighthouse, the
    stores, the other groups through forwarding) at 10.<net>.<i>.1. A partition
    sets the host end down: packets vanish (no reset), as in a real partition.
    """

    def __init__(self, groups: int) -> None:
        self.tag = f"{os.getpid() % 10000}"
        self.net = 200 + os.getpid() % 50
        self.groups = groups
        self.forwarding = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "needs root for network namespaces"
        if shutil.which("ip") is None:
            return "the `ip` command (iproute2) is missing"
        probe = subprocess.run(["ip", "netns", "add", f"tftlprobe{os.getpid()}"], capture_output=True, text=True)
        if probe.returncode != 0:
            return f"network namespaces unavailable: {probe.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", f"tftlprobe{os.getpid()}"], capture_output=True)
        return None

    def ns(self, g: int) -> str:
        return f"tftl{self.tag}g{g}"

    def host_if(self, g: int) -> str:
        return f"th{self.tag}g{g}"

    def host_ip(self, g: int) -> str:
        return f"10.{self.net}.{g}.1"

    def group_ip(self, g: int) -> str:
        return f"10.{self.net}.{g}.2"

    def setup(self) -> None:
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        for g in range(self.groups):
            ns, host_if, ns_if = self.ns(g), self.host_if(g), f"tn{self.tag}g{g}"
            for command in (
                f"ip netns add {ns}",
                f"ip link add {host_if} type veth peer name {ns_if}",
                f"ip link set {ns_if} netns {ns}",
                f"ip addr add {self.host_ip(g)}/24 dev {host_if}",
                f"ip link set {host_if} up",
                f"ip netns exec {ns} ip addr add {self.group_ip(g)}/24 dev {ns_if}",
                f"ip netns exec {ns} ip link set {ns_if} up",
                f"ip netns exec {ns} ip link set lo up",
                f"ip netns exec {ns} ip route add default via {self.host_ip(g)}",
            ):
                subprocess.run(command.split(), check=True, capture_output=True)

    def env(self, g: int) -> dict[str, str]:
        return {"GLOO_SOCKET_IFNAME": f"tn{self.tag}g{g}"}  # gloo must not pick the namespace's loopback

    def cut(self, g: int, connected: bool) -> None:
        subprocess.run(["ip", "link", "set", self.host_if(g), "up" if connected else "down"], check=True)

    def teardown(self) -> None:
        for g in range(self.groups):
            subprocess.run(["ip", "netns", "del", self.ns(g)], capture_output=True)
            subprocess.run(["ip", "link", "del", self.host_if(g)], capture_output=True)
        Path("/proc/sys/net/ipv4/ip_forward").write_text(self.forwarding)


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="torchft-lite-chaos-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.report = self.workdir / "report.jsonl"
        if self.report.exists():  # its rows, logs and checkpoints would mix with this run's
            raise SystemExit(f"{self.workdir} holds a previous run's report.jsonl; use an empty --workdir")
        self.checkpoints = self.workdir / "checkpoints"
        # A majority, as production jobs should run: with fewer, a lone fresh group could
        # train on its own while the groups holding the latest state are hung (a fork).
        self.network = Network(args.groups) if "partition" in args.kinds else None
        self.lighthouse = LighthouseProcess(min_replicas=args.groups // 2 + 1, join_timeout=1.0,
                                            heartbeat_timeout=2.0, log_path=self.workdir / "lighthouse.log",
                                            host="0.0.0.0" if self.network else "127.0.0.1",
                                            state_dir=self.workdir / "lighthouse-state")
        self.partitioned: dict[int, float] = {}  # group -> when to reconnect it
        self.groups: list[ReplicaGroup] = []
        self.down: dict[int, float] = {}  # group -> when to restart it
        self.hung: dict[int, float] = {}  # group -> when to SIGCONT it
        self.faults: Counter[str] = Counter()
        self.forced = args.first_fault
        self.restarts = 0
        self.starts: list[dict] = []  # every group start: its pids by rank, for the checker to find a row's log
        self.kill_alls: list[dict] = []  # what the checker needs of each kill-all (see _chaos_checks.verify)
        self.log: list[str] = []

    def say(self, message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        self.log.append(line)
        print(line, flush=True)

    def start(self) -> None:
        if self.network:
            self.network.setup()
        self.lighthouse.start()
        train = ["--steps", "100000000", "--step-sleep", "0.02", "--report", str(self.report), "--timeout", "10",
                 "--pg", self.args.pg]
        if self.args.checkpoint_every:
            train += ["--checkpoint-dir", str(self.checkpoints), "--checkpoint-every", str(self.args.checkpoint_every)]
        for g in range(self.args.groups):
            env = {"TORCHFT_QUORUM_RETRIES": "3"}
            where: dict = {}
            lighthouse = self.lighthouse.address
            if self.network:
                # Not loopback: the job token local_cluster gives every process it starts admits them.
                env.update(self.network.env(g))
                port = lighthouse.rsplit(":", 1)[1]
                lighthouse = f"http://{self.network.host_ip(g)}:{port}"
                where = dict(store_host=self.network.host_ip(g), advertise=self.network.group_ip(g),
                             prefix=["ip", "netns", "exec", self.network.ns(g)])
            group = ReplicaGroup(g, self.args.groups, lighthouse, SCRIPT, train,
                                 world_size=self.args.ranks, log_dir=self.workdir, env=env, **where)
            self.groups.append(group)
            self.start_group(g)

    def stop(self) -> None:
        for g in list(self.hung):
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
            if g in self.down or g in self.hung:
                if g in self.down and now >= self.down[g]:
                    group.stop()
                    self.start_group(g)
                    self.restarts += 1
                    del self.down[g]
                    self.say(f"group {g}: restarted (incarnation {group.incarnation})")
                continue
            codes = [p.poll() for p in group.procs]
            if any(code is not None for code in codes):
                # A rank exited: the rest of the group can't go on (torchrun would restart them all).
                group.kill(signal.SIGKILL)
                self.down[g] = now + self.rng.uniform(0.5, 2.0)
                self.say(f"group {g}: ranks exited {codes}; replacing it")

    def draw(self) -> str:
        kinds = self.args.kinds
        weights = [self.args.kill_all_weight if kind == "kill-all" else 1.0 for kind in kinds]
        return self.rng.choices(kinds, weights)[0] if sum(weights) else kinds[0]

    def inject(self, now: float, kind: str) -> bool:
        """Inject a fault of ``kind`` unless it can't be now; whether it was."""
        if kind == "kill-all":
            return self.kill_all(now)
        live = [g for g in range(len(self.groups))
                if g not in self.down and g not in self.hung and g not in self.partitioned]
        if kind != "lighthouse" and len(live) < 2:
            return False  # keep at least one group training, or there is nothing to verify
        if kind == "lighthouse":
            self.faults[kind] += 1
            self.lighthouse.kill()
            self.restart_lighthouse()
            self.say(f"fault {sum(self.faults.values())}: lighthouse killed and restarted")
            return True
        g = self.rng.choice(live)
        group = self.groups[g]
        # Destroying the only live copy of the latest committed state makes the job redo steps: the
        # lighthouse refuses a quorum of older state until its holder timeout, then starts a new epoch
        # from it (a checkpoint's, or step 0). With checkpoints, a hang or a cut of that copy longer than
        # the heartbeat timeout does too when the others all just resumed from disk (no wait then).
        # Only a kill-all may rewind the job: the checker counts any other new epoch as a failure.
        guarded = ("kill", "kill-rank", "term") + (("hang", "partition") if self.args.checkpoint_every else ())
        if kind in guarded and not self.another_holder(g, live):
            return False
        self.faults[kind] += 1
        if kind == "kill":
            group.kill(signal.SIGKILL)
            self.down[g] = now + self.rng.uniform(0.5, 3.0)
        elif kind == "kill-rank":
            victim = self.rng.choice(group.procs)
            victim.kill()
        elif kind == "term":
            group.kill(signal.SIGTERM)
        elif kind == "hang":
            group.kill(signal.SIGSTOP)
            self.hung[g] = now + self.rng.uniform(1.0, 5.0)
        elif kind == "partition":
            self.network.cut(g, connected=False)
            self.partitioned[g] = now + self.rng.uniform(1.0, 5.0)
        self.say(f"fault {sum(self.faults.values())}: {kind} group {g}")
        return True

    def restart_lighthouse(self) -> None:
        time.sleep(self.rng.uniform(0.2, 1.5))
        self.lighthouse.start()

    def kill_all(self, now: float) -> bool:
        """SIGKILL every group (and the lighthouse in half the draws), as a power cut would; the
        supervisor restarts them all after the usual delay, and they resume from the newest
        checkpoint. Not before the job committed a step since the last kill-all, nor before a checkpoint."""
        if not self.epoch_rows() or not complete_checkpoints(self.checkpoints):
            return False
        with_lighthouse = "lighthouse" in self.args.kinds and self.rng.random() < 0.5
        for group in self.groups:
            group.kill(signal.SIGKILL)  # a hung group too: SIGKILL needs no SIGCONT
        if with_lighthouse:
            self.lighthouse.kill()
        at = time.time()  # every process is dead: rows before it are the old epoch's, rows after the new one's
        killed_step, on_disk = self.committed(), complete_checkpoints(self.checkpoints)
        self.kill_alls.append({"at": at, "killed_step": killed_step, "checkpoint": on_disk[0],
                               "lighthouse": with_lighthouse})
        self.hung.clear()
        for g in range(len(self.groups)):  # down ones too: a scheduler restarts the whole job
            self.down[g] = now + self.rng.uniform(0.5, 3.0)
        kind = "kill-all+lighthouse" if with_lighthouse else "kill-all"
        self.faults[kind] += 1
        self.say(f"fault {sum(self.faults.values())}: {kind} at step {killed_step}; the newest complete "
                 f"checkpoint is step {on_disk[0]} (on disk: {on_disk[:4]})")
        if with_lighthouse:
            self.restart_lighthouse()
        return True

    def run(self) -> dict:
        self.start()
        self.say(f"{self.args.groups} groups of {self.args.ranks} rank(s); baseline for {self.args.baseline:.0f}s")
        deadline = time.monotonic() + 300
        while self.committed() < 5:
            if time.monotonic() > deadline:
                raise SystemExit(f"no steps committed within 300s; logs in {self.workdir}")
            time.sleep(0.2)
        base_start, base_step = time.monotonic(), self.committed()
        time.sleep(self.args.baseline)
        baseline_rate = (self.committed() - base_step) / (time.monotonic() - base_start)
        chaos_start, chaos_step = time.monotonic(), self.committed()
        next_fault = chaos_start
        while sum(self.faults.values()) < self.args.faults:
            now = time.monotonic()
            self.supervise(now)
            if now >= next_fault:
                if self.inject(now, self.forced or self.draw()):
                    self.forced = None
                next_fault = now + self.rng.expovariate(1.0 / self.args.interval)
            time.sleep(0.05)
        last_fault = time.monotonic()
        # Let everything come back, then demand progress from every group.
        while self.down or self.hung or self.partitioned:
            self.supervise(time.monotonic())
            time.sleep(0.05)
        marks = {g: self.last_step_of(g) for g in range(len(self.groups))}
        hangs = []
        settle_deadline = time.monotonic() + self.args.progress_timeout
        waiting = set(marks)
        while waiting and time.monotonic() < settle_deadline:
            self.supervise(time.monotonic())
            waiting = {g for g in waiting if self.last_step_of(g) <= marks[g]}
            time.sleep(0.2)
        hangs = sorted(waiting)
        chaos_rate = (self.committed() - chaos_step) / (time.monotonic() - chaos_start)
        return {"baseline_steps_per_s": baseline_rate, "chaos_steps_per_s": chaos_rate,
                "efficiency": chaos_rate / baseline_rate if baseline_rate else 0.0,
                "chaos_seconds": last_fault - chaos_start, "hangs": hangs}

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


def main(argv=None) -> int:
    args = parse_args(argv)
    chaos = Chaos(args)
    print(f"chaos: seed {args.seed}, {args.faults} faults of {args.kinds}; logs in {chaos.workdir}", flush=True)
    # A SIGTERM (a CI timeout, a killed terminal) must still stop the groups and remove the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        outcome = chaos.run()
    finally:
        chaos.stop()
    rows = read_reports(chaos.report)
    checks = verify(rows, chaos.kill_alls, chaos.starts, chaos.workdir)
    figures = heal_and_stall_figures(chaos.workdir, rows, chaos.kill_alls)
    ok = not (checks["divergent_steps"] or checks["duplicated_steps"] or checks["missing_steps"]
              or checks["inconsistent_steps"] or checks["batch_accounting_errors"] or checks["kill_all_errors"]
              or checks["unplanned_rewinds"] or outcome["hangs"])
    print_summary(args, chaos.faults, chaos.restarts, checks, figures, outcome, ok)
    short: dict = {}
    for key, value in checks.items():  # counts, and the first few steps of each kind of violation
        if isinstance(value, list):
            short[key], short[f"{key}_first"] = len(value), value[:10]
        else:
            short[key] = value
    print(json.dumps({"seed": args.seed, "pg": args.pg, "faults": dict(chaos.faults), "kinds": args.kinds,
                      "skipped_kinds": args.skipped_kinds, "restarts": chaos.restarts, **figures,
                      **short, **outcome, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
