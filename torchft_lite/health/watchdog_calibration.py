"""Watchdog timeouts computed from observed durations: the pure part (no clock, thread, lock or I/O).

The :class:`~torchft_lite.health.watchdog.Watchdog` measures each completed section
and hands the seconds to :meth:`Calibration.observe`; it asks
:meth:`Calibration.timeout` what the next occurrence may take. The rules are on
:class:`Calibration`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["CALIBRATED_SECTIONS", "Calibration", "CalibrationRules", "Observed", "TimeoutChange"]

CALIBRATED_SECTIONS = ("quorum", "heal", "step")
"""``checkpoint`` is left out: it runs once per preemption, never often enough to warm up."""
STATE_VERSION = 1
MAX_SAVED_SECONDS = 7 * 24 * 3600.0
"""A saved duration longer than a week is not a step's: the saved calibration is refused as corrupt."""
ANNOUNCE_CHANGE = 0.2
"""A calibrated timeout that moves by more than this fraction since it was last logged is logged again."""


@dataclass(frozen=True)
class CalibrationRules:
    """How timeouts are derived (``WatchdogConfig``'s calibration fields)."""

    warmup: int
    multiple: float
    floor: float
    sections: frozenset[str]
    """The sections whose timeout calibrates: none when calibration is off; never an explicit one."""


@dataclass(frozen=True)
class Observed:
    """Completed occurrences of one section and the longest of them, in seconds."""

    count: int
    max_seconds: float


@dataclass(frozen=True)
class TimeoutChange:
    """A calibrated timeout that is new or moved by more than :data:`ANNOUNCE_CHANGE` (the Watchdog logs it)."""

    section: str
    old: float | None
    """The timeout in force before: the configured one (None: unwatched) when calibrated for the first time."""
    new: float
    observed: Observed
    first: bool
    restored: bool
    """Calibrated by observations restored from a durable checkpoint."""
    multiple: float
    floor: float

    def describe(self) -> str:
        before = "unwatched" if self.old is None else f"{self.old:.1f}s"
        verb = "calibrated" if self.first else "recalibrated"
        source = " (restored from a durable checkpoint)" if self.restored else ""
        longest = self.multiple * self.observed.max_seconds
        why = (f"{self.multiple:g} x that" if longest >= self.floor
               else f"{self.multiple:g} x that is {longest:.2f}s, below the floor")
        return (f"{self.section} timeout {verb}{source}: {before} -> {self.new:.1f}s; the longest of "
                f"{self.observed.count} observed took {self.observed.max_seconds:.2f}s ({why})")


