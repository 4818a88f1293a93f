"""guard_future: errors and timeouts become the default value, reported once. work_future and ManagedWork: a work
without a torch future of its own is completed by the first wait for its result."""

import threading
from datetime import timedelta
from typing import Any

import torch

from torchft_lite.work import DoneWork, ManagedWork, guard_future, work_future


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


class WaitOnlyWork:
    """A c10d-style work that has no future (``get_future`` raises, as c10d's "not implemented" does): it is done
    when ``wait()`` returns."""

    def __init__(self, result: Any = True, error: BaseException | None = None) -> None:
        self.result, self.error, self.waits, self.completed = result, error, [], False

    def get_future(self) -> Any:
        raise RuntimeError("ProcessGroup::getFuture not implemented")

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout: timedelta | None = None) -> Any:
        self.waits.append(timeout)
        if self.error is not None:
            raise self.error
        return self.result


def test_a_work_without_a_future_is_completed_by_the_first_wait_for_the_result():
    work, waits = WaitOnlyWork(), []
    fut = work_future(work, "tensors", waits)
    assert len(waits) == 1 and not fut.done()
    managed = ManagedWork(fut.then(lambda f: f.value() + " averaged"), waits, wait_seconds=7.0)
    assert not managed.is_completed()  # nothing waits on its own
    assert managed.wait() and managed.result() == "tensors averaged"
    assert work.waits == [timedelta(seconds=7.0)]  # once, bounded by the Manager's timeout
    assert managed.wait(timedelta(seconds=1)) and work.waits == [timedelta(seconds=7.0)]


def test_a_work_with_a_torch_future_is_not_waited_for():
    fut, waits = torch.futures.Future(), []

    class Work:
        def get_future(self):
            return fut

    assert work_future(Work(), None, waits) is fut and waits == []


def test_get_future_waits_first_so_ddp_gets_a_future_that_completes():
    work, waits = WaitOnlyWork(), []
    managed = ManagedWork(work_future(work, 5, waits), waits, wait_seconds=3.0)
    assert managed.get_future().done() and managed.get_future().value() == 5 and len(work.waits) == 1


def test_a_failed_or_timed_out_wait_fails_the_future_and_a_shorter_timeout_bounds_it():
    failing, waits = WaitOnlyWork(error=RuntimeError("peer gone")), []
    fut = work_future(failing, 1, waits)
    waits[0].run(2.0)
    assert _raises(fut, "peer gone") and failing.waits == [timedelta(seconds=2.0)]
    late, waits, errors = WaitOnlyWork(result=False), [], []
    managed = ManagedWork(guard_future(work_future(late, 1, waits), "default", errors.append, None, "x"), waits,
                          wait_seconds=30.0)
    assert managed.wait(timedelta(seconds=0.5)) and managed.result() == "default"
    assert late.waits == [timedelta(seconds=0.5)] and "did not complete within 0.5s" in str(errors[0])


def _raises(fut: torch.futures.Future, text: str) -> bool:
    try:
        fut.wait()
    except Exception as exc:
        return text in str(exc)
    return False


def test_a_work_without_a_future_counts_as_completed_once_it_says_so_without_being_waited_for():
    # What the member-gone watch asks of a step's works: did the collective finish? (It must not block.)
    work, waits = WaitOnlyWork(), []
    managed = ManagedWork(work_future(work, 1, waits), waits)
    assert not managed.is_completed()
    work.completed = True
    assert managed.is_completed() and work.waits == []

    class CannotSay(WaitOnlyWork):
        def is_completed(self) -> bool:
            raise RuntimeError("not implemented")

    waits = []
    assert not ManagedWork(work_future(CannotSay(), 1, waits), waits).is_completed()
