"""One rank of an HSDP replica group that saves what test_hsdp.py checks the cross-group average against.

Trains ``examples/train_hsdp.py``'s model with ``torchft_lite.hsdp`` for
``--steps`` steps. At the step attempted at ``--dump-at`` it saves, before the
forward pass, the full parameters, and after the backward pass the full
gradients (both gathered inside the group, for the test's eyes only), the
step's participants and this rank's (group, rank), to
``OUT/g{group}r{rank}.pt`` (tensors and numbers only: ``weights_only`` loads it).

Run by ``torchft_lite.cluster.local.ReplicaGroup`` (direct mode, torchrun's environment).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from train_hsdp import TinyDecoder, batch_for  # noqa: E402

import torchft_lite as torchft  # noqa: E402
from torchft_lite.hsdp import ShardedState, average_across_groups, init_group_mesh  # noqa: E402
from torchft_lite.process_group import ManagedProcessGroup  # noqa: E402

SIZES = dict(vocab=64, dim=32, layers=2, heads=4, seq_len=16)


def model_args(batch_size: int) -> argparse.Namespace:
    """What ``batch_for`` reads of the example's arguments."""
    return argparse.Namespace(batch_size=batch_size, seq_len=SIZES["seq_len"], vocab=SIZES["vocab"])


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().float().clone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dump-at", type=int, default=1)
    parser.add_argument("--hook", choices=["helper", "torchft"], default="helper")
    parser.add_argument("--reduce-dtype", choices=["float32", "float16"], default="float32")
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    group, rank = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"])
    timeout = timedelta(seconds=15)

    mesh = init_group_mesh("cpu", timeout=timedelta(seconds=300))
    torch.manual_seed(7 + group)  # groups start apart: the first quorum heals them to one state
    model = TinyDecoder(SIZES["vocab"], SIZES["dim"], SIZES["layers"], SIZES["heads"], SIZES["seq_len"])
    policy = MixedPrecisionPolicy(reduce_dtype=getattr(torch, args.reduce_dtype))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    state = ShardedState(model, inner)
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(timeout=timeout), min_replica_size=2,
                              state_dict=state.state_dict, load_state_dict=state.load_state_dict,
                              replica_id=f"hsdp_grad_{group}", timeout=timeout)
    if args.hook == "helper":
        assert average_across_groups(model, manager) == SIZES["layers"] + 1
    else:
        replicas = ManagedProcessGroup(manager)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(lambda t: dist.all_reduce(t, group=replicas, op=dist.ReduceOp.AVG))
    optimizer = torchft.Optimizer(manager, inner)
    batch_args = model_args(args.batch_size)
    try:
        while manager.current_step() < args.steps:
            step = manager.current_step()
            inputs, targets = batch_for(step, group, rank, batch_args)
            optimizer.zero_grad()
            dump = step == args.dump_at
            # The state a heal may still be landing in is settled by should_commit; the test checks the
            # dumped parameters agree across groups, which they only do when nobody healed this step.
            params = {name: full(p) for name, p in model.named_parameters()} if dump else None
            loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
            loss.backward()
            if dump:
                grads = {name: full(p.grad) for name, p in model.named_parameters()}
                torch.save({"group": group, "rank": rank, "step": step, "params": params, "grads": grads,
                            "participants": manager.num_participants(), "errored": manager.errored() is not None},
                           Path(args.out) / f"g{group}r{rank}.pt")
            optimizer.step()
    finally:
        manager.shutdown()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
