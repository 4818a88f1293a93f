"""StragglerBook: scores, smoothing, the flag after patience, recovery; and what a member's data may hold."""

from __future__ import annotations

import json

import pytest

from lighthouse.stragglers.scores import ComputeSample, StragglerBook, StragglerConfig, compute_sample_of


class Feed:
    """Quorums of the same members, each advertising one new sample per quorum."""

    def __init__(self, book: StragglerBook) -> None:
        self.book = book
        self.step = 0

    def quorum(self, times: dict[str, float | None]):
        self.step += 1
        return self.book.record({rid: None if ms is None else ComputeSample(ms, self.step)
                                 for rid, ms in times.items()})


def test_relative_score_is_compute_over_the_quorums_median_smoothed_over_three():
    feed = Feed(StragglerBook())
    feed.quorum({"a": 100.0, "b": 110.0, "x": 500.0})
    feed.quorum({"a": 100.0, "b": 110.0, "x": 500.0})
    assert feed.book.scores("x").relative is None  # two raw scores: not smoothed yet
    feed.quorum({"a": 100.0, "b": 110.0, "x": 550.0})
    x, a = feed.book.scores("x"), feed.book.scores("a")
    assert x.quorum_median_ms == 110.0
    assert x.relative == pytest.approx(500 / 110)  # median of 500/110, 500/110, 550/110
    assert a.relative == pytest.approx(100 / 110)
    assert x.compute_ms == 550.0 and x.compute_step == 3 and x.samples == 3


def test_a_slowdown_is_flagged_after_patience_and_one_spike_never_is():
    feed = Feed(StragglerBook(StragglerConfig(threshold=2.0, patience=3)))
    for _ in range(4):
        assert feed.quorum({"a": 100.0, "b": 100.0, "x": 100.0}) == []
    # One spike (a heal, a GC pause): the median of three ignores it, whatever its size.
    assert feed.quorum({"a": 100.0, "b": 100.0, "x": 100_000.0}) == []
    assert feed.book.scores("x").relative == pytest.approx(1.0)
    for _ in range(3):
        assert feed.quorum({"a": 100.0, "b": 100.0, "x": 100.0}) == []
    # From now on x is 5x slower: smoothed above 2 from its 2nd slow sample, flagged at the 4th (patience + 1).
    delays = []
    for n in range(1, 10):
        changes = feed.quorum({"a": 100.0, "b": 100.0, "x": 500.0})
        if changes:
            delays.append(n)
            assert [(c.scores.replica_id, c.flagged) for c in changes] == [("x", True)]
            assert changes[0].scores.relative == pytest.approx(5.0)
            assert changes[0].scores.quorum_median_ms == 100.0
    assert delays == [4]
    assert feed.book.is_flagged("x") and not feed.book.is_flagged("a")
    assert list(feed.book.flagged()) == ["x"]


def test_two_slow_quorums_in_a_row_are_not_enough_with_patience_three():
    feed = Feed(StragglerBook())
    for _ in range(3):
        feed.quorum({"a": 100.0, "b": 100.0, "x": 100.0})
    for ms in (500.0, 500.0, 100.0, 100.0, 100.0, 500.0, 500.0, 100.0):
        assert feed.quorum({"a": 100.0, "b": 100.0, "x": ms}) == []
    assert not feed.book.is_flagged("x")


def test_a_flagged_group_recovers_once_its_smoothed_score_is_back_at_or_below_the_threshold():
    feed = Feed(StragglerBook(StragglerConfig(patience=2)))
    for _ in range(5):
        feed.quorum({"a": 100.0, "b": 100.0, "x": 400.0})
    assert feed.book.is_flagged("x")
    assert feed.quorum({"a": 100.0, "b": 100.0, "x": 100.0}) == []  # median(4, 4, 1): still slow
    changes = feed.quorum({"a": 100.0, "b": 100.0, "x": 100.0})
    assert [(c.scores.replica_id, c.flagged) for c in changes] == [("x", False)]
    assert changes[0].scores.slow_streak == 0 and not feed.book.is_flagged("x")


def test_individual_score_compares_with_its_own_history_and_a_whole_job_slowdown_flags_nobody():
    feed = Feed(StragglerBook(StragglerConfig(warmup=5)))
    for _ in range(5):
        feed.quorum({"a": 100.0, "b": 100.0, "c": 100.0})
    assert feed.book.scores("a").individual is None and feed.book.scores("a").own_median_ms is None
    for _ in range(6):  # everyone 5x slower: a bigger batch, a slow filesystem
        assert feed.quorum({"a": 500.0, "b": 500.0, "c": 500.0}) == []
    a = feed.book.scores("a")
    assert a.individual == pytest.approx(5.0)  # 500 against a median of 100 (the history's first 5 samples win)
    assert a.relative == pytest.approx(1.0)
    assert not any(feed.book.is_flagged(rid) for rid in "abc")


