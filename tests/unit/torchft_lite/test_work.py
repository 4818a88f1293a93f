"""guard_future: errors and timeouts become the default value, reported once."""

import threading
from datetime import timedelta

import torch

from torchft_lite.work import DoneWork, ManagedWork, guard_future


def test_value_passes_through_and_the_timer_is_cancelled():
    fut, errors, cancelled = torch.futures.Future(), [], []

    def schedule(delay, fn):
        return lambda: cancelled.append(delay)

    out = guard_future(fut, "default", errors.append, 5.0, "x", schedule_timeout=schedule)
    fut.set_result("value")
    assert out.wait() == "value" and errors == [] and cancelled == [5.0]


def test_error_yields_the_default_and_is_reported_once():
    fut, errors = torch.futures.Future(), []
    out = guard_future(fut, "default", errors.append, None, "x")
    fut.set_exception(RuntimeError("peer died"))
    assert out.wait() == "default"
    assert [str(e) for e in errors] == ["peer died"]


def test_timeout_yields_the_default_and_a_late_result_is_ignored():
    fut, errors, timers = torch.futures.Future(), [], []

    def schedule(delay, fn):
        timers.append(fn)
        return lambda: None

    out = guard_future(fut, "default", errors.append, 1.5, "the allreduce", schedule_timeout=schedule)
    timers[0]()  # the timeout fires first
    fut.set_result("late")
    assert out.wait() == "default"
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError)
    assert "the allreduce did not complete within 1.5s" in str(errors[0])


def test_threading_timer_fallback_fires():
    fut, errors = torch.futures.Future(), []
    done = threading.Event()
    out = guard_future(fut, 0, lambda e: (errors.append(e), done.set()), 0.01, "x")
    assert done.wait(30) and out.wait() == 0


def test_work_wrappers():
    assert DoneWork(3).result() == 3 and DoneWork(3).is_completed()
    fut = torch.futures.Future()
    work = ManagedWork(fut)
    assert not work.is_completed()
    fut.set_result(4)
    assert work.wait() and work.result() == 4 and work.get_future() is fut


def test_managed_work_wait_honours_its_timeout():
    fut = torch.futures.Future()
    work = ManagedWork(fut)
    answers: list[bool] = []
    waiter = threading.Thread(target=lambda: answers.append(work.wait(timedelta(seconds=0.05))), daemon=True)
    try:
        waiter.start()
        waiter.join(60)
        assert answers == [False], "wait(timeout) blocked past its timeout on a future that never settles"
        assert not work.is_completed()
    finally:
        fut.set_result(5)  # lets a waiter that ignored its timeout finish
    assert work.wait(timedelta(seconds=30)) is True and work.wait(timedelta(0)) is True
    assert work.result() == 5
