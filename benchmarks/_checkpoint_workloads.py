"""What ``benchmarks/checkpoint_bench.py`` runs: the model, the training loop, the three savers, a restarted job.

* :func:`build`: an MLP of ``layers`` square ``Linear`` layers (float32) with AdamW, and one synthetic batch;
* :class:`Trainer`: one replica group's loop through a real ``torchft_lite.Manager`` on the in-memory fakes
  (``InMemoryLighthouse``, ``InMemoryProcessGroup``), with our DDP and optimizer wrappers: ``zero_grad``
  starts the quorum, ``step`` votes and steps AdamW. Every method is measured on this same loop;
* the savers, told of each committed step on the training thread right after ``optimizer.step()``:
  :class:`Saver` (none, the baseline), :class:`Ours` (``DurableCheckpointer``), :class:`Dcp`
  (``torch.distributed.checkpoint.async_save``, no process group) and :class:`TorchSave`;
* :func:`run_segment`: one method's turn in a block: a lead-in step, timed steps, the drain;
* ``python -m benchmarks._checkpoint_workloads --method M --dir D ...``: a job restarted after the whole
  job was killed: it resumes from ``D`` and commits one step, then prints one JSON line of wall-clock times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

# DCP says so once per save and load when torch.distributed is not initialized (one process: what we want).
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

KEEP = 2  # checkpoints kept on disk by every method (ours: keep_last)


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    batch: int

    @property
    def param_bytes(self) -> int:
        return self.layers * (self.hidden * self.hidden + self.hidden) * 4

    def argv(self) -> list[str]:
        return ["--hidden", str(self.hidden), "--layers", str(self.layers), "--batch", str(self.batch)]


def build(sizes: Sizes, seed: int = 0) -> tuple[Any, Any, tuple[Any, Any]]:
    """``(model, AdamW, (inputs, targets))``: the same model for every run of one size and seed."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(sizes.layers):
        layers += [nn.Linear(sizes.hidden, sizes.hidden), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(sizes.batch, sizes.hidden), torch.randn(sizes.batch, sizes.hidden)
    return model, optimizer, batch


class Trainer:
    """One replica group of one rank training ``model`` through a Manager on the in-memory fakes."""

    def __init__(self, model: Any, optimizer: Any, batch: tuple[Any, Any], name: str = "bench") -> None:
        import torchft_lite as torchft
        from torchft_lite.testing import InMemoryLighthouse, InMemoryProcessGroup

        self.model, self.inner, self.batch = model, optimizer, batch
        self.manager = InMemoryLighthouse(min_replicas=1).manager(
            name, InMemoryProcessGroup(), load_state_dict=self.load, state_dict=self.state, min_replica_size=1,
            timeout=timedelta(seconds=300))
        self.ddp = torchft.DistributedDataParallel(self.manager, model, find_unused_parameters=False)
        self.optimizer = torchft.Optimizer(self.manager, optimizer)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.inner.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["optim"])

    def step(self) -> bool:
        """One training step; True when it committed."""
        import torch.nn.functional as F

        before = self.manager.current_step()
        self.optimizer.zero_grad()
        F.mse_loss(self.ddp(self.batch[0]), self.batch[1]).backward()
        self.optimizer.step()
        return self.manager.current_step() > before

    def close(self) -> None:
        self.manager.shutdown()


class Saver:
    """No checkpoints (the baseline). Subclasses save every ``every`` committed steps into ``directory``.

    A saver lives for a whole block and is attached only during its own segments.
    """

    method = "none"

    def __init__(self, trainer: Trainer, directory: Path, every: int) -> None:
        self.trainer, self.directory, self.every = trainer, directory, every
        self.blocked = 0.0
        """Training-thread seconds spent in checkpointing (hooks, calls, waits)."""
        self.write_seconds: list[float] = []
        self.saves = self.skipped = self.failed = 0

    def attach(self) -> None:
        """From the next step on, this saver sees the loop's commits."""

    def detach(self) -> None:
        """Commits from now on are not this saver's (a save due is dropped)."""

    def after_commit(self, step: int) -> None:
        """Right after ``optimizer.step()`` of committed step ``step``, on the training thread."""

    def drain(self, timeout: float) -> None:
        """Wait (bounded) for a save in flight."""

    def newest_files(self) -> list[Path]:
        """The files of the newest complete checkpoint."""
        return []

    def extra(self) -> dict[str, Any]:
        return {}


