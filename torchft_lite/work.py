"""Futures and Work objects the Manager hands to training code.

``Manager.allreduce`` returns a :class:`ManagedWork`: its future never raises
into the training loop. A failure (or a timeout) is reported to the Manager,
which then votes not to commit the step, and the future resolves with a
default value (the input tensor) so backward can finish.

``_DummyWork`` (torchft's name) is a c10d ``Work`` already done with a value:
what a collective with nothing to exchange returns.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Generic, TypeVar

import torch
import torch.distributed as dist

__all__ = ["ManagedWork", "DoneWork", "guard_future"]

T = TypeVar("T")


def completed_future(value: T) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class _DummyWork(dist.Work):
    """A c10d ``Work`` that is already done with ``result``.

    A real ``dist.Work``, so torch (DDP's reducer, functional collectives) can
    take it; :class:`torchft_lite.process_group.CompletedWork` is its public name.
    """

    def __init__(self, result: object = None) -> None:
        super().__init__()
        self._result = result
        self._future: torch.futures.Future = completed_future(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return True

    def exception(self) -> None:
        return None


def guard_future(
    fut: torch.futures.Future,
    default: T,
    on_error: Callable[[BaseException], None],
    timeout: float | None,
    what: str,
    schedule_timeout: Callable[[float, Callable[[], None]], Callable[[], None]] | None = None,
) -> torch.futures.Future:
    """A future that resolves with ``fut``'s value, or ``default`` on error or timeout.

    ``on_error`` is called once with the error (a ``TimeoutError`` naming
    ``what`` when ``timeout`` seconds pass first). ``schedule_timeout(delay,
    fn)`` arranges for ``fn`` to run after ``delay`` seconds and returns a
    cancel function (the Manager passes its control-plane loop; without it a
    ``threading.Timer`` is used). The timer is cancelled once ``fut`` settles.
    """
    out: torch.futures.Future = torch.futures.Future()
    lock = threading.Lock()
    settled = False
    cancel_timer: Callable[[], None] | None = None

    def settle(value, error: BaseException | None) -> None:
        nonlocal settled
        with lock:
            if settled:
                return
            settled = True
        if cancel_timer is not None:
            cancel_timer()  # don't keep the tensors alive until the timeout
        if error is not None:
            on_error(error)
            out.set_result(default)
        else:
            out.set_result(value)

    def done(f: torch.futures.Future) -> None:
        try:
            value = f.value()
        except Exception as exc:  # the error is recorded by the Manager, not lost
            settle(None, exc)
            return
        settle(value, None)

    if timeout is not None:
        def expire() -> None:
            settle(None, TimeoutError(f"{what} did not finish within {timeout:.1f}s"))

        if schedule_timeout is not None:
            cancel_timer = schedule_timeout(timeout, expire)
        else:
            timer = threading.Timer(timeout, expire)
            timer.daemon = True
            timer.start()
            cancel_timer = timer.cancel
    fut.add_done_callback(done)
    return out


class ManagedWork(Generic[T]):
    """A ``Work``-like handle around a future that never raises."""

    def __init__(self, fut: torch.futures.Future) -> None:
        self._fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the future settles (True), or until ``timeout`` passes first (False).

        Never raises: the future itself is bounded by the Manager's timeout and
        resolves with a default on failure. After a False the collective goes on
        and its future still settles; the Manager waits for it before the vote.
        """
        if timeout is None:
            self._fut.wait()
            return True
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        settled = threading.Event()
        self._fut.add_done_callback(lambda _: settled.set())  # runs at once when already done
        return settled.wait(max(seconds, 0.0))

    def is_completed(self) -> bool:
        return self._fut.done()

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def result(self) -> T:
        return self._fut.wait()


class DoneWork(ManagedWork[T]):
    """An already-finished work holding ``value`` (used when the step is already errored)."""

    def __init__(self, value: T) -> None:
        super().__init__(completed_future(value))


class _ManagedWork(dist.Work):
    """torchft's name: a process group's ``work`` whose failure goes to ``manager``, never to the caller.

    ``wait()`` reports an error with ``manager.report_error`` and returns False
    (the step will not commit); the future yields ``value`` whatever happened.
    ``Manager.allreduce`` returns a :class:`ManagedWork`, bounded by the
    Manager's timeout; this class is for code that wraps its own collectives,
    as torchft's internals and tests do.
    """

    def __init__(self, manager: Any, work: dist.Work, value: object) -> None:
        super().__init__()
        self._manager, self._work, self._value = manager, work, value

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
        except Exception as exc:
            self._manager.report_error(exc)
            return False
        return True

    def get_future(self) -> torch.futures.Future:
        def settle(fut: torch.futures.Future) -> object:
            try:
                fut.value()
            except Exception as exc:
                self._manager.report_error(exc)
            return self._value

        return self._work.get_future().then(settle)
