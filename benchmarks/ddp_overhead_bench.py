"""Per-step overhead of fault tolerance: two replica groups vs a plain gloo DDP loop.

Both runs train the same tiny MLP with the same batch on two processes:

* ``plain``: ``torch.distributed`` gloo + torch DDP, no fault tolerance (the ceiling);
* ``torchft_lite``: two replica groups (one rank each) with our Manager, DDP wrapper
  and optimizer wrapper, quorums from a local lighthouse, every step.

Each worker times every step (zero_grad -> forward -> backward -> optimizer
step); the first ``--warmup`` steps are dropped and the median of the rest is
reported per run. Prints a table and one JSON line (the last line). Figures on
a 2-core shared machine are noisy; compare the two within one run.

    python benchmarks/ddp_overhead_bench.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build(seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    data = torch.randn(16, 32), torch.randn(16, 8)
    return model, data


def timed_loop(model, optimizer, data, steps: int) -> list[float]:
    import torch.nn.functional as F

    times = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        F.mse_loss(model(data[0]), data[1]).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return times


def worker_plain(rank: int, steps: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    model, data = build()
    ddp = DistributedDataParallel(model)
    times = timed_loop(ddp, torch.optim.SGD(model.parameters(), lr=0.01), data, steps)
    out.write_text(json.dumps(times))
    dist.destroy_process_group()


def worker_ft(steps: int, out: Path) -> None:
    import torch

    import torchft_lite as torchft

    model, data = build()
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=2,
        load_state_dict=model.load_state_dict, state_dict=model.state_dict,
        replica_id=f"bench_{os.environ['REPLICA_GROUP_ID']}", timeout=timedelta(seconds=30),
    )
    try:
        ddp = torchft.DistributedDataParallel(manager, model)
        times = timed_loop(ddp, torchft.Optimizer(manager, inner), data, steps)
        out.write_text(json.dumps({"times": times, "committed": manager.current_step()}))
    finally:
        manager.shutdown()


def run_plain(steps: int, workdir: Path) -> list[float]:
    from torchft_lite.cluster.local import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "plain", "--rank", str(r), "--steps", str(steps),
                               "--out", str(workdir / f"plain{r}.json")], env=env) for r in range(2)]
    try:
        for proc in procs:
            if proc.wait(600) != 0:
                raise SystemExit("plain gloo worker failed")
    finally:
        for proc in procs:
            proc.kill()
    return json.loads((workdir / "plain0.json").read_text())


def run_ft(steps: int, workdir: Path) -> tuple[list[float], int]:
    from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup

    lighthouse = LighthouseProcess(min_replicas=2, join_timeout=30.0, log_path=workdir / "lighthouse.log").start()
    groups = []
    try:
        for g in range(2):
            groups.append(ReplicaGroup(g, 2, lighthouse.address, __file__,
                                       ["--worker", "ft", "--steps", str(steps), "--out", str(workdir / f"ft{g}.json")],
                                       log_dir=workdir).start())
        for group in groups:
            if group.wait(600) != [0]:
                raise SystemExit(f"torchft_lite worker failed; logs in {workdir}")
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()
    result = json.loads((workdir / "ft0.json").read_text())
    return result["times"], result["committed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    parser.add_argument("--warmup", type=int, default=20, help="leading steps not counted (default 20)")
    parser.add_argument("--worker", choices=["plain", "ft"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "plain":
        return worker_plain(args.rank, args.steps, args.out)
    if args.worker == "ft":
        return worker_ft(args.steps, args.out)

    workdir = Path(tempfile.mkdtemp(prefix="ddp-overhead-"))
    plain = run_plain(args.steps, workdir)[args.warmup:]
    ft, committed = run_ft(args.steps, workdir)
    ft = ft[args.warmup:]
    result = {
        "steps": args.steps,
        "plain_gloo_ms_p50": statistics.median(plain) * 1e3,
        "torchft_lite_ms_p50": statistics.median(ft) * 1e3,
        "plain_gloo_ms_p90": statistics.quantiles(plain, n=10)[-1] * 1e3,
        "torchft_lite_ms_p90": statistics.quantiles(ft, n=10)[-1] * 1e3,
        "torchft_lite_committed": committed,
    }
    result["overhead_ms_p50"] = result["torchft_lite_ms_p50"] - result["plain_gloo_ms_p50"]
    print(f"{'run':<16}{'p50 ms/step':>14}{'p90 ms/step':>14}")
    print(f"{'plain gloo DDP':<16}{result['plain_gloo_ms_p50']:>14.2f}{result['plain_gloo_ms_p90']:>14.2f}")
    print(f"{'torchft_lite':<16}{result['torchft_lite_ms_p50']:>14.2f}{result['torchft_lite_ms_p90']:>14.2f}")
    print(f"overhead per step (p50): {result['overhead_ms_p50']:.2f} ms; committed {committed}/{args.steps} steps")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
