"""Helpers shared by the unit tests: plain functions and classes, imported by the test modules (their shared
fixtures, should they have any, go in a conftest.py)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch
import torch.distributed as dist

from lighthouse.quorum import Decision, QuorumConfig, QuorumState


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


# ---------------------------------------------------------------- the lighthouse's quorum rules

_CONFIG_FIELDS = frozenset(field.name for field in dataclasses.fields(QuorumConfig))


def quorum_state(min_replicas: int = 1, join_timeout: float = 10.0, **settings) -> QuorumState:
    """A QuorumState; ``settings`` are QuorumConfig's (heartbeat_timeout, holder_timeout, startup_grace: its
    defaults unless given) or QuorumState's own (last_quorum_id, started_at, max_step, restart_evidence)."""
    config = QuorumConfig(min_replicas, join_timeout, **{k: v for k, v in settings.items() if k in _CONFIG_FIELDS})
    return QuorumState(config, **{k: v for k, v in settings.items() if k not in _CONFIG_FIELDS})


def issue(s: QuorumState, now: float) -> Decision:
    """The decision at ``now``, which must issue a quorum (the test fails with its reason if not)."""
    decision, _ = s.decide(now)
    assert decision.quorum is not None, decision.reason
    return decision
