"""Quorum ids that strictly increase across lighthouse restarts.

Managers prefix their process-group store keys with the quorum id, so a
restarted lighthouse must never hand out an id that an earlier incarnation
already used. Without a state directory the first id is seeded from wall-clock
milliseconds: ids only grow by one per membership change, far slower than one
per millisecond. With a state directory the last issued id is also kept on disk
(written atomically before it is handed out), which covers a clock that steps
back; the seed is the larger of the two. The directory also keeps the highest
step a quorum reached (raised as quorums advance, lowered only when a new epoch
of the job starts), and only it can tell a restart from a first start.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

STATE_FILE = "last_quorum_id"
MAX_STEP_FILE = "max_step"  # the highest step a quorum reached (the stale-quorum guard's memory)


def time_seed(wall_clock: Callable[[], float] = time.time) -> int:
    return int(wall_clock() * 1000)


class QuorumIdStore:
    """Reads the starting quorum id and persists each newly issued one."""

    def __init__(self, state_dir: Path | None, wall_clock: Callable[[], float] = time.time) -> None:
        self._path = None if state_dir is None else Path(state_dir) / STATE_FILE
        self._wall_clock = wall_clock
        self._last_saved: int | None = None
        self._kept_step, self._kept_at = 0, -math.inf  # see keep_max_step
        self.earlier_quorum_id: int | None = None
        """The last id an earlier incarnation issued, as read by :meth:`initial`;
        None without a state directory or when none was ever issued with it."""

    @property
    def restart_evidence(self) -> str | None:
        """Why this start is a restart (see README, "Beyond torchft"); None for a first start."""
        earlier = self.earlier_quorum_id
        return None if earlier is None else f"its state dir holds quorum id {earlier}"

    def initial(self) -> int:
        """The id to seed the quorum state with (the first issued is one more)."""
        seed = time_seed(self._wall_clock)
        if self._path is None:
            return seed
        self._path.parent.mkdir(parents=True, exist_ok=True)
        try:
            text = self._path.read_text().strip()
        except FileNotFoundError:
            return seed
        try:
            stored = int(text)
        except ValueError:
            raise ValueError(f"{self._path} does not hold a quorum id (got {text[:40]!r}); fix or remove it") from None
        if stored >= seed:
            logger.warning(
                "stored quorum id %d is ahead of the wall-clock seed %d (clock stepped back?); continuing from it",
                stored, seed,
            )
        self._last_saved = self.earlier_quorum_id = stored
        return max(seed, stored)

    def save(self, quorum_id: int) -> None:
        """Durably record ``quorum_id`` (a no-op without a state directory)."""
        if self._path is None or quorum_id == self._last_saved:
            return
        _write_atomically(self._path, quorum_id)
        self._last_saved = quorum_id

    def initial_max_step(self) -> int:
        """The highest step an earlier incarnation saw a quorum reach (0 without a state directory)."""
        if self._path is None:
            return 0
        path = self._path.with_name(MAX_STEP_FILE)
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return 0
        try:
            self._kept_step = int(text)
        except ValueError:
            raise ValueError(f"{path} does not hold a step (got {text[:40]!r}); fix or remove it") from None
        return self._kept_step

    def save_max_step(self, step: int) -> None:
        if self._path is not None:
            _write_atomically(self._path.with_name(MAX_STEP_FILE), step)

    def keep_max_step(self, step: int, now: float, *, force: bool = False) -> None:
        """Save ``step`` when it is a new high, at most once a second (``now``: monotonic seconds) unless ``force``.

        A slightly stale value still stops replicas at step 0 from redoing
        history after a restart, without an fsync per step.
        """
        if step > self._kept_step and (force or now - self._kept_at >= 1.0):
            self.save_max_step(step)
            self._kept_step, self._kept_at = step, now

    def reset_max_step(self, step: int, now: float) -> None:
        """Save ``step`` at once even when it is lower than the kept one (a new epoch of the job lowered it),
        so a restart does not wait for holders of the old step again."""
        self.save_max_step(step)
        self._kept_step, self._kept_at = step, now


def _write_atomically(path: Path, value: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{value}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
