"""allreduce_quantized and reduce_scatter_quantized across real processes, against the exact float64 result.

Each rank is a process (this file run as a script) with our ProcessGroupGloo or ProcessGroupBabyGloo,
configured on a TCPStore the test holds on port 0. A rank's inputs are drawn from a seed of its own, so the
test rebuilds every rank's inputs and checks each result against the bound the format gives (see
``torchft_lite.collectives``): ``sum_j a_j / 127`` for SUM, ``/ W`` for AVG, ``a_j`` the largest magnitude
of the value's block on rank j. Workers are killed in ``finally`` whatever happens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from tests.conftest import block_amax

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT = 180.0  # generous: several processes import torch at once on two shared cores
BLOCK = 1024
SLACK = 1e-5


def inputs(rank: int, case: str) -> list[torch.Tensor]:
    """Rank ``rank``'s tensors for ``case``: magnitudes that change by orders from block to block."""
    generator = torch.Generator().manual_seed(1000 * rank + len(case))
    shapes = {"sum": [(10007,), (33, 7)], "avg": [(10007,), (33, 7)], "bf16": [(4099,)],
              "rs": [(10, 301), (7,)], "ordered": [(5000,)]}[case]
    tensors = []
    for shape in shapes:
        numel = torch.Size(shape).numel()
        scale = 10.0 ** torch.empty(-(-numel // BLOCK)).uniform_(-3, 3, generator=generator)
        values = torch.randn(numel, generator=generator) * scale.repeat_interleave(BLOCK)[:numel]
        tensors.append(values.view(shape).to(torch.bfloat16 if case == "bf16" else torch.float32))
    return tensors


def run_ranks(kind: str, world: int, tmp_path: Path) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    addr = f"127.0.0.1:{store.port}/torchft/1/0"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    procs = []
    try:
        for rank in range(world):
            out = tmp_path / f"rank{rank}.pt"
            procs.append((subprocess.Popen([sys.executable, __file__, "worker", kind, addr, str(rank), str(world),
                                            str(out)], cwd=REPO_ROOT, env=env), out))
        deadline = time.monotonic() + WAIT
        while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = [p.poll() for p, _ in procs]
        assert codes == [0] * world, f"workers exited with {codes} (None: still running after {WAIT:.0f}s)"
        return [torch.load(out, weights_only=True) for _, out in procs]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=WAIT)


def check_allreduce(results: list[dict], case: str, op: ReduceOp, world: int) -> None:
    per_rank = [inputs(r, case) for r in range(world)]
    for i in range(len(per_rank[0])):
        exact = sum(tensors[i].double() for tensors in per_rank)
        bound = sum(block_amax(tensors[i], BLOCK, torch.float64) for tensors in per_rank) / 127
        if op == ReduceOp.AVG:
            exact, bound = exact / world, bound / world
        got = results[0][case][i]
        if got.dtype == torch.bfloat16:  # and the rounding of the result to bfloat16
            bound = bound + exact.abs() * torch.finfo(torch.bfloat16).eps
        assert got.dtype == per_rank[0][i].dtype and got.shape == per_rank[0][i].shape
        assert bool(((got.double() - exact).abs() <= bound * (1 + SLACK)).all()), (case, i)
        assert not torch.equal(got.double(), exact)  # it went through 8 bits
        for rank in range(world):  # every rank ends with the same bytes
            assert torch.equal(results[rank][case][i], got), (case, i, rank)


@pytest.mark.parametrize("kind,world", [("gloo", 2), ("gloo", 3), ("baby-gloo", 2)])
def test_quantized_allreduce_and_reduce_scatter_across_processes(kind, world, tmp_path):
    results = run_ranks(kind, world, tmp_path)
    check_allreduce(results, "sum", ReduceOp.SUM, world)
    check_allreduce(results, "avg", ReduceOp.AVG, world)
    check_allreduce(results, "bf16", ReduceOp.AVG, world)
    check_allreduce(results, "ordered", ReduceOp.SUM, world)
    # issued right behind the quantized allreduce, before its all-gather finished: paired correctly
    assert all(r["ordered_after"].tolist() == [float(sum(range(world)))] * 3 for r in results)
    # reduce-scatter: rank r holds rows r of each (padded) input, averaged
    per_rank = [inputs(r, "rs") for r in range(world)]
    for rank in range(world):
        got, start = results[rank]["rs"], 0
        for i, tensor in enumerate(per_rank[0]):
            rows = -(-(tensor.shape[0] if tensor.dim() > 1 else tensor.numel()) // world)
            width = tensor.shape[1] if tensor.dim() > 1 else 1

            def share(t: torch.Tensor) -> torch.Tensor:
                padded = torch.zeros(rows * world * width, dtype=torch.float64)
                padded[:t.numel()] = t.reshape(-1).double()
                return padded.view(world, -1)[rank]

            exact = sum(share(tensors[i]) for tensors in per_rank) / world
            # a share's blocks
            bound = sum(block_amax(share(tensors[i]), BLOCK, torch.float64) for tensors in per_rank) / 127 / world
            part = got[start:start + rows * width].double()
            assert bool(((part - exact).abs() <= bound * (1 + SLACK) + 1e-30).all()), (rank, i)
            start += rows * width
        assert start == got.numel()


def _worker(kind: str, addr: str, rank: int, world: int, out: str) -> None:  # pragma: no cover - a worker
    from torchft_lite.collectives import allocate_reduce_scatter_output, allreduce_quantized, reduce_scatter_quantized
    from torchft_lite.process_group import ProcessGroupBabyGloo, ProcessGroupGloo

    pg = {"gloo": ProcessGroupGloo, "baby-gloo": ProcessGroupBabyGloo}[kind](timeout=timedelta(seconds=60))
    pg.configure(addr, f"replica_{rank}", rank, world)
    results: dict[str, object] = {}
    try:
        for case, op in (("sum", ReduceOp.SUM), ("avg", ReduceOp.AVG), ("bf16", ReduceOp.AVG)):
            tensors = inputs(rank, case)
            allreduce_quantized(tensors, op, pg).wait()
            results[case] = tensors
        tensors, after = inputs(rank, "ordered"), torch.full((3,), float(rank))
        quantized = allreduce_quantized(tensors, ReduceOp.SUM, pg)
        plain = pg.allreduce([after], ReduceOp.SUM)  # issued while the quantized all-gather may be in flight
        plain.wait(), quantized.wait()
        results["ordered"], results["ordered_after"] = tensors, after
        tensors = inputs(rank, "rs")
        output, _ = allocate_reduce_scatter_output(tensors, world)
        reduce_scatter_quantized(output, tensors, ReduceOp.AVG, pg).wait()
        results["rs"] = output
    finally:
        pg.shutdown()
    torch.save(results, out)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
