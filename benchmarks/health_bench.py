"""What the health checks cost per step: the non-finite guard and one replica fingerprint, per state size.

Two measurements, each on float32 state of every ``--sizes-mb`` (100 MB and 1 GB by default), on this
machine's CPU (the checks run on the tensor's own device: on a GPU they are kernels at memory speed):

* ``guard``: what :class:`torchft_lite.health.nonfinite.NonFiniteGuard` adds to a step's gradient allreduce, which
  is all local work: per bucket (DDP's 25 MB by default, ``--bucket-mb``) a float32 sum and a
  ``masked_fill_`` before the reduction, then a sum of the average after it; and the count of left-out
  groups: up to 4 MiB a bucket is sent as a copy one element longer, above it the count is one extra
  allreduce of one element (``--bucket-mb 4`` measures the first, the default 25 MB the second). The
  process group here is a stand-in whose allreduce returns at once (the reduction itself is the same
  with or without the guard), so the figure is the guard's own CPU time: ``guard ms`` (with the guard)
  minus ``plain ms`` (the unguarded path: the same buckets, divided by the participants) per step.
* ``fingerprint``: :func:`torchft_lite.health.fingerprint.fingerprint_of` of a state of that size (a model
  and AdamW's two moments, a third each), which group rank 0 computes every ``fingerprint_every``
  steps (100 by default): ``ms`` per fingerprint, and amortised per step.

``ceiling``: reading the same bytes once (one ``torch.sum`` per tensor), the least a check that looks at
every byte can cost. torchft has neither check (it commits whatever the allreduce produced and heals
whatever the source holds), so there is no torchft column: its cost is 0 and so is its protection.

Prints a table, then one JSON line.

    python benchmarks/health_bench.py
    python -m benchmarks.health_bench --sizes-mb 100 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch
from torch.distributed import ReduceOp

from torchft_lite.core.step import Step, start_allreduce
from torchft_lite.health.fingerprint import fingerprint_of
from torchft_lite.health.nonfinite import HealthConfig, NonFiniteGuard


class InstantGroup:
    """A process group whose allreduce completes at once and leaves the tensor as it is (one participant)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(tensors)

        class Work:
            def get_future(self) -> torch.futures.Future:
                return future

        return Work()


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one warm-up."""
    fn()
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def buckets_of(total_bytes: int, bucket_bytes: int) -> list[torch.Tensor]:
    count, rest = divmod(total_bytes, bucket_bytes)
    sizes = [bucket_bytes] * count + ([rest] if rest else [])
    return [torch.randn(size // 4) for size in sizes]


def guard_cost(total_bytes: int, bucket_bytes: int, repeats: int) -> dict[str, float]:
    buckets = buckets_of(total_bytes, bucket_bytes)
    pg = InstantGroup()
    guard = NonFiniteGuard(HealthConfig(), log=lambda *a, **k: None, record=lambda step, exc: None)

    def plain() -> None:
        for bucket in buckets:
            start_allreduce(pg, bucket, ReduceOp.AVG, 1, []).wait()

    def guarded() -> None:
        step = Step(number=0)
        for bucket in buckets:
            guard.start(pg, bucket, ReduceOp.AVG, 1, step, True, []).wait()

    ceiling = timed(lambda: [b.sum() for b in buckets], repeats)
    return {"plain_s": timed(plain, repeats), "guard_s": timed(guarded, repeats), "ceiling_s": ceiling,
            "buckets": len(buckets)}


def fingerprint_cost(total_bytes: int, repeats: int) -> dict[str, float]:
    third = total_bytes // 3 // 4
    state = {"model": {"weight": torch.randn(third)},
             "optim": {"state": {0: {"exp_avg": torch.randn(third), "exp_avg_sq": torch.rand(third)}}}}
    tensors = [state["model"]["weight"], *state["optim"]["state"][0].values()]
    return {"fingerprint_s": timed(lambda: fingerprint_of(state), repeats),
            "ceiling_s": timed(lambda: [t.sum() for t in tensors], repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="100,1000", help="state sizes in MB, comma-separated (default 100,1000)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size (DDP's default: 25)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure; the median is shown")
    parser.add_argument("--fingerprint-every", type=int, default=100, help="for the per-step amortised figure")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    if not sizes or min(sizes) <= 0 or args.bucket_mb <= 0 or args.repeats < 1 or args.fingerprint_every < 1:
        parser.error("sizes, --bucket-mb, --repeats and --fingerprint-every must be positive")
    rows = []
    for mb in sizes:
        total = int(mb * 1e6) // 4 * 4
        guard = guard_cost(total, int(args.bucket_mb * 1e6) // 4 * 4, args.repeats)
        fp = fingerprint_cost(total, args.repeats)
        rows.append({"state_mb": mb, **{f"guard_{k}": v for k, v in guard.items()},
                     "guard_added_ms": (guard["guard_s"] - guard["plain_s"]) * 1e3,
                     "fingerprint_ms": fp["fingerprint_s"] * 1e3, "fingerprint_ceiling_ms": fp["ceiling_s"] * 1e3,
                     "fingerprint_per_step_ms": fp["fingerprint_s"] * 1e3 / args.fingerprint_every,
                     "fingerprint_gb_per_s": total / 1e9 / fp["fingerprint_s"]})
    print(f"float32 state on CPU ({torch.get_num_threads()} intra-op thread(s)); guard buckets of "
          f"{args.bucket_mb:g} MB; medians of {args.repeats} run(s); torchft: no such checks (cost 0, no protection)")
    header = (f"{'state MB':>9} {'plain ms':>9} {'guard ms':>9} {'guard +ms':>9} {'read ms':>8} | "
              f"{'fprint ms':>9} {'read ms':>8} {'GB/s':>6} {'ms/step @' + str(args.fingerprint_every):>12}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['state_mb']:>9g} {r['guard_plain_s'] * 1e3:>9.1f} {r['guard_guard_s'] * 1e3:>9.1f} "
              f"{r['guard_added_ms']:>9.1f} {r['guard_ceiling_s'] * 1e3:>8.1f} | {r['fingerprint_ms']:>9.1f} "
              f"{r['fingerprint_ceiling_ms']:>8.1f} {r['fingerprint_gb_per_s']:>6.2f} "
              f"{r['fingerprint_per_step_ms']:>12.2f}")
    print(json.dumps({"benchmark": "health", "threads": torch.get_num_threads(), "bucket_mb": args.bucket_mb,
                      "fingerprint_every": args.fingerprint_every, "rows": rows}))


if __name__ == "__main__":
    main()
