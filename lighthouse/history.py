"""The job's recent past as the lighthouse saw it, in fixed memory: per-second samples and markers.

Plain data and a container; what goes in is decided by :mod:`lighthouse.timeline`.

* **Samples**: a ring of ``capacity`` samples, one per second at most (the
  feeder folds what it sees within a second into one), in preallocated typed
  arrays: :data:`SAMPLE_BYTES` bytes a sample, whatever happens. The default,
  :data:`CAPACITY` = 21,600, covers at least the last 6 hours.
* **Markers**: the newest :data:`MAX_MARKERS` things that happened (a group
  gone or back, a heal, a stall, a new epoch, a rewind, an eviction, a
  lighthouse restart), each with one human sentence. Texts are cut to
  :data:`MAX_TEXT` characters and replica ids to :data:`MAX_ID`, so a marker
  takes a bounded size too.

:func:`memory_bound` states the whole bound in bytes (under 4 MiB by default,
about 0.8 MiB of it samples); a test fills a history with worst-case markers
and checks it. Times are the caller's monotonic seconds; :meth:`History.to_json`
turns them into wall-clock seconds at the edge.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Iterator

__all__ = ["CAPACITY", "History", "KINDS", "MAX_MARKERS", "Marker", "SAMPLE_BYTES", "STATES", "Sample",
           "memory_bound"]

SAMPLE_INTERVAL = 1.0
"""Seconds: the feeder keeps at most one sample a second."""
CAPACITY = 6 * 3600
"""Samples kept: at one a second at most, the last 6 hours at least."""
MAX_MARKERS = 1024
"""Markers kept (the newest)."""
MAX_TEXT = 300
"""Characters of a marker's sentence kept (longer ones end in '...')."""
MAX_ID = 160
"""Characters of a marker's replica id kept."""

STATES = ("idle", "waiting", "training", "healing", "stalled", "stopped")
"""What the job was doing, as :mod:`lighthouse.timeline` tells it (a sample keeps the index)."""
KINDS = ("gone", "back", "joined", "heal", "heal_failed", "stall", "epoch", "rewind", "evicted", "readmitted",
         "restart")
"""Marker kinds. ``heal`` and ``stall`` are spans (``t`` is their start, ``duration`` their length)."""

# name, array typecode: one preallocated array per field of Sample
_COLUMNS = (("t", "d"), ("step", "q"), ("steps_per_s", "f"), ("quorums", "i"), ("quorum_size", "i"),
            ("healthy", "i"), ("participants", "i"), ("state", "b"))
SAMPLE_BYTES = sum(array(code).itemsize for _, code in _COLUMNS)
"""Bytes one sample takes in the ring (37)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One second of the job (the last one, when several fell into it: see :mod:`lighthouse.timeline`)."""

    t: float
    """Monotonic time the second ended."""
    step: int
    """The highest step of the last quorum issued by then (committed steps of the job)."""
    steps_per_s: float | None
    """Steps per second since the previous sample; None for the first and across a new epoch."""
    quorums: int
    """Quorums issued within the second."""
    quorum_size: int
    """Members of the smallest quorum issued within it (of the last quorum, when none was)."""
    healthy: int
    """Fewest replicas with a live heartbeat seen within it."""
    participants: int
    """Most replicas waiting in a Quorum call seen within it."""
    state: str
    """What the job was doing at its end: one of :data:`STATES`."""

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {self.state!r}")


