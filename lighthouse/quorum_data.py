"""The quorum rules' plain data: settings, members, issued quorums, epochs and decisions.

Frozen dataclasses with no behaviour beyond validation; the rules that
produce them are in :mod:`lighthouse.quorum` (and :mod:`lighthouse.epochs`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from lighthouse.stragglers.scores import ComputeSample

__all__ = ["Decision", "Epoch", "IssuedQuorum", "Member", "QuorumConfig", "Status"]


@dataclass(frozen=True)
class QuorumConfig:
    """Settings of the quorum rules, in seconds."""

    min_replicas: int
    """Fewest healthy participants a (non-fast) quorum may have."""
    join_timeout: float = 60.0
    """How long to wait for healthy replicas that have not joined yet, counted
    from the first participant's join."""
    heartbeat_timeout: float = 5.0
    """A replica is healthy while its last heartbeat is younger than this."""
    startup_grace: float = 0.0
    """After a restart, no quorum is issued until this long after the lighthouse
    started, so that replicas already training re-register first: a restarted
    lighthouse knows nobody, and a minority (say, a freshly restarted group at
    step 0) could otherwise form a quorum on its own and commit steps the others
    already did. Applies only with ``QuorumState``'s ``restart_evidence``."""
    holder_timeout: float = 30.0
    """How long the stale-quorum guard waits for a holder of the highest step
    (a member of the last quorum at that step) to come back: when none was seen
    for this long (nor for ``heartbeat_timeout``, if that is longer),
    participants that are all behind start a new epoch of the job at their own
    step instead of waiting forever."""

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"min_replicas must be an integer >= 1, got {self.min_replicas!r}")
        for name in ("join_timeout", "heartbeat_timeout", "startup_grace", "holder_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        for name in ("heartbeat_timeout", "holder_timeout"):
            if getattr(self, name) == 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True)
class Member:
    """One replica group asking to join. ``payload`` is carried through
    untouched (the server keeps the wire message there, unknown fields and all)."""

    replica_id: str
    shrink_only: bool = False
    commit_failures: int = 0
    payload: Any = field(default=None, compare=False)
    step: int = 0
    """The replica's committed step (for the stale-quorum guard)."""
    resumed_from: int | None = None
    """The step of the durable checkpoint the replica resumed from, as it
    advertises (``"resumed_from"`` in ``QuorumMember.data``); equal to ``step``
    while it has not committed since. None when it says nothing."""
    resumed_quorum: int | None = None
    """The id of the quorum under which that checkpoint's state was committed, as it advertises
    (``"resumed_quorum"``); None when it says nothing (see :mod:`lighthouse.epochs`, the fence)."""
    compute: ComputeSample | None = field(default=None, compare=False)
    """Its compute time of its last finished step, as it advertises (``"compute_ms"``/``"compute_step"``
    in ``QuorumMember.data``, see :mod:`lighthouse.stragglers.scores`); None when it says nothing valid."""


@dataclass(frozen=True)
class IssuedQuorum:
    quorum_id: int
    members: tuple[Member, ...]
    issued_at: float
    """Monotonic time the quorum was issued (the caller's clock)."""
    redone_by_others: tuple[tuple[str, int, int], ...] = ()
    """Members whose step the quorum lowers so they heal: ``(replica id, step it reported, step it is given)``.
    Each was declared gone from an earlier quorum at the step it is given, the others redid that step
    without it, and it came back one step further: a commit of a step its peers redid (see
    :mod:`lighthouse.quorum`, "lineage fence")."""

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(m.replica_id for m in self.members)


@dataclass(frozen=True)
class Epoch:
    """A new epoch of the job: the stale-quorum guard gave way and the highest step went down."""

    number: int
    """1 for the first epoch this lighthouse process started (not persisted)."""
    started_at: float
    """Monotonic time it started (the caller's clock)."""
    from_step: int
    """The highest step a quorum had reached before."""
    to_step: int
    """The highest step among the participants that started it (the new highest step)."""
    reason: str
    """Why, in one human sentence."""
    first_quorum_id: int = 0
    """The id of its first quorum: a state committed under this id or a later one is of this epoch."""


class Status(enum.Enum):
    """Why the lighthouse is (not) issuing a quorum; the reason's category."""

    NO_PARTICIPANTS = "no_participants"
    BELOW_MIN_REPLICAS = "below_min_replicas"
    SPLIT_BRAIN_GUARD = "split_brain_guard"
    BEHIND_COMMITTED = "behind_committed"
    STARTUP_GRACE = "startup_grace"
    WAITING_FOR_STRAGGLERS = "waiting_for_stragglers"
    FAST_QUORUM = "fast_quorum"
    VALID_QUORUM = "valid_quorum"

    @property
    def ready(self) -> bool:
        return self in (Status.FAST_QUORUM, Status.VALID_QUORUM)


@dataclass(frozen=True)
class Decision:
    status: Status
    reason: str
    """One human sentence, e.g. 'waiting for 2 stragglers, 0.4 s of join timeout left'."""
    quorum: IssuedQuorum | None = None
    """Set when this decision issued a quorum."""
    wake_at: float | None = None
    """When waiting on a deadline (the join timeout, the startup grace, the
    holder timeout): the time the decision may change even if nothing else happens."""
    epoch: Epoch | None = None
    """Set when this decision started a new epoch."""
    fenced: tuple[Member, ...] = ()
    """Participants that the epoch this decision started found to be from before
    it (above its step, not eligible): dropped, their Quorum calls to be refused."""

    @property
    def ready(self) -> bool:
        return self.status.ready


def plural(count: int, noun: str) -> str:
    """"2 participants", "1 participant"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
