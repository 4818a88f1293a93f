"""Timeouts for futures, code blocks and accelerator streams (torchft's ``futures`` module).

::

    fut = future_timeout(pg.allreduce([t]).get_future(), timedelta(seconds=30))   # fails with TimeoutError
    value = future_wait(fut, timedelta(seconds=30))                                # blocks at most 30 s
    with context_timeout(pg.abort, timedelta(seconds=30)):                         # abort if the block overruns
        pg.barrier().wait()
    stream_timeout(pg.abort, timedelta(seconds=30))         # abort if the current stream has not drained by then

Every timeout is a timer on one process-wide *timer thread*
(:class:`_TimeoutManager`), started on first use. Callbacks run on that
thread, one at a time, so they must return quickly (an abort, setting an
exception). Timers are kept off the control-plane event loop so that a slow
callback never delays a heartbeat. A watchdog thread checks that no callback
runs for longer than ``TORCHFT_WATCHDOG_TIMEOUT_SEC`` seconds (default 30):
one that does stalls every other timeout in the process, so the watchdog
ends the process (``sys.exit(1)``, then a hard exit when that is raised off
the main thread), as torchft's does, for the job to be restarted.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Generator, TypeVar

import torch
from torch.futures import Future

from torchft_lite.errors import ConfigError

__all__ = ["WATCHDOG_TIMEOUT_SEC", "context_timeout", "future_timeout", "future_wait", "stream_timeout"]

T = TypeVar("T")
logger = logging.getLogger(__name__)

WATCHDOG_TIMEOUT_SEC = "TORCHFT_WATCHDOG_TIMEOUT_SEC"
_DEFAULT_WATCHDOG_SECONDS = 30.0
_IDLE_WAKE = 1.0  # seconds the timer thread sleeps at most with nothing due (it still re-checks its heap)
_COMPACT_AT = 1024  # cancelled timers kept in the heap before it is rebuilt without them


def _watchdog_interval_from_env() -> timedelta:
    raw = os.environ.get(WATCHDOG_TIMEOUT_SEC)
    if raw is None or not raw.strip():
        return timedelta(seconds=_DEFAULT_WATCHDOG_SECONDS)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"{WATCHDOG_TIMEOUT_SEC} must be a positive number of seconds, got {raw!r}")
    return timedelta(seconds=seconds)


def _timeout_error(timeout: timedelta) -> TimeoutError:
    return TimeoutError(f"future did not complete within {timeout}")


@dataclass(order=True)
class _Timer:
    due: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)


class _TimeoutManager:
    """One timer thread (a heap of due times) plus the watchdog that checks it is not stuck."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._heap: list[_Timer] = []
        self._cancelled = 0
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._busy_since: float | None = None  # when the callback now running began (time.monotonic)
        self._stopping = False
        self._stopped = threading.Event()  # wakes the watchdog at shutdown
        self._interval: timedelta | None = None
        # Accelerator events, deleted on a caller's thread: destroying one can block while its queue is full.
        self._del_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    @property
    def _watchdog_interval(self) -> timedelta:
        """How long one callback may run before the watchdog ends the process (the environment's by default)."""
        if self._interval is None:
            self._interval = _watchdog_interval_from_env()
        return self._interval

    @_watchdog_interval.setter
    def _watchdog_interval(self, value: timedelta) -> None:
        self._interval = value

    # ------------------------------------------------------------ timers

    def schedule(self, callback: Callable[[], None], timeout: timedelta) -> _Timer:
        """Call ``callback`` on the timer thread after ``timeout`` unless the returned timer is cancelled first."""
        self._clear_del_queue()
        timer = _Timer(time.monotonic() + max(timeout.total_seconds(), 0.0), next(self._seq), callback)
        with self._changed:
            if self._thread is None or not self._thread.is_alive():
                self._start()
            heapq.heappush(self._heap, timer)
            self._changed.notify()
        return timer

    def cancel(self, timer: _Timer) -> None:
        """Make sure ``timer`` does not fire (a no-op once it has)."""
        with self._changed:
            if timer.cancelled:
                return
            timer.cancelled = True
            self._cancelled += 1
            if self._cancelled > _COMPACT_AT and 2 * self._cancelled > len(self._heap):
                self._heap = [t for t in self._heap if not t.cancelled]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def _start(self) -> None:
        self._stopping = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchft_lite-timeouts", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="torchft_lite-timeouts-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    def _next_due(self) -> _Timer | None:
        """The next timer to fire, popped, once due; None when stopping. Called holding the lock."""
        while not self._stopping:
            while self._heap and self._heap[0].cancelled:
                heapq.heappop(self._heap)
                self._cancelled -= 1
            now = time.monotonic()
            if self._heap and self._heap[0].due <= now:
                timer = heapq.heappop(self._heap)
                timer.cancelled = True  # fired: a later cancel() is a no-op
                return timer
            self._changed.wait(min(self._heap[0].due - now, _IDLE_WAKE) if self._heap else _IDLE_WAKE)
        return None

    def _run(self) -> None:
        while True:
            with self._changed:
                timer = self._next_due()
                if timer is None:
                    return
                self._busy_since = time.monotonic()
            try:
                timer.callback()
            except Exception:  # a callback's failure must not stop every other timeout of the process
                logger.exception("a timeout callback failed")
            finally:
                with self._changed:
                    self._busy_since = None

    def _watch(self) -> None:
        stopped = self._stopped
        while not stopped.is_set():
            interval = self._watchdog_interval.total_seconds()
            if stopped.wait(min(interval, _IDLE_WAKE)):
                return
            busy_since = self._busy_since
            if busy_since is not None and time.monotonic() - busy_since > interval:
                self._exit_stuck(time.monotonic() - busy_since)
                return

    @staticmethod
    def _exit_stuck(seconds: float) -> None:
        logger.critical("a timeout callback has blocked the timer thread for %.1fs (over %s): no other timeout "
                        "of this process can fire; exiting", seconds, WATCHDOG_TIMEOUT_SEC)
        try:
            sys.exit(1)
        except SystemExit:  # raised on this thread, it would only end the watchdog: end the process
            logging.shutdown()
            os._exit(1)

    def shutdown(self) -> None:
        """Stop the timer and watchdog threads (pending timers never fire); the next timer starts them again."""
        with self._changed:
            self._stopping = True
            self._stopped.set()
            self._heap.clear()
            self._cancelled = 0
            self._changed.notify_all()
            threads = [t for t in (self._thread, self._watchdog) if t is not None]
            self._thread = self._watchdog = None
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(self._watchdog_interval.total_seconds() + _IDLE_WAKE)

    # ------------------------------------------------------------ the public operations

    def register(self, fut: Future[T], timeout: timedelta) -> Future[T]:
        """A future with ``fut``'s outcome, or ``TimeoutError`` when ``fut`` is not done within ``timeout``."""
        timed: Future[T] = Future()
        settled = threading.Lock()
        done = [False]

        def settle(value: Any = None, error: BaseException | None = None) -> None:
            with settled:  # the first of the outcome and the timer wins; the other is dropped
                if done[0]:
                    return
                done[0] = True
            if error is not None:
                timed.set_exception(error)
            else:
                timed.set_result(value)

        timer = self.schedule(lambda: settle(error=_timeout_error(timeout)), timeout)
        stream = torch.accelerator.current_stream() if torch.accelerator.is_available() else None

        def finished(source: Future[T]) -> None:
            self.cancel(timer)
            with stream if stream is not None else contextlib.nullcontext():  # the caller's stream, for wait()
                try:
                    value = source.wait()
                except Exception as exc:
                    settle(error=exc)
                else:
                    settle(value)

        fut.add_done_callback(finished)
        return timed

    def stream_timeout(self, callback: Callable[[], None], timeout: timedelta) -> None:
        if not torch.accelerator.is_available():
            return  # no stream: nothing queued can be late
        event = torch.Event()
        event.record()

        def check() -> None:
            try:
                if not event.query():
                    callback()
            finally:
                self._del_queue.put(event)  # destroyed by the next caller, never on the timer thread

        self.schedule(check, timeout)

    @contextlib.contextmanager
    def context_timeout(self, callback: Callable[[], None], timeout: timedelta) -> Generator[None, None, None]:
        timer = self.schedule(callback, timeout)
        try:
            yield
        finally:
            self.cancel(timer)

    def _clear_del_queue(self) -> int:
        """Drop the events the timer thread handed back; returns how many."""
        count = 0
        while True:
            try:
                self._del_queue.get_nowait()
            except queue.Empty:
                return count
            count += 1


