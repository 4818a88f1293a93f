"""Durable checkpoints: every ``every`` committed steps, one replica group writes the job's state to disk.

Live heals cover a group that dies while others live; :class:`DurableCheckpointer`
covers the whole job going down. The first participant of the quorum that committed
a checkpoint step writes it (each of its ranks its own state file, off the training
thread); every group writes its rank-local state (RNG states, data position). A
checkpoint is assembled in a staging directory and renamed into place once complete
(``_layout``), in the heal format; ``resume()`` (``_resume``) loads the newest one
that reads back intact. How it behaves and what it costs: docs/durable.md.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from torchft_lite.core.capabilities import Advertises
from torchft_lite.core.context import ManagerContext
from torchft_lite.durable import _rng
from torchft_lite.durable._files import (
    FileRecord, fsync_directory, read_state_file, write_bytes_atomically, write_state_file,
)
from torchft_lite.durable._layout import CheckpointInfo, Layout
from torchft_lite.durable._resume import GroupAgreement, Resumer
from torchft_lite.durable._sharded import sharded_paths
from torchft_lite.errors import CheckpointError, ConfigError, DurableCheckpointError
from torchft_lite.health.watchdog import Watchdog
from torchft_lite.serialization.encode import FlatStateDict, encode_to_bytes, flatten

__all__ = ["DurableCheckpointer", "DurableCheckpointStatistics"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DurableCheckpointStatistics:
    """What the checkpointer did (read by tests, logs and metrics)."""

    saves_completed: int
    saves_failed: int
    saves_skipped: int
    """Due while the previous save was still being written."""
    local_saves: int
    """Rank-local state files written (every group, every checkpoint step)."""
    last_saved_step: int | None
    last_write_seconds: float | None
    last_bytes: int | None
    snapshot_wait_seconds: float
    """Total time the training thread waited for snapshot copies to finish."""
    last_error: str | None
    resumed_from: int | None


@dataclass
class _Save:
    """One checkpoint being saved by this rank."""

    step: int
    writes_state: bool
    local: bytes
    flat: FlatStateDict | None = None
    copied: threading.Event | None = None
    abandoned: bool = False
    thread: threading.Thread | None = None
    # A save before leaving: another group may save the same step at the same time (first complete one wins).
    leaving: bool = False
    quorum_id: int | None = None  # the quorum its state was committed (or healed) under, for the manifest


class DurableCheckpointer:
    """Saves the Manager's state to ``directory`` every ``every`` committed steps and resumes from it.

    Args:
        manager: the ``Manager`` of this rank; every state dict fn registered on it is saved.
        directory: where checkpoints go (a shared file system when groups run on several hosts).
        every: save when the committed step is a multiple of this.
        keep_last: complete checkpoints kept (the newest is never removed).
        replicated_in_group: every rank of a group holds the same state (a DDP inside the group), so
            group rank 0 alone writes it and every rank loads it. Default False: each rank writes and
            loads its own state file, as torchft's scripts need (group rank r of every group forms one
            data-parallel ring, so ranks of one group differ) and FSDP's shards do.
        save_on_preemption: on a preemption signal, every group saves its current step before it
            leaves (see docs/durable.md).
        timeout: bound on every wait (a snapshot copy, the writing group's ranks); default the Manager's.
    """

    def __init__(self, manager: Any, directory: str | Path, *, every: int = 100, keep_last: int = 3,
                 replicated_in_group: bool = False, save_on_preemption: bool = True,
                 timeout: timedelta | None = None) -> None:
        for name, value in (("every", every), ("keep_last", keep_last)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"DurableCheckpointer: {name} must be an integer >= 1, got {value!r}")
        if not str(directory):
            raise ConfigError("DurableCheckpointer: directory must not be empty")
        self._manager = manager
        self.layout = Layout(Path(directory))
        try:
            self.layout.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"DurableCheckpointer: can't create {directory}: {exc}") from exc
        self.every, self.keep_last = every, keep_last
        self.per_rank = not replicated_in_group  # one state file per rank
        self.save_on_preemption = save_on_preemption
        context: ManagerContext = manager.context
        self._context = context
        settings = context.settings
        self._timeout = (timeout if timeout is not None else settings.timeouts.step).total_seconds()
        self._rank, self._world = settings.group_rank, settings.group_world_size
        # The group's stable name (the replica_id it was given, without the incarnation suffix): its local files.
        self._group = settings.replica_id or manager.replica_id.split(":")[0]
        self._local_fns: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._buffers: list[torch.Tensor] = []
        self._sources: tuple[torch.Tensor, ...] = ()
        self._lock = threading.Lock()  # statistics, written by the worker
        self._current: _Save | None = None
        self._due: _Save | None = None  # taken at the commit, snapshotted at the next start_quorum
        self._last_commit_rank: int | None = None
        self._counts = dict(saves_completed=0, saves_failed=0, saves_skipped=0, local_saves=0)
        self._last: dict[str, Any] = dict(last_saved_step=None, last_write_seconds=None, last_bytes=None,
                                          last_error=None)
        self._waited = 0.0
        self._resumed_from: int | None = None
        self._resumed_quorum: int | None = None
        self._closed = False
        manager.add_step_listener(self)

    # ------------------------------------------------------------ public API

    def register_local(self, key: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """Rank-local state saved with every checkpoint by every group (a data loader's position, say).

        ``state_dict()`` runs at the commit of a checkpoint step, on the training thread.
        """
        if key in self._local_fns:
            raise ValueError(f"local state {key!r} is already registered")
        self._local_fns[key] = (state_dict, load_state_dict)

    def checkpoints(self) -> list[CheckpointInfo]:
        """Complete checkpoints on disk, newest first (their data is checked only when loaded)."""
        return self.layout.complete()

    def resume(self) -> int | None:
        """Load the newest complete checkpoint that reads back intact; its step, or None to start fresh.

        Call it after every state dict fn is registered and before training.
        A torn or corrupt checkpoint is skipped with a WARNING and the one
        before it is tried; a checkpoint that does not fit the model (other
        tensor names, shapes or dtypes) raises ``DurableCheckpointError``
        before anything is loaded.
        """
        store = self._context.store  # the group's TCPStore (DefaultWiring)
        agreement = GroupAgreement(store if hasattr(store, "get") else None,
                                   f"torchft_lite/{self._context.settings.restart_count}/durable_resume/",
                                   self._rank, self._world)
        resumer = Resumer(self.layout, self._context.state, getattr(self._manager, "watchdog", None),
                          rank=self._rank, world=self._world, group=self._group, local_loaders={key: load for key, (_, load) in self._local_fns.items()},
                          agreement=agreement)
        step = resumer.resume()
        if step is not None:
            self._resumed_from, self._resumed_quorum = step, resumer.resumed_quorum
            # Tell the lighthouse (group rank 0 speaks for the group): a job whose every group resumed from
            # disk may start a new epoch at this step; the quorum its state was committed under tells it the
            # state is of the job's current epoch (lighthouse.epochs).
            client = self._context.client
            if isinstance(client, Advertises):
                client.advertise("resumed_from", step)
                client.advertise("resumed_quorum", self._resumed_quorum)
        return step

    def _state_quorum(self) -> int | None:
        """The quorum the current state was committed or healed under; after a resume with no commit since,
        the one the checkpoint recorded."""
        committed = self._manager.state_quorum_id()
        return committed if committed is not None else self._resumed_quorum

    def save_now(self) -> int:
        """Save the current step synchronously (every rank of the group must call it); returns the step."""
        return self._save_now(leaving=False)

    def _save_now(self, *, leaving: bool) -> int:
        self.wait()
        step = self._manager.current_step()
        save = _Save(step, writes_state=self.per_rank or self._rank == 0, local=self._capture_local(step),
                     leaving=leaving, quorum_id=self._state_quorum())
        if save.writes_state:
            save.flat = self._take_buffers(flatten(self._context.state.state_dict()))
            self._copy(save)
        error = self._write(save)
        if error is not None:
            raise DurableCheckpointError(f"the checkpoint of step {step} failed: {error}") from error
        return step

    def flush(self) -> None:
        """Start the save of a checkpoint step just committed, now instead of at the next ``start_quorum``.

        For the end of a training loop: call it after the last ``optimizer.step()`` (``close`` does).
        """
        due = self._due
        if due is not None and due.step == self._manager.current_step():
            self.step_starting(due.step)
            self.state_changing()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a save in flight; False if it is still running after ``timeout`` (default the checkpointer's)."""
        current = self._current
        if current is None or current.thread is None:
            return True
        current.thread.join(self._timeout if timeout is None else timeout)
        return not current.thread.is_alive()

    def close(self, timeout: float | None = None) -> None:
        """Save a checkpoint that is due (training ended right after its commit), stop listening to the
        Manager, and wait (bounded) for a save in flight. Call it after the last ``optimizer.step()``."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._manager.remove_step_listener(self)
        if not self.wait(timeout):
            logger.warning("durable checkpoint of step %s still being written at close", self._current.step)

    def statistics(self) -> DurableCheckpointStatistics:
        with self._lock:
            return DurableCheckpointStatistics(**self._counts, **self._last, snapshot_wait_seconds=self._waited,
                                               resumed_from=self._resumed_from)

    # ------------------------------------------------------------ the Manager's step events

    def step_committed(self, step: int, replica_rank: int | None) -> None:
        self._last_commit_rank = replica_rank
        if step % self.every or self._closed:
            return
        if self._current is not None and self._current.thread is not None and self._current.thread.is_alive():
            self._count("saves_skipped")
            logger.warning("durable checkpoint of step %d skipped: the save of step %d is still being written",
                           step, self._current.step)
            return
        # The quorum's first participant writes; in it, every rank (default), else group rank 0 alone.
        writes_state = replica_rank == 0 and (self.per_rank or self._rank == 0)
        self._due = _Save(step, writes_state=writes_state, local=self._capture_local(step),
                          quorum_id=self._state_quorum())

    def step_starting(self, step: int) -> None:
        save, self._due = self._due, None
        if save is None or save.step != step:
            return  # not due, or the step changed since (a heal)
        if save.writes_state:  # copied on the worker while the forward and backward pass run
            try:
                save.flat = self._take_buffers(flatten(self._context.state.state_dict()))
            except ConfigError as exc:  # a sharded state with replicated_in_group=True: every save fails alike
                return self._failed(step, exc)
            save.copied = threading.Event()
        self._start(save, copy=save.writes_state)  # else only our few KB of rank-local state

    def state_changing(self) -> None:
        current = self._current
        if current is None or current.copied is None or current.copied.is_set():
            return
        started = time.monotonic()
        if not current.copied.wait(self._timeout):
            current.abandoned = True  # the copy may be torn once the state changes: drop this save
            logger.error("durable checkpoint of step %d abandoned: its snapshot copy took over %.0fs",
                         current.step, self._timeout)
        with self._lock:
            self._waited += time.monotonic() - started

    def leaving(self) -> None:
        if not self.save_on_preemption:
            return
        step = self._manager.current_step()
        if self._last["last_saved_step"] == step or step == 0:
            return
        if self._context.state.torn:
            logger.error("leaving without a durable checkpoint of step %d: a failed heal left the state mixing two "
                         "steps", step)
            return
        # Every group saves, not only the one that wrote the last committed step: a SIGKILL or a hang can take
        # that group in the same seconds (a chaos run lost 8 steps so), and then this one holds the only copy.
        logger.warning("saving a durable checkpoint of step %d before leaving (group %s%s)", step, self._group,
                       "" if self._last_commit_rank == 0 else ", in case the group that writes is gone too")
        try:
            self._save_now(leaving=True)
        except CheckpointError as exc:
            logger.error("the durable checkpoint before leaving failed: %s", exc)

    # ------------------------------------------------------------ saving

    def _capture_local(self, step: int) -> bytes:
        local = {"rng": _rng.capture(), "local": {key: fn() for key, (fn, _) in self._local_fns.items()}}
        watchdog = getattr(self._manager, "watchdog", None)
        if isinstance(watchdog, Watchdog):  # its observed durations: a restarted job starts calibrated
            local["watchdog"] = watchdog.calibration_state()
        return encode_to_bytes(step, local)

    def _take_buffers(self, flat: FlatStateDict) -> FlatStateDict:
        """``flat`` with its tensors swapped for host buffers of the same shapes (reused from the last save).

        A DTensor's buffer holds its local shard only (``flat.tensors``); see ``_sharded``.
        """
        sharded = [] if self.per_rank else sharded_paths(flat)
        if sharded:
            raise ConfigError(f"DurableCheckpointer(replicated_in_group=True) saves group rank 0's state alone, but "
                              f"{', '.join(sharded[:3])} {'are' if len(sharded) > 1 else 'is'} sharded across the "
                              f"group's ranks: use replicated_in_group=False (the default), each rank writes its shard")
        sources = flat.tensors
        same = len(self._buffers) == len(sources) and all(
            b.shape == s.shape and b.dtype == s.dtype for b, s in zip(self._buffers, sources))
        if not same:
            self._buffers = [torch.empty(s.shape, dtype=s.dtype, device="cpu") for s in sources]
        self._sources = sources
        return FlatStateDict(flat.tree, tuple(self._buffers), flat.paths, flat.leaves)

    def _copy(self, save: _Save) -> None:
        try:
            with torch.no_grad():
                for buffer, source in zip(self._buffers, self._sources):
                    buffer.copy_(source)
        finally:
            self._sources = ()
            if save.copied is not None:
                save.copied.set()

    def _start(self, save: _Save, *, copy: bool) -> None:
        def run() -> None:
            if copy:
                self._copy(save)
            self._write(save)

        save.thread = threading.Thread(target=run, name=f"torchft_lite-durable-{save.step}", daemon=True)
        self._current = save
        save.thread.start()

    def _write(self, save: _Save) -> BaseException | None:
        """Write what ``save`` holds; a failure is logged and counted (and returned), never raised."""
        started = time.monotonic()
        try:
            if save.abandoned:
                raise DurableCheckpointError("its snapshot copy did not finish before the state changed")
            local_path = self.layout.local_file(save.step, self._group, self._rank)
            local_path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomically(local_path, save.local)
            self._count("local_saves")
            if save.writes_state:
                written = self._write_state(save)
                if written is not None:
                    self._finished(save.step, time.monotonic() - started, written)
        except (CheckpointError, OSError) as exc:
            self._failed(save.step, exc)
            return exc
        except Exception as exc:  # a bug must not kill the worker silently: log it, count it, train on
            logger.exception("durable checkpoint of step %d failed unexpectedly", save.step)
            self._failed(save.step, exc)
            return exc
        return None

    def _write_state(self, save: _Save) -> int | None:
        """This rank's state file; group rank 0 then completes the checkpoint. Returns its bytes, or None."""
        manager = self._manager
        staging = self.layout.staging_dir(save.step, manager.replica_id)
        staging.mkdir(parents=True, exist_ok=True)
        assert save.flat is not None
        record = write_state_file(staging / Layout.state_file_name(self._rank), save.step, save.flat)
        if self.per_rank and self._rank != 0:
            write_bytes_atomically(staging / f"part-r{self._rank}.json",
                                   f'{{"name":"{record.name}","bytes":{record.bytes},"digest":"{record.digest}"}}'
                                   .encode())
            return None
        records = [record] + (self._wait_for_parts(staging, save.step) if self.per_rank else [])
        self.layout.write_manifest(staging, save.step, manager.replica_id, self._group, self._world, self.per_rank,
                                   records, quorum_id=save.quorum_id)
        final = self.layout.step_dir(save.step)
        try:
            if final.exists():
                raise FileExistsError(final)
            staging.rename(final)  # fails if another writer renamed its copy since the check
        except OSError:
            if not final.exists():
                raise
            if save.leaving:
                return self._saved_by_another(staging, final, save.step)
            raise DurableCheckpointError(
                f"a checkpoint of step {save.step} already exists at {final}; not replacing it (two writers for "
                f"one step, or a job resumed from an older step that reached this one again)") from None
        fsync_directory(self.layout.root)
        removed = self.layout.prune(self.keep_last, busy_steps={save.step})
        if removed:
            logger.info("removed durable checkpoints of steps %s (keep_last=%d)", removed, self.keep_last)
        return sum(r.bytes for r in records)

    @staticmethod
    def _saved_by_another(staging: Path, final: Path, step: int) -> None:
        """Two groups saved one step before leaving: the same committed state, so the first complete copy stands."""
        shutil.rmtree(staging, ignore_errors=True)
        logger.info("durable checkpoint of step %d: another group saved it first (%s); dropped this copy", step, final)

    def _wait_for_parts(self, staging: Path, step: int) -> list[FileRecord]:
        import json

        deadline = time.monotonic() + self._timeout
        records: list[FileRecord] = []
        for rank in range(1, self._world):
            marker = staging / f"part-r{rank}.json"
            while not marker.exists():
                if time.monotonic() > deadline:
                    raise DurableCheckpointError(f"group rank {rank} did not write its part of step {step} "
                                                 f"within {self._timeout:.0f}s")
                time.sleep(0.01)
            raw = json.loads(marker.read_text())
            records.append(FileRecord.from_json(raw["name"], raw))
        return records

    def _finished(self, step: int, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._counts["saves_completed"] += 1
            self._last.update(last_saved_step=step, last_write_seconds=seconds, last_bytes=nbytes, last_error=None)
        logger.info("durable checkpoint of step %d written to %s: %.1f MB in %.2fs", step,
                    self.layout.step_dir(step), nbytes / 1e6, seconds)

    def _failed(self, step: int, exc: BaseException) -> None:
        with self._lock:
            self._counts["saves_failed"] += 1
            self._last["last_error"] = f"step {step}: {exc}"
        logger.error("durable checkpoint of step %d failed (training goes on): %s", step, exc)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1


def read_checkpoint(info: CheckpointInfo, rank: int = 0) -> tuple[int, Any]:
    """``(step, state)`` of one rank's state file of a complete checkpoint, every byte checked."""
    name = Layout.state_file_name(rank if info.per_rank else 0)
    if name not in info.files:
        raise DurableCheckpointError(f"{info.path} has no {name} in its manifest")
    return read_state_file(info.path / name, info.files[name])