class Ours(Saver):
    """``DurableCheckpointer``; its hooks on the Manager are timed to count the training thread's share."""

    method = "ours"

    def __init__(self, trainer: Trainer, directory: Path, every: int) -> None:
        super().__init__(trainer, directory, every)
        from torchft_lite.durable import DurableCheckpointer

        self.checkpointer = DurableCheckpointer(trainer.manager, directory, every=every, keep_last=KEEP)
        for event in ("step_committed", "step_starting", "state_changing"):  # the Manager looks them up by name
            setattr(self.checkpointer, event, self._timed(getattr(self.checkpointer, event)))
        self._seen: int | None = None
        self.detach()

    def _timed(self, hook: Any) -> Any:
        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return hook(*args)
            finally:
                self.blocked += time.perf_counter() - started
        return timed

    def attach(self) -> None:
        self.trainer.manager.add_step_listener(self.checkpointer)

    def detach(self) -> None:
        # A save due then is dropped at the next step_starting, whose step is not the one due.
        self.trainer.manager.remove_step_listener(self.checkpointer)

    def _collect(self) -> None:
        # One save is in flight at a time and the next starts only at a step: polling every step sees each.
        stats = self.checkpointer.statistics()
        if stats.last_saved_step != self._seen and stats.last_write_seconds is not None:
            self._seen = stats.last_saved_step
            self.write_seconds.append(stats.last_write_seconds)
        self.saves, self.skipped, self.failed = stats.saves_completed, stats.saves_skipped, stats.saves_failed

    def after_commit(self, step: int) -> None:
        self._collect()

    def drain(self, timeout: float) -> None:
        self.checkpointer.wait(timeout)
        self._collect()

    def newest_files(self) -> list[Path]:
        found = self.checkpointer.checkpoints()
        if not found:
            return []
        local = self.checkpointer.layout.local_dir(found[0].step)
        return list(found[0].path.iterdir()) + (list(local.iterdir()) if local.exists() else [])

    def extra(self) -> dict[str, Any]:
        return {"snapshot_wait_s": self.checkpointer.statistics().snapshot_wait_seconds}


class Dcp(Saver):
    """``dcp.async_save`` of ``get_state_dict(model, optimizer)``, waiting for the previous save first."""

    method = "dcp"

    def __init__(self, trainer: Trainer, directory: Path, every: int) -> None:
        super().__init__(trainer, directory, every)
        self._future: Any = None
        self._done: list[Path] = []
        self._pending: Path | None = None

    def _wait(self, timeout: float | None = None) -> None:
        if self._future is None:
            return
        try:
            self._future.result(timeout)
            self.saves += 1
            self._done.append(self._pending)
            for old in self._done[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)
            self._done = self._done[-KEEP:]
        except Exception:  # noqa: BLE001 (counted and shown in the table; the loop goes on)
            self.failed += 1
        self._future = None

    def after_commit(self, step: int) -> None:
        if step % self.every:
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        started = time.perf_counter()
        self._wait()  # DCP's advice: one save in flight
        called = time.perf_counter()
        model_state, optim_state = get_state_dict(self.trainer.model, self.trainer.inner)
        self._pending = self.directory / f"step-{step}"
        self._future = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=str(self._pending))
        self._future.add_done_callback(lambda _: self.write_seconds.append(time.perf_counter() - called))
        self.blocked += time.perf_counter() - started

    def drain(self, timeout: float) -> None:
        self._wait(timeout)

    def newest_files(self) -> list[Path]:
        return list(self._done[-1].iterdir()) if self._done else []


class TorchSave(Saver):
    """``torch.save`` of the model's and optimizer's state dicts, then fsync (as durable as the other two)."""

    method = "torch_save"

    def after_commit(self, step: int) -> None:
        if step % self.every:
            return
        import torch

        started = time.perf_counter()
        path = self.directory / f"step-{step}.pt"
        with open(path, "wb") as file:
            torch.save(self.trainer.state(), file)
            file.flush()
            os.fsync(file.fileno())
        elapsed = time.perf_counter() - started
        self.blocked += elapsed
        self.write_seconds.append(elapsed)
        self.saves += 1
        for old in sorted(self.directory.glob("step-*.pt"), key=lambda p: p.stat().st_mtime)[:-KEEP]:
            old.unlink()

    def newest_files(self) -> list[Path]:
        return sorted(self.directory.glob("step-*.pt"), key=lambda p: p.stat().st_mtime)[-1:]


