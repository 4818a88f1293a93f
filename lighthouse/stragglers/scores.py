"""Straggler scores: how slow each replica group computes, against its quorum and against itself.

Each group's ManagerServer advertises ``"compute_ms"`` and ``"compute_step"`` in
the JSON of ``QuorumMember.data``; when a quorum is issued, :class:`StragglerBook`
records the members' new samples, keeps a relative and an individual score per
group, and says who is flagged (the rules are on the class; docs/health.md,
"Stragglers", says what a user sees). Pure: no clock, no I/O, no logging; the
caller (``lighthouse.stragglers.rules``) decides what a change of flag means.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Iterable, Mapping

__all__ = ["COMPUTE_MS_KEY", "COMPUTE_STEP_KEY", "MAX_COMPUTE_MS", "ComputeSample", "GroupScores", "StragglerBook",
           "StragglerConfig", "Transition", "compute_sample_of"]

COMPUTE_MS_KEY = "compute_ms"
COMPUTE_STEP_KEY = "compute_step"
MAX_COMPUTE_MS = 1e7
"""A step computing for more than ~2.8 hours is a broken clock or a hostile client, not a measurement."""
_INT64_MAX = 2**63 - 1
_SMOOTHING = 3
_SHOWN_CHARS = 40  # of a refused value, in a log line: the value is the caller's text


@dataclass(frozen=True)
class StragglerConfig:
    """How slow is a straggler, and whether the lighthouse acts on it."""

    threshold: float = 2.0
    """A group whose smoothed relative score stays above this is flagged."""
    patience: int = 3
    """For this many scored quorums in a row; also the base of the eviction cooldown, in quorums."""
    evict: bool = False
    """Leave a flagged group out of the next quorums (``lighthouse.stragglers.rules``); off: only report it."""
    history: int = 20
    """Samples of its own that a group's individual score compares with."""
    warmup: int = 5
    """Samples a group needs before it has an individual score."""
    floor_ms: float = 1.0
    """Medians below this are raised to it: sub-millisecond differences are noise."""

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold) or self.threshold <= 1:
            raise ValueError(f"straggler threshold must be a finite number > 1 (a ratio to the median), "
                             f"got {self.threshold!r}")
        for name, low in (("patience", 1), ("history", 1), ("warmup", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ValueError(f"straggler {name} must be an integer >= {low}, got {value!r}")
        if self.warmup > self.history:
            raise ValueError(f"straggler warmup ({self.warmup}) must not exceed history ({self.history})")
        if not isinstance(self.floor_ms, (int, float)) or not math.isfinite(self.floor_ms) or self.floor_ms <= 0:
            raise ValueError(f"straggler floor_ms must be a finite number > 0, got {self.floor_ms!r}")


@dataclass(frozen=True)
class ComputeSample:
    """One group's advertised compute time of one step."""

    ms: float
    step: int


def compute_sample_of(data: str) -> tuple[ComputeSample | None, str | None]:
    """The sample a member advertises in its ``QuorumMember.data``, and why it was refused if it was.

    ``(sample, None)`` for a valid one; ``(None, None)`` when there is none to
    take (no data, not a JSON object, either key missing: a torchft manager,
    an old client, a first step); ``(None, problem)`` when the keys are there
    with values no honest manager sends (the wrong type, not finite, out of
    range): the caller counts and logs it. Never raises.
    """
    if not data or COMPUTE_MS_KEY not in data:  # cheap test first: most members' data has no sample
        return None, None
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, an integer of too many digits, nested absurdly deep
        return None, None
    if not isinstance(parsed, dict) or COMPUTE_MS_KEY not in parsed or COMPUTE_STEP_KEY not in parsed:
        return None, None
    ms, step = parsed[COMPUTE_MS_KEY], parsed[COMPUTE_STEP_KEY]
    # type(): a bool is an int to isinstance, and no compute time.
    if type(ms) not in (int, float) or not math.isfinite(ms) or not 0 <= ms <= MAX_COMPUTE_MS:
        return None, f"{COMPUTE_MS_KEY} must be a finite number from 0 to {MAX_COMPUTE_MS:g}, got {_shown(ms)}"
    if type(step) is not int or not 0 <= step <= _INT64_MAX:
        return None, f"{COMPUTE_STEP_KEY} must be an integer from 0 to 2**63-1, got {_shown(step)}"
    return ComputeSample(float(ms), step), None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


@dataclass(frozen=True)
class GroupScores:
    """One group's scores, as /api/status and /metrics show them (ratios; None: not known yet)."""

    replica_id: str
    compute_ms: float
    """Its last sample."""
    compute_step: int
    quorum_median_ms: float | None
    """The median of the samples of the last quorum it was scored in (None: it was alone)."""
    own_median_ms: float | None
    """The median of its own recent samples (None during the warm-up)."""
    relative: float | None
    """Smoothed relative score (None until 3 raw ones)."""
    individual: float | None
    """Smoothed individual score (None until 3 raw ones after the warm-up)."""
    slow_streak: int
    """Scored quorums in a row with the smoothed relative score above the threshold."""
    flagged: bool
    samples: int
    """Samples recorded since it was first seen (or since the lighthouse forgot it last)."""


@dataclass(frozen=True)
class Transition:
    """A group became flagged (``flagged``) or recovered (not ``flagged``) in a :meth:`StragglerBook.record`."""

    scores: GroupScores
    flagged: bool


class _Group:
    __slots__ = ("last", "history", "relative", "individual", "quorum_median", "own_median", "streak", "flagged",
                 "samples", "calm")

    def __init__(self, history: int) -> None:
        self.last: ComputeSample | None = None
        self.history: deque[float] = deque(maxlen=history)
        self.relative: deque[float] = deque(maxlen=_SMOOTHING)
        self.individual: deque[float] = deque(maxlen=_SMOOTHING)
        self.quorum_median: float | None = None
        self.own_median: float | None = None
        self.streak = 0
        self.flagged = False
        self.samples = 0
        self.calm = 0  # quorums in a row with a smoothed relative score at or below the threshold


def _smoothed(window: deque[float]) -> float | None:
    return median(window) if len(window) == _SMOOTHING else None


class StragglerBook:
    """Every known group's samples and scores.

    A sample is a group's ``compute_ms`` (its training thread's time from
    ``start_quorum`` returning to its first ``allreduce``: forward, backward and
    anything injected, the group's own work) at ``compute_step``. Two scores per
    group:

    * **relative**: its compute time / the median of the fresh samples of the
      members of that quorum (itself included; needs two samples at least). A
      group that is slow *compared with its peers* is what holds every step back.
    * **individual**: its compute time / the median of its own last ``history``
      samples (after ``warmup`` of them), shown and logged only: a group that
      slowed down against itself while the others slowed down too (a bigger
      batch, a slow shared filesystem) is no straggler, so only the relative
      score flags.

    Both are smoothed by the **median of the last 3 raw scores**: one spike (a GC
    pause, the first step after a heal, a checkpoint save) moves a median of three
    not at all, where an EWMA would move by a fraction of the spike and a large
    enough spike would still cross the threshold; a real slowdown shows from its
    second sample on; and there is no decay constant to tune. A group has no
    smoothed score until it has 3 raw ones.

    A group is **flagged** once its smoothed relative score has been above
    ``threshold`` for ``patience`` scored quorums in a row, and **recovers** the
    first time it is at or below it. A slowdown from one step on is therefore
    flagged at the ``patience + 1``-th quorum that carries a slow sample (3 + 1
    with the defaults); samples report the previous step, so ``patience + 2``
    steps after it began.

    Compute times under ``floor_ms`` (1 ms) are noise: medians are raised to it
    before dividing, so no one is flagged for 0.3 ms against 0.1 ms. Samples are
    taken only when new (another ``(compute_step, compute_ms)`` than the group's
    last), so a retried request or a re-issued quorum scores nobody twice.
    Memory: per group, a few small fixed windows; a group is dropped when the
    lighthouse forgets it.
    """

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._groups: dict[str, _Group] = {}

    def record(self, samples: Mapping[str, ComputeSample | None]) -> list[Transition]:
        """The members of one issued quorum (``replica_id -> its sample``, None for a member without one):
        take the new samples, score the groups that sent one, and return who became flagged or recovered."""
        cfg = self.config
        fresh: dict[str, ComputeSample] = {}
        for replica_id, sample in samples.items():
            if sample is None:
                continue
            group = self._groups.get(replica_id)
            if group is None:
                group = self._groups[replica_id] = _Group(cfg.history)
            if group.last == sample:
                continue  # the same measurement again (a retry, a re-issued quorum)
            group.last = sample
            group.samples += 1
            fresh[replica_id] = sample
        if not fresh:
            return []
        quorum_median = max(median(s.ms for s in fresh.values()), cfg.floor_ms) if len(fresh) >= 2 else None
        transitions = []
        for replica_id, sample in fresh.items():
            group = self._groups[replica_id]
            if len(group.history) >= cfg.warmup:
                group.own_median = max(median(group.history), cfg.floor_ms)
                group.individual.append(sample.ms / group.own_median)
            group.history.append(sample.ms)
            group.quorum_median = quorum_median
            if quorum_median is None:
                continue  # alone: nothing to compare with, and no evidence either way
            group.relative.append(sample.ms / quorum_median)
            relative = _smoothed(group.relative)
            slow = relative is not None and relative > cfg.threshold
            group.streak = group.streak + 1 if slow else 0
            group.calm = 0 if relative is None or slow else group.calm + 1
            if not group.flagged and group.streak >= cfg.patience:
                group.flagged = True
                transitions.append(Transition(self._scores(replica_id, group), True))
            elif group.flagged and group.streak == 0:
                group.flagged = False
                transitions.append(Transition(self._scores(replica_id, group), False))
        return transitions

    def readmitted(self, replica_id: str) -> None:
        """``replica_id`` is back after an eviction: judge it on new relative scores only (its individual
        history stays), so it must be slow for ``patience`` fresh quorums again to be flagged again."""
        group = self._groups.get(replica_id)
        if group is not None:
            group.relative.clear()
            group.streak = 0
            group.flagged = False
            group.calm = 0

    def forget(self, replica_id: str) -> None:
        """The lighthouse forgot ``replica_id`` (gone): drop its scores (and its /metrics series)."""
        self._groups.pop(replica_id, None)

    def is_flagged(self, replica_id: str) -> bool:
        group = self._groups.get(replica_id)
        return group is not None and group.flagged

    def calm_streak(self, replica_id: str) -> int:
        """Quorums in a row (since :meth:`readmitted`) with a smoothed relative score at or below the
        threshold: how long it has shown it keeps up."""
        group = self._groups.get(replica_id)
        return 0 if group is None else group.calm

    def scores(self, replica_id: str) -> GroupScores | None:
        group = self._groups.get(replica_id)
        return None if group is None else self._scores(replica_id, group)

    def all_scores(self) -> tuple[GroupScores, ...]:
        """Every known group (each has a sample), sorted by replica id."""
        return tuple(self._scores(rid, group) for rid, group in sorted(self._groups.items()))

    def flagged(self) -> Iterable[str]:
        return (rid for rid, group in self._groups.items() if group.flagged)

    def __len__(self) -> int:
        return len(self._groups)

    @staticmethod
    def _scores(replica_id: str, group: _Group) -> GroupScores:
        last: ComputeSample = group.last  # type: ignore[assignment]  # a group is created with its first sample
        return GroupScores(
            replica_id=replica_id,
            compute_ms=last.ms,
            compute_step=last.step,
            quorum_median_ms=group.quorum_median,
            own_median_ms=group.own_median,
            relative=_smoothed(group.relative),
            individual=_smoothed(group.individual),
            slow_streak=group.streak,
            flagged=group.flagged,
            samples=group.samples,
        )
