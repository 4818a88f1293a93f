"""The DDP wrappers' pieces that need no process group: the per-gradient wrapper and the bucket futures."""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn

from tests.unit.helpers import CountingManager
from torchft_lite.ddp import PureDistributedDataParallel, _bucket_future, _single_rank_group
from torchft_lite.work import ManagedWork, _DummyWork, completed_future


def test_pure_ddp_allreduces_each_gradient_once_per_backward() -> None:
    manager = CountingManager()
    model = PureDistributedDataParallel(manager, nn.Linear(3, 4))  # type: ignore[arg-type]
    model(torch.rand(2, 3)).mean().backward()
    params = list(model.parameters())
    assert len(manager.allreduced) == len(params) == 2
    assert all(any(g is p.grad for g in manager.allreduced) for p in params)


class TorchftStyleWork:
    """Like torchft's managed work: wait() reports a failure and returns False; its future is a lazy proxy."""

    def __init__(self, ok: bool, inner: torch.futures.Future | None = None) -> None:
        self.ok, self.waited = ok, False
        self._proxy = type("Proxy", (), {"_fut": inner})()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waited = True
        return self.ok

    def get_future(self):
        return self._proxy


def test_our_managed_work_hands_ddp_its_future_without_waiting() -> None:
    future: torch.futures.Future = torch.futures.Future()  # not done: communication still running
    assert _bucket_future(ManagedWork(future), torch.zeros(1)) is future


def test_a_failed_torchft_style_work_hands_back_the_bucket_instead_of_failing_backward() -> None:
    bucket = torch.ones(3)
    work = TorchftStyleWork(ok=False)
    future = _bucket_future(work, bucket)
    assert work.waited and future.wait() is bucket


def test_a_torchft_style_work_hands_ddp_the_real_future_inside_its_proxy() -> None:
    inner = completed_future(torch.ones(1))
    assert _bucket_future(TorchftStyleWork(ok=True, inner=inner), torch.zeros(1)) is inner


def test_a_plain_completed_work_hands_over_its_own_future() -> None:
    bucket = torch.ones(2)
    assert _bucket_future(_DummyWork(bucket), torch.zeros(2)).wait() is bucket


def test_ddps_private_group_answers_for_cuda_modules_too() -> None:
    # DDP checks a CUDA module's parameters through the group's backend for device type cuda: without one,
    # DistributedDataParallel(manager, cuda_module) fails at construction ("No backend type associated with
    # device type cuda"), as it did on the first GPU run.
    group = _single_rank_group()
    for device_type in ("cpu", "cuda"):
        assert torch.device(device_type) in group._device_types
        assert group._get_backend(torch.device(device_type)) is not None
    assert group.size() == 1 and group.rank() == 0
