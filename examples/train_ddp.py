"""Fault-tolerant DDP with synthetic data, on CPU or one GPU per rank: torchft's train_ddp flow.

Launch one torchrun per replica group (a lighthouse must be running)::

    python -m lighthouse --min_replicas 1 --join_timeout_ms 2000 &
    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=29600 --nnodes=1 --nproc_per_node=1 examples/train_ddp.py
    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=29601 --nnodes=1 --nproc_per_node=1 examples/train_ddp.py

Kill either group (Ctrl-C / SIGKILL) and the other trains on; start it again
and it is healed from the survivor and rejoins. Each committed step prints the
step, loss and participants; ``--report FILE`` also appends one JSON line per
committed step with a checksum of the parameters (the demo and tests compare
them across groups).

On GPUs (``--device cuda``) every rank trains on its own GPU, ``cuda:LOCAL_RANK``
of the ones its group sees (``CUDA_VISIBLE_DEVICES``): a group with fewer GPUs
than ranks stops with a clear error. Groups may share GPUs; the replica
process group (``--pg``) then stays gloo, which stages CUDA tensors through
host memory. When every group has GPUs of its own, ``--pg nccl`` (or
``baby-nccl``: NCCL in a child process, whose abort is a kill) keeps the
gradients on the GPUs::

    CUDA_VISIBLE_DEVICES=0,1,2,3 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=29600 --nproc_per_node=4 examples/train_ddp.py --device cuda --pg nccl
    CUDA_VISIBLE_DEVICES=4,5,6,7 REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=29601 --nproc_per_node=4 examples/train_ddp.py --device cuda --pg nccl

With ``--checkpoint-dir DIR`` (torchft_lite only) one group saves a durable
checkpoint every ``--checkpoint-every`` committed steps; start every group again
after the whole job died and they resume from the newest complete one. The
batches are drawn by position (saved with the checkpoint), so a resumed job
continues exactly as one that was never interrupted.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib
import json
import logging
import math
import os
import signal
import struct
import time
from datetime import timedelta

SCRIPT_START = time.time()  # --timeline: before ``import torch``, the first thing a restart pays for

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

TORCH_IMPORTED = time.time()

from rejoin_timeline import Timeline  # noqa: E402  (next to this script; imports neither torch nor the library)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="stop after this many committed steps (default 100)")
    parser.add_argument("--batch-size", type=int, default=16, help="per-rank batch size (default 16)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step, to watch it (default 0)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden width of the MLP; 1024 makes a ~13 MB heal (default 64)")
    parser.add_argument("--min-replicas", type=int, default=1, help="min_replica_size for the Manager (default 1)")
    parser.add_argument("--timeout", type=float, default=10.0, help="collective/heal timeout in seconds (default 10)")
    parser.add_argument("--report", help="append a JSON line per committed step to this file")
    parser.add_argument("--timeline", help="append one JSON line to this file at this process's first committed "
                                           "step: when it started, imported torch and the library, built the "
                                           "Manager, got its first quorum, healed (examples/rejoin_timeline.py; "
                                           "needs --log-level INFO or lower)")
    parser.add_argument("--impl", choices=["torchft_lite", "torchft"], default="torchft_lite",
                        help="which library to import as `torchft` (torchft: PyTorch's, for comparisons)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where each rank trains: cpu, or cuda (its own GPU, cuda:LOCAL_RANK of the ones its "
                             "group sees; groups may share GPUs) (default cpu)")
    parser.add_argument("--pg", choices=["gloo", "baby-gloo", "nccl", "baby-nccl"], default="gloo",
                        help="the replica process group across groups: gloo in this process, or in a child process "
                             "whose abort is a kill (baby-gloo); nccl or baby-nccl need --device cuda and GPUs no "
                             "other group uses (default gloo: works on any device, GPUs shared or not)")
    parser.add_argument("--grad-sync", choices=["ddp", "allreduce"], default="ddp",
                        help="how gradients are averaged: DistributedDataParallel's comm hook, or one "
                             "manager.allreduce(p.grad) per parameter after backward, each waited for (default ddp)")
    parser.add_argument("--checkpoint-dir", help="save durable checkpoints here and resume from the newest at start "
                                                   "(torchft_lite only; default: off)")
    parser.add_argument("--checkpoint-every", type=int, default=100,
                        help="save every this many committed steps (default 100)")
    parser.add_argument("--keep-last", type=int, default=3, help="complete checkpoints to keep (default 3)")
    faults = parser.add_argument_group("fault injection (only in the replica group named by --inject-group)")
    faults.add_argument("--inject-group", type=int, help="REPLICA_GROUP_ID of the group the faults below apply to")
    faults.add_argument("--inject-nan-at", type=int, metavar="STEP",
                        help="from the step attempted at STEP on, poison the loss with NaN (a bad batch): every "
                             "gradient of the group is NaN")
    faults.add_argument("--inject-nan-times", type=int, default=1, metavar="K",
                        help="for this many step attempts in a row (default 1)")
    faults.add_argument("--inject-bitflip-at", type=int, metavar="STEP",
                        help="before the step attempted at STEP, flip one bit (bit 22, the top of the mantissa) of "
                             "the first parameter's first element on group rank --inject-rank: silent data "
                             "corruption")
    faults.add_argument("--inject-rank", type=int, default=0, metavar="R",
                        help="the group rank --inject-bitflip-at flips a bit on (default 0)")
    faults.add_argument("--slow-ms", type=float, default=0.0, help="sleep this many ms every step (a straggler)")
    faults.add_argument("--inject-stop-at", type=int, metavar="STEP",
                        help="once the gradients of the step attempted at STEP were exchanged (after backward, "
                             "before the optimizer step and its commit vote), every rank of the group stops itself "
                             "with SIGSTOP: a hang that SIGCONT ends")
    faults.add_argument("--inject-hold-at", type=int, metavar="STEP",
                        help="like --inject-stop-at, but each rank only holds its training thread (the control "
                             "plane keeps running) until --inject-hold-file exists, after writing that path plus "
                             "'.rank<R>' (for a test to cut the network meanwhile); at most 300 s")
    faults.add_argument("--inject-hold-file", metavar="PATH", help="see --inject-hold-at")
    faults.add_argument("--inject-stop-on-usr1", action="store_true",
                        help="in every group: SIGUSR1 arms a stop, and the rank stops itself with SIGSTOP once its "
                             "next step's gradients were exchanged, before the vote (the chaos run's "
                             "hang-before-vote fault); SIGUSR2 disarms it")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    injects = (args.inject_nan_at is not None or args.inject_bitflip_at is not None or args.slow_ms
               or args.inject_stop_at is not None or args.inject_hold_at is not None)
    if injects and args.inject_group is None:
        parser.error("--inject-nan-at, --inject-bitflip-at, --inject-stop-at, --inject-hold-at and --slow-ms need "
                     "--inject-group G")
    if (args.inject_hold_at is None) != (args.inject_hold_file is None):
        parser.error("--inject-hold-at and --inject-hold-file go together")
    if args.inject_nan_times < 1 or args.slow_ms < 0:
        parser.error("--inject-nan-times must be >= 1 and --slow-ms >= 0")
    if args.checkpoint_dir and args.impl != "torchft_lite":
        parser.error("--checkpoint-dir needs --impl torchft_lite (torchft has no durable checkpoints)")
    if args.checkpoint_every < 1 or args.keep_last < 1:
        parser.error("--checkpoint-every and --keep-last must be >= 1")
    return args


class Batches:
    """The batch at each position of this rank's endless pass over its shard, epoch after epoch.

    Drawn by position rather than from a DataLoader iterator, so the position
    (a number) is all a durable checkpoint needs to continue the data order
    exactly.
    """

    def __init__(self, dataset: TensorDataset, sampler, batch_size: int) -> None:
        self.dataset, self.sampler, self.batch_size = dataset, sampler, batch_size
        self.per_epoch = math.ceil(len(sampler) / batch_size)
        self.position = 0
        self._epoch, self._order = -1, []

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = divmod(self.position, self.per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._epoch, self._order = epoch, list(self.sampler)
        self.position += 1
        return self.dataset[self._order[index * self.batch_size:(index + 1) * self.batch_size]]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


class Faults:
    """The faults ``--inject-*`` and ``--slow-ms`` ask for, applied in this group only (see ``--help``)."""

    def __init__(self, args: argparse.Namespace, replica_group: int, rank: int) -> None:
        mine = args.inject_group == replica_group
        self.nan_at = args.inject_nan_at if mine else None
        self.nan_left = args.inject_nan_times
        self.flip_at = args.inject_bitflip_at if mine and rank == args.inject_rank else None
        self.slow = args.slow_ms / 1000 if mine else 0.0
        self.stop_at = args.inject_stop_at if mine else None
        self.hold_at = args.inject_hold_at if mine else None
        self.hold_file = args.inject_hold_file
        self.rank = rank
        self.label = f"[group {replica_group} rank {rank}]"
        self.armed = False
        if args.inject_stop_on_usr1:
            signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "armed", True))
            signal.signal(signal.SIGUSR2, lambda *_: setattr(self, "armed", False))

    def before_step(self, step: int, model: nn.Module) -> None:
        if self.flip_at is not None and step >= self.flip_at:
            self.flip_at = None
            with torch.no_grad():
                first = next(model.parameters())
                bits = first.view(-1)[:1].view(torch.int32)
                bits ^= 1 << 22
            print(f"{self.label} injected a bit flip at step {step}", flush=True)

    def after_exchange(self, step: int) -> None:
        """Between backward (the gradients are averaged across groups) and the optimizer step (the vote)."""
        due = self.stop_at is not None and step >= self.stop_at
        if self.armed or due:
            self.armed = False
            self.stop_at = None if due else self.stop_at
            print(f"{self.label} stopping itself (SIGSTOP) after the exchange of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
            print(f"{self.label} resumed after the exchange of step {step}", flush=True)
        if self.hold_at is not None and step >= self.hold_at:
            self.hold_at = None
            print(f"{self.label} holding after the exchange of step {step} until {self.hold_file} exists", flush=True)
            with open(f"{self.hold_file}.rank{self.rank}", "w") as marker:
                marker.write(f"{step}\n")
            deadline = time.monotonic() + 300.0
            while not os.path.exists(self.hold_file) and time.monotonic() < deadline:
                time.sleep(0.05)
            print(f"{self.label} released after the exchange of step {step}", flush=True)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.slow:  # here, between start_quorum and the first allreduce: the group's compute time
            time.sleep(self.slow)
        if self.nan_at is None or step < self.nan_at or self.nan_left <= 0:
            return loss
        self.nan_left -= 1
        print(f"{self.label} injected NaN into the loss at step {step}", flush=True)
        return loss * float("nan")


def params_checksum(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        if tensor.is_cuda and tensor.element_size() == 4:  # summed on the GPU: 120 MB through sha256 is 0.2 s a step
            digest.update(_words_digest(tensor))
            continue
        flat = tensor.detach().contiguous().cpu()
        digest.update(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()))  # exact bytes
    return digest.hexdigest()[:16]


def _words_digest(tensor: torch.Tensor) -> bytes:
    """The exact bits of a 4-byte tensor in two numbers: the sum of its 32-bit words, and of each word times
    its position (wrapping at 64 bits). Any changed bit changes the first; moved words change the second."""
    words = tensor.detach().contiguous().view(-1).view(torch.int32).to(torch.int64)
    positions = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64)
    return struct.pack("<2q", *torch.stack([words.sum(), (words * positions).sum()]).tolist())


def training_device(kind: str, pg: str) -> torch.device:
    """``cuda:LOCAL_RANK`` for ``--device cuda`` (made current), after checking this group has a GPU per rank."""
    from torchft_lite.errors import ConfigError  # exit code 78 (torchft_lite.cluster.exit_codes), whichever --impl

    if kind == "cpu":
        if pg in ("nccl", "baby-nccl"):
            raise ConfigError(f"--pg {pg} needs --device cuda (NCCL reduces GPU tensors only)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch.cuda.is_available() is False here (a CPU-only torch, or no GPU "
                          "visible); use --device cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    visible = torch.cuda.device_count()
    if visible < ranks_here or local_rank >= visible:
        raise ConfigError(f"--device cuda gives every rank a GPU of its own: this group runs {ranks_here} rank(s) "
                          f"on this machine (LOCAL_RANK {local_rank}) and sees {visible} GPU(s) "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); give it at "
                          f"least as many GPUs as ranks")
    torch.cuda.set_device(local_rank)  # before the process group: NCCL's binds the device current at construction
    return torch.device("cuda", local_rank)


def average_each_gradient(manager, model: nn.Module) -> None:
    """``--grad-sync allreduce``: one manager.allreduce per gradient, all started, then each waited for."""
    works = [manager.allreduce(p.grad) for p in model.parameters() if p.grad is not None]
    for work in works:
        work.wait()


def main() -> None:
    args = parse_args()
    # The same script runs on either library: that is the drop-in promise.
    timeline = Timeline(args.timeline, args.impl, SCRIPT_START)
    timeline.mark("torch_imported", at=TORCH_IMPORTED)
    torchft = importlib.import_module(args.impl)
    # What ``from torchft import Manager, ...`` would load (torchft_lite resolves its names lazily).
    _ = (torchft.Manager, torchft.DistributedDataParallel, torchft.Optimizer, torchft.DistributedSampler,
         torchft.ProcessGroupGloo)
    timeline.mark("library_imported")
    replica_group = int(os.environ.get("REPLICA_GROUP_ID", 0))
    num_groups = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s g{replica_group}r{rank} %(levelname)s %(name)s: %(message)s")
    device = training_device(args.device, args.pg)

    # Every group seeds differently on purpose: init_sync makes them agree at step 0.
    torch.manual_seed(1000 + replica_group)
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 8)).to(device)
    inner_optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner_optim.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner_optim.load_state_dict(state["optim"])

    generator = torch.Generator().manual_seed(0)  # the same synthetic dataset everywhere
    inputs = torch.randn(4096, 32, generator=generator)
    dataset = TensorDataset(inputs, (inputs[:, :8] * 2).sin())
    sampler = torchft.DistributedSampler(dataset, replica_rank=replica_group, num_replica_groups=num_groups,
                                         group_rank=rank, num_replicas=world, shuffle=True)
    batches = Batches(dataset, sampler, args.batch_size)

    timeline.mark("manager_begin")
    pg_class = {"gloo": "ProcessGroupGloo", "baby-gloo": "ProcessGroupBabyGloo", "nccl": "ProcessGroupNCCL",
                "baby-nccl": "ProcessGroupBabyNCCL"}[args.pg]
    pg_class = getattr(torchft, pg_class)
    pg = pg_class(timeout=timedelta(seconds=args.timeout))
    manager = torchft.Manager(pg=pg, min_replica_size=args.min_replicas, load_state_dict=load_state_dict,
                              state_dict=state_dict, replica_id=f"train_ddp_{replica_group}",
                              timeout=timedelta(seconds=args.timeout))
    timeline.mark("manager_constructed")
    if hasattr(manager, "add_step_listener"):  # torchft_lite: the first step's StepReport
        manager.add_step_listener(timeline)
    checkpointer = None
    if args.checkpoint_dir:
        checkpointer = torchft.DurableCheckpointer(manager, args.checkpoint_dir, every=args.checkpoint_every,
                                                   keep_last=args.keep_last)
        checkpointer.register_local("batches", batches.state_dict, batches.load_state_dict)
        resumed = checkpointer.resume()
        timeline.mark("checkpoint_resumed")
        print(f"[group {replica_group} rank {rank}] "
              + (f"resumed from step {resumed}" if resumed is not None else "no checkpoint: starting fresh"),
              flush=True)
    ddp_model = torchft.DistributedDataParallel(manager, model) if args.grad_sync == "ddp" else model
    optimizer = torchft.Optimizer(manager, inner_optim)
    criterion = nn.MSELoss()
    report = open(args.report, "a", buffering=1) if args.report else None
    faults = Faults(args, replica_group, rank)
    try:
        while manager.current_step() < args.steps:
            faults.before_step(manager.current_step(), model)
            batch, target = (t.to(device) for t in batches.next())
            timeline.mark("first_step_begin")
            optimizer.zero_grad()
            loss = faults.loss(manager.current_step(), criterion(ddp_model(batch), target))
            loss.backward()
            if args.grad_sync == "allreduce":
                average_each_gradient(manager, model)
            faults.after_exchange(manager.current_step())
            before = manager.current_step()
            optimizer.step()
            # Committed: the step moved on with enough replicas. (A heal also moves the step, and is
            # kept when the step only lacked replicas: the healing group did not count.)
            if manager.current_step() > before and manager.num_participants() >= args.min_replicas:
                step = manager.current_step()
                print(f"[group {replica_group} rank {rank}] step={step} loss={loss.item():.4f} "
                      f"participants={manager.num_participants()}", flush=True)
                timeline.first_commit(replica_group, rank, step)
                if report:
                    report.write(json.dumps({"group": replica_group, "rank": rank, "step": step,
                                             "checksum": params_checksum(model), "loss": loss.item(),
                                             "participants": manager.num_participants(),
                                             "batches_committed": manager.batches_committed(),
                                             "time": time.time(), "pid": os.getpid()}) + "\n")
            if args.step_sleep:
                time.sleep(args.step_sleep)
    finally:
        if report:
            report.close()
        if checkpointer is not None:
            checkpointer.close()
        manager.shutdown()


if __name__ == "__main__":
    from torchft_lite.cluster.exit_codes import run  # documented exit codes for schedulers (0, 1, 75, 78, 143)

    raise SystemExit(run(main))
