"""Fault-tolerant DiLoCo, Streaming DiLoCo and LocalSGD on CPU with synthetic data.

Launch one torchrun per replica group, as for train_ddp.py (a lighthouse must be running)::

    python -m lighthouse --min_replicas 1 --join_timeout_ms 2000 &
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=29600 --nnodes=1 --nproc_per_node=1 examples/train_diloco.py --sync-every 20
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=29601 --nnodes=1 --nproc_per_node=1 examples/train_diloco.py --sync-every 20

Each group takes ``--sync-every`` inner steps (AdamW) on its own data, then
the groups average their pseudo-gradients (global - local parameters) and
step an outer optimizer (SGD, Nesterov momentum) on the global parameters.
``--fragments N`` syncs the model in N parts, one every ``sync_every / N``
inner steps (Streaming DiLoCo); ``--local-sgd`` averages the parameters
instead; ``--ddp`` averages gradients every step (torchft's DDP), for
comparison. Kill a group and the others sync on without it; start it again
and it heals the global parameters and outer optimizer from a peer at its
first sync.

Each committed sync prints the job's step (one per sync), the loss and the
participants; ``--report FILE`` appends one JSON line per committed sync with
checksums of the global parameters and the outer optimizer state (equal in
every group at the same step), the bytes sent to other groups so far, and a
last ``"event": "done"`` line with the loss on held-out data. A slow link
between groups can be simulated (``--link-mb-per-s``; see slow_link.py).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import importlib
import json
import logging
import math
import os
import signal
import time
from datetime import timedelta

import torch
from slow_link import MeteredLink  # noqa: E402  (next to this script)
from torch import nn

IN, OUT, BLOCKS = 32, 8, 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="inner steps of the job: stop at the sync that "
                        "completes this many (a multiple of the steps between syncs) (default 200)")
    parser.add_argument("--sync-every", type=int, default=20, help="inner steps between two syncs of the same "
                        "parameters (default 20)")
    parser.add_argument("--fragments", type=int, default=1, help=f"Streaming DiLoCo: sync the model in this many "
                        f"fragments (1-{BLOCKS}; sync_every must be a multiple) (default 1: DiLoCo)")
    parser.add_argument("--fragment-sync-delay", type=int, default=0, help="inner steps a fragment's averaging "
                        "overlaps before the sync waits for it (default 0)")
    parser.add_argument("--alpha", type=float, default=0.0, help="fragment_update_alpha: mix this much of the "
                        "local parameters into the new global ones (default 0.0)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD learning rate (default 0.7)")
    parser.add_argument("--lr", type=float, default=1e-3, help="inner AdamW learning rate (default 1e-3)")
    parser.add_argument("--quantize", action="store_true", help="average the pseudo-gradients in 8 bits "
                        "(should_quantize=True)")
    parser.add_argument("--bucketize", action="store_true", help="average in flat buckets (use_bucketization)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--local-sgd", action="store_true", help="LocalSGD: average the parameters every "
                      "--sync-every steps instead")
    mode.add_argument("--ddp", action="store_true", help="per-step DDP on the same model and data (a baseline)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width of the MLP (default 128)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    parser.add_argument("--min-replicas", type=int, default=1, help="min_replica_size for the Manager (default 1)")
    parser.add_argument("--timeout", type=float, default=30.0, help="collective/heal timeout in seconds (default 30)")
    parser.add_argument("--link-mb-per-s", type=float, help="simulate a link of this bandwidth (MB/s) between "
                        "groups (default: no limit)")
    parser.add_argument("--link-latency-ms", type=float, default=0.0, help="and this one-way latency (default 0)")
    parser.add_argument("--report", help="append a JSON line per committed sync (and a last one) to this file")
    parser.add_argument("--impl", choices=["torchft_lite", "torchft"], default="torchft_lite",
                        help="which library to import as `torchft` (default torchft_lite)")
    faults = parser.add_argument_group("fault injection (only in the replica group named by --inject-group)")
    faults.add_argument("--inject-group", type=int, help="REPLICA_GROUP_ID of the group that kills itself")
    faults.add_argument("--kill-at-inner-step", type=int, metavar="N", help="SIGKILL this process before its "
                        "inner step N (counted from 0 in this process): a death mid inner loop")
    faults.add_argument("--kill-in-sync", type=int, metavar="N", help="SIGKILL this process inside the first sync "
                        "after it committed N syncs, once the sync's first collective completed and before its "
                        "second starts")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args()
    if (args.kill_at_inner_step is not None or args.kill_in_sync is not None) and args.inject_group is None:
        parser.error("--kill-at-inner-step and --kill-in-sync need --inject-group G")
    if not 1 <= args.fragments <= BLOCKS:
        parser.error(f"--fragments must be between 1 and {BLOCKS} (the model has {BLOCKS} blocks)")
    if (args.local_sgd or args.ddp) and (args.fragments > 1 or args.quantize or args.alpha):
        parser.error("--fragments, --quantize and --alpha are DiLoCo's: leave them out with --local-sgd/--ddp")
    if args.steps < 1 or args.sync_every < 1:
        parser.error("--steps and --sync-every must be >= 1")
    return args


def build_model(hidden: int) -> nn.Sequential:
    """BLOCKS blocks, so that a model fragment is a run of whole blocks."""
    return nn.Sequential(nn.Sequential(nn.Linear(IN, hidden), nn.ReLU()),
                         nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
                         nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()), nn.Linear(hidden, OUT))


class Data:
    """Inputs drawn from this rank's own stream; targets from a fixed random teacher network."""

    def __init__(self, seed: int, batch_size: int) -> None:
        teacher_rng = torch.Generator().manual_seed(0)  # the same task everywhere
        self.w1 = torch.randn(IN, 64, generator=teacher_rng) / IN ** 0.5
        self.w2 = torch.randn(64, OUT, generator=teacher_rng) / 8
        self.rng, self.batch_size = torch.Generator().manual_seed(seed), batch_size
        held_out = torch.randn(1024, IN, generator=torch.Generator().manual_seed(12345))
        self.held_out = (held_out, self.target(held_out))

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1) @ self.w2

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch_size, IN, generator=self.rng)
        return x, self.target(x)


