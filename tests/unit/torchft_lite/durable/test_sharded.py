"""Durable checkpoints of sharded (DTensor) state: each rank writes and loads its own shard, and a resume
into another layout is refused naming both.

A replica group of two ranks runs in two threads. A real Manager needs a
ManagerServer to gather a group's ranks, so each rank has :class:`RankManager`:
the few parts of a Manager a DurableCheckpointer uses (its settings, step,
state dict and loader). DTensors live on meshes without process groups, so
anything that tried to gather a full tensor would fail.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.conftest import cpu_mesh, dtensor, in_threads, read_header
from torchft_lite.durable import DurableCheckpointer, read_checkpoint
from torchft_lite.durable._files import write_state_file
from torchft_lite.durable._layout import Layout
from torchft_lite.errors import CheckpointMismatchError, ConfigError, DurableCheckpointError
from torchft_lite.serialization.encode import flatten

ROWS, COLS = 301, 64  # 301 rows over 2 ranks: uneven shards (151 and 150 rows), as FSDP2 makes them
STEP = 6


def shard(full: torch.Tensor, rank: int, mesh: DeviceMesh, dim: int = 0) -> DTensor:
    """Group rank ``rank``'s Shard(dim) of ``full`` on a 1-D mesh (or the last dim of a 2-D one)."""
    local = full.tensor_split(2, dim=dim)[rank].clone()
    placements = [Shard(dim)] if mesh.ndim == 1 else [Replicate(), Shard(dim)]
    return dtensor(local, mesh, placements, full.shape)


def model_state(rank: int, seed: int, dim: int = 0, shape: tuple[int, ...] = (2,),
                names: tuple[str, ...] = ("fsdp",)) -> dict:
    """What an FSDP2 model and its AdamW hold on group rank ``rank``: shards of every tensor."""
    generator = torch.Generator().manual_seed(seed)
    mesh = cpu_mesh(torch.arange(2).reshape(shape).tolist(), names, rank)
    weight, moment = (torch.randn(ROWS, COLS, generator=generator) for _ in range(2))
    return {"model": {"w": shard(weight, rank, mesh, dim)},
            "optim": {"state": {0: {"exp_avg": shard(moment, rank, mesh, dim), "step": torch.tensor(3.0)}}}}


class RankManager:
    """Group rank ``rank`` of group ``g0`` (two ranks), as a DurableCheckpointer sees its Manager."""

    def __init__(self, rank: int, state: dict, step: int = STEP, timeout: float = 30.0) -> None:
        self.state, self.step = state, step
        self.loaded: dict | None = None
        self.replica_id = "g0:incarnation"
        settings = SimpleNamespace(group_rank=rank, group_world_size=2, replica_id="g0", restart_count=0,
                                   timeouts=SimpleNamespace(step=timedelta(seconds=timeout)))
        held = SimpleNamespace(state_dict=self._manager_state_dict, load_state_dict=self._load, torn=False)
        # No group store: GroupAgreement then trusts each rank's own scan.
        self.context = SimpleNamespace(settings=settings, client=None, store=None,
                                       state=held, fingerprinter=None)

    def add_step_listener(self, listener: Any) -> None:
        pass

    def remove_step_listener(self, listener: Any) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def state_quorum_id(self) -> int | None:
        return 17

    def _manager_state_dict(self) -> dict:
        return {"user": {"state": self.state}, "torchft": {"step": self.step}}

    def _load(self, whole: dict) -> None:
        self.loaded = whole["user"]["state"]
        with torch.no_grad():  # as model.load_state_dict does: copy_ into each live DTensor
            self.state["model"]["w"].copy_(self.loaded["model"]["w"])
            self.state["optim"]["state"][0]["exp_avg"].copy_(self.loaded["optim"]["state"][0]["exp_avg"])
        self.step = whole["torchft"]["step"]


def on_both_ranks(body: Callable[[int], Any]) -> list[Any]:
    """``body(rank)`` for ranks 0 and 1 at once, one thread each; their results, or raises what one raised."""
    results, raised = in_threads((0, 1), body, 60, "a rank hung")
    if raised:
        raise next(iter(raised.values()))
    return [results[0], results[1]]


def save_group(directory: Path, seed: int = 1) -> list[dict]:
    """Both ranks save step STEP of their shards; returns each rank's state."""
    states = [model_state(rank, seed) for rank in (0, 1)]
    on_both_ranks(lambda rank: DurableCheckpointer(RankManager(rank, states[rank]), directory).save_now())
    return states


def data_bytes_of(path: Path) -> int:
    return read_header(path.read_bytes())[0].data_bytes


def test_each_rank_writes_only_its_own_shards_and_the_manifest_lists_every_rank(tmp_path):
    states = save_group(tmp_path)
    (info,) = Layout(tmp_path).complete()
    assert info.step == STEP and info.per_rank and info.group_world_size == 2
    assert sorted(info.files) == ["state-r0.tft", "state-r1.tft"]
    for rank in (0, 1):
        rows = 151 if rank == 0 else 150
        # Two local shards and AdamW's float32 step, never the 301-row global tensors.
        assert data_bytes_of(info.path / f"state-r{rank}.tft") == 2 * rows * COLS * 4 + 4
        _, saved = read_checkpoint(info, rank)
        for path in (("model", "w"), ("optim", "state", 0, "exp_avg")):
            got, sent = saved["user"]["state"], states[rank]
            for key in path:
                got, sent = got[key], sent[key]
            assert got._spec == sent._spec and torch.equal(got._local_tensor, sent._local_tensor)