def test_missing_repeated_and_lonely_samples_score_nobody():
    book = StragglerBook()
    assert book.record({"a": None, "b": None}) == []
    assert book.scores("a") is None and len(book) == 0
    same = ComputeSample(100.0, 7)
    book.record({"a": same, "b": ComputeSample(100.0, 7)})
    book.record({"a": same, "b": ComputeSample(100.0, 7)})  # a retried request or a re-issued quorum
    assert book.scores("a").samples == 1
    # Alone in its quorum: nothing to compare with.
    book.record({"a": ComputeSample(100.0, 8)})
    assert book.scores("a").quorum_median_ms is None and book.scores("a").samples == 2
    # The same step measured again (a step that did not commit) is a new sample.
    book.record({"a": ComputeSample(90.0, 8), "b": ComputeSample(95.0, 8)})
    assert book.scores("a").samples == 3


def test_sub_millisecond_times_are_noise():
    feed = Feed(StragglerBook(StragglerConfig(patience=1)))
    for _ in range(6):
        assert feed.quorum({"a": 0.1, "b": 0.1, "x": 0.9}) == []
    assert feed.book.scores("x").relative == pytest.approx(0.9)  # against the 1 ms floor, not 0.1 ms


def test_forget_drops_a_group_and_readmitted_judges_it_afresh():
    feed = Feed(StragglerBook(StragglerConfig(patience=1)))
    for _ in range(4):
        feed.quorum({"a": 100.0, "b": 100.0, "x": 500.0})
    assert feed.book.is_flagged("x") and feed.book.calm_streak("x") == 0
    feed.book.readmitted("x")
    x = feed.book.scores("x")
    assert not x.flagged and x.relative is None and x.slow_streak == 0 and x.samples == 4
    for _ in range(3):
        feed.quorum({"a": 100.0, "b": 100.0, "x": 100.0})
    assert feed.book.calm_streak("x") == 1  # a smoothed score from the 3rd sample back on
    feed.book.forget("x")
    assert feed.book.scores("x") is None and [g.replica_id for g in feed.book.all_scores()] == ["a", "b"]


@pytest.mark.parametrize("data", [
    "", "not json", "[1, 2]", "17", '{"other": 1}', '{"compute_ms": 5.0}', '{"compute_step": 3}',
    '{"resumed_from": 4, "heal_sources": ["http://x:1"]}', "{" * 100_000, '{"compute_ms": 1' + "0" * 5000 + "}",
])
def test_data_without_a_sample_is_no_sample_and_no_problem(data):
    assert compute_sample_of(data) == (None, None)


@pytest.mark.parametrize("ms, step", [
    ("5", 1), (True, 1), (None, 1), ([5], 1), ({"a": 1}, 1), (-1.0, 1), (1e7 + 1, 1), (float("nan"), 1),
    (float("inf"), 1), (-float("inf"), 1), (5.0, -1), (5.0, 1.5), (5.0, "3"), (5.0, False), (5.0, 2**63), (5.0, None),
])
def test_garbage_values_are_refused_with_a_reason_never_raised(ms, step):
    sample, problem = compute_sample_of(json.dumps({"compute_ms": ms, "compute_step": step}))
    assert sample is None
    assert problem is not None and ("compute_ms" in problem or "compute_step" in problem)


def test_a_huge_garbage_value_is_shortened_in_the_reason():
    _, problem = compute_sample_of(json.dumps({"compute_ms": "x" * 10_000, "compute_step": 1}))
    assert len(problem) < 200


def test_valid_samples():
    assert compute_sample_of('{"compute_ms": 12.5, "compute_step": 40, "resumed_from": 3}') == (
        ComputeSample(12.5, 40), None)
    assert compute_sample_of('{"compute_ms": 0, "compute_step": 0}') == (ComputeSample(0.0, 0), None)
    assert compute_sample_of(json.dumps({"compute_ms": 1e7, "compute_step": 2**63 - 1}))[0] is not None


@pytest.mark.parametrize("kwargs", [
    dict(threshold=1.0), dict(threshold=float("nan")), dict(threshold="2"), dict(patience=0), dict(patience=2.0),
    dict(patience=True), dict(history=3, warmup=5), dict(floor_ms=0.0),
])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="straggler"):
        StragglerConfig(**kwargs)
