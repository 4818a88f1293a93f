"""The lighthouse's state directory: quorum ids that strictly increase across restarts, and the job's highest agreed step.

Managers prefix their process-group store keys with the quorum id, so a
restarted lighthouse must never hand out an id an earlier incarnation used.
The directory (``--state-dir``) also keeps the highest step a quorum agreed on
and the replica ids that held it, for the next incarnation's stale-quorum guard
(:mod:`lighthouse.epochs`). A write that fails never stops the lighthouse.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

logger = logging.getLogger(__name__)

STATE_FILE = "last_quorum_id"
MAX_STEP_FILE = "max_step"  # the highest step quorums agreed on (the stale-quorum guard's memory)
HOLDERS_FILE = "holders"  # a JSON list of the replica ids that held it


def time_seed(wall_clock: Callable[[], float] = time.time) -> int:
    return int(wall_clock() * 1000)


def agreed_step(steps: Iterable[int]) -> int:
    """The highest step that more than half of a quorum's members hold: 5 for [5, 2**53 - 1], 7 for [7, 7, 9]."""
    ordered = sorted(steps, reverse=True)
    return ordered[len(ordered) // 2] if ordered else 0


class QuorumIdStore:
    """Reads the starting quorum id and step, and persists each newly issued id and agreed step.

    The step kept is one a quorum agreed on, not one member's claim (:func:`agreed_step` of each issued
    quorum). It is raised as quorums advance and lowered only when a new epoch of the job starts. A member
    that heals in a quorum reports the quorum's step at its next one, so a job's honest progress reaches the
    disk one round later at most. What a forged member (a process with the job token, or any loopback
    process without one) can still do: claim any step below 2**53 (see :mod:`lighthouse.validation`) and,
    in a quorum, become its members' heal source (the managers pick the highest step) and raise the running
    lighthouse's guard, which then waits ``holder_timeout`` for it before a new epoch; it moves the
    persisted step only in a quorum where it holds more than half of the slots (many replica ids of its
    own), or alone while no replica of the job heartbeats (the split-brain guard keeps a minority from
    forming a quorum).

    With the step go its holders' replica ids (the members at or above it in the quorum that last named
    them), so the next incarnation knows whom the guard waits for (see :mod:`lighthouse.epochs`).
    """

    def __init__(self, state_dir: Path | None, wall_clock: Callable[[], float] = time.time) -> None:
        self._path = None if state_dir is None else Path(state_dir) / STATE_FILE
        self._wall_clock = wall_clock
        self._last_saved: int | None = None
        self._agreed = 0  # the highest step quorums agreed on (see agreed_step)
        self._kept_step, self._kept_at = 0, -math.inf  # the step on disk and when it was written; see keep_max_step
        self._holders: frozenset[str] = frozenset()
        self._kept_holders: frozenset[str] = frozenset()
        self.write_failures = 0
        self._failing = False
        self.earlier_quorum_id: int | None = None
        """The last id an earlier incarnation issued, as read by :meth:`initial`;
        None without a state directory or when none was ever issued with it."""

    @property
    def restart_evidence(self) -> str | None:
        """Why this start is a restart (see docs/lighthouse.md, "Beyond torchft"); None for a first start."""
        earlier = self.earlier_quorum_id
        return None if earlier is None else f"its state dir holds quorum id {earlier}"

    def initial(self) -> int:
        """The id to seed the quorum state with (the first issued is one more).

        Without a state directory it is wall-clock milliseconds: ids only grow by one per membership change,
        far slower than one per millisecond. With one, the last issued id is also kept on disk (written
        atomically before it is handed out), which covers a clock that steps back; the seed is the larger of
        the two. Only the directory can tell a restart from a first start.
        """
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
        """Durably record ``quorum_id`` (a no-op without a state directory; a failed write is logged and counted)."""
        if self._path is None or quorum_id == self._last_saved:
            return
        if self._write(self._path, quorum_id):
            self._last_saved = quorum_id

    def initial_max_step(self) -> int:
        """The highest step an earlier incarnation saw quorums agree on (0 without a state directory)."""
        if self._path is None:
            return 0
        path = self._path.with_name(MAX_STEP_FILE)
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return 0
        try:
            self._kept_step = self._agreed = int(text)
        except ValueError:
            raise ValueError(f"{path} does not hold a step (got {text[:40]!r}); fix or remove it") from None
        return self._kept_step

    def initial_holders(self) -> frozenset[str]:
        """The replica ids an earlier incarnation saw holding its step; empty when unknown (no state directory,
        none saved, or a file that can't be read, which is logged)."""
        if self._path is None:
            return frozenset()
        path = self._path.with_name(HOLDERS_FILE)
        try:
            ids = json.loads(path.read_text())
        except FileNotFoundError:
            return frozenset()
        except (OSError, ValueError) as exc:
            ids = exc
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            logger.warning("%s does not hold a JSON list of replica ids (%s): the stale-quorum guard counts from "
                           "the start instead of waiting for known holders", path, str(ids)[:80])
            return frozenset()
        self._holders = self._kept_holders = frozenset(ids)
        return self._holders

    def save_max_step(self, step: int) -> bool:
        """Write ``step`` as the job's highest step now; False when the write failed (logged and counted)."""
        return self._path is None or self._write(self._path.with_name(MAX_STEP_FILE), step)

    def quorum_reached(self, steps: Sequence[int], now: float, replica_ids: Sequence[str] = ()) -> None:
        """A quorum was issued to ``replica_ids`` at ``steps``: raise the agreed step (see :func:`agreed_step`)
        and keep it, with those at or above it as its holders (unless none is: a fast quorum ignores steps)."""
        self._agreed = max(self._agreed, agreed_step(steps))
        holders = frozenset(r for r, step in zip(replica_ids, steps) if step >= self._agreed)
        if holders:
            self._holders = holders
        self.keep_max_step(now)

    def keep_max_step(self, now: float, *, force: bool = False) -> None:
        """Save the agreed step when it differs from the one on disk, at most once a second (``now``:
        monotonic seconds) unless ``force``.

        A slightly stale value still stops replicas at step 0 from redoing
        history after a restart, without an fsync per step.
        """
        changed = self._agreed != self._kept_step or self._holders != self._kept_holders
        if changed and (force or now - self._kept_at >= 1.0):
            self._kept_at = now  # a failing disk is retried once a second, not at every quorum
            if self._holders != self._kept_holders and self._save_holders(self._holders):
                self._kept_holders = self._holders
            if self._agreed != self._kept_step and self.save_max_step(self._agreed):
                self._kept_step = self._agreed

    def reset_max_step(self, step: int, now: float, holders: Iterable[str] = ()) -> None:
        """A new epoch of the job lowered the highest step to ``step``, held by ``holders``: save it (or the
        agreed step, if lower) at once, so a restart does not wait for holders of the old step again."""
        self._agreed = min(self._agreed, step)
        self._holders = frozenset(holders)
        self.keep_max_step(now, force=True)

    def _save_holders(self, holders: frozenset[str]) -> bool:
        return self._path is None or self._write(self._path.with_name(HOLDERS_FILE), json.dumps(sorted(holders)))

    def _write(self, path: Path, value: int | str) -> bool:
        """Write ``value`` atomically; False when that failed (a full disk). A failure logs an ERROR once per
        streak of failures, is counted in ``write_failures``, and the value is written again at the next
        chance; meanwhile a restart relies on the wall-clock seed and an older step."""
        try:
            _write_atomically(path, value)
        except OSError as exc:
            self.write_failures += 1
            if not self._failing:
                logger.error("could not write %s to %s: %s. The lighthouse serves on without it (a restart would "
                             "start from an older value; free space or fix %s); retrying at the next change",
                             value, path, exc, path.parent)
            self._failing = True
            return False
        if self._failing:
            logger.info("writes to %s succeed again (%d failed)", path.parent, self.write_failures)
        self._failing = False
        return True


def _write_atomically(path: Path, value: int | str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(f"{value}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also keep half a file
        raise
