"""Section timeouts: a hung replica group exits to be rescheduled instead of stalling everyone.

The Manager marks sections of each step (``quorum``, ``heal``, ``step``,
``checkpoint``); a :class:`Watchdog` thread watches them, and when one runs past
its timeout it logs what was being waited for, dumps every thread's stack and
exits with :data:`EXIT_CODE_RESCHEDULE` (75). With calibration on, timeouts come
from observed durations (:mod:`torchft_lite.health.watchdog_calibration`); the
observations are saved with durable checkpoints. Defaults, settings and why
calibration is opt-in: docs/health.md ("Watchdog", "Watchdog calibration").
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from torchft_lite.health.watchdog_calibration import CALIBRATED_SECTIONS, Calibration, CalibrationRules, TimeoutChange

__all__ = ["CALIBRATED_SECTIONS", "EXIT_CODE_PREEMPTED", "EXIT_CODE_RESCHEDULE", "SECTIONS", "SectionStatistics",
           "Watchdog", "WatchdogConfig", "WatchdogStatistics"]

logger = logging.getLogger(__name__)
_STDERR_FD = 2  # the process's stderr itself, whatever object sys.stderr is by then

EXIT_CODE_RESCHEDULE = 75
"""A watchdog section timed out (``EX_TEMPFAIL``): restart it, elsewhere if the host is suspect."""
EXIT_CODE_PREEMPTED = 143
"""Left gracefully on SIGTERM (128 + 15), after saving a durable checkpoint of its step (with a
DurableCheckpointer): restart it when capacity returns."""
EXIT_BACKSTOP_SEC = 10.0
"""How long the watchdog's exit may take before faulthandler ends the process (code 1) regardless."""
SECTIONS = ("quorum", "heal", "step", "checkpoint")
_ON = ("1", "on", "true", "yes")
_OFF = ("0", "off", "false", "no", "")


