"""The bounded history: a ring of samples and a list of markers, in memory that does not grow."""

import math
import tracemalloc

import pytest

from lighthouse.history import (
    CAPACITY, MAX_ID, MAX_MARKERS, MAX_TEXT, SAMPLE_BYTES, History, Marker, Sample, memory_bound,
)


def sample(t: float, step: int = 0, state: str = "training", rate: float | None = 1.0) -> Sample:
    return Sample(t, step, rate, 1, 2, 2, 0, state)


def test_the_default_covers_six_hours_in_under_four_mib():
    assert CAPACITY * 1.0 >= 6 * 3600  # one sample a second at most
    assert SAMPLE_BYTES == 37
    assert memory_bound() < 4 * 2**20
    assert CAPACITY * SAMPLE_BYTES < 2**20


def test_a_full_history_with_the_largest_markers_stays_within_its_stated_bound():
    widest = chr(0x10FFFF)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        history = History()
        after_start = tracemalloc.get_traced_memory()[0] - before
        sizes = []
        for rounds in range(2):
            for i in range(rounds * CAPACITY, (rounds + 1) * CAPACITY):
                history.add_sample(sample(float(i), 10**12 + i))
            for i in range(MAX_MARKERS):
                n = rounds * MAX_MARKERS + i
                history.add_marker(Marker(float(n), "heal", widest * (2 * MAX_TEXT) + str(n),
                                          widest * (2 * MAX_ID) + str(n), 1.5 + n, 10**12 + n))
            sizes.append(tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()
    assert after_start >= CAPACITY * SAMPLE_BYTES  # the ring is allocated up front
    assert sizes[0] <= memory_bound(), f"{sizes[0]} bytes > the stated bound {memory_bound()}"
    assert abs(sizes[1] - sizes[0]) < 64 * 1024  # full: more of everything takes no more memory
    assert len(history) == CAPACITY and len(history.markers()) == MAX_MARKERS
    marker = history.markers()[-1]
    assert len(marker.text) == MAX_TEXT and marker.text.endswith("...") and len(marker.replica_id) == MAX_ID


def test_the_ring_keeps_the_newest_samples_in_order():
    history = History(capacity=4)
    for t in range(10):
        history.add_sample(sample(float(t), t, rate=None if t == 3 else 2.0))
    kept = list(history.samples())
    assert [n for n, _ in kept] == [6, 7, 8, 9]
    assert [s.t for _, s in kept] == [6.0, 7.0, 8.0, 9.0]
    assert history.sample_count == 10 and len(history) == 4
    assert [s.t for _, s in history.samples(after=7)] == [8.0, 9.0]
    assert [s.t for _, s in history.samples(since=8.5)] == [9.0]
    wrapped = history.to_json(now=9.0, wall_now=9.0)  # the ring's last four, across its end
    assert wrapped["samples"]["step"] == [6, 7, 8, 9] and wrapped["samples"]["steps_per_s"][-1] == 2.0
    assert history.to_json(9.0, 9.0, samples_after=7)["samples"]["t"] == [8.0, 9.0]
    assert history.to_json(9.0, 9.0, seconds=2.5)["samples"]["t"] == [7.0, 8.0, 9.0]
    history = History(capacity=4)
    history.add_sample(sample(0.0, rate=None))
    assert next(history.samples())[1].steps_per_s is None


def test_markers_keep_the_newest_and_spans_count_until_they_end():
    history = History(max_markers=3)
    for t in range(5):
        history.add_marker(Marker(float(t), "gone", f"g{t}"))
    assert [m.text for m in history.markers()] == ["g2", "g3", "g4"]
    assert [m.number for m in history.markers(after=3)] == [4]
    history.add_marker(Marker(1.0, "stall", "long", duration=10.0))
    assert [m.text for m in history.markers(since=9.0)] == ["long"]  # began at 1 s, ended at 11 s


def test_json_gives_wall_clock_times_and_cursors_for_the_next_call():
    history = History(capacity=8)
    for t in range(3):
        history.add_sample(sample(100.0 + t, t, rate=None if t == 0 else 1.0))
    history.add_marker(Marker(101.5, "gone", "b gone", "b:1"))
    first = history.to_json(now=103.0, wall_now=1_000_003.0)
    assert first["samples"]["t"] == [1_000_000.0, 1_000_001.0, 1_000_002.0]
    assert first["samples"]["steps_per_s"] == [None, 1.0, 1.0]
    assert first["samples"]["state"] == ["training"] * 3
    assert first["markers"] == [{"number": 0, "t": 1_000_001.5, "kind": "gone", "text": "b gone", "replica_id": "b:1",
                                 "duration_s": None, "steps": None}]
    assert (first["samples_after"], first["markers_after"]) == (2, 0)
    history.add_sample(sample(103.0, 3))
    again = history.to_json(103.5, 1_000_003.5, samples_after=2, markers_after=0)
    assert again["samples"]["step"] == [3] and again["markers"] == []
    assert (again["samples_after"], again["markers_after"]) == (3, 0)
    recent = history.to_json(103.5, 1_000_003.5, seconds=1.0)
    assert recent["samples"]["step"] == [3] and recent["samples_after"] == 3
    assert not any(isinstance(v, float) and math.isnan(v) for v in again["samples"]["steps_per_s"])


def test_bad_values_are_refused_with_clear_errors():
    with pytest.raises(ValueError, match="capacity"):
        History(capacity=1)
    with pytest.raises(ValueError, match="max_markers"):
        History(max_markers=0)
    with pytest.raises(ValueError, match="state must be one of"):
        Sample(0.0, 0, None, 0, 0, 0, 0, "sleeping")
    with pytest.raises(ValueError, match="kind must be one of"):
        Marker(0.0, "party", "")
    history = History(capacity=4)
    history.add_sample(sample(5.0))
    with pytest.raises(ValueError, match="time order"):
        history.add_sample(sample(4.0))
