"""The lighthouse's quorum rules as a pure state machine.

No gRPC, asyncio or clock in here: every method that depends on time takes
``now`` (monotonic seconds) from the caller, so tests pass literal timestamps.

Rules (torchft's semantics, so mixed fleets agree):

* A replica is *healthy* while its last heartbeat is younger than
  ``heartbeat_timeout``. Joining (a Quorum call) counts as a heartbeat.
* A participant is a replica waiting in a Quorum call. Only healthy
  participants count.
* **Fast quorum**: when every member of the previous quorum is a healthy
  participant again, a quorum is issued at once.
* Otherwise a quorum needs at least ``min_replicas`` healthy participants,
  strictly more than half of the healthy heartbeating replicas (split-brain
  guard), and, while some healthy replicas have not joined, waits up to
  ``join_timeout`` counted from the first participant's join.
* ``shrink_only`` from any healthy participant admits only members of the
  previous quorum.
* ``quorum_id`` increases when membership changes or any member reports
  ``commit_failures > 0``. Members are sorted by replica id.
* Members of an issued quorum stop being participants; a participant left out
  keeps waiting for the next quorum (its join time restarts).

Beyond torchft (both keep a restarted lighthouse from letting a minority redo
committed steps):

* **Startup grace**: a lighthouse that knows an earlier incarnation of itself
  issued quorums (``restart_evidence``, from its state directory) issues no
  first quorum until ``startup_grace`` after it started, so replicas already
  training re-register first. A first start has nobody to wait for and answers
  at once, as torchft's lighthouse does.
* **Stale-quorum guard**: no quorum of participants that are all behind the
  highest step a quorum already reached.

Cost: each join, heartbeat and :meth:`QuorumState.evaluate` is O(1)
amortized (counters are kept incrementally and stale heartbeats are pruned
from the front of a list ordered by last-seen time); only issuing a quorum is
O(n log n). torchft recomputes every set on every call, which makes a round of
n joins O(n^2).
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator


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

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ValueError(f"min_replicas must be an integer >= 1, got {self.min_replicas!r}")
        for name in ("join_timeout", "heartbeat_timeout", "startup_grace"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if self.heartbeat_timeout == 0:
            raise ValueError("heartbeat_timeout must be > 0")


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


@dataclass(frozen=True)
class IssuedQuorum:
    quorum_id: int
    members: tuple[Member, ...]
    issued_at: float
    """Monotonic time the quorum was issued (the caller's clock)."""

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(m.replica_id for m in self.members)


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
    """When waiting on a deadline (the join timeout, the startup grace): the
    time the decision may change even if nothing else happens."""

    @property
    def ready(self) -> bool:
        return self.status.ready


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


@dataclass
class _Participant:
    member: Member
    joined_at: float


class QuorumState:
    """Heartbeats, participants and the previous quorum, with the rules above.

    Not thread-safe: the server calls it from one event loop.
    """

    def __init__(self, config: QuorumConfig, *, last_quorum_id: int = 0, started_at: float = -math.inf,
                 max_step: int = 0, restart_evidence: str | None = None) -> None:
        """``restart_evidence``: why this lighthouse knows an earlier incarnation
        issued quorums (e.g. "its state dir holds quorum id 17"), shown in the
        startup grace's reason; None for a first start, which gets no grace:
        nobody can be training yet, so there is nobody to wait for."""
        self.config = config
        self._started_at = started_at
        self._restart_evidence = restart_evidence
        self._quorum_id = last_quorum_id
        # replica_id -> last heartbeat, oldest first (moved to the end on update).
        self._heartbeats: OrderedDict[str, float] = OrderedDict()
        # Join order == joined_at order, so the first entry joined first.
        self._participants: dict[str, _Participant] = {}
        self._prev: IssuedQuorum | None = None
        self._prev_ids: frozenset[str] = frozenset()
        self._now = -math.inf
        # Counters over healthy participants (participants with a live heartbeat entry).
        self._healthy_participants = 0
        self._healthy_prev_participants = 0
        self._healthy_shrink_only = 0
        # The highest step any issued quorum reached, and how many healthy
        # participants hold it (all, and previous members only, which is whom
        # shrink_only admits): without one of them a quorum would redo steps.
        self._max_step = max_step  # restored from the state directory after a restart
        self._healthy_up_to_date = 0
        self._healthy_prev_up_to_date = 0
        self.quorums_issued = 0

    # ------------------------------------------------------------ inputs

    def heartbeat(self, replica_id: str, now: float) -> None:
        """Record that ``replica_id`` is alive at ``now``."""
        now = self._advance(now)
        heartbeats = self._heartbeats
        if replica_id in heartbeats:
            heartbeats[replica_id] = now
            heartbeats.move_to_end(replica_id)
            return
        heartbeats[replica_id] = now
        participant = self._participants.get(replica_id)
        if participant is not None:
            self._count(participant.member, +1)

    def join(self, member: Member, now: float) -> None:
        """``member`` asks to be in the next quorum (a Quorum call)."""
        if not member.replica_id:
            raise ValueError("replica_id must be a non-empty string")
        self.heartbeat(member.replica_id, now)
        now = self._now
        old = self._participants.get(member.replica_id)
        if old is not None:
            # The same replica calling again (a retry): newest data wins, the
            # original join time stays so a retry can't extend the join timeout.
            self._count(old.member, -1)
            old.member = member
        else:
            self._participants[member.replica_id] = _Participant(member, now)
        self._count(member, +1)

    def leave(self, replica_id: str) -> None:
        """``replica_id`` stopped waiting (its Quorum call was cancelled)."""
        participant = self._participants.pop(replica_id, None)
        if participant is not None and replica_id in self._heartbeats:
            self._count(participant.member, -1)

    def forget(self, replica_id: str) -> bool:
        """``replica_id`` is known to be gone (its lease broke): unhealthy and out of the next quorum now.

        Returns whether it was known. A later heartbeat or join brings it back,
        as for any replica.
        """
        was_heartbeating = self._heartbeats.pop(replica_id, None) is not None
        participant = self._participants.pop(replica_id, None)
        if participant is not None and was_heartbeating:
            self._count(participant.member, -1)
        return was_heartbeating or participant is not None

    def expire(self, now: float) -> list[str]:
        """Forget replicas whose heartbeat is too old; returns their ids."""
        now = self._advance(now)
        deadline = now - self.config.heartbeat_timeout
        heartbeats = self._heartbeats
        expired = []
        while heartbeats:
            replica_id, last = next(iter(heartbeats.items()))
            if last > deadline:
                break
            heartbeats.popitem(last=False)
            expired.append(replica_id)
            participant = self._participants.get(replica_id)
            if participant is not None:
                self._count(participant.member, -1)
        return expired

    # ------------------------------------------------------------ decisions

    def evaluate(self, now: float) -> Decision:
        """What the rules say at ``now``, without issuing anything.

        Call :meth:`expire` first (``decide`` does) so health is current.
        """
        now = self._advance(now)
        cfg = self.config
        healthy = len(self._heartbeats)
        joined = self._healthy_participants
        prev = self._prev
        shrink_only = prev is not None and self._healthy_shrink_only > 0
        eligible = self._healthy_prev_participants if shrink_only else joined
        up_to_date = self._healthy_prev_up_to_date if shrink_only else self._healthy_up_to_date
        shrink_note = " (shrink_only: previous members only)" if shrink_only else ""

        if prev is not None and prev.members and self._healthy_prev_participants == len(prev.members):
            return Decision(
                Status.FAST_QUORUM,
                f"fast quorum: all {len(prev.members)} members of quorum {prev.quorum_id} rejoined"
                f"{shrink_note}, {_n(eligible, 'participant')}",
            )
        if joined == 0:
            return Decision(Status.NO_PARTICIPANTS, f"no participants; {_n(healthy, 'healthy replica')} heartbeating")
        grace_left = self._started_at + cfg.startup_grace - now
        if prev is None and self._restart_evidence is not None and grace_left > 0:
            return Decision(
                Status.STARTUP_GRACE,
                f"waiting: the lighthouse restarted ({self._restart_evidence}); replicas already training get "
                f"{cfg.startup_grace:.1f}s to re-register before the first quorum ({grace_left:.1f}s left, "
                f"{_n(joined, 'participant')})",
                wake_at=self._started_at + cfg.startup_grace,
            )
        if eligible < cfg.min_replicas:
            return Decision(
                Status.BELOW_MIN_REPLICAS,
                f"waiting: {_n(eligible, 'eligible participant')}{shrink_note}, need min_replicas={cfg.min_replicas}",
            )
        if self._max_step > 0 and up_to_date == 0:
            return Decision(
                Status.BEHIND_COMMITTED,
                f"waiting: no participant{shrink_note} holds step {self._max_step}, the highest step a quorum reached; "
                "a quorum without one would redo committed steps (fresh or behind replicas only)",
            )
        if eligible * 2 <= healthy:
            return Decision(
                Status.SPLIT_BRAIN_GUARD,
                f"waiting: {_n(eligible, 'participant')} is not more than half of {_n(healthy, 'healthy replica')} "
                "(split-brain guard)",
            )
        stragglers = healthy - joined
        if stragglers > 0:
            first_joined = self._first_joined()
            deadline = first_joined + cfg.join_timeout
            if now < deadline:
                return Decision(
                    Status.WAITING_FOR_STRAGGLERS,
                    f"waiting for {_n(stragglers, 'straggler')}, "
                    f"{deadline - now:.1f} s of join timeout left ({joined} of {healthy} healthy replicas joined)",
                    wake_at=deadline,
                )
            return Decision(
                Status.VALID_QUORUM,
                f"valid quorum: {_n(eligible, 'participant')}{shrink_note}; join timeout expired with "
                f"{_n(stragglers, 'healthy replica')} not joined",
            )
        return Decision(
            Status.VALID_QUORUM,
            f"valid quorum: {_n(eligible, 'participant')}{shrink_note}, all healthy replicas joined",
        )

    def decide(self, now: float) -> tuple[Decision, list[str]]:
        """Expire stale heartbeats, evaluate, and issue a quorum when ready.

        Returns the decision (with ``quorum`` set if one was issued) and the
        replica ids whose heartbeat expired during this call.
        """
        expired = self.expire(now)
        decision = self.evaluate(now)
        if decision.ready:
            decision = Decision(decision.status, decision.reason, self._issue(self._now))
        return decision, expired

    # ------------------------------------------------------------ views

    @property
    def max_step(self) -> int:
        """The highest step an issued quorum reached."""
        return self._max_step

    @property
    def quorum_id(self) -> int:
        """Id of the last issued quorum (the seed before the first)."""
        return self._quorum_id

    @property
    def previous_quorum(self) -> IssuedQuorum | None:
        return self._prev

    def heartbeats(self) -> Iterator[tuple[str, float]]:
        """(replica_id, last heartbeat) for every replica not yet expired."""
        return iter(self._heartbeats.items())

    def participants(self) -> Iterator[tuple[Member, float]]:
        """(member, joined_at) for every participant, healthy or not."""
        return ((p.member, p.joined_at) for p in self._participants.values())

    @property
    def first_joined(self) -> float | None:
        """Join time of the earliest current participant, None without any."""
        return self._first_joined() if self._participants else None

    def is_heartbeating(self, replica_id: str) -> bool:
        """Whether ``replica_id`` has a heartbeat entry that has not been expired yet."""
        return replica_id in self._heartbeats

    def is_healthy(self, replica_id: str, now: float) -> bool:
        last = self._heartbeats.get(replica_id)
        return last is not None and now - last < self.config.heartbeat_timeout

    @property
    def num_heartbeating(self) -> int:
        return len(self._heartbeats)

    @property
    def num_participants(self) -> int:
        return len(self._participants)

    @property
    def num_healthy_participants(self) -> int:
        return self._healthy_participants

    # ------------------------------------------------------------ internals

    def _advance(self, now: float) -> float:
        # Heartbeat order relies on time never going backwards.
        if now > self._now:
            self._now = now
        return self._now

    def _count(self, member: Member, sign: int) -> None:
        self._healthy_participants += sign
        in_prev = member.replica_id in self._prev_ids
        if in_prev:
            self._healthy_prev_participants += sign
        if member.shrink_only:
            self._healthy_shrink_only += sign
        if member.step >= self._max_step:
            self._healthy_up_to_date += sign
            if in_prev:
                self._healthy_prev_up_to_date += sign

    def _first_joined(self) -> float:
        # Participants are kept in join order (see _issue for the re-queued ones).
        for participant in self._participants.values():
            return participant.joined_at
        return self._now

    def _issue(self, now: float) -> IssuedQuorum:
        shrink_only = self._prev is not None and self._healthy_shrink_only > 0
        heartbeats = self._heartbeats
        chosen = [
            p.member
            for rid, p in self._participants.items()
            if rid in heartbeats and (not shrink_only or rid in self._prev_ids)
        ]
        chosen.sort(key=lambda m: m.replica_id)
        ids = frozenset(m.replica_id for m in chosen)
        if ids != self._prev_ids or self._prev is None or any(m.commit_failures > 0 for m in chosen):
            self._quorum_id += 1
        quorum = IssuedQuorum(self._quorum_id, tuple(chosen), now)
        self._max_step = max([self._max_step, *(m.step for m in chosen)])
        self._prev = quorum
        self._prev_ids = ids
        self.quorums_issued += 1

        # Members are served; those left out wait for the next quorum.
        remaining = {rid: p for rid, p in self._participants.items() if rid not in ids}
        self._participants = remaining
        self._healthy_participants = self._healthy_prev_participants = self._healthy_shrink_only = 0
        self._healthy_up_to_date = self._healthy_prev_up_to_date = 0
        for rid, participant in remaining.items():
            participant.joined_at = now
            if rid in heartbeats:
                self._count(participant.member, +1)
        return quorum
