"""ProcessGroupNCCL on a real GPU: one rank (a single device cannot host two NCCL ranks)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torchft_lite.errors import CollectiveError
from torchft_lite.process_group import ProcessGroupNCCL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]


def test_nccl_group_configures_allreduces_aborts_and_reconfigures() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{store.port}/torchft/1/0", "replica-a", 0, 1)
    tensor = torch.full((4,), 2.0, device="cuda")
    pg.allreduce([tensor]).wait()
    assert tensor.cpu().tolist() == [2.0] * 4
    assert pg.allreduce([tensor]).get_future().wait()[0].cpu().tolist() == [2.0] * 4

    pg.abort()
    assert isinstance(pg.errored(), CollectiveError)
    with pytest.raises(CollectiveError):
        pg.allreduce([tensor])

    pg.configure(f"127.0.0.1:{store.port}/torchft/2/0", "replica-a", 0, 1)
    assert pg.errored() is None
    pg.broadcast([tensor], 0).wait()
    pg.shutdown()
