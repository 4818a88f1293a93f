"""``Work`` handles returned by our process groups, and error translation.

:class:`TrackedWork` wraps a c10d ``Work``: ``wait()`` is bounded by the
group's timeout, and a failure seen through ``wait()`` or through the future is
translated once to :class:`CollectiveError` / :class:`CollectiveTimeout` and
reported to the group (which marks itself errored). The future returned by
``get_future()`` completes with that translated error, so callbacks the
Manager attaches see it.

CUDA: a TrackedWork follows the stream rule (``torchft_lite.work``). Its
future is CUDA-aware for the devices of the collective's tensors, and is set
only after ``Work.synchronize()`` made a side stream wait for what the backend
still has queued (gloo's copies back to the GPU); ``wait()`` leaves the
caller's current stream waiting for the result, whether the backend's Work or
the future holds it.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchft_lite.errors import CollectiveError, CollectiveTimeout
from torchft_lite.work import _DummyWork, completion_streams, device_future

__all__ = ["CompletedWork", "TrackedWork", "translate_error"]

_TIMEOUT_MARKERS = ("timed out", "timeout")


def translate_error(exc: BaseException, what: str, timeout: timedelta, consequence: str = "") -> CollectiveError:
    """Turn a torch/gloo/NCCL failure of ``what`` into a CollectiveError (or CollectiveTimeout).

    ``consequence`` (what the group did about it, e.g. that it aborted its
    communicator) ends the message.
    """
    if isinstance(exc, CollectiveError):
        return exc
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, TimeoutError) or any(marker in detail.lower() for marker in _TIMEOUT_MARKERS):
        error: CollectiveError = CollectiveTimeout(
            f"{what} timed out after {timeout.total_seconds():g} seconds: {detail}{consequence}")
    else:
        error = CollectiveError(f"{what} failed: {type(exc).__name__}: {detail}{consequence}")
    error.__cause__ = exc
    return error


class TrackedWork(dist.Work):
    """A c10d ``Work`` whose failures are translated and reported to its process group.

    The backend's Work is released as soon as it failed, or its result is in
    the future: a gloo Work pins its communicator's connections, and peers
    blocked on this rank only fail fast once those close.

    Args:
        work: the backend's Work.
        op: what it is doing, for messages ("allreduce").
        timeout: the bound of ``wait()`` when the caller gives none.
        wait: ``wait(work, timeout)`` -- blocks at most ``timeout``, raises the work's error.
        on_error: ``on_error(exc, timeout)`` translates a failure seen while waiting up to
            ``timeout``, marks the group errored, and returns the translation.
        devices: the CUDA devices of the collective's tensors (``torchft_lite.work.cuda_devices``).
        outputs: what the future yields when the backend's Work has no future of its own (gloo's
            send and recv): the tensors received, so that a CUDA future records their events.
    """

    def __init__(self, work: dist.Work, *, op: str, timeout: timedelta,
                 wait: Callable[[dist.Work, timedelta], None],
                 on_error: Callable[[BaseException, timedelta], CollectiveError],
                 devices: tuple[torch.device, ...] = (), outputs: Any = None) -> None:
        super().__init__()
        self._work: dist.Work | None = work
        self._devices = devices
        self._outputs = outputs
        self._op = op
        self._timeout = timeout
        self._wait = wait
        self._on_error = on_error
        self._lock = threading.Lock()
        self._error: CollectiveError | None = None
        self._future: torch.futures.Future | None = None
        self._settled = False

    def _fail(self, exc: BaseException, timeout: timedelta | None = None) -> CollectiveError:
        # The error is kept (by the group, the Manager) with its traceback: clear
        # the finished frames' locals so they do not pin the backend's Work.
        traceback.clear_frames(exc.__traceback__)
        # on_error takes the group's lock and drops its communicator: call it outside ours.
        if self._error is not None:
            error = self._error
        else:
            error = self._on_error(exc, timeout if timeout is not None else self._timeout)
        with self._lock:
            if self._error is None:
                self._error = error
            error, future = self._error, self._future
            self._work = None
        self._settle(future, error=error)
        return error

    def mark_failed(self, exc: BaseException) -> CollectiveError:
        """Fail this work from outside (a watchdog saw it overrun); returns the translated error."""
        return self._fail(exc)

    def _settle(self, future: torch.futures.Future | None, value: Any = None,
                error: CollectiveError | None = None) -> None:
        """Complete the derived future once, whichever of result, error or watchdog comes first."""
        if future is None:
            return
        with self._lock:
            if self._settled:
                return
            self._settled = True
            if error is None:
                self._work = None  # the result is in the future now
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective is done, at most ``timeout`` (default: the group's).

        The caller's current CUDA streams then wait for the result (c10d's ``Work.wait()`` does so, and so
        does the future's once the backend's Work is released).
        """
        with self._lock:
            work, error, future = self._work, self._error, self._future
        if error is not None:
            raise error
        if work is None:  # released after its result reached the future
            if future is not None:
                future.wait()  # done: only the caller's streams wait for its events
            return True
        limit = timeout if timeout is not None else self._timeout
        try:
            self._wait(work, limit)
            return True
        except Exception as exc:
            failure = exc
        del work  # this frame outlives the call in the error's traceback; it must not pin the Work
        raise self._fail(failure, limit) from failure

    def get_future(self) -> torch.futures.Future:
        """A future of the collective's result that fails with the translated error."""
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = future = device_future(self._devices)
            work, error = self._work, self._error
        if work is None:
            self._settle(future, error=error)
            return future
        try:
            source = work.get_future()
        except RuntimeError:
            # gloo's send/recv have no future: wait for them (bounded) on a thread.
            threading.Thread(target=self._complete_by_waiting, args=(future,),
                             name=f"torchft_lite-{self._op}-waiter", daemon=True).start()
            return future

        def done(source: torch.futures.Future) -> None:
            if self._devices:
                self._settle_on_device(source, future)
                return
            # CPU: nothing to order. (No lock here: a compat run that injects failed futures hung its
            # collectives until their timeout when this callback took the work's lock.)
            try:
                value = source.value()
            except Exception as exc:
                self._fail(exc)
            else:
                self._settle(future, value=value)

        source.add_done_callback(done)
        return future

    def _settle_on_device(self, source: torch.futures.Future, future: torch.futures.Future) -> None:
        """The stream rule (``torchft_lite.work``) for a collective of CUDA tensors: set the result on side
        streams that waited for the backend's future and for what the backend still has queued (gloo's
        copies back to the GPU)."""
        backend = self._work  # read now, not captured: a failed work must not be pinned by the callback
        with completion_streams(self._devices):
            try:
                value = source.wait()  # done; a CUDA-aware source (NCCL's) leaves these streams waiting for it
                if backend is not None:
                    backend.synchronize()
            except Exception as exc:
                self._fail(exc)
                return
            self._settle(future, value=value)

    def _complete_by_waiting(self, future: torch.futures.Future) -> None:
        with completion_streams(self._devices):  # c10d's wait() makes these streams wait; the future records after
            try:
                self.wait()
            except CollectiveError:
                return  # _fail() already failed the future with this error
            self._settle(future, value=self._outputs)

    def is_completed(self) -> bool:
        with self._lock:
            work, error = self._work, self._error
        return error is not None or work is None or work.is_completed()

    def exception(self) -> CollectiveError | None:
        return self._error

    def __repr__(self) -> str:
        return f"TrackedWork({self._op}, completed={self.is_completed()}, error={self._error!r})"


class CompletedWork(_DummyWork):
    """A Work that is already done with ``result`` (no-op groups, single-member groups)."""
