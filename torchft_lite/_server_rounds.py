"""The ManagerServer's rounds: one group's Quorum (or ShouldCommit) calls for a step, gathered until every rank
has asked, then answered together."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from lighthouse.protocol import torchft_pb2 as pb

__all__ = ["QuorumRound", "VoteRound"]


@dataclass
class QuorumRound:
    requests: dict[int, pb.ManagerQuorumRequest] = field(default_factory=dict)
    deadlines: dict[int, float] = field(default_factory=dict)  # loop time, per rank: of its latest request
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def deadline(self) -> float | None:
        """The earliest deadline among the ranks' current requests."""
        return min(self.deadlines.values(), default=None)


@dataclass
class VoteRound:
    step: int
    votes: dict[int, bool] = field(default_factory=dict)
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