SAVERS: dict[str, type[Saver]] = {cls.method: cls for cls in (Saver, Ours, Dcp, TorchSave)}
METHODS = ("ours", "dcp", "torch_save")


def make_saver(method: str, trainer: Trainer, directory: Path, every: int) -> Saver:
    directory.mkdir(parents=True, exist_ok=True)
    return SAVERS[method](trainer, directory, every)


def cpu_seconds() -> float:
    """User and system CPU time of this process, every thread (the background writes' share included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_segment(trainer: Trainer, saver: Saver, steps: int, timeout: float) -> dict[str, Any]:
    """``steps`` timed steps (a multiple of ``every``) with ``saver`` attached: ``steps / every`` saves.

    Untimed first: steps until the next commit is a checkpoint step S0, then that
    step (the lead-in), which commits S0. Every method's save of step S is called
    (or, for ours, starts at the next ``start_quorum``) right after the commit of
    S, and is timed in step S+1: the timed steps S0+1 .. S0+steps hold the saves
    of S0, S0+every, ..., S0+steps-every, whatever the method. The save of the
    last step is dropped; a write still in flight is waited for, untimed.
    """
    every = saver.every
    uncommitted = 0
    while (trainer.manager.current_step() + 1) % every:
        trainer.step()
    saver.attach()
    pending = trainer.manager.current_step() + 1
    if not trainer.step():
        pending, uncommitted = None, 1
    blocked, cpu = saver.blocked, cpu_seconds()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        if pending is not None:
            saver.after_commit(pending)
        pending = trainer.manager.current_step() + 1
        if not trainer.step():
            pending, uncommitted = None, uncommitted + 1
        times.append(time.perf_counter() - started)
    segment = {"cpu_s": cpu_seconds() - cpu, "blocked_s": saver.blocked - blocked, "times": times,
               "uncommitted": uncommitted}
    saver.detach()
    saver.drain(timeout)
    return segment


def saver_totals(saver: Saver) -> dict[str, Any]:
    """What a saver did over its block: saves, write time (median per save), bytes of its newest checkpoint."""
    return dict(saves=saver.saves, skipped=saver.skipped, failed=saver.failed,
                write_s=statistics.median(saver.write_seconds) if saver.write_seconds else None,
                bytes=sum(p.stat().st_size for p in saver.newest_files() if p.is_file()) or None, **saver.extra())


# ------------------------------------------------------------ the restarted job (a child process)

def drop_from_page_cache(directory: Path) -> None:
    """Forget the (fsynced) pages of every file under ``directory``: the restart reads from disk, not memory."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def resume(method: str, trainer: Trainer, directory: Path) -> int | None:
    """Load the newest checkpoint ``method`` wrote in ``directory``; the step it holds, when it says."""
    if method == "ours":
        from torchft_lite.durable import DurableCheckpointer

        checkpointer = DurableCheckpointer(trainer.manager, directory, every=1 << 30)
        return checkpointer.resume()
    if method == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        newest = max(directory.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        model_state, optim_state = get_state_dict(trainer.model, trainer.inner)  # allocates the optimizer state
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(newest))
        set_state_dict(trainer.model, trainer.inner, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return int(newest.name.split("-")[1])
    import torch

    newest = max(directory.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    trainer.load(torch.load(newest, weights_only=True))
    return int(newest.stem.split("-")[1])


def resume_main() -> None:
    started = time.time()
    import torch  # noqa: F401 (timed: what every restart pays first)

    imported = time.time()
    parser = argparse.ArgumentParser(description="A restarted job: resume from --dir, commit one step.")
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    args = parser.parse_args()
    model, optimizer, batch = build(Sizes(args.hidden, args.layers, args.batch), seed=1)  # not the saved weights
    trainer = Trainer(model, optimizer, batch)  # the same group name as the job that saved
    try:
        loading = time.time()
        step = resume(args.method, trainer, args.dir)
        loaded = time.time()
        committed = trainer.step()
        print(json.dumps({"started": started, "torch_imported": imported, "loading": loading, "loaded": loaded,
                          "committed_at": time.time(), "committed": committed, "resumed_step": step}), flush=True)
    finally:
        trainer.close()


if __name__ == "__main__":
    resume_main()