@dataclass(frozen=True)
class WatchdogConfig:
    """Seconds each section may take before the process exits; None disables it (until calibrated)."""

    quorum: float | None = None
    """From ``start_quorum`` until the quorum is known and the process group is ready."""
    heal: float | None = None
    """Receiving and applying a peer's state dict."""
    step: float | None = None
    """From ``start_quorum`` to the end of ``should_commit``, less any heal in it (the Manager's default is
    generous: quorum timeout + 5 x timeout + 300 s; raise it for steps that take longer)."""
    checkpoint: float | None = None
    """The user's durable-checkpoint callback (and ``manager.watchdog.section("checkpoint")``)."""
    calibrate: bool = False
    """Compute the timeouts of ``quorum``, ``heal`` and ``step`` from observed durations, unless explicit
    (also ``TORCHFT_LITE_WATCHDOG_CALIBRATE=1``). The defaults must fit every job, so they are loose (a hung
    1 s step waits 11 minutes) and can be too tight for very long steps. Off by default because a false expiry
    costs a healthy group a restart: a membership change legitimately makes every group's quorum wait up to
    the lighthouse's ``join_timeout`` (60 s) plus a process-group reconfiguration, whether or not the warm-up
    saw one (``floor`` is sized for that)."""
    explicit: Iterable[str] | None = None
    """Sections whose timeout the user chose: calibration never changes them. None (the default): every
    section given a timeout in this config; so ``WatchdogConfig(calibrate=True)`` watches nothing until
    the warm-up ends, and ``explicit=()`` makes the given timeouts starting values. ``from_env`` sets it
    to the sections its variables set."""
    warmup: int = 20
    """Completed occurrences of a section before its timeout is calibrated: enough that their maximum
    covers the usual spread of a steady job, few enough to calibrate within its first minutes."""
    multiple: float = 4.0
    """A calibrated timeout is this many times the longest duration observed: a loaded machine, a GC
    pause or a checkpoint write stretch a section by well under that."""
    floor: float = 120.0
    """Seconds a calibrated timeout never goes below: a job of tiny steps gets no hair trigger, and a
    membership change (the lighthouse's 60 s ``join_timeout`` for a restarting group, a process-group
    reconfiguration) is covered even if the warm-up saw none."""

    def __post_init__(self) -> None:
        for name in SECTIONS:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"watchdog {name} timeout must be positive or None, got {value}")
        explicit = self.explicit
        if explicit is None:
            explicit = [name for name in SECTIONS if getattr(self, name) is not None]
        elif isinstance(explicit, str):
            raise ValueError(f"watchdog explicit must be a collection of section names, got the string {explicit!r}")
        explicit = frozenset(explicit)
        unknown = sorted(explicit - set(SECTIONS))
        if unknown:
            raise ValueError(f"watchdog explicit names unknown sections {unknown}; sections are {SECTIONS}")
        object.__setattr__(self, "explicit", explicit)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 1:
            raise ValueError(f"watchdog warmup must be a whole number >= 1, got {self.warmup!r}")
        if not (isinstance(self.multiple, (int, float)) and math.isfinite(self.multiple) and self.multiple > 1):
            raise ValueError(f"watchdog multiple must be a number > 1 (the longest duration seen must not "
                             f"expire), got {self.multiple!r}")
        if not (isinstance(self.floor, (int, float)) and math.isfinite(self.floor) and self.floor > 0):
            raise ValueError(f"watchdog floor must be a positive number of seconds, got {self.floor!r}")

    def calibration_rules(self) -> CalibrationRules:
        sections = frozenset(CALIBRATED_SECTIONS) - frozenset(self.explicit or ()) if self.calibrate else frozenset()
        return CalibrationRules(self.warmup, float(self.multiple), float(self.floor), sections)

    @classmethod
    def from_env(cls, env: Mapping[str, str], defaults: "WatchdogConfig") -> "WatchdogConfig":
        """``TORCHFT_LITE_WATCHDOG_<SECTION>_SEC`` overrides each default (``0`` or ``off`` disables it) and
        makes that section explicit; the others keep ``defaults``' timeouts as values calibration may change.
        ``TORCHFT_LITE_WATCHDOG_CALIBRATE`` (``1``/``0``), ``..._CALIBRATE_WARMUP``, ``..._CALIBRATE_MULTIPLE``
        and ``..._CALIBRATE_FLOOR_SEC`` override the calibration fields of ``defaults``."""
        values: dict[str, Any] = {}
        explicit = []
        for name in SECTIONS:
            key = f"TORCHFT_LITE_WATCHDOG_{name.upper()}_SEC"
            raw = env.get(key)
            if raw is None or raw == "":
                values[name] = getattr(defaults, name)
                continue
            explicit.append(name)
            if raw.lower() in ("0", "off", "none"):
                values[name] = None
            else:
                values[name] = _number(key, raw, float, "a number of seconds or 'off'")
        raw = env.get("TORCHFT_LITE_WATCHDOG_CALIBRATE")
        if raw is None or raw.strip() == "":
            values["calibrate"] = defaults.calibrate
        elif raw.strip().lower() in _ON + _OFF:
            values["calibrate"] = raw.strip().lower() in _ON
        else:
            raise ValueError(f"$TORCHFT_LITE_WATCHDOG_CALIBRATE must be 1 or 0 (on/off), got {raw!r}")
        for field, suffix, kind, what in (("warmup", "WARMUP", int, "a whole number of occurrences"),
                                          ("multiple", "MULTIPLE", float, "a number > 1"),
                                          ("floor", "FLOOR_SEC", float, "a number of seconds")):
            key = f"TORCHFT_LITE_WATCHDOG_CALIBRATE_{suffix}"
            raw = env.get(key)
            values[field] = getattr(defaults, field) if raw is None or raw == "" else _number(key, raw, kind, what)
        try:
            return cls(**values, explicit=explicit)
        except ValueError as exc:
            raise ValueError(f"{exc} (from the TORCHFT_LITE_WATCHDOG_* environment variables)") from None


def _number(key: str, raw: str, kind: type, what: str) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"${key} must be {what}, got {raw!r}") from None


