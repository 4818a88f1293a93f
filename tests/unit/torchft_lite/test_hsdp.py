"""torchft_lite.hsdp without processes: the environment, the hook and ShardedState on unsharded modules.

(Sharded models need a process group: tests/integration/test_hsdp.py and test_hsdp_state.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from torchft_lite.errors import CheckpointError, ConfigError
from torchft_lite.hsdp import GroupEnv, ShardedState, _CrossGroupAverage, average_across_groups
from torchft_lite.process_group import ManagedProcessGroup, ProcessGroupDummy
from torchft_lite.work import ManagedWork

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_group_env_reads_torchrun_and_says_what_is_missing() -> None:
    env = GroupEnv.from_env({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "3"})
    assert env == GroupEnv(rank=1, world_size=2, local_rank=1, store_host="127.0.0.1", store_port=29500,
                           restart_count=3)
    assert GroupEnv.from_env({k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}).local_rank == 1
    with pytest.raises(ConfigError, match="WORLD_SIZE is not set: start each replica group with torchrun"):
        GroupEnv.from_env({k: v for k, v in TORCHRUN.items() if k != "WORLD_SIZE"})
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        GroupEnv.from_env({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"})
    with pytest.raises(ConfigError, match="RANK must be an integer, got 'one'"):
        GroupEnv.from_env({**TORCHRUN, "RANK": "one"})
    with pytest.raises(ConfigError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        GroupEnv.from_env({**TORCHRUN, "RANK": "2"})
    with pytest.raises(ConfigError, match="MASTER_PORT must be in 1..65535"):
        GroupEnv.from_env({**TORCHRUN, "MASTER_PORT": "0"})


class RecordingManager:
    """What the hook uses of a Manager: allreduce (here: halves the tensor, as a 2-group average of it and 0)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self._pg = ProcessGroupDummy(0, 1)  # what ManagedProcessGroup wraps

    def num_participants(self) -> int:
        return 2

    def allreduce(self, tensor: torch.Tensor, **kwargs) -> ManagedWork:
        self.calls.append(kwargs)
        future: torch.futures.Future = torch.futures.Future()
        work = ManagedWork(future)
        tensor.div_(2)
        future.set_result(tensor)
        return work


def test_the_hook_averages_in_place_through_the_manager_and_passes_quantization_only_when_asked() -> None:
    manager = RecordingManager()
    tensor = torch.full((4,), 6.0)
    _CrossGroupAverage(manager, should_quantize=False)(tensor)  # type: ignore[arg-type]
    _CrossGroupAverage(manager, should_quantize=True)(tensor)  # type: ignore[arg-type]
    assert torch.equal(tensor, torch.full((4,), 1.5))
    assert manager.calls == [{"reduce_op": ReduceOp.AVG}, {"should_quantize": True, "reduce_op": ReduceOp.AVG}]


def test_torchfts_hook_spelling_dist_all_reduce_on_a_managed_process_group_goes_through_the_manager() -> None:
    """``dist.all_reduce(t, group=ManagedProcessGroup(manager), op=ReduceOp.AVG)``, torchft's FSDP hook, with
    no default process group: c10d dispatches to the Python group, which hands the tensor to the Manager."""
    manager = RecordingManager()
    group = ManagedProcessGroup(manager)  # type: ignore[arg-type]
    tensor = torch.full((3,), 8.0)
    assert dist.all_reduce(tensor, group=group, op=ReduceOp.AVG) is None
    work = dist.all_reduce(tensor, group=group, op=ReduceOp.AVG, async_op=True)
    assert work.wait() and torch.equal(tensor, torch.full((3,), 2.0))
    assert [call["reduce_op"] == ReduceOp.AVG for call in manager.calls] == [True, True]
    assert group.size() == 2


def test_average_across_groups_refuses_a_model_without_fsdp_modules() -> None:
    with pytest.raises(ConfigError, match="no FSDPModule; call torch.distributed.fsdp.fully_shard"):
        average_across_groups(nn.Linear(2, 2), RecordingManager())  # type: ignore[arg-type]


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_sharded_state_round_trips_model_and_optimizer_into_the_live_tensors() -> None:
    source_model, source_optim = trained(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # fresh: no state yet, as a restarted group's
    weight = model[0].weight
    ShardedState(model, optimizer).load_state_dict(ShardedState(source_model, source_optim).state_dict())
    assert model[0].weight is weight  # loaded into the live parameter, not replaced
    for key, value in source_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert torch.equal(optimizer.state[model[0].weight]["exp_avg"], source_optim.state[source_model[0].weight]["exp_avg"])


def test_sharded_state_names_what_does_not_fit() -> None:
    source_model, source_optim = trained(0)
    good = ShardedState(source_model, source_optim).state_dict()
    model, optimizer = trained(1)
    state = ShardedState(model, optimizer)
    missing = {**good, "model": {k: v for k, v in good["model"].items() if k != "0.bias"}}
    with pytest.raises(CheckpointError, match=r"lacks \['0.bias'\]"):
        state.load_state_dict(missing)
    wrong = {**good, "model": {**good["model"], "0.weight": torch.zeros(2, 4)}}
    with pytest.raises(CheckpointError, match=r"0.weight: the source's shard is \[2, 4\], this rank's \[3, 4\]"):
        state.load_state_dict(wrong)
    extra = {**good, "optim": {**good["optim"], "state": {**good["optim"]["state"], 9: {}}}}
    with pytest.raises(CheckpointError, match="names parameter 9; this optimizer has 4"):
        state.load_state_dict(extra)
