"""Durable checkpoints of an FSDP2 model with real Managers: one replica group of two ranks, two processes.

A real lighthouse (in this process) and, per run, a group of two processes
with a gloo world of their own, a CPU mesh and a ``fully_shard`` model (uneven
shards) trained through a Manager with a DurableCheckpointer. Then, as after
the whole job went down, fresh processes resume:

* with the same layout: each rank gets back its own shards (model and AdamW
  moments) and the next step is bit-identical to the one the first run took;
* with another layout (the same model sharded on dim 1): the resume is
  refused naming both layouts, and nothing is loaded.
"""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import WAIT
from tests.integration.helpers import shard_digests
from tests.integration.spawned import put_outcome, run_spawned

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LONG = timedelta(seconds=WAIT)
IN, HIDDEN, OUT = 16, 45, 7  # 45 and 7 rows over 2 ranks: uneven shards
EVERY, SAVED, STEPS = 2, 4, 5


def worker(phase: str, rank: int, port: int, lighthouse: str, directory: str, results: "mp.Queue") -> None:
    put_outcome(results, f"{phase} rank {rank}",
                lambda: (rank, run(phase, rank, port, lighthouse, Path(directory))))


def run(phase: str, rank: int, port: int, lighthouse: str, directory: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from torchft_lite.durable import DurableCheckpointer
    from torchft_lite.errors import CheckpointMismatchError
    from torchft_lite.manager import Manager
    from torchft_lite.process_group import ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=LONG)
    dist.init_process_group("gloo", store=dist.PrefixStore("fsdp/", store), rank=rank, world_size=2, timeout=LONG)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    torch.manual_seed(0 if phase == "train" else 1)  # a resumed process starts from other weights
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    # The other layout: the first layer's weight sharded on dim 1 (FSDP2 shards dim 1 only evenly: 16 columns).
    placement = (lambda param: Shard(1) if param.shape == (HIDDEN, IN) else None) if phase == "other-layout" else None
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, shard_placement_fn=placement)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    def state() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load(loaded: dict) -> None:
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=LONG), load_state_dict=load, state_dict=state, min_replica_size=1,
                      rank=rank, world_size=2, store_addr="127.0.0.1", store_port=port, lighthouse_addr=lighthouse,
                      replica_id="sharded", hostname="127.0.0.1", timeout=LONG, quorum_timeout=LONG,
                      connect_timeout=LONG, preemption_signals=())
    checkpointer = DurableCheckpointer(manager, directory, every=EVERY, keep_last=2)
    report: dict = {}
    try:
        if phase != "train":
            before = shard_digests(state())
            try:
                report["resumed"] = checkpointer.resume()
            except CheckpointMismatchError as exc:
                return {"refused": str(exc), "untouched": shard_digests(state()) == before,
                        "step": manager.current_step()}
        while manager.current_step() < STEPS:
            manager.start_quorum()
            generator = torch.Generator().manual_seed(10 * manager.current_step() + rank)  # data by position
            model(torch.randn(4, IN, generator=generator)).pow(2).mean().backward()
            if manager.should_commit():
                optimizer.step()
            optimizer.zero_grad()
            report[manager.current_step()] = shard_digests(state())
        checkpointer.close()
        report["saves"] = checkpointer.statistics().saves_completed
        return report
    finally:
        checkpointer.close()
        manager.shutdown(wait=False)
        dist.destroy_process_group()


def run_group(phase: str, lighthouse: str, directory: Path) -> dict[int, dict]:
    """Both ranks of the group through ``phase``, each in a fresh process; their reports by rank."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=LONG)
    arg_lists = [(phase, rank, store.port, lighthouse, str(directory)) for rank in (0, 1)]
    return dict(run_spawned(worker, arg_lists, f"the {phase} run's two processes", 4 * WAIT))


def test_a_sharded_model_resumes_each_ranks_shards_and_another_layout_is_refused(tmp_path, lighthouse):
    from torchft_lite.durable._layout import Layout

    trained = run_group("train", lighthouse.server.address(), tmp_path)
    assert trained[0]["saves"] >= 2  # steps 2 and 4, completed by group rank 0 (it writes the manifest)
    newest = Layout(tmp_path).complete()[0]
    assert newest.step == SAVED and sorted(newest.files) == ["state-r0.tft", "state-r1.tft"]
    assert trained[0][SAVED] != trained[1][SAVED]  # the ranks hold different shards

    resumed = run_group("resume", lighthouse.server.address(), tmp_path)
    for rank in (0, 1):
        assert resumed[rank]["resumed"] == SAVED
        # The next step from the checkpoint equals the first run's: every shard and moment came back to its rank.
        assert resumed[rank][STEPS] == trained[rank][STEPS]
        assert resumed[rank][STEPS] != trained[rank][SAVED]

    refused = run_group("other-layout", lighthouse.server.address(), tmp_path)
    for rank in (0, 1):
        message = refused[rank]["refused"]
        saved_as, now = message.split("this process has it as")
        assert "[Shard(0)]" in saved_as and "[Shard(1)]" in now and "resharding on resume is not supported" in message
        assert refused[rank]["untouched"] and refused[rank]["step"] == 0