@dataclass(frozen=True)
class SectionStatistics:
    """One section as the watchdog sees it now."""

    timeout: float | None
    """What its next occurrence gets; None: unwatched."""
    calibrated: bool
    """That timeout comes from observed durations."""
    count: int
    """Completed occurrences observed (restored ones included)."""
    max_seconds: float
    running_for: float | None
    """Seconds the occurrence under way has run (less heal time for ``step``); None: not under way."""
    left: float | None
    """Seconds until it expires; None when not under way, unwatched, or a heal defers it."""


@dataclass(frozen=True)
class WatchdogStatistics:
    calibrate: bool
    sections: Mapping[str, SectionStatistics]


@dataclass
class _Open:
    """One section under way."""

    started: float
    deadline: float | None
    timeout: float | None
    what: str
    paused: float = 0.0
    """Seconds of it spent in watched heals that ended (``step`` only): not counted against it, nor observed."""


class Watchdog:
    """Watches named sections from a daemon thread; ``on_expire`` defaults to dump-and-exit.

    A timeout of ``None`` disables that section. Time spent in a heal does not count against the ``step``
    section: the ``heal`` section watches it. The observations are saved with durable checkpoints
    (:meth:`calibration_state`) and restored by ``DurableCheckpointer.resume``, so a restarted job starts
    calibrated.
    """

    def __init__(self, config: WatchdogConfig, label: str = "",
                 on_expire: Callable[[str, str, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.label = label
        self._on_expire = on_expire or _dump_and_exit
        self._clock = clock
        self._lock = threading.Condition()
        self._open: dict[str, _Open] = {}
        self._calibration = Calibration(config.calibration_rules(), {name: getattr(config, name) for name in SECTIONS})
        self._warm: set[str] = set()  # sections completed at least once in this process
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="torchft-watchdog", daemon=True)
        if config.calibrate or any(getattr(config, name) is not None for name in SECTIONS):
            self._thread.start()

    def begin(self, section: str, what: str) -> None:
        with self._lock:
            timeout = self._calibration.timeout(section, warm=section in self._warm)
            if timeout is None and section not in CALIBRATED_SECTIONS:
                return
            now = self._clock()
            self._open[section] = _Open(now, None if timeout is None else now + timeout, timeout, what)
            self._lock.notify()

    def end(self, section: str) -> None:
        with self._lock:
            entry = self._open.pop(section, None)
            if entry is None:
                return
            now = self._clock()
            step = self._open.get("step")
            if section == "heal" and step is not None and entry.deadline is not None:  # the heal section watched it
                held = max(0.0, now - max(entry.started, step.started))
                step.paused += held
                if step.deadline is not None:
                    step.deadline += held
            seconds = now - entry.started - (self._held_by_heal(entry, now) if section == "step" else 0.0)
            change = self._calibration.observe(section, seconds)
            self._warm.add(section)
        if change is not None:
            self._report(change)

    def section(self, section: str, what: str) -> "_Section":
        """``with watchdog.section("checkpoint", "saving step 10"): ...``"""
        return _Section(self, section, what)

    def timeout(self, section: str) -> float | None:
        """The timeout the section's next occurrence gets (configured or calibrated); None: unwatched."""
        with self._lock:
            return self._calibration.timeout(section, warm=section in self._warm)

    def statistics(self) -> WatchdogStatistics:
        with self._lock:
            now = self._clock()
            counting = dict(self._counting())
            sections = {}
            for name in SECTIONS:
                seen, entry = self._calibration.observed(name), self._open.get(name)
                timeout = self._calibration.timeout(name, warm=name in self._warm)
                sections[name] = SectionStatistics(
                    timeout, timeout is not None and timeout == self._calibration.calibrated(name), seen.count,
                    seen.max_seconds, None if entry is None else now - entry.started - self._held_by_heal(entry, now),
                    counting[name].deadline - now if name in counting else None)
            return WatchdogStatistics(self.config.calibrate, sections)

    def calibration_state(self) -> dict[str, Any]:
        """The observed durations as plain data (saved with durable checkpoints, restored by ``DurableCheckpointer.resume``)."""
        with self._lock:
            return self._calibration.state()

    def load_calibration_state(self, state: Any) -> bool:
        """Restore what :meth:`calibration_state` saved (from a checkpoint on disk: it may be corrupt).

        A state that is malformed is refused as a whole with a WARNING that says why, and the configured
        timeouts stay in force; returns whether it was loaded.
        """
        try:
            with self._lock:
                changes = self._calibration.load(state)
        except ValueError as exc:
            logger.warning("%s watchdog: ignoring the saved calibration (%s); the configured timeouts hold and "
                           "calibration starts afresh", self.label, exc)
            return False
        for change in changes:
            self._report(change)
        if not changes:
            seen = {name: entry["count"] for name, entry in self.calibration_state()["sections"].items()}
            logger.info("%s watchdog: restored the observed durations (%s) from a durable checkpoint; no timeout "
                        "changed (calibration %s)", self.label, seen or "none",
                        "on for " + ", ".join(sorted(self._calibration.rules.sections))
                        if self._calibration.rules.sections else "off for every section")
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._open.clear()
            self._lock.notify()

    def _report(self, change: TimeoutChange) -> None:
        logger.info("%s watchdog: %s", self.label, change.describe())

    def _held_by_heal(self, step: _Open, now: float) -> float:
        """Seconds of the ``step`` under way spent in watched heals, the one under way included."""
        heal = self._open.get("heal")
        if heal is None or heal.deadline is None:
            return step.paused
        return step.paused + max(0.0, now - max(heal.started, step.started))

    def _counting(self) -> list[tuple[str, _Open]]:
        """Open sections whose deadline runs: watched, and not ``step`` while a watched heal holds it."""
        heal = self._open.get("heal")
        healing = heal is not None and heal.deadline is not None
        return [(name, entry) for name, entry in self._open.items()
                if entry.deadline is not None and not (name == "step" and healing)]

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                counting = self._counting()
                if not counting:
                    self._lock.wait()
                    continue
                section, entry = min(counting, key=lambda item: item[1].deadline)
                left = entry.deadline - self._clock()
                if left > 0:
                    self._lock.wait(left)
                    continue
                self._open.pop(section)
                break
            else:
                return
        self._on_expire(f"{self.label} {section}".strip(), entry.what, entry.timeout)


class _Section:
    def __init__(self, watchdog: Watchdog, section: str, what: str) -> None:
        self._watchdog, self._section, self._what = watchdog, section, what

    def __enter__(self) -> None:
        self._watchdog.begin(self._section, self._what)

    def __exit__(self, *exc_info) -> None:
        self._watchdog.end(self._section)


def _dump_and_exit(section: str, what: str, timeout: float) -> None:
    """Log, dump every thread's stack to stderr, exit with ``EXIT_CODE_RESCHEDULE`` (``EX_TEMPFAIL``: "try again
    later", which batch schedulers and torchrun treat as a failure to restart).

    Exiting must not hang in turn: the thread that hung the step may hold a lock the exit needs (a logging
    handler's, stderr's) or never release the GIL. So the first thing is to arm :mod:`faulthandler`'s own
    timer, a C thread that needs neither: if the process is still alive ``EXIT_BACKSTOP_SEC`` later, it dumps
    every thread's stack and ends the process with code 1.
    """
    # Armed first: everything below needs the GIL and locks that a stuck thread may hold forever.
    faulthandler.dump_traceback_later(EXIT_BACKSTOP_SEC, exit=True, file=_STDERR_FD)
    logger.critical("watchdog: %s took more than %.0fs waiting for %s; dumping all threads and exiting "
                    "with %d so this replica group is rescheduled", section, timeout, what, EXIT_CODE_RESCHEDULE)
    sys.stderr.write(f"\n=== torchft_lite watchdog: {section} exceeded {timeout:.0f}s ({what}); thread stacks ===\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    logging.shutdown()
    os._exit(EXIT_CODE_RESCHEDULE)
