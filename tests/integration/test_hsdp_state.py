"""ShardedState with real FSDP2 shards (2 processes, gloo over a FileStore): a heal into fresh tensors.

Each rank encodes its sharded state in the heal format, decodes it with no
targets (as ``TORCHFT_LITE_HEAL_IN_PLACE=0`` receives: every DTensor comes back
on a stand-in mesh without process groups) and loads it into a fresh model and
optimizer. The optimizer's DTensors must end up on the parameters' own mesh:
a collective on them (``full_tensor()``, as a full-state checkpoint does)
fails on the stand-in.
"""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WAIT = 240.0


def _build(seed: int):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchft_lite.hsdp import ShardedState

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, ShardedState(model, optimizer)


def _rank(rank: int, store_path: str, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        from torchft_lite.errors import CheckpointError
        from torchft_lite.serialization.decode import decode_bytes
        from torchft_lite.serialization.encode import encode_to_bytes

        dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
        source_model, source_optim, source = _build(0)
        for _ in range(2):
            source_model(torch.randn(4, 6)).sum().backward()
            source_optim.step()
            source_optim.zero_grad()
        _, received = decode_bytes(encode_to_bytes(2, source.state_dict()))
        stand_in = received["optim"]["state"][0]["exp_avg"]
        checks = {"received_on_stand_in": stand_in.device_mesh is not source_model[0].weight.device_mesh}

        model, optimizer, state = _build(1)  # other weights, no optimizer state yet: a restarted rank
        state.load_state_dict(received)
        checks["model_equal"] = all(torch.equal(a.to_local(), b.to_local()) for a, b in
                                    zip(model.parameters(), source_model.parameters()))
        params, source_params = list(model.parameters()), list(source_model.parameters())
        checks["optim_on_own_mesh"] = all(optimizer.state[p]["exp_avg"].device_mesh is p.device_mesh for p in params)
        checks["optim_full_equal"] = all(  # collectives on the loaded state work, and agree with the source's
            torch.equal(optimizer.state[p][k].full_tensor(), source_optim.state[q][k].full_tensor())
            for p, q in zip(params, source_params) for k in ("exp_avg", "exp_avg_sq"))
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()  # the next step runs on the loaded state
        checks["stepped"] = True

        try:  # the plain load leaves the stand-in mesh in the optimizer: what ShardedState is for
            stand_in.full_tensor()
            checks["stand_in_collective_fails"] = False
        except Exception:  # torch's own error for a mesh without process groups
            checks["stand_in_collective_fails"] = True

        shifted = {**received, "model": {**received["model"], "0.weight": torch.zeros(3, 6)}}
        try:
            state.load_state_dict(shifted)
            checks["plain_for_sharded_refused"] = False
        except CheckpointError as exc:
            checks["plain_for_sharded_refused"] = "0.weight: this rank's is sharded, the source's is not" in str(exc)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, checks))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_a_heal_into_fresh_tensors_loads_shards_and_puts_optimizer_state_on_the_parameters_mesh(tmp_path: Path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_rank, args=(rank, str(tmp_path / "store"), results)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        answers = dict(results.get(timeout=WAIT) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(30)
    for rank, checks in sorted(answers.items()):
        assert isinstance(checks, dict), f"rank {rank} failed:\n{checks}"
        assert checks == {"received_on_stand_in": True, "model_equal": True, "optim_on_own_mesh": True,
                          "optim_full_equal": True, "stepped": True, "stand_in_collective_fails": True,
                          "plain_for_sharded_refused": True}, f"rank {rank}: {checks}"
