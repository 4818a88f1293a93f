"""Resuming from the newest durable checkpoint that reads back intact.

Everything is read and checked before anything is loaded: the state file
(every block's sum, the manifest's size and digest), the rank-local file, and
whether the checkpoint fits the live state (tensor names, shapes, dtypes, and
a DTensor's mesh and placements: ``_sharded``). A
checkpoint that is torn or corrupt is skipped with a WARNING and the one
before it is tried; one that does not fit the model is refused with
``DurableCheckpointError`` (it is the wrong directory or the wrong model, and
starting from scratch would silently throw the job's progress away); a
process that lets it end its training loop exits with ``EXIT_CODE_FATAL``
(``torchft_lite.cluster.exit_codes``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from torchft_lite.core.healer import RegisteredState
from torchft_lite.durable import _rng
from torchft_lite.durable._files import read_state_file
from torchft_lite.durable._layout import CheckpointInfo, Layout, read_manifest
from torchft_lite.durable._sharded import check_layout
from torchft_lite.errors import CheckpointError, CheckpointMismatchError, DurableCheckpointError
from torchft_lite.health.watchdog import Watchdog
from torchft_lite.serialization.decode import decode_bytes, targets_of
from torchft_lite.serialization.spec import format_path

__all__ = ["GroupAgreement", "Resumer", "check_fits"]

logger = logging.getLogger(__name__)


class Resumer:
    """Finds, checks and loads one checkpoint for one rank."""

    def __init__(self, layout: Layout, state: RegisteredState, watchdog: Watchdog | None, *, rank: int, world: int,
                 group: str, local_loaders: dict[str, Callable[[Any], None]],
                 agreement: "GroupAgreement | None" = None) -> None:
        """``state``: the Manager's (what a checkpoint holds, and where it loads); ``watchdog``: the Manager's,
        whose calibration a checkpoint restores."""
        self._layout, self._state, self._watchdog = layout, state, watchdog
        self._rank, self._world, self._group = rank, world, group
        self._local_loaders = local_loaders
        self._agreement = agreement or GroupAgreement(None, "", rank, world)
        self.resumed_quorum: int | None = None
        """After a resume: the quorum id the loaded checkpoint's manifest recorded (None if it recorded none)."""

    def resume(self) -> int | None:
        found = {info.step: info for info in self._layout.complete()}
        # Every rank of the group must resume from the same step: a checkpoint that appears while they scan
        # (other groups live and write) must not split them, nor a file that only one rank finds corrupt.
        candidates = self._agreement.candidates(list(found))
        if not candidates:
            on_disk = self._layout.steps_on_disk()
            if on_disk:
                logger.warning("no complete durable checkpoint in %s (steps %s have no manifest): starting fresh",
                               self._layout.root, on_disk)
            else:
                logger.info("no durable checkpoint in %s: starting fresh", self._layout.root)
            return None
        for step in candidates:
            started = time.monotonic()
            mismatch: CheckpointMismatchError | None = None
            try:
                info = found.get(step) or read_manifest(self._layout.step_dir(step))
                live = self._state.state_dict()
                state, local = self._read(info, live)
                check_fits(live, state, info)
                readable = True
            except CheckpointMismatchError as exc:
                mismatch, readable = exc, False
            except DurableCheckpointError as exc:
                logger.warning("skipping the durable checkpoint of step %d: %s", step, exc)
                readable = False
            everyone = self._agreement.all_readable(step, readable)
            if mismatch is not None:
                raise mismatch
            if not everyone:
                if readable:
                    logger.warning("skipping the durable checkpoint of step %d: another rank of the group can't "
                                   "read its part", step)
                continue
            self._apply(info, state, local)
            self.resumed_quorum = info.quorum_id
            logger.info("resumed from the durable checkpoint of step %d (%s, written by %s) in %.2fs", step,
                        info.path, info.writer, time.monotonic() - started)
            return step
        logger.error("every durable checkpoint in %s is torn or corrupt (steps %s): starting fresh",
                     self._layout.root, candidates)
        return None

    def _read(self, info: CheckpointInfo, live: Any) -> tuple[Any, Any]:
        if info.per_rank and info.group_world_size != self._world:
            raise CheckpointMismatchError(f"the checkpoint of step {info.step} was written by groups of "
                                          f"{info.group_world_size} ranks (one file per rank); this group has {self._world}")
        name = Layout.state_file_name(self._rank if info.per_rank else 0)
        if name not in info.files:
            raise DurableCheckpointError(f"its manifest lists no {name}")
        # Into fresh tensors (nothing live changes before every check passed); DTensors onto the live meshes.
        step, state = read_state_file(info.path / name, info.files[name], meshes_from=targets_of(live))
        if step != info.step:
            raise DurableCheckpointError(f"{name} holds step {step}, the manifest says {info.step}")
        if not (isinstance(state, dict) and isinstance(state.get("user"), dict) and "torchft" in state):
            raise DurableCheckpointError(f"{name} does not hold a Manager state (user and torchft parts)")
        return state, self._read_local(info)

    def _read_local(self, info: CheckpointInfo) -> Any:
        """This group's rank-local state, else the writing group's for this rank, else None (with a WARNING)."""
        candidates = [self._group] + ([info.writer_group] if info.writer_group != self._group else [])
        for group in candidates:
            path = self._layout.local_file(info.step, group, self._rank)
            if not path.exists():
                continue
            try:
                blob = path.read_bytes()
                step, local = decode_bytes(blob)
            except (OSError, CheckpointError) as exc:
                logger.warning("rank-local state %s is unreadable: %s", path, exc)
                continue
            if step != info.step or not isinstance(local, dict):
                logger.warning("rank-local state %s is not step %d's", path, info.step)
                continue
            if group != self._group:
                logger.warning("no rank-local state of group %s at step %d: using group %s's (RNG states and data "
                               "position as that group had them)", self._group, info.step, group)
            return local
        logger.warning("no rank-local state for rank %d at step %d: RNG states and data position are not restored",
                       self._rank, info.step)
        return None

    def _apply(self, info: CheckpointInfo, state: Any, local: Any) -> None:
        try:
            self._state.load_state_dict(state)  # every registered piece, then the Manager's own
        except Exception as exc:
            raise DurableCheckpointError(f"loading the checkpoint of step {info.step} failed part-way (the state "
                                         f"may be torn; restart the process): {exc}") from exc
        if local is None:
            return
        restored = _rng.restore(local.get("rng", {}))
        watchdog = self._watchdog
        if "watchdog" in local and isinstance(watchdog, Watchdog):  # absent from checkpoints written before it
            watchdog.load_calibration_state(local["watchdog"])  # refuses garbage with a WARNING
        pieces = local.get("local", {})
        for key, load in self._local_loaders.items():
            if key in pieces:
                load(pieces[key])
            else:
                logger.warning("the checkpoint of step %d holds no local state %r", info.step, key)
        logger.debug("restored RNG states %s and local state %s", restored, sorted(pieces))


