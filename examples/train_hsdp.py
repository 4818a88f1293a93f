"""Fault-tolerant HSDP: FSDP2 shards a small decoder-only transformer inside each replica group, the
Manager averages the shards across groups. CPU and gloo by default; ``--device cuda`` uses NCCL (give each
group its own GPUs, e.g. ``CUDA_VISIBLE_DEVICES=0,1`` and ``2,3``, when they share a machine).

Launch one torchrun per replica group (a lighthouse must be running)::

    python -m lighthouse --min_replicas 1 --join_timeout_ms 2000 &
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=29600 --nnodes=1 --nproc_per_node=2 examples/train_hsdp.py
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=29601 --nnodes=1 --nproc_per_node=2 examples/train_hsdp.py

Kill one rank of a group (SIGKILL): its partner's next in-group collective
fails, the group leaves and the other trains on; start the group again and
each of its ranks heals its own shard from the same rank of the survivor.
Each committed step prints the step, loss and participants; ``--report FILE``
appends one JSON line per rank and committed step with a checksum of that
rank's shards (group rank r of every group holds the same shard: compare
them per rank). Tokens are synthetic, drawn from a generator seeded by
(step, group, rank), so a run is deterministic.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import torchft_lite as torchft
from torchft_lite.hsdp import ShardedState, average_across_groups, init_group_mesh
from torchft_lite.process_group import ManagedProcessGroup


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="stop after this many committed steps (default 100)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step (default 8)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--vocab", type=int, default=128, help="vocabulary size (default 128)")
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks, one FSDP unit each (default 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: gloo in the group and across groups; cuda: NCCL for both, device LOCAL_RANK "
                             "(default cpu)")
    parser.add_argument("--bf16", action="store_true", help="compute in bfloat16, reduce in float32 (FSDP2's "
                                                            "MixedPrecisionPolicy; works on CPU too)")
    parser.add_argument("--hook", choices=["helper", "torchft"], default="helper",
                        help="how shards are averaged across groups: torchft_lite.hsdp.average_across_groups, or "
                             "torchft's way (dist.all_reduce on a ManagedProcessGroup in each module's hook) "
                             "(default helper)")
    parser.add_argument("--min-replicas", type=int, default=1, help="min_replica_size for the Manager (default 1)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds for collectives across groups and heals (default 10)")
    parser.add_argument("--group-timeout", type=float, default=300.0,
                        help="seconds for the in-group (FSDP) collectives; well above --timeout, since a rank may "
                             "serve a heal that long while its partner waits in the next all-gather (default 300)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step, to watch it (default 0)")
    parser.add_argument("--report", help="append a JSON line per rank and committed step to this file")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    if args.dim % args.heads or min(args.steps, args.batch_size, args.seq_len, args.vocab, args.layers) < 1:
        parser.error("--dim must be a multiple of --heads, and the sizes positive")
    return args


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.mlp_norm(x))


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch_for(step: int, group: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences mod the vocabulary (learnable in context), from a generator seeded by position."""
    seed = int.from_bytes(hashlib.sha256(f"hsdp/{step}/{group}/{rank}".encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(args.vocab, (args.batch_size, 1), generator=generator)
    stride = torch.randint(1, 5, (args.batch_size, 1), generator=generator)
    tokens = (start + stride * torch.arange(args.seq_len + 1)) % args.vocab
    return tokens[:, :-1], tokens[:, 1:]


def shards_checksum(model_state: dict) -> str:
    """A digest of this rank's shards (exact bytes); group rank r of every group should report the same."""
    digest = hashlib.sha256()
    for key, tensor in model_state.items():
        local = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().contiguous().cpu()
        digest.update(key.encode())
        digest.update(ctypes.string_at(local.data_ptr(), local.numel() * local.element_size()))
    return digest.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s g{group}r{rank} %(levelname)s %(name)s: %(message)s")
    timeout = timedelta(seconds=args.timeout)

    mesh = init_group_mesh(args.device, timeout=timedelta(seconds=args.group_timeout))  # this group's ranks only
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(1000 + group)  # groups differ on purpose: the first quorum heals them to one state
    model = TinyDecoder(args.vocab, args.dim, args.layers, args.heads, args.seq_len).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    inner_optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = ShardedState(model, inner_optim)

    replica_pg = torchft.ProcessGroupNCCL if args.device == "cuda" else torchft.ProcessGroupGloo
    manager = torchft.Manager(pg=replica_pg(timeout=timeout), min_replica_size=args.min_replicas,
                              state_dict=state.state_dict, load_state_dict=state.load_state_dict,
                              replica_id=f"train_hsdp_{group}", timeout=timeout)
    if args.hook == "helper":
        average_across_groups(model, manager)
    else:  # torchft's spelling, unchanged
        replicas = ManagedProcessGroup(manager)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(lambda t: dist.all_reduce(t, group=replicas, op=dist.ReduceOp.AVG))
    optimizer = torchft.Optimizer(manager, inner_optim)
    report = open(args.report, "a", buffering=1) if args.report else None
    try:
        while manager.current_step() < args.steps:
            inputs, targets = (t.to(device) for t in batch_for(manager.current_step(), group, rank, args))
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
            loss.backward()
            before = manager.current_step()
            optimizer.step()
            if manager.current_step() > before and manager.num_participants() >= args.min_replicas:
                step = manager.current_step()
                print(f"[group {group} rank {rank}] step={step} loss={loss.item():.4f} "
                      f"participants={manager.num_participants()}", flush=True)
                if report:
                    report.write(json.dumps({"group": group, "rank": rank, "step": step,
                                             "checksum": shards_checksum(state.state_dict()["model"]),
                                             "loss": loss.item(), "participants": manager.num_participants(),
                                             "batches_committed": manager.batches_committed(),
                                             "time": time.time(), "pid": os.getpid()}) + "\n")
            if args.step_sleep:
                time.sleep(args.step_sleep)
        print(f"[group {group} rank {rank}] done at step {manager.current_step()}", flush=True)
    finally:
        if report:
            report.close()
        manager.shutdown()
        dist.destroy_process_group()


if __name__ == "__main__":
    from torchft_lite.cluster.exit_codes import run  # documented exit codes for schedulers (0, 1, 75, 78, 143)

    raise SystemExit(run(main))
