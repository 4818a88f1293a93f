"""The event loop every control-plane thread runs, and the trainer's one control-plane thread.

:func:`new_event_loop` is what the lighthouse's thread and the trainers' run. A trainer process has one
:class:`ControlPlane`: a daemon thread whose loop holds every network client and server torchft_lite needs
(the lighthouse and ManagerServer gRPC clients, the ManagerServer on group rank 0, the HTTP checkpoint
server). The training thread talks to it only through futures with timeouts (:meth:`ControlPlane.submit`,
:meth:`ControlPlane.run`); the loop starts on first use and lives until the process exits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Callable, Coroutine, TypeVar

__all__ = ["ControlPlane", "control_plane", "new_event_loop"]

logger = logging.getLogger(__name__)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop, or asyncio's default where uvloop is missing."""
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency, but don't die without it
        logger.warning("uvloop not installed; using the default asyncio event loop")
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


T = TypeVar("T")
_HANDOVER = 5.0  # seconds a finished coroutine may take to hand its outcome to the waiting thread (microseconds)


class ControlPlane:
    """An event loop running in a daemon thread."""

    def __init__(self, name: str = "torchft-control-plane") -> None:
        self.loop = new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            logger.debug("control-plane loop stopped")

    def in_loop_thread(self) -> bool:
        """True when called from the control-plane thread itself."""
        return threading.get_ident() == self._thread.ident

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future is thread-safe."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        """Run ``coro`` on the loop and wait for its result from another thread.

        Raises ``TimeoutError`` naming ``what`` after ``timeout`` seconds (the
        coroutine is cancelled). An error of the coroutine's own, a
        ``TimeoutError`` of its own included, is raised as it is. Calling this
        from the loop's own thread would deadlock, so it raises
        ``RuntimeError`` instead.
        """
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(f"{what}: blocking call made from the control-plane thread")
        future = self.submit(coro)
        # Not future.result(timeout): its TimeoutError is the very class a coroutine's own timeout raises.
        concurrent.futures.wait([future], timeout)
        if not future.done() and future.cancel():  # cancel() is False while the outcome is handed over
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        return future.result(_HANDOVER)


    def call_later(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Run ``fn`` on the loop after ``delay`` seconds; returns a cancel that any thread may call."""
        handle: list[asyncio.TimerHandle] = []
        self.loop.call_soon_threadsafe(lambda: handle.append(self.loop.call_later(delay, fn)))
        # FIFO on the loop: the cancel always runs after the timer was armed.
        return lambda: self.loop.call_soon_threadsafe(lambda: handle and handle[0].cancel())


_lock = threading.Lock()
_instance: ControlPlane | None = None


def control_plane() -> ControlPlane:
    """The process's control plane, started on first call."""
    global _instance
    with _lock:
        if _instance is None or not _instance._thread.is_alive():
            _instance = ControlPlane()
        return _instance
