"""allreduce_quantized on CUDA tensors: the stream-ordered path (one rank: a single device hosts one NCCL rank).

The quantize, exchange, reduce and dequantize run on ``sync_stream``; ``wait()`` makes the caller's stream
wait for it, so reading the result on the current stream must see it even while that stream was busy.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchft_lite.collectives import allreduce_quantized
from torchft_lite.process_group import ProcessGroupNCCL
from torchft_lite.process_group.dummy import ProcessGroupDummy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]


def within_bound(result: torch.Tensor, original: torch.Tensor) -> bool:
    flat = original.float().reshape(-1).abs()
    amax = torch.nn.functional.pad(flat, (0, -flat.numel() % 1024)).view(-1, 1024).amax(1)
    bound = amax.repeat_interleave(1024)[:flat.numel()] / 127 * (1 + 1e-5)
    rounding = result.float().reshape(-1).abs() * torch.finfo(result.dtype).eps
    return bool(((result.float().reshape(-1) - original.float().reshape(-1)).abs() <= bound + rounding).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cuda_tensor_is_reduced_on_the_sync_stream_and_the_caller_waits_for_it(dtype):
    x = torch.randn(3_000_001, device="cuda").to(dtype)
    original = x.clone()
    side = torch.cuda.Stream()
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(10):  # keep the current stream busy: a missing stream dependency would show
        busy = busy @ busy / 2048
    work = allreduce_quantized([x], ReduceOp.AVG, ProcessGroupDummy(0, 1), sync_stream=side)
    assert work.wait()
    assert within_bound(x, original) and not torch.equal(x, original)


def test_nccl_single_rank_quantized_allreduce():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{store.port}/torchft/1/0", "replica-a", 0, 1)
    try:
        x = torch.randn(100_000, device="cuda")
        original = x.clone()
        allreduce_quantized([x], ReduceOp.SUM, pg, sync_stream=torch.cuda.current_stream()).wait()
        assert within_bound(x, original)
    finally:
        pg.shutdown()
