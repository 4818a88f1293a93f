"""What should_quantize=True buys and costs: bytes on the wire, time and error of one cross-group allreduce.

W processes (``--world``, 2 and 3 by default) on loopback, each one rank of our ``ProcessGroupGloo``, each
with a float32 tensor of ``--numel`` values (10M by default; ``randn`` seeded per rank, like a gradient).
Per world size:

* ``bytes/rank``: what each rank sends, counted from the buffers its collectives are handed, not sniffed
  off the wire: the quantized path's all-to-all sends ``(W-1)/W`` of its buffer and its all-gather this
  rank's row to ``W-1`` peers; a float32 allreduce is counted as a ring's ``2 (W-1)/W`` of the tensor
  (the least any allreduce algorithm sends per rank; gloo's may send more). ``ratio`` is quantized over
  float32.
* ``ms``: the median wall time of ``allreduce_quantized`` (AVG) and of gloo's float32 allreduce of the same
  tensor, over ``--repeats`` runs after a warm-up; ``local ms``: the quantized path's own compute on rank 0
  (quantize, and dequantize the gathered rows), which a fast link does not hide. On loopback the
  bytes cost little and the quantized path is slower; it pays where the link between groups is slow.
* error against the float32 allreduce: the largest absolute error, the RMS error relative to the result's
  RMS, and the largest error as a fraction of the bound the format guarantees (``sum_j a_j / 127 / W``,
  ``a_j`` the largest magnitude of the value's block on rank j; at most 1).

Prints a table, then one JSON line.

    python benchmarks/quantized_reduce_bench.py
    python -m benchmarks.quantized_reduce_bench --world 2 --numel 1000000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

REPO_ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 900.0

sys.path.insert(0, str(REPO_ROOT))
from benchmarks.health_bench import timed  # noqa: E402  (median of repeats after a warm-up)


def _rank(addr: str, rank: int, world: int, numel: int, repeats: int, out: str) -> None:  # pragma: no cover
    """One rank: time both allreduces, measure the error, count the bytes; rank 0 writes the result."""
    from torchft_lite.collectives import allreduce_quantized
    from torchft_lite.process_group import ProcessGroupGloo
    from torchft_lite.quantization import BLOCK_SIZE, BlockLayout, dequantize_rows, quantize_rows

    torch.set_num_threads(1)  # W processes share the machine's cores
    pg = ProcessGroupGloo(timeout=timedelta(seconds=300))
    pg.configure(addr, f"bench_{rank}", rank, world)
    try:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        exact, quantized = x.clone(), x.clone()
        pg.allreduce([exact], ReduceOp.SUM).wait()
        exact /= world
        allreduce_quantized([quantized], ReduceOp.AVG, pg).wait()
        # the bound needs every rank's block maxima: their sum, in float32
        amax = torch.nn.functional.pad(x.abs(), (0, -numel % BLOCK_SIZE)).view(-1, BLOCK_SIZE).amax(1)
        pg.allreduce([amax], ReduceOp.SUM).wait()
        bound = (amax / 127 / world).repeat_interleave(BLOCK_SIZE)[:numel]
        error = (quantized - exact).abs()
        plain_s = timed(lambda: pg.allreduce([x.clone()], ReduceOp.SUM).wait(), repeats)
        quantized_s = timed(lambda: allreduce_quantized([x.clone()], ReduceOp.AVG, pg).wait(), repeats)
        layout = BlockLayout.of([x], world)
        rows, back = quantize_rows([x], layout), [torch.empty_like(x)]
        local_s = timed(lambda: (quantize_rows([x], layout), dequantize_rows(back, rows, layout)), repeats)
        pg.barrier().wait()
    finally:
        pg.shutdown()
    if rank == 0:
        result = {
            "world": world, "numel": numel,
            "bytes_fp32_per_rank": 2 * (world - 1) * numel * 4 // world,
            "bytes_quantized_per_rank": layout.total_bytes * (world - 1) // world + layout.row_bytes * (world - 1),
            "ms_fp32": plain_s * 1e3, "ms_quantized": quantized_s * 1e3, "ms_local_quantized": local_s * 1e3,
            "max_abs_error": float(error.max()),
            "rms_relative_error": float(error.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()),
            "max_error_over_bound": float((error / bound).max()),
        }
        result["bytes_ratio"] = result["bytes_quantized_per_rank"] / result["bytes_fp32_per_rank"]
        Path(out).write_text(json.dumps(result))


def run_world(world: int, numel: int, repeats: int) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        procs = [subprocess.Popen([sys.executable, __file__, "rank", f"127.0.0.1:{store.port}/bench/{world}/0",
                                   str(rank), str(world), str(numel), str(repeats), str(out)], env=env)
                 for rank in range(world)]
        try:
            codes = [p.wait(timeout=WAIT_S) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=60)
        if codes != [0] * world:
            raise RuntimeError(f"benchmark ranks exited with {codes}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 3], help="ranks (replica groups); default 2 3")
    parser.add_argument("--numel", type=int, default=10_000_000, help="float32 values per rank; default 10M")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (median); default 5")
    args = parser.parse_args(argv)
    results = [run_world(world, args.numel, args.repeats) for world in args.world]
    print(f"{'W':>2} {'fp32 MB/rank':>12} {'q MB/rank':>10} {'ratio':>6} {'fp32 ms':>8} {'q ms':>8} "
          f"{'local ms':>8} {'max err':>9} {'rms rel':>9} {'err/bound':>9}")
    for r in results:
        print(f"{r['world']:>2} {r['bytes_fp32_per_rank'] / 1e6:>12.2f} {r['bytes_quantized_per_rank'] / 1e6:>10.2f} "
              f"{r['bytes_ratio']:>6.3f} {r['ms_fp32']:>8.1f} {r['ms_quantized']:>8.1f} "
              f"{r['ms_local_quantized']:>8.1f} {r['max_abs_error']:>9.2e} {r['rms_relative_error']:>9.2e} "
              f"{r['max_error_over_bound']:>9.3f}")
    summary = {"bench": "quantized_reduce", "numel": args.numel, "results": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        _rank(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
    else:
        main()
