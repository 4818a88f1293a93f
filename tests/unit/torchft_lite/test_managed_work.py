"""torchft's ``_ManagedWork``: a wrapped work's failure is reported to the manager, never raised."""

from __future__ import annotations

import torch

from tests.unit.helpers import FailingWork
from torchft_lite.manager import _ManagedWork
from torchft_lite.work import _DummyWork


class Recorder:
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def report_error(self, exc: BaseException) -> None:
        self.errors.append(exc)


def test_a_finished_work_waits_true_and_its_future_yields_the_value():
    manager, value = Recorder(), torch.ones(2)
    work = _ManagedWork(manager, _DummyWork(value), value)
    assert work.wait() is True
    assert work.get_future().wait() is value and manager.errors == []


def test_a_failed_work_is_reported_and_yields_the_value_instead_of_raising():
    manager, value = Recorder(), torch.zeros(2)
    work = _ManagedWork(manager, FailingWork(RuntimeError("connection closed by peer")), value)
    assert work.wait() is False
    assert work.get_future().wait() is value
    assert [str(e) for e in manager.errors] == ["connection closed by peer"] * 2