_TIMEOUT_MANAGER = _TimeoutManager()


def future_timeout(fut: Future[T], timeout: timedelta) -> Future[T]:
    """A future that completes with ``fut``'s result or error, or with ``TimeoutError`` after ``timeout``."""
    return _TIMEOUT_MANAGER.register(fut, timeout)


def future_wait(fut: Future[T], timeout: timedelta) -> T:
    """``fut``'s result (or its error, raised), waiting at most ``timeout``; then ``TimeoutError``."""
    finished = threading.Event()
    fut.add_done_callback(lambda _: finished.set())
    if not finished.wait(timeout.total_seconds()):
        raise _timeout_error(timeout)
    return fut.wait()


def stream_timeout(callback: Callable[[], None], timeout: timedelta) -> None:
    """Call ``callback`` if the work queued so far on the current accelerator stream is not done after ``timeout``.

    Without an accelerator nothing is queued on a stream, so nothing can be late.
    """
    _TIMEOUT_MANAGER.stream_timeout(callback, timeout)


@contextlib.contextmanager
def context_timeout(callback: Callable[[], None], timeout: timedelta) -> Generator[None, None, None]:
    """Call ``callback`` (on the timer thread) if the ``with`` block has not exited after ``timeout``."""
    with _TIMEOUT_MANAGER.context_timeout(callback, timeout):
        yield
