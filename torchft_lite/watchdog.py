"""Section timeouts: a hung replica group exits to be rescheduled instead of stalling everyone.

The Manager marks sections of each step (``quorum``, ``heal``, ``step``,
``checkpoint``). A daemon thread watches them; when one runs past its timeout
it logs what was being waited for, dumps every thread's stack to stderr and
exits the process with :data:`EXIT_CODE_RESCHEDULE` (75, ``EX_TEMPFAIL``: "try
again later", which batch schedulers and torchrun treat as a failure to
restart). A timeout of ``None`` disables that section.

Exiting must not hang in turn: the thread that hung the step may hold a lock
the exit needs (a logging handler's, stderr's) or never release the GIL. So
the first thing the exit does is arm :mod:`faulthandler`'s own timer, a C
thread that needs neither: if the process is still alive
:data:`EXIT_BACKSTOP_SEC` later, it dumps every thread's stack and ends the
process with code 1.

Exit codes of a training process using torchft_lite::

    0    finished
    1    killed through the lighthouse's Kill (torchft's code)
    75   EXIT_CODE_RESCHEDULE: a watchdog section timed out (this module)
    143  EXIT_CODE_PREEMPTED: left gracefully on a preemption signal (SIGTERM by default)
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["EXIT_CODE_PREEMPTED", "EXIT_CODE_RESCHEDULE", "SECTIONS", "Watchdog", "WatchdogConfig"]

logger = logging.getLogger(__name__)
_STDERR_FD = 2  # the process's stderr itself, whatever object sys.stderr is by then

EXIT_CODE_RESCHEDULE = 75
EXIT_CODE_PREEMPTED = 143
EXIT_BACKSTOP_SEC = 10.0
"""How long the watchdog's exit may take before faulthandler ends the process (code 1) regardless."""
SECTIONS = ("quorum", "heal", "step", "checkpoint")


@dataclass(frozen=True)
class WatchdogConfig:
    """Seconds each section may take before the process exits; None disables it."""

    quorum: float | None = None
    """From ``start_quorum`` until the quorum is known and the process group is ready."""
    heal: float | None = None
    """Receiving and applying a peer's state dict."""
    step: float | None = None
    """From ``start_quorum`` to the end of ``should_commit`` (the Manager's default is
    generous: quorum timeout + 5 x timeout + 300 s; raise it for steps that take longer)."""
    checkpoint: float | None = None
    """The user's durable-checkpoint callback (and ``manager.watchdog.section("checkpoint")``)."""

    def __post_init__(self) -> None:
        for name in SECTIONS:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"watchdog {name} timeout must be positive or None, got {value}")

    @classmethod
    def from_env(cls, env: Mapping[str, str], defaults: "WatchdogConfig") -> "WatchdogConfig":
        """``TORCHFT_LITE_WATCHDOG_<SECTION>_SEC`` overrides each default; ``0`` or ``off`` disables it."""
        values = {}
        for name in SECTIONS:
            key = f"TORCHFT_LITE_WATCHDOG_{name.upper()}_SEC"
            raw = env.get(key)
            if raw is None or raw == "":
                values[name] = getattr(defaults, name)
            elif raw.lower() in ("0", "off", "none"):
                values[name] = None
            else:
                try:
                    values[name] = float(raw)
                except ValueError:
                    raise ValueError(f"${key} must be a number of seconds or 'off', got {raw!r}") from None
        return cls(**values)


class Watchdog:
    """Watches named sections from a daemon thread; ``on_expire`` defaults to dump-and-exit."""

    def __init__(self, config: WatchdogConfig, label: str = "",
                 on_expire: Callable[[str, str, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.label = label
        self._on_expire = on_expire or _dump_and_exit
        self._clock = clock
        self._lock = threading.Condition()
        self._open: dict[str, tuple[float, str]] = {}  # section -> (deadline, what it waits for)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="torchft-watchdog", daemon=True)
        if any(getattr(config, name) is not None for name in SECTIONS):
            self._thread.start()

    def begin(self, section: str, what: str) -> None:
        timeout = getattr(self.config, section)
        if timeout is None:
            return
        with self._lock:
            self._open[section] = (self._clock() + timeout, what)
            self._lock.notify()

    def end(self, section: str) -> None:
        with self._lock:
            self._open.pop(section, None)

    def section(self, section: str, what: str) -> "_Section":
        """``with watchdog.section("checkpoint", "saving step 10"): ...``"""
        return _Section(self, section, what)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._open.clear()
            self._lock.notify()

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._open:
                    self._lock.wait()
                    continue
                section, (deadline, what) = min(self._open.items(), key=lambda item: item[1][0])
                left = deadline - self._clock()
                if left > 0:
                    self._lock.wait(left)
                    continue
                self._open.pop(section)
                timeout = getattr(self.config, section)
                break
            else:
                return
        self._on_expire(f"{self.label} {section}".strip(), what, timeout)


class _Section:
    def __init__(self, watchdog: Watchdog, section: str, what: str) -> None:
        self._watchdog, self._section, self._what = watchdog, section, what

    def __enter__(self) -> None:
        self._watchdog.begin(self._section, self._what)

    def __exit__(self, *exc_info) -> None:
        self._watchdog.end(self._section)


def _dump_and_exit(section: str, what: str, timeout: float) -> None:
    # Armed first: everything below needs the GIL and locks that a stuck thread may hold forever.
    faulthandler.dump_traceback_later(EXIT_BACKSTOP_SEC, exit=True, file=_STDERR_FD)
    logger.critical("watchdog: %s took more than %.0fs waiting for %s; dumping all threads and exiting "
                    "with %d so this replica group is rescheduled", section, timeout, what, EXIT_CODE_RESCHEDULE)
    sys.stderr.write(f"\n=== torchft_lite watchdog: {section} exceeded {timeout:.0f}s ({what}); thread stacks ===\n")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    logging.shutdown()
    os._exit(EXIT_CODE_RESCHEDULE)