@dataclass(frozen=True, slots=True)
class Marker:
    """Something that happened, with one human sentence for the hover and the JSON."""

    t: float
    """Monotonic time it happened; a span's start."""
    kind: str
    """One of :data:`KINDS`."""
    text: str
    replica_id: str = ""
    duration: float | None = None
    """A span's length in seconds (``heal``, ``stall``)."""
    steps: int | None = None
    """Steps involved: how far behind a healed group was; how far a new epoch or a rewind went back."""
    number: int = -1
    """Its place among every marker this history was given (set by :meth:`History.add_marker`)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def memory_bound(capacity: int = CAPACITY, max_markers: int = MAX_MARKERS) -> int:
    """The most bytes a :class:`History` of this size holds: its ring, and its markers at their largest
    (texts and ids of the widest characters at their longest, every number a separate object)."""
    widest = chr(0x10FFFF)
    marker = Marker(0.0, "heal", widest * MAX_TEXT, widest * MAX_ID, 1.5, 10**12, 10**12)
    per_marker = (sys.getsizeof(marker) + sys.getsizeof(marker.text) + sys.getsizeof(marker.replica_id)
                  + sys.getsizeof(max(KINDS, key=len)) + 2 * sys.getsizeof(1.5) + 2 * sys.getsizeof(10**12))
    deque_slot = 9  # a pointer in one of the deque's blocks of 64, plus the blocks' links
    overhead = 64 * 1024  # the History object, its deque and arrays' headers, allocator rounding
    return capacity * SAMPLE_BYTES + max_markers * (per_marker + deque_slot) + overhead


class History:
    """The ring of samples and the list of markers (see the module docstring). Not thread-safe: one feeder."""

    def __init__(self, capacity: int = CAPACITY, max_markers: int = MAX_MARKERS) -> None:
        if not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"capacity must be an integer >= 2, got {capacity!r}")
        if not isinstance(max_markers, int) or max_markers < 1:
            raise ValueError(f"max_markers must be an integer >= 1, got {max_markers!r}")
        self.capacity = capacity
        self.max_markers = max_markers
        self._columns = {name: array(code, bytes(array(code).itemsize * capacity)) for name, code in _COLUMNS}
        self._samples = 0  # every sample ever added; the next one's number
        self._markers: deque[Marker] = deque(maxlen=max_markers)
        self._marker_count = 0

    # ------------------------------------------------------------ input

    def add_sample(self, sample: Sample) -> None:
        """Keep ``sample``; the oldest goes once ``capacity`` are kept. Samples come in time order."""
        columns = self._columns
        if self._samples and sample.t < columns["t"][(self._samples - 1) % self.capacity]:
            raise ValueError(f"samples must come in time order: {sample.t} is before the last one")
        i = self._samples % self.capacity
        columns["t"][i] = sample.t
        columns["step"][i] = sample.step
        columns["steps_per_s"][i] = math.nan if sample.steps_per_s is None else sample.steps_per_s
        columns["quorums"][i] = sample.quorums
        columns["quorum_size"][i] = sample.quorum_size
        columns["healthy"][i] = sample.healthy
        columns["participants"][i] = sample.participants
        columns["state"][i] = STATES.index(sample.state)
        self._samples += 1

    def add_marker(self, marker: Marker) -> Marker:
        """Keep ``marker`` (its text and id cut to size, numbered); the oldest goes once ``max_markers`` are kept."""
        kept = Marker(marker.t, marker.kind, _clip(marker.text, MAX_TEXT), _clip(marker.replica_id, MAX_ID),
                      marker.duration, marker.steps, self._marker_count)
        self._markers.append(kept)
        self._marker_count += 1
        return kept

    # ------------------------------------------------------------ views

    @property
    def sample_count(self) -> int:
        """Samples ever added (the ring keeps the last ``capacity``)."""
        return self._samples

    @property
    def marker_count(self) -> int:
        """Markers ever added (the last ``max_markers`` are kept)."""
        return self._marker_count

    def __len__(self) -> int:
        """Samples kept."""
        return min(self._samples, self.capacity)

    def samples(self, after: int = -1, since: float = -math.inf) -> Iterator[tuple[int, Sample]]:
        """(number, sample) of the kept samples numbered above ``after`` and taken at or after ``since``,
        oldest first."""
        columns = self._columns
        for number in self._numbers(after, since):
            i = number % self.capacity
            rate = columns["steps_per_s"][i]
            yield number, Sample(columns["t"][i], columns["step"][i], None if math.isnan(rate) else rate,
                                 columns["quorums"][i], columns["quorum_size"][i], columns["healthy"][i],
                                 columns["participants"][i], STATES[columns["state"][i]])

    def _numbers(self, after: int, since: float) -> range:
        """The numbers of the kept samples above ``after`` taken at or after ``since`` (a binary search: the
        ring is in time order)."""
        t, capacity = self._columns["t"], self.capacity
        low, high = max(self._samples - capacity, after + 1, 0), self._samples
        while low < high:
            middle = (low + high) // 2
            if t[middle % capacity] < since:
                low = middle + 1
            else:
                high = middle
        return range(low, self._samples)

    def _column(self, name: str, numbers: range) -> list:
        """One column's values for ``numbers`` (consecutive, kept), as a list: one or two slices of the ring."""
        column, start = self._columns[name], numbers.start % self.capacity
        end = start + len(numbers)
        if end <= self.capacity:
            return column[start:end].tolist()
        return column[start:].tolist() + column[:end - self.capacity].tolist()

    def markers(self, after: int = -1, since: float = -math.inf) -> list[Marker]:
        """Kept markers numbered above ``after`` that ended at or after ``since`` (spans: their end), oldest first."""
        return [m for m in self._markers
                if m.number > after and m.t + (m.duration or 0.0) >= since]

    def to_json(self, now: float, wall_now: float, *, samples_after: int = -1, markers_after: int = -1,
                seconds: float | None = None) -> dict:
        """The history as plain JSON-able data for ``/api/history``: samples (columns) and markers newer than
        the cursors and, with ``seconds``, within that many seconds before ``now``. Times are wall-clock
        seconds (``wall_now`` is the wall clock at ``now``)."""
        since = -math.inf if seconds is None else now - seconds
        offset = wall_now - now
        numbers = self._numbers(samples_after, since)
        columns = {name: self._column(name, numbers) for name, _ in _COLUMNS}  # slices: 6 h in ~20 ms on 2 cores
        columns["t"] = [round(t + offset, 3) for t in columns["t"]]
        columns["steps_per_s"] = [None if math.isnan(v) else round(v, 3) for v in columns["steps_per_s"]]
        columns["state"] = [STATES[code] for code in columns["state"]]
        markers = self.markers(markers_after, since)
        return {
            "now": round(wall_now, 3),
            "interval_s": SAMPLE_INTERVAL,
            "capacity": self.capacity,
            "max_markers": self.max_markers,
            "samples": columns,
            "markers": [{"number": m.number, "t": round(m.t + offset, 3), "kind": m.kind, "text": m.text,
                         "replica_id": m.replica_id, "duration_s": None if m.duration is None else round(m.duration, 3),
                         "steps": m.steps} for m in markers],
            # Cursors for the next call (?samples_after=&markers_after=): only what is newer comes back.
            "samples_after": max(samples_after, self._samples - 1),
            "markers_after": max(markers_after, self._marker_count - 1),
        }