def checksum(tensors) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().contiguous().cpu()
        digest.update(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()))  # exact bytes
    return digest.hexdigest()[:16]


def global_parameters(model: nn.Module, fragments: list[nn.Module], algorithm) -> dict[str, torch.Tensor]:
    """The parameters every group agreed on at its last sync: DiLoCo's global copies, else the model's."""
    backups = {}
    for fragment, state in zip(fragments, getattr(algorithm, "_fragments", [])):  # DiLoCo's per-fragment state
        for (name, p) in fragment.named_parameters():
            backups[id(p)] = state.original_parameters[name]
    return {name: backups.get(id(p), p).detach() for name, p in model.named_parameters()}


def outer_state(outers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [value for outer in outers for _, s in sorted(outer.state_dict()["state"].items())
            for _, value in sorted(s.items()) if isinstance(value, torch.Tensor)]


class Faults:
    """``--kill-at-inner-step`` and ``--kill-in-sync`` (this group only): the process SIGKILLs itself."""

    def __init__(self, args: argparse.Namespace, replica_group: int, manager) -> None:
        mine = args.inject_group == replica_group
        self.kill_at = args.kill_at_inner_step if mine else None
        self.committed = 0  # syncs this process committed (the training loop counts them)
        if mine and args.kill_in_sync is not None:
            allreduce, started = manager.allreduce, []

            def allreduce_then_die(tensor, *rest, **kwargs):
                if self.committed != args.kill_in_sync:
                    return allreduce(tensor, *rest, **kwargs)
                if started:  # the sync's first collective went through; die before the second starts
                    started[0].wait()
                    self.die(f"in the sync at step {manager.current_step()}, after its first collective")
                started.append(allreduce(tensor, *rest, **kwargs))
                return started[0]

            manager.allreduce = allreduce_then_die

    @staticmethod
    def die(where: str) -> None:
        print(f"[pid {os.getpid()}] injected SIGKILL {where}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def before_inner_step(self, inner_step: int) -> None:
        if self.kill_at is not None and inner_step == self.kill_at:
            self.die(f"before inner step {inner_step}")


def main() -> None:
    args = parse_args()
    torchft = importlib.import_module(args.impl)
    local_sgd = importlib.import_module(f"{args.impl}.local_sgd")
    replica_group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s g{replica_group}r{rank} %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)  # the same initial model in every group: their first quorum is at the first sync
    model = build_model(args.hidden)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = Data(seed=1000 * replica_group + rank, batch_size=args.batch_size)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner_optim"])

    link = MeteredLink(torchft.ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)),
                       args.link_mb_per_s * 1e6 if args.link_mb_per_s else None, args.link_latency_ms / 1000)
    manager = torchft.Manager(pg=link, min_replica_size=args.min_replicas, load_state_dict=load_state_dict,
                              state_dict=state_dict, replica_id=f"train_diloco_{replica_group}",
                              timeout=timedelta(seconds=args.timeout), use_async_quorum=args.ddp, init_sync=False)
    faults = Faults(args, replica_group, manager)
    outers: list[torch.optim.Optimizer] = []
    fragments: list[nn.Module] = []
    forward, optimizer = model, inner
    if args.ddp:
        forward, optimizer = torchft.DistributedDataParallel(manager, model), torchft.Optimizer(manager, inner)
        algorithm, per_sync = contextlib.nullcontext(), 1
    elif args.local_sgd:
        algorithm, per_sync = local_sgd.LocalSGD(manager, model, inner, sync_every=args.sync_every), args.sync_every
    else:
        bounds = [BLOCKS * i // args.fragments for i in range(args.fragments + 1)]
        fragments = [model[bounds[i]:bounds[i + 1]] for i in range(args.fragments)]
        outers = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True) for f in fragments]
        algorithm = local_sgd.DiLoCo(manager, fragments, inner, outers, sync_every=args.sync_every,
                                     use_bucketization=args.bucketize, should_quantize=args.quantize,
                                     fragment_sync_delay=args.fragment_sync_delay, fragment_update_alpha=args.alpha)
        per_sync = args.sync_every // args.fragments
    syncs = math.ceil(args.steps / per_sync)
    report = open(args.report, "a", buffering=1) if args.report else None
    label, inner_steps, loop_start = f"[group {replica_group} rank {rank}]", 0, time.time()

    def write(row: dict) -> None:
        if report:
            report.write(json.dumps({"group": replica_group, "rank": rank, "pid": os.getpid(), "time": time.time(),
                                     "bytes_sent": link.bytes_sent, "collectives": link.collectives, **row}) + "\n")

    try:
        with algorithm:
            while manager.current_step() < syncs:
                faults.before_inner_step(inner_steps)
                batch, target = data.next()
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(forward(batch), target)
                loss.backward()
                before = manager.current_step()
                optimizer.step()  # DiLoCo/LocalSGD: every per_sync-th inner step also syncs
                inner_steps += 1
                if manager.current_step() > before and manager.num_participants() >= args.min_replicas:
                    step, faults.committed = manager.current_step(), faults.committed + 1
                    print(f"{label} sync step={step} loss={loss.item():.4f} participants="
                          f"{manager.num_participants()} sent={link.bytes_sent / 1e6:.1f} MB", flush=True)
                    write({"event": "sync", "step": step, "inner_steps": inner_steps, "loss": loss.item(),
                           "participants": manager.num_participants(),
                           "checksum": checksum(global_parameters(model, fragments, algorithm).values()),
                           "outer_checksum": checksum(outer_state(outers))})
        with torch.no_grad():
            held_out, expected = data.held_out
            predicted = torch.func.functional_call(model, global_parameters(model, fragments, algorithm), (held_out,))
            eval_loss = nn.functional.mse_loss(predicted, expected).item()
        print(f"{label} done at step {manager.current_step()}: held-out loss {eval_loss:.5f}, "
              f"{link.bytes_sent / 1e6:.2f} MB sent to other groups", flush=True)
        write({"event": "done", "step": manager.current_step(), "inner_steps": inner_steps, "eval_loss": eval_loss,
               "loop_start": loop_start})
    finally:
        if report:
            report.close()
        manager.shutdown()


if __name__ == "__main__":
    from torchft_lite.cluster.exit_codes import run  # documented exit codes for schedulers (0, 1, 75, 78, 143)

    raise SystemExit(run(main))
