"""ProcessGroupBabyNCCL on a real GPU: NCCL in a child process, tensors shared through CUDA IPC.

One rank only (a single device cannot host two NCCL ranks), so the checks are
that what this process writes reaches the child and what the child's NCCL
writes comes back (allgather copies the input into an output this process
owns), and that an abort is a kill.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.conftest import alive, wait_until_sync
from torchft_lite.errors import CollectiveError
from torchft_lite.process_group import ProcessGroupBabyNCCL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]


def test_baby_nccl_shares_cuda_tensors_both_ways_and_aborts_by_killing() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=60))
    try:
        pg.configure(f"127.0.0.1:{store.port}/torchft/1/0", "replica-a", 0, 1)
        source = torch.empty(16 << 20, device="cuda")
        source.copy_(torch.arange(16 << 20, device="cuda", dtype=torch.float32))  # still running when we send
        output = torch.zeros_like(source)
        pg.allgather([[output]], [source]).wait()
        assert torch.equal(output, source)
        tensor = torch.full((4,), 2.0, device="cuda")
        assert pg.allreduce([tensor]).get_future().wait()[0].cpu().tolist() == [2.0] * 4

        child = pg.child_pid()
        pg.abort()
        assert isinstance(pg.errored(), CollectiveError)
        wait_until_sync(lambda: not alive(child), f"the aborted NCCL child {child} to exit", 60.0)

        pg.configure(f"127.0.0.1:{store.port}/torchft/2/0", "replica-a", 0, 1)
        assert pg.errored() is None and pg.child_pid() != child
        pg.broadcast([tensor], 0).wait()
        assert tensor.cpu().tolist() == [2.0] * 4
    finally:
        pg.shutdown()
