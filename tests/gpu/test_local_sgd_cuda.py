"""DiLoCo on a GPU: pseudo-gradients averaged on the fragment's side stream, the global copy in pinned memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.unit.helpers import SoloManager
from torchft_lite.local_sgd import DiLoCo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]


class DoublingManager(SoloManager):
    """One group; its "allreduce" doubles the tensor on the current stream (the fragment's side stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[torch.cuda.Stream] = []

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.streams.append(torch.cuda.current_stream())
        big = torch.randn(2048, 2048, device="cuda")
        for _ in range(10):  # keep this stream busy so a missing wait would read stale values
            big = big @ big / 2048
        return tensor.mul_(2)


@pytest.mark.parametrize("bucketize", [False, True])
def test_diloco_on_cuda_averages_on_a_side_stream_and_keeps_a_pinned_backup(bucketize):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).cuda()
    start = [p.detach().clone() for p in model.parameters()]
    manager = DoublingManager()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    with DiLoCo(manager, [model], inner, outer, sync_every=2, use_bucketization=bucketize) as diloco:
        backups = list(diloco._fragments[0].original_parameters.values())
        assert all(b.device.type == "cpu" and b.is_pinned() for b in backups)
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            inner.step()
    torch.cuda.synchronize()
    assert manager.streams and all(s != torch.cuda.default_stream() for s in manager.streams)
    # Pseudo-gradient 0.2, doubled to 0.4 by the "allreduce", applied with lr 1.
    for p, w, b in zip(model.parameters(), start, backups):
        torch.testing.assert_close(p.detach(), w - 0.4)
        torch.testing.assert_close(b, (w - 0.4).cpu())
