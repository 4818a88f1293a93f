"""DDP on CUDA modules, end to end: examples/train_ddp.py --device cuda, replica groups sharing one GPU.

The groups share the machine's first GPU, so the replica process group is
gloo (it stages CUDA tensors through host memory); every group still holds
bit-identical parameters at every step more than one of them committed, a
killed group (its whole process tree) heals on restart, with one
``manager.allreduce`` per gradient instead of DDP's comm hook.
"""

from __future__ import annotations

import signal

import pytest
import torch
from torch import nn

from tests.integration.helpers import (
    JOB_WAIT as WAIT, assert_identical_per_step, cluster, read_reports, steps_of, wait_for,
)
from tests.unit.helpers import CountingManager
from torchft_lite.ddp import DistributedDataParallel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(600),
]

ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}


def test_ddp_constructs_on_a_cuda_module_and_its_gradients_come_back():
    # The first GPU run failed here: "No backend type associated with device type cuda".
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    reference = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    reference.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(CountingManager(), model)
    inputs = torch.randn(32, 64, device="cuda")
    ddp(inputs).square().mean().backward()
    reference(inputs).square().mean().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(ours.grad, theirs.grad)


def test_cuda_groups_on_one_gpu_averaging_each_gradient_stay_identical_and_a_killed_group_heals(tmp_path):
    # One manager.allreduce per gradient, each waited for: the first GPU run's divergent setup. (DDP's comm hook
    # on the same setup is make gpu-check's training phase, with a ~30M-parameter model.)
    extra = ("--device", "cuda", "--grad-sync", "allreduce", "--hidden", "1024")
    with cluster(tmp_path, min_replicas=1, join_timeout=1.0, heartbeat_timeout=1.0) as (_, add, report):
        groups = [add(g, 3, steps=100000, env=ONE_GPU, extra=extra) for g in range(3)]
        wait_for(lambda: min(len(steps_of(read_reports(report), g)) for g in range(3)) >= 10,
                 "every group's 10th step", groups=groups)
        groups[2].kill(signal.SIGKILL)
        killed_at = max(steps_of(read_reports(report), 0))
        wait_for(lambda: max(steps_of(read_reports(report), 0)) >= killed_at + 10,
                 "the survivors' 10 steps without the killed group", groups=groups[:2])
        before = len(steps_of(read_reports(report), 2))
        groups[2].start()
        wait_for(lambda: len(steps_of(read_reports(report), 2)) >= before + 10,
                 "the restarted group's 10 steps", timeout=WAIT, groups=groups)
        for group in groups:
            group.kill(signal.SIGKILL)
    rows = read_reports(report)
    assert steps_of(rows, 2)[before] > killed_at, "the restarted group did not resume from the healed step"
    assert assert_identical_per_step(rows) >= 30