def check_fits(live: Any, loaded: Any, info: CheckpointInfo) -> None:
    """Raise unless every registered piece that holds tensors now gets the same tensors from ``loaded``.

    A piece without tensors yet (an optimizer before its first step) is not
    compared; a missing piece or tensor, another shape or dtype, another
    DTensor layout (``_sharded.check_layout``), or an extra tensor beside the
    live ones, is refused.
    """
    live_user, loaded_user = live["user"], loaded["user"]
    missing = sorted(set(live_user) - set(loaded_user))
    if missing:
        raise CheckpointMismatchError(f"the checkpoint of step {info.step} lacks registered state {missing}")
    for key, piece in live_user.items():
        have = targets_of(piece)
        if not have:
            continue
        got = targets_of(loaded_user[key])
        for path, tensor in have.items():
            other = got.get(path)
            where = f"{key}.{format_path(path)}" if path else str(key)
            if other is None:
                raise CheckpointMismatchError(f"the checkpoint of step {info.step} has no tensor {where} "
                                              "(another model?)")
            if tuple(other.shape) != tuple(tensor.shape) or other.dtype != tensor.dtype:
                raise CheckpointMismatchError(
                    f"the checkpoint of step {info.step} holds {where} as {tuple(other.shape)} {other.dtype}, "
                    f"the model has {tuple(tensor.shape)} {tensor.dtype} (another model?)")
            check_layout(where, tensor, other, info.step, info.per_rank)
        # A tensor the live state lacks beside ones it has (a model's extra layer) is another model; one under
        # a container with no live tensors (an optimizer's moments before its first step) is expected.
        parents = {path[:-1] for path in have}
        extra = sorted(format_path(path) for path in set(got) - set(have) if path[:-1] in parents)
        if extra:
            raise CheckpointMismatchError(f"the checkpoint of step {info.step} holds tensors the model lacks in "
                                          f"{key!r}: {', '.join(extra[:5])} (another model?)")


class GroupAgreement:
    """How the ranks of one group agree on the checkpoint to resume from, through the group's TCPStore.

    Group rank 0's scan is the list every rank tries, newest first; for each
    step every rank posts whether it read its part intact, and the group
    resumes from the first step all could read. A group of one rank (or no
    store) agrees with itself. Each ``get`` waits at most the store's timeout.
    """

    def __init__(self, store: Any, prefix: str, rank: int, world: int) -> None:
        self._store = store if world > 1 else None
        self._prefix, self._rank, self._world = prefix, rank, world

    def candidates(self, mine: list[int]) -> list[int]:
        if self._store is None:
            return mine
        key = self._prefix + "candidates"
        try:
            if self._rank == 0:
                self._store.set(key, json.dumps(mine))
                return mine
            return [int(step) for step in json.loads(self._store.get(key))]
        except RuntimeError as exc:  # the store's own timeout (DistStoreError)
            raise DurableCheckpointError(f"group rank {self._rank}: group rank 0 did not say which checkpoints "
                                         f"to resume from in time: {exc}") from exc

    def all_readable(self, step: int, readable: bool) -> bool:
        if self._store is None:
            return readable
        base = f"{self._prefix}{step}/"
        try:
            self._store.set(base + str(self._rank), b"1" if readable else b"0")
            return all(self._store.get(base + str(rank)) == b"1" for rank in range(self._world))
        except RuntimeError as exc:
            raise DurableCheckpointError(f"group rank {self._rank}: the group's ranks did not agree on the "
                                         f"checkpoint of step {step} in time: {exc}") from exc
