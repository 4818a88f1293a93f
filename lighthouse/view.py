"""A running lighthouse as its HTTP side sees it: the status page, /metrics and the admin actions.

Those modules take a :class:`LighthouseView` (``LighthouseServer`` is one)
rather than importing the server, which imports them to start HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from lighthouse.config import LighthouseConfig
from lighthouse.quorum_data import Epoch
from lighthouse.stragglers.rules import StragglerStatistics
from lighthouse.timeline import TimelineStatistics
from torchft_lite.rpc.protocol import torchft_pb2 as pb
from torchft_lite.rpc.refusals import RefusalLog

__all__ = ["LighthouseStatistics", "LighthouseView"]


@dataclass(frozen=True)
class LighthouseStatistics:
    """A snapshot of what the lighthouse is doing (read by /api/status and /metrics)."""

    quorum_id: int
    quorum_members: int
    quorum_age: float | None
    participants: int
    healthy_participants: int
    heartbeating_replicas: int
    status: str
    reason: str
    quorums_issued: int
    quorum_id_changes: int
    quorum_requests: int
    heartbeats: int
    invalid_requests: int
    expired_replicas: int
    leases_held: int
    leases_ended: int
    last_formation_seconds: float | None
    uptime: float
    max_step: int
    """The highest step a quorum reached (the stale-quorum guard's)."""
    epochs: int
    """New epochs of the job this process started (the current epoch's number)."""
    fenced_requests: int
    """Quorum calls refused as from before the current epoch."""
    invalid_reasons: Mapping[str, int] = field(default_factory=dict)
    """Refused requests by reason (see :mod:`lighthouse.validation`), ``lease_held`` included."""
    lease_refusals: int = 0
    """Lease calls refused because another live connection holds the replica's lease."""
    state_write_failures: int = 0
    """Writes to ``--state-dir`` that failed (a full disk): the lighthouse served on without them."""


class LighthouseView(Protocol):
    """What the HTTP side reads and asks of a lighthouse; every call on the lighthouse's event loop."""

    config: LighthouseConfig
    refusals: RefusalLog
    """gRPC calls refused by ``config.access`` (no or a wrong job token, or a peer protected mode does not serve)."""

    @property
    def grpc_port(self) -> int: ...

    @property
    def http_port(self) -> int | None: ...

    def statistics(self) -> LighthouseStatistics:
        """Counters and the current decision, now."""

    def add_formation_observer(self, observe: Callable[[float], None]) -> None:
        """Call ``observe(seconds)`` with the formation time of each issued quorum."""

    def stragglers(self) -> StragglerStatistics:
        """Every group's compute-time scores, flags and evictions (lighthouse.stragglers.rules)."""

    def snapshot(self) -> dict:
        """Everything the dashboard shows, as plain JSON-able data."""

    def history(self, samples_after: int = -1, markers_after: int = -1, seconds: float | None = None) -> dict:
        """The job's history as JSON-able data (lighthouse.history): what is newer than the cursors, within
        ``seconds`` before now if given."""

    def timeline_statistics(self) -> TimelineStatistics:
        """Stalls, heals, groups gone and back, and what the job is doing now (lighthouse.timeline)."""

    def known_member(self, replica_id: str) -> pb.QuorumMember | None:
        """The last Quorum request of a replica still worth showing (None for one the lighthouse forgot)."""

    def request_epoch(self, requested_by: str) -> Epoch | None:
        """Start a new epoch now if the stale-quorum guard holds participants back; None when nothing is blocked."""
