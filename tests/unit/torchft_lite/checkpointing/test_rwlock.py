"""The Manager's state-dict lock (torchft's private RWLock): many readers or one writer, every wait bounded."""

from __future__ import annotations

import threading

import pytest

from tests.conftest import wait_until_sync
from torchft_lite.checkpointing._rwlock import RWLock


def test_readers_share_it_and_a_writer_waits_for_all_of_them():
    lock = RWLock(timeout=0.05)
    lock.r_acquire()
    with lock.r_lock():  # a second reader at once
        with pytest.raises(TimeoutError, match="2 reader"):
            lock.w_acquire()
    with pytest.raises(TimeoutError, match="1 reader"):
        lock.w_acquire()
    lock.r_release()
    with lock.w_lock():
        assert lock.w_locked()
        with pytest.raises(TimeoutError, match="reading"):
            lock.r_acquire()
    assert not lock.w_locked()


def test_a_waiting_writer_goes_before_later_readers():
    lock = RWLock(timeout=10.0)
    order: list[str] = []
    lock.r_acquire()

    def write() -> None:
        with lock.w_lock():
            order.append("writer")

    def read() -> None:
        with lock.r_lock():
            order.append("late reader")

    writer = threading.Thread(target=write)
    writer.start()
    wait_until_sync(lambda: lock._writers_waiting == 1, "the writer to wait")
    reader = threading.Thread(target=read)
    reader.start()
    threading.Event().wait(0.1)
    assert order == []  # the late reader waits behind the writer, which waits for the first reader
    lock.r_release()
    writer.join(10.0)
    reader.join(10.0)
    assert order == ["writer", "late reader"]


def test_a_writer_that_gives_up_lets_waiting_readers_in():
    lock = RWLock(timeout=0.05)
    lock.r_acquire()
    with pytest.raises(TimeoutError):
        lock.w_acquire()
    with lock.r_lock():  # no writer waits any more
        pass


def test_releasing_what_is_not_held_is_an_error_and_a_negative_timeout_waits_without_limit():
    lock = RWLock(timeout=-1)
    with pytest.raises(RuntimeError, match="r_release"):
        lock.r_release()
    with pytest.raises(RuntimeError, match="w_release"):
        lock.w_release()
    lock.w_acquire()
    released = threading.Timer(0.1, lock.w_release)
    released.start()
    with lock.r_lock():  # waited for the writer, however long
        pass
    released.join()
