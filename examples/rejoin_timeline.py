"""When a training process reached each stage of its start, up to its first committed step.

``examples/train_ddp.py --timeline FILE`` keeps one :class:`Timeline` and
appends it to FILE (one JSON line, ``time.time()`` seconds) when the process
commits its first step. ``benchmarks/recovery_bench.py`` turns the line of a
restarted process into the rejoin breakdown, for torchft_lite and torchft
alike, so the events are only what both libraries let a training script see:

* marks the script sets itself (``script_start`` before ``import torch``,
  ``torch_imported``, ``library_imported``, ``manager_begin``,
  ``manager_constructed``, ``checkpoint_resumed`` with durable checkpoints, ``first_commit``) and ``process_start``, read
  from ``/proc`` (the interpreter's own start-up is before any line runs);
* the library's INFO log lines that say the first quorum was answered, the
  process group configured, the heal begun and applied (:data:`LOG_EVENTS`;
  the record's own creation time, so log formatting costs nothing here);
* for torchft_lite, the first step's ``StepReport`` (a step listener).

Imports neither torch nor the library: it runs before them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, is_dataclass
from typing import Any

__all__ = ["LOG_EVENTS", "Timeline", "process_start_time"]

LOG_EVENTS: dict[str, list[tuple[str, str, str]]] = {
    # event: [(library, logger name, regular expression searched in the message)]
    "quorum_answered": [("torchft_lite", "torchft_lite.group_server.server", r"\] quorum \d+ at step \d+:"),
                        ("torchft", "torchft.manager", r"reconfiguring for quorum_id")],
    "configured": [("torchft_lite", "torchft_lite.manager", r"\] quorum \d+: reconfigured as replica"),
                   ("torchft", "torchft.manager", r"resetting fr recording for quorum id")],
    "heal_started": [("torchft_lite", "torchft_lite.manager", r"\] healing from "),
                     ("torchft", "torchft.manager", r"healing required")],
    "heal_applied": [("torchft_lite", "torchft_lite.manager", r"\] healed: "),
                     ("torchft", "torchft.manager", r"Loaded state dict")],
}
"""The first matching record of each event wins. torchft_lite logs "quorum N at step S" on the ManagerServer
when the lighthouse answers and "quorum N: reconfigured" after the process group's configure; torchft logs
"reconfiguring" before its configure, "resetting fr recording" after it and "healing required" as the heal's
first line."""


def process_start_time() -> float | None:
    """This process's start (fork/exec) in ``time.time()`` seconds, from ``/proc`` (clock-tick precision);
    None where there is no ``/proc``."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError):
        return None
    return now - uptime + started_after_boot


class _LogEvents(logging.Handler):
    """Notes the creation time of the first log record of each of :data:`LOG_EVENTS`."""

    def __init__(self, library: str, events: dict[str, float]) -> None:
        super().__init__(logging.INFO)
        self._wanted = [(event, name, re.compile(pattern)) for event, rules in LOG_EVENTS.items()
                        for lib, name, pattern in rules if lib == library]
        self._events = events

    def emit(self, record: logging.LogRecord) -> None:
        pending = [(e, p) for e, name, p in self._wanted if e not in self._events and record.name == name]
        if pending:
            message = record.getMessage()
            for event, pattern in pending:
                if pattern.search(message):
                    self._events[event] = record.created


class Timeline:
    """Marks, library log events and the first step's report of one process; written once."""

    def __init__(self, path: str | None, library: str, script_start: float) -> None:
        """``path``: the JSON-lines file to append to (None: a timeline that records nothing)."""
        self.path = path
        self.events: dict[str, float] = {}
        self.first_report: dict[str, Any] | None = None
        self._library = library
        self._written = False
        self._handler: _LogEvents | None = None
        if path is None:
            return
        start = process_start_time()
        if start is not None:
            self.events["process_start"] = start
        self.events["script_start"] = script_start
        self._handler = _LogEvents(library, self.events)
        logging.getLogger(library).addHandler(self._handler)  # the records of its modules propagate to it

    def mark(self, event: str, at: float | None = None) -> None:
        """Note ``event`` now, or ``at`` (``time.time()`` seconds); the first time only."""
        if self.path is not None and event not in self.events:
            self.events[event] = time.time() if at is None else at

    def step_finished(self, report: Any) -> None:
        """torchft_lite's step listener: keep the report of the first step that committed."""
        if self.first_report is None and getattr(report, "committed", False):
            self.first_report = asdict(report) if is_dataclass(report) else dict(vars(report))

    def first_commit(self, group: int, rank: int, step: int) -> None:
        """The process committed its first step: note it and append the timeline to the file."""
        if self.path is None or self._written:
            return
        self.mark("first_commit")
        self._written = True
        line = json.dumps({"group": group, "rank": rank, "pid": os.getpid(), "library": self._library,
                           "step": step, "events": self.events, "first_step": self.first_report})
        with open(self.path, "a") as f:  # one short line per process: an append lands whole
            f.write(line + "\n")
        self.close()

    def close(self) -> None:
        if self._handler is not None:
            logging.getLogger(self._library).removeHandler(self._handler)
            self._handler = None
