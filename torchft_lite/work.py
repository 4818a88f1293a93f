"""Futures and Work objects the Manager hands to training code, and the stream rule they all follow.

``Manager.allreduce`` returns a :class:`ManagedWork`: its future never raises
into the training loop. A failure (or a timeout) is reported to the Manager,
which then votes not to commit the step, and the future resolves with a
default value (the input tensor) so backward can finish.

``_DummyWork`` (torchft's name) is a c10d ``Work`` already done with a value:
what a collective with nothing to exchange returns.

The stream rule
---------------
**Every work or future that hands back CUDA tensors makes the consumer's
current CUDA stream wait for them.** A consumer is whoever reads the result:
``wait()``, ``value()`` after ``wait()``, a ``then()`` callback (the division
by the number of participants), DDP's reducer reading a comm-hook future. The
host returning from a wait is not enough: the bytes may still be on their way
to the GPU on another stream.

How every work and future here keeps it:

* A future that may hold CUDA tensors is a CUDA-aware torch future
  (:func:`device_future`: ``Future(devices=...)``). Its ``set_result`` records
  an event on the setter's current stream of each device; ``wait()`` makes the
  waiter's current streams wait for those events; ``then()`` and
  ``add_done_callback`` run their callback on pool streams that wait for them,
  and the child future records its own events after the callback's kernels.
  (``value()`` alone does not synchronize: outside a callback, ``wait()``
  first.)
* A result is set where it was produced, or after the stream it is set on
  waited for its producer. Where our process groups wrap a backend's work
  (``process_group.tracked_work.TrackedWork``), the backend's own ordering is
  brought in with c10d's ``Work.synchronize()``, which makes the current
  stream wait for the backend's work (gloo's copies back to the GPU run on
  streams of its own, and gloo's futures carry no devices: before it completes
  one, gloo makes only its own thread's current stream, the default stream,
  wait for the copy). Results are set
  on a fresh side stream (:func:`completion_streams`), never on the stream a
  training loop computes on, so a collective's completion never stalls the
  compute queued after it.
* A work's ``wait()`` ends with the CUDA-aware future's ``wait()`` (or c10d's
  ``Work.wait()``, which synchronizes the same way), on the caller's thread,
  so it is the caller's current stream that waits.

On CPU none of this costs anything: with no CUDA tensor in a value,
:func:`device_future` is a plain future and :func:`completion_streams` does
nothing.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any, Callable, Generator, Generic, Sequence, TypeVar

import torch
import torch.distributed as dist

__all__ = ["ManagedWork", "DoneWork", "WorkWait", "completion_streams", "cuda_devices", "device_future", "guard_future",
           "work_future"]

T = TypeVar("T")


def cuda_devices(value: Any) -> tuple[torch.device, ...]:
    """The CUDA devices of the tensors in ``value`` (a tensor, or lists, tuples and dicts of them), in order."""
    found: dict[torch.device, None] = {}
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            if item.is_cuda:
                found.setdefault(item.device, None)
        elif isinstance(item, (list, tuple)):
            pending.extend(reversed(item))
        elif isinstance(item, dict):
            pending.extend(reversed(list(item.values())))
    return tuple(found)


def device_future(devices: Sequence[torch.device]) -> torch.futures.Future:
    """An unset future for a value on ``devices``: CUDA-aware when there are any (the stream rule), else plain."""
    return torch.futures.Future(devices=list(devices)) if devices else torch.futures.Future()


@contextlib.contextmanager
def completion_streams(devices: Sequence[torch.device]) -> Generator[None, None, None]:
    """Make a side stream from torch's pool current on each of ``devices`` for the block (nothing without any).

    Where results are set: the events their futures record, and the waits for
    the backend's work, go on these streams, not on the stream the training
    loop computes on.
    """
    if not devices:
        yield
        return
    with contextlib.ExitStack() as stack:
        for device in devices:
            stack.enter_context(torch.cuda.stream(torch.cuda.Stream(device=device)))
        yield


def completed_future(value: T) -> torch.futures.Future:
    """A future already holding ``value``, produced on the caller's current stream (the stream rule's events)."""
    fut = device_future(cuda_devices(value))
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
    out = device_future(cuda_devices(default))  # the stream rule: CUDA-aware when the default is on a GPU
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
        # A callback of a CUDA-aware ``fut`` runs on streams that waited for its result: setting ``out`` here
        # records events after them. (A plain ``fut`` runs it where it was completed.)
        try:
            value = f.value()
        except Exception as exc:  # the error is recorded by the Manager, not lost
            settle(None, exc)
            return
        settle(value, None)

    if timeout is not None:
        def expire() -> None:
            settle(None, TimeoutError(f"{what} did not complete within {timeout:g}s"))

        if schedule_timeout is not None:
            cancel_timer = schedule_timeout(timeout, expire)
        else:
            timer = threading.Timer(timeout, expire)
            timer.daemon = True
            timer.start()
            cancel_timer = timer.cancel
    fut.add_done_callback(done)
    return out


class WorkWait:
    """A future that a work's ``wait()`` completes, for a work that has no torch future of its own.

    c10d does not promise ``Work.get_future()``: a backend may raise "not
    implemented", and a process group that a test mocks (as torchft's own
    tests do, with ``create_autospec(ProcessGroup)``) hands back works whose
    futures are mocks that never complete. Such a work is done when its
    ``wait()`` returns, so :meth:`run`, called by whoever waits for the result
    (:class:`ManagedWork`), calls it and completes :attr:`future` with ``value``
    (or the error ``wait()`` raised); continuations chained on the future run
    then, on the waiting thread. ``wait()`` is called once; later calls of
    :meth:`run` return at once (a concurrent waiter waits for the future).
    """

    def __init__(self, work: Any, value: Any) -> None:
        self._work = work
        self._claimed = threading.Lock()
        self.future = device_future(cuda_devices(value))  # the stream rule: set after wait(), on the waiter's stream
        self._value = value

    def work_done(self) -> bool:
        """Whether the future is set, or the work says it is completed (c10d's ``is_completed()``; a work that
        can't say is not)."""
        if self.future.done():
            return True
        try:
            return self._work.is_completed() is True
        except Exception:  # not implemented by this backend
            return False

    def run(self, timeout: float | None) -> None:
        """Wait for the work (at most ``timeout`` seconds where given) and complete the future."""
        if not self._claimed.acquire(blocking=False):
            return
        try:
            done = self._work.wait() if timeout is None else self._work.wait(timedelta(seconds=max(timeout, 0.0)))
        except Exception as exc:  # the future carries it to the continuations, and the Manager records it
            self.future.set_exception(exc)
            return
        if done is False:  # c10d's wait(timeout) raises on a timeout; a work that returns False timed out too
            self.future.set_exception(TimeoutError(f"the collective did not complete within {timeout:g}s"))
            return
        self.future.set_result(self._value)


def work_future(work: Any, value: Any, waits: list[WorkWait]) -> torch.futures.Future:
    """``work``'s torch future; for a work without one, a :class:`WorkWait`'s future, appended to ``waits``
    (whoever waits for the result must run them: :class:`ManagedWork` does). ``value``: what the work
    produces (its tensors), which the :class:`WorkWait`'s future yields.

    ``get_future()`` is called once (a mocked process group counts the calls).
    """
    try:
        fut = work.get_future()
    except (NotImplementedError, RuntimeError):  # c10d's "getFuture not implemented" is a RuntimeError
        fut = None
    if isinstance(fut, torch.futures.Future):
        return fut
    pending = WorkWait(work, value)
    waits.append(pending)
    return pending.future


class ManagedWork(Generic[T]):
    """A ``Work``-like handle around a future that never raises.

    ``waits`` (:func:`work_future`): works without a torch future of their own
    that this one's future depends on; ``wait()`` and ``get_future()`` wait for
    them first, at most ``wait_seconds`` each.
    """

    def __init__(self, fut: torch.futures.Future, waits: Sequence[WorkWait] = (),
                 wait_seconds: float | None = None) -> None:
        self._fut = fut
        self._waits = tuple(waits)
        self._wait_seconds = wait_seconds

    def _run_waits(self, timeout: float | None) -> None:
        limits = [seconds for seconds in (timeout, self._wait_seconds) if seconds is not None]
        for pending in self._waits:
            pending.run(min(limits) if limits else None)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the future settles (True), or until ``timeout`` passes first (False).

        Never raises: the future itself is bounded by the Manager's timeout and
        resolves with a default on failure. After a False the collective goes on
        and its future still settles; the Manager waits for it before the vote.
        On True the caller's current CUDA streams wait for the result (the stream rule).
        """
        seconds = None if timeout is None else (timeout.total_seconds() if isinstance(timeout, timedelta)
                                                else float(timeout))
        if self._waits:
            self._run_waits(seconds)
        if seconds is not None:
            settled = threading.Event()
            self._fut.add_done_callback(lambda _: settled.set())  # runs at once when already done
            if not settled.wait(max(seconds, 0.0)):
                return False
        self._fut.wait()  # done by now when a timeout was given: only the streams wait
        return True

    def is_completed(self) -> bool:
        """Whether the result is ready, or (for works without a future of their own, ``waits``) every such work
        says it is done and only waiting for it is left. Never blocks."""
        return self._fut.done() or bool(self._waits) and all(pending.work_done() for pending in self._waits)

    def get_future(self) -> torch.futures.Future:
        """The future (a torch future, which DDP's reducer can wait on); works it depends on that have no future
        of their own (``waits``) are waited for first."""
        self._run_waits(None)
        return self._fut

    def result(self) -> T:
        self._run_waits(None)
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

    def block_current_stream(self, timeout: timedelta | None = None) -> None:
        """The caller's current stream waits for the work, the host does not (c10d's); an error goes to the
        manager."""
        try:
            if timeout is None:
                self._work.block_current_stream()
            else:
                self._work.block_current_stream(timeout)
        except Exception as exc:
            self._manager.report_error(exc)

    def get_future(self) -> torch.futures.Future:
        def settle(fut: torch.futures.Future) -> object:
            try:
                fut.value()
            except Exception as exc:
                self._manager.report_error(exc)
            return self._value

        return self._work.get_future().then(settle)
