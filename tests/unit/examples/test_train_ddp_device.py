"""examples/train_ddp.py --device: where a rank trains, and the clear errors when it can't (no process is started)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.unit.helpers import EXAMPLES, load_example
from torchft_lite.errors import ConfigError


@pytest.fixture(scope="module")
def train_ddp():
    """examples/ is not a package: load the script (and the helper it imports from beside it)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield load_example("train_ddp.py", "train_ddp_under_test")
    finally:
        sys.path.remove(str(EXAMPLES))


def test_cpu_is_the_default_and_stays_on_the_cpu(train_ddp, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train_ddp.py"])
    args = train_ddp.parse_args()
    assert (args.device, args.pg, args.grad_sync) == ("cpu", "gloo", "ddp")
    assert train_ddp.training_device(args.device, args.pg) == torch.device("cpu")


def test_nccl_across_groups_needs_gpus(train_ddp):
    with pytest.raises(ConfigError, match="--pg nccl needs --device cuda"):
        train_ddp.training_device("cpu", "nccl")


def test_cuda_without_a_gpu_says_so(train_ddp, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="is_available"):
        train_ddp.training_device("cuda", "gloo")


def test_a_group_with_fewer_gpus_than_ranks_is_refused_naming_both(train_ddp, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match=r"runs 4 rank\(s\) .* sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\)"):
        train_ddp.training_device("cuda", "nccl")


def test_the_checksum_of_cpu_parameters_is_their_exact_bytes(train_ddp):
    model = torch.nn.Linear(3, 2)
    before = train_ddp.params_checksum(model)
    with torch.no_grad():
        model.weight.view(-1)[:1].view(torch.int32).bitwise_xor_(1)  # the lowest mantissa bit of one value
    assert train_ddp.params_checksum(model) != before
