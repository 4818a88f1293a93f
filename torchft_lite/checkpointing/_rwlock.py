"""A readers-writer lock whose every wait is bounded (torchft's ``torchft.checkpointing._rwlock.RWLock``).

The Manager guards its state dict with one (``Manager._state_dict_lock``):
``disallow_state_dict_read`` holds it for writing until ``allow_state_dict_read``,
so a read of the Manager's state (``Manager._manager_state_dict``) from another
thread waits while the training loop changes the parameters.

Many readers or one writer hold it at a time. A waiting writer goes before
readers that arrive after it, so a stream of readers can't starve it; a writer
that gives up lets those readers in again.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["RWLock"]

DEFAULT_TIMEOUT = 60.0


class RWLock:
    """Many readers or one writer; ``r_acquire``/``w_acquire`` raise ``TimeoutError`` after ``timeout`` seconds.

    Args:
        timeout: seconds an acquire waits before it raises ``TimeoutError``; a negative value (torchft's default
            of -1) waits without limit.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._timeout = timeout
        self._changed = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def _limit(self) -> float | None:
        return None if self._timeout < 0 else self._timeout

    def r_acquire(self) -> None:
        """Take the lock for reading (with other readers); ``TimeoutError`` while a writer holds or waits for it."""
        with self._changed:
            if not self._changed.wait_for(lambda: not self._writer and not self._writers_waiting, self._limit()):
                raise TimeoutError(f"RWLock: not acquired for reading within {self._timeout}s (a writer holds it "
                                   f"or waits for it)")
            self._readers += 1

    def r_release(self) -> None:
        with self._changed:
            if self._readers == 0:
                raise RuntimeError("RWLock: r_release() without a reader holding the lock")
            self._readers -= 1
            self._changed.notify_all()

    @contextlib.contextmanager
    def r_lock(self) -> Iterator[None]:
        """Hold the lock for reading inside the block."""
        self.r_acquire()
        try:
            yield
        finally:
            self.r_release()

    def w_acquire(self) -> None:
        """Take the lock alone; ``TimeoutError`` while readers or another writer hold it."""
        with self._changed:
            self._writers_waiting += 1
            try:
                acquired = self._changed.wait_for(lambda: not self._writer and self._readers == 0, self._limit())
            finally:
                self._writers_waiting -= 1
            if not acquired:
                self._changed.notify_all()  # readers held back by this writer's wait may go on
                raise TimeoutError(f"RWLock: not acquired for writing within {self._timeout}s "
                                   f"({self._readers} reader(s){' and a writer' if self._writer else ''} hold it)")
            self._writer = True

    def w_release(self) -> None:
        with self._changed:
            if not self._writer:
                raise RuntimeError("RWLock: w_release() without the writer holding the lock")
            self._writer = False
            self._changed.notify_all()

    @contextlib.contextmanager
    def w_lock(self) -> Iterator[None]:
        """Hold the lock alone inside the block."""
        self.w_acquire()
        try:
            yield
        finally:
            self.w_release()

    def w_locked(self) -> bool:
        """Whether a writer holds the lock now."""
        with self._changed:
            return self._writer