def test_a_checkpoint_missing_a_ranks_shard_is_never_complete(tmp_path):
    alone = DurableCheckpointer(RankManager(0, model_state(0, seed=1), timeout=1.0), tmp_path)
    with pytest.raises(DurableCheckpointError, match="group rank 1 did not write its part of step 6"):
        alone.save_now()
    assert Layout(tmp_path).complete() == [] and Layout(tmp_path).steps_on_disk() == []


def test_each_rank_resumes_its_own_shards_into_its_own_dtensors_on_its_own_mesh(tmp_path):
    saved = save_group(tmp_path, seed=1)
    fresh = [model_state(rank, seed=2) for rank in (0, 1)]
    managers = [RankManager(rank, fresh[rank], step=0) for rank in (0, 1)]
    live_weights = [state["model"]["w"] for state in fresh]
    assert on_both_ranks(lambda rank: DurableCheckpointer(managers[rank], tmp_path).resume()) == [STEP, STEP]
    for rank in (0, 1):
        assert managers[rank].step == STEP
        assert fresh[rank]["model"]["w"] is live_weights[rank]  # loaded into, not replaced
        for key in ("w",):
            assert torch.equal(fresh[rank]["model"][key]._local_tensor, saved[rank]["model"][key]._local_tensor)
        assert torch.equal(fresh[rank]["optim"]["state"][0]["exp_avg"]._local_tensor,
                           saved[rank]["optim"]["state"][0]["exp_avg"]._local_tensor)
        # What the loader got was rebuilt on this rank's own mesh, not on a new one.
        assert managers[rank].loaded["model"]["w"].device_mesh is live_weights[rank].device_mesh
    assert not torch.equal(fresh[0]["model"]["w"]._local_tensor[:150], fresh[1]["model"]["w"]._local_tensor)


@pytest.mark.parametrize("live, saved_as, now", [
    (lambda rank: model_state(rank, seed=2, dim=1), "[Shard(0)]", "[Shard(1)]"),
    (lambda rank: model_state(rank, seed=2, shape=(1, 2), names=("dp", "fsdp")),
     "mesh [2] ('fsdp',)", "mesh [1, 2] ('dp', 'fsdp')"),
    (lambda rank: {"model": {"w": torch.zeros(ROWS, COLS)}, "optim": {}}, "a DTensor [Shard(0)]",
     "a plain tensor"),
])
def test_a_resume_into_another_layout_is_refused_naming_both_before_anything_loads(tmp_path, live, saved_as, now):
    save_group(tmp_path, seed=1)
    managers = [RankManager(rank, live(rank), step=0) for rank in (0, 1)]
    before = [flatten(m.state).tensors[0].clone() for m in managers]
    with pytest.raises(CheckpointMismatchError) as raised:
        on_both_ranks(lambda rank: DurableCheckpointer(managers[rank], tmp_path).resume())
    message = str(raised.value)
    assert "holds state.model.w as" in message and saved_as in message.split("this process has it as")[0]
    assert now in message.split("this process has it as")[1] and "resharding on resume is not supported" in message
    assert all(m.loaded is None and m.step == 0 for m in managers)
    assert all(torch.equal(flatten(m.state).tensors[0], b) for m, b in zip(managers, before))


def test_replicated_in_group_refuses_to_save_a_sharded_state(tmp_path):
    checkpointer = DurableCheckpointer(RankManager(0, model_state(0, seed=1)), tmp_path, every=STEP,
                                       replicated_in_group=True)
    with pytest.raises(ConfigError, match=r"user.state.model.w, .* are sharded .* replicated_in_group=False"):
        checkpointer.save_now()
    checkpointer.step_committed(STEP, 0)  # the background path: the save fails, counted, and training goes on
    checkpointer.step_starting(STEP)
    stats = checkpointer.statistics()
    assert stats.saves_failed == 1 and "replicated_in_group=True" in stats.last_error
    assert Layout(tmp_path).complete() == []


def test_a_rank_0_only_checkpoint_of_a_sharded_state_is_refused(tmp_path):
    # As a checkpointer before this check would have written it: group rank 0's shards alone.
    layout, state = Layout(tmp_path), model_state(0, seed=1)
    directory = layout.step_dir(STEP)
    directory.mkdir()
    whole = {"user": {"state": state}, "torchft": {"step": STEP}}
    record = write_state_file(directory / Layout.state_file_name(0), STEP, flatten(whole))
    layout.write_manifest(directory, STEP, "g0:old", "g0", 2, False, [record])
    manager = RankManager(1, model_state(1, seed=2), step=0)
    with pytest.raises(CheckpointMismatchError, match="holds group rank 0's state alone .* would load rank 0's shard"):
        DurableCheckpointer(manager, tmp_path).resume()
    assert manager.loaded is None