class Calibration:
    """Observed durations per section and the timeouts they give; the caller serializes access.

    * Until a section has completed ``warmup`` times, its configured timeout holds.
    * Then its timeout is ``multiple x`` the longest duration observed for it, never below ``floor``. The
      maximum only grows, so a heal of a bigger state or a slower step keeps raising the timeout; nothing
      lowers it again.
    * Only calibrating sections change (calibration on, and the section not set explicitly); durations of
      ``quorum``, ``heal`` and ``step`` are observed either way, so a checkpoint written with calibration off
      can start a later run with it on already calibrated.
    * The first occurrence of a section in a process gets the larger of its configured and calibrated
      timeouts: observations restored from a durable checkpoint describe a warm process, and a restarted one
      pays one-off costs first (the process group built from nothing, compilation, allocator warm-up).

    What is saved (:meth:`state`) is the observations (count and longest duration per section), not the
    timeouts, so a restart that changes ``multiple`` or ``floor`` applies them to the history it restores.
    """

    def __init__(self, rules: CalibrationRules, configured: Mapping[str, float | None]) -> None:
        unknown = rules.sections - set(CALIBRATED_SECTIONS)
        if unknown:
            raise ValueError(f"sections {sorted(unknown)} can't be calibrated; only {CALIBRATED_SECTIONS} can")
        self.rules = rules
        self._configured = dict(configured)
        self._observed: dict[str, Observed] = {}
        self._announced: dict[str, float] = {}  # the calibrated timeout last reported, per section

    def observed(self, section: str) -> Observed:
        return self._observed.get(section, Observed(0, 0.0))

    def calibrated(self, section: str) -> float | None:
        """``max(floor, multiple x longest)`` once warmed up, for a calibrating section; else None."""
        seen = self.observed(section)
        if section not in self.rules.sections or seen.count < self.rules.warmup:
            return None
        return max(self.rules.floor, self.rules.multiple * seen.max_seconds)

    def timeout(self, section: str, *, warm: bool) -> float | None:
        """The timeout of the section's next occurrence; ``warm``: one already completed in this process."""
        configured = self._configured.get(section)
        calibrated = self.calibrated(section)
        if calibrated is None:
            return configured
        if not warm:  # one-off costs of a fresh process: never tighter than the configured timeout
            return None if configured is None else max(configured, calibrated)
        return calibrated

    def observe(self, section: str, seconds: float) -> TimeoutChange | None:
        """Count one completed occurrence that took ``seconds``; the change to report, if any."""
        if section not in CALIBRATED_SECTIONS:
            return None
        seen = self.observed(section)
        self._observed[section] = Observed(seen.count + 1, max(seen.max_seconds, max(0.0, float(seconds))))
        return self._announce(section, restored=False)

    # ------------------------------------------------------------ saved with durable checkpoints

    def state(self) -> dict[str, Any]:
        """Plain data (the heal format and JSON carry it): the observations of every section seen."""
        return {"version": STATE_VERSION,
                "sections": {name: {"count": seen.count, "max_seconds": float(seen.max_seconds)}
                             for name, seen in sorted(self._observed.items()) if seen.count > 0}}

    def load(self, state: Any) -> list[TimeoutChange]:
        """Add saved observations to ours; raises ``ValueError`` saying what is wrong, having changed nothing.

        A section this version does not know (a newer writer's) is skipped; anything malformed refuses the
        whole state, since one corrupt number would otherwise set a timeout.
        """
        saved = parse_state(state)
        for name, seen in saved.items():
            mine = self.observed(name)
            self._observed[name] = Observed(mine.count + seen.count, max(mine.max_seconds, seen.max_seconds))
        changes = [self._announce(name, restored=True) for name in CALIBRATED_SECTIONS if name in saved]
        return [change for change in changes if change is not None]

    def _announce(self, section: str, *, restored: bool) -> TimeoutChange | None:
        new = self.calibrated(section)
        if new is None:
            return None
        old = self._announced.get(section)
        if old is not None and abs(new - old) <= ANNOUNCE_CHANGE * old:
            return None
        self._announced[section] = new
        return TimeoutChange(section, self._configured.get(section) if old is None else old, new,
                             self.observed(section), first=old is None, restored=restored,
                             multiple=self.rules.multiple, floor=self.rules.floor)


def parse_state(state: Any) -> dict[str, Observed]:
    """The observations in a saved state, or ``ValueError`` naming the first thing wrong with it."""
    if not isinstance(state, Mapping):
        raise ValueError(f"expected a mapping, got {type(state).__name__}")
    version = state.get("version")
    if version != STATE_VERSION:
        raise ValueError(f"version {version!r} is not {STATE_VERSION}")
    sections = state.get("sections")
    if not isinstance(sections, Mapping):
        raise ValueError(f"'sections' is {type(sections).__name__}, not a mapping")
    parsed: dict[str, Observed] = {}
    for name, entry in sections.items():
        if not isinstance(name, str):
            raise ValueError(f"section name {name!r} is not a string")
        if not isinstance(entry, Mapping):
            raise ValueError(f"section {name!r} is {type(entry).__name__}, not a mapping")
        count, longest = entry.get("count"), entry.get("max_seconds")
        if type(count) is not int or count < 0:
            raise ValueError(f"section {name!r}: count {count!r} is not a whole number >= 0")
        if type(longest) not in (int, float) or not math.isfinite(longest) or not 0 <= longest <= MAX_SAVED_SECONDS:
            raise ValueError(f"section {name!r}: max_seconds {longest!r} is not a number of seconds in "
                             f"[0, {MAX_SAVED_SECONDS:.0f}]")
        if name in CALIBRATED_SECTIONS and count > 0:
            parsed[name] = Observed(count, float(longest))
    return parsed
