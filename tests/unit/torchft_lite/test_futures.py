"""torchft's futures API: timeouts for futures and code blocks on one timer thread, watched by a watchdog."""

import threading
from datetime import timedelta

import pytest
import torch
from torch.futures import Future

from torchft_lite import futures
from torchft_lite.errors import ConfigError
from torchft_lite.futures import context_timeout, future_timeout, future_wait, stream_timeout

WAIT = 30.0
SHORT = timedelta(milliseconds=10)
LONG = timedelta(seconds=WAIT)


@pytest.fixture
def manager():
    """A timer thread of the test's own, stopped afterwards."""
    own = futures._TimeoutManager()
    own._watchdog_interval = timedelta(seconds=WAIT)
    yield own
    own.shutdown()


def test_future_wait_returns_the_result_or_raises_its_error():
    done: Future = Future()
    done.set_result(1)
    assert future_wait(done, LONG) == 1
    failed: Future = Future()
    failed.set_exception(RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):
        future_wait(failed, LONG)


def test_future_wait_gives_up_naming_the_timeout():
    with pytest.raises(TimeoutError, match=r"future did not complete within 0:00:00.010000"):
        future_wait(Future(), SHORT)


def test_future_timeout_passes_the_outcome_through():
    source: Future = Future()
    timed = future_timeout(source, LONG)
    source.set_result("value")
    assert timed.wait() == "value"
    source = Future()
    timed = future_timeout(source, LONG)
    source.set_exception(ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        timed.wait()


def test_future_timeout_fails_a_future_that_is_never_done():
    timed = future_timeout(Future(), SHORT)
    with pytest.raises(TimeoutError, match="future did not complete within"):
        future_wait(timed, LONG)


def test_a_future_done_in_time_cancels_its_timer(manager):
    source: Future = Future()
    timed = manager.register(source, LONG)
    source.set_result(2)
    assert timed.wait() == 2
    assert all(timer.cancelled for timer in manager._heap)


def test_a_late_outcome_after_the_timeout_is_ignored(manager):
    source: Future = Future()
    timed = manager.register(source, SHORT)
    with pytest.raises(TimeoutError):
        future_wait(timed, LONG)
    source.set_result(3)  # must not try to complete the timed future twice
    with pytest.raises(TimeoutError):
        timed.wait()


def test_context_timeout_calls_back_when_the_block_overruns():
    fired = threading.Event()
    with context_timeout(fired.set, SHORT):
        assert fired.wait(WAIT)


def test_context_timeout_is_cancelled_when_the_block_exits_even_by_an_error(manager):
    fired = threading.Event()
    with pytest.raises(KeyError):
        with manager.context_timeout(fired.set, timedelta(milliseconds=200)):
            raise KeyError("left early")
    with manager.context_timeout(lambda: None, timedelta(milliseconds=400)):
        pass
    later = threading.Event()
    with manager.context_timeout(later.set, timedelta(milliseconds=300)):
        assert later.wait(WAIT)  # the timer thread ran past the first timer's due time
    assert not fired.is_set()


def test_timers_fire_in_due_order_and_a_failing_callback_stops_none(manager, caplog):
    order = []
    last = threading.Event()

    def broken():
        order.append("broken")
        raise RuntimeError("callback bug")

    manager.schedule(lambda: (order.append("third"), last.set()), timedelta(milliseconds=60))
    manager.schedule(broken, timedelta(milliseconds=20))
    manager.schedule(lambda: order.append("second"), timedelta(milliseconds=40))
    assert last.wait(WAIT)
    assert order == ["broken", "second", "third"]
    assert any("timeout callback failed" in message for message in caplog.messages)


def test_the_watchdog_exits_when_a_callback_blocks_the_timer_thread(manager, monkeypatch):
    exits = []
    exited = threading.Event()
    monkeypatch.setattr(futures.sys, "exit", lambda code: (exits.append(code), exited.set()))
    manager._watchdog_interval = timedelta(milliseconds=200)
    release = threading.Event()
    manager.schedule(lambda: release.wait(WAIT), SHORT)
    try:
        assert exited.wait(WAIT)
        assert exits == [1]
    finally:
        release.set()


def test_the_watchdog_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(futures.WATCHDOG_TIMEOUT_SEC, "7")
    assert futures._TimeoutManager()._watchdog_interval == timedelta(seconds=7)
    monkeypatch.delenv(futures.WATCHDOG_TIMEOUT_SEC)
    assert futures._TimeoutManager()._watchdog_interval == timedelta(seconds=30)
    monkeypatch.setenv(futures.WATCHDOG_TIMEOUT_SEC, "soon")
    with pytest.raises(ConfigError, match="TORCHFT_WATCHDOG_TIMEOUT_SEC"):
        futures._TimeoutManager()._watchdog_interval


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the behaviour without an accelerator")
def test_stream_timeout_without_an_accelerator_schedules_nothing(manager):
    manager.stream_timeout(lambda: pytest.fail("nothing was queued on a stream"), SHORT)
    assert manager._heap == [] and manager._thread is None
    stream_timeout(lambda: None, SHORT)  # the module function too
