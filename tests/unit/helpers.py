"""Helpers shared by the unit tests: plain functions and classes, imported by the test modules (their shared
fixtures, should they have any, go in a conftest.py)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class FailingWork(dist.Work):
    """A collective that failed: wait() raises ``error``, and its future (one per work, as c10d's) carries it."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_exception(error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        raise self.error

    def get_future(self) -> torch.futures.Future:
        return self.future
