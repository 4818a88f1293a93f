"""Live checkpoint recovery: a replica group joins late and is healed from a peer.

Starts a lighthouse and replica group 0 of examples/train_ddp.py; once group 0
has committed ``--join-at`` steps, starts group 1 (as a replacement machine
would). Group 1 is behind (step 0 < max step), so the quorum assigns it a
healthy peer; it pulls that peer's state dict over HTTP while training goes
on, applies it on its training thread, and continues in lockstep. The script
prints who healed from whom, how many bytes and how long, from both sides'
logs. Exit code 0 when the heal happened at a step above zero and both groups
then hold identical parameters.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup  # noqa: E402

HEAL_LINES = re.compile(r"healing from|received step|healed:|released step")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--join-at", type=int, default=20, help="start group 1 once group 0 is at this step (default 20)")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width, sets the state dict size (default 1024)")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds per phase")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="torchft-lite-lcr-"))
    report = workdir / "report.jsonl"
    lighthouse = LighthouseProcess(min_replicas=1, join_timeout=1.0, log_path=workdir / "lighthouse.log").start()
    train = ["--steps", "1000000", "--step-sleep", "0.05", "--hidden", str(args.hidden), "--report", str(report)]
    groups = [ReplicaGroup(g, 2, lighthouse.address, ROOT / "examples" / "train_ddp.py", train, log_dir=workdir)
              for g in range(2)]

    def steps(group: int) -> list[dict]:
        rows = [json.loads(x) for x in report.read_text().splitlines() if x.strip()] if report.exists() else []
        return [r for r in rows if r["group"] == group]

    def wait(what: str, predicate) -> None:
        deadline = time.monotonic() + args.timeout
        while not predicate():
            if time.monotonic() > deadline or not all(g.alive() for g in groups if g.procs):
                raise SystemExit(f"failed waiting for {what}; logs in {workdir}")
            time.sleep(0.1)

    try:
        groups[0].start()
        wait(f"group 0 at step {args.join_at}", lambda: len(steps(0)) >= args.join_at)
        print(f"group 0 is at step {len(steps(0))}; starting group 1 (at step 0)")
        groups[1].start()
        wait("group 1 to commit 5 steps", lambda: len(steps(1)) >= 5)
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()

    for group in (1, 0):
        for log in sorted(workdir.glob(f"group{group}.*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if HEAL_LINES.search(line) and "step 0" not in line.split("]")[-1]:
                    print(f"  group {group}: {line.split(' INFO ', 1)[-1]}")
    first = steps(1)[0]["step"]
    shared = {r["step"]: r["checksum"] for r in steps(0)}
    same = all(shared.get(r["step"], r["checksum"]) == r["checksum"] for r in steps(1))
    print(f"group 1's first committed step: {first} (healed at step {first - 1}); "
          f"parameters identical on shared steps: {'yes' if same else 'NO'}; logs in {workdir}")
    return 0 if first > 1 and same else 1


if __name__ == "__main__":
    sys.exit(main())
