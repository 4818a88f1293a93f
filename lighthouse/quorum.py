"""The lighthouse's quorum rules as a pure state machine: :class:`QuorumState`.

No gRPC, asyncio or clock in here: every method that depends on time takes
``now`` (monotonic seconds) from the caller, so tests pass literal timestamps.
The rules (torchft's, then ours: the startup grace, the stale-quorum guard and
the lineage fence) are stated on :class:`QuorumState`; new epochs and the fence
of replicas from before one are :mod:`lighthouse.epochs`'. What they mean for a
job is in docs/lighthouse.md.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Iterator

from lighthouse.epochs import EpochBook, StaleReplica
from lighthouse.quorum_data import Decision, Epoch, IssuedQuorum, Member, QuorumConfig, Status, plural

__all__ = ["Decision", "Epoch", "IssuedQuorum", "Member", "QuorumConfig", "QuorumState", "StaleReplica", "Status"]

MAX_DROPPED = 1024  # members dropped from the last quorum that the lineage fence remembers


@dataclass
class _Participant:
    member: Member
    joined_at: float


class QuorumState:
    """Heartbeats, participants and the previous quorum, and the rules that turn them into quorums.

    torchft's rules, so mixed fleets agree:

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

    Ours (a restarted lighthouse or a minority must not redo committed steps,
    and every wait has a bounded way out):

    * **Startup grace**: a lighthouse that knows an earlier incarnation of itself
      issued quorums (``restart_evidence``, from its state directory) issues no
      first quorum until ``startup_grace`` after it started, so replicas already
      training re-register first. A first start has nobody to wait for and answers
      at once, as torchft's lighthouse does.
    * **Stale-quorum guard**: no quorum of eligible participants that are all
      behind ``max_step``, the highest step a quorum reached (restored from the
      state directory after a restart), while a holder of it may come back.
    * **New epoch** and **fence** (:class:`~lighthouse.epochs.EpochBook`): ``decide``
      lets the guard give way at the participants' step; a replica from before
      the epoch is refused (``join`` raises :class:`StaleReplica`).
    * **Lineage fence** (:meth:`_fence_lineages`): a member that comes back having
      committed a step the others redid without it is given that step, so it heals.

    Cost: a join, heartbeat or ``evaluate`` is O(1) amortized (incremental
    counters; heartbeats pruned from the front of a list in last-seen order); only
    issuing a quorum (O(n log n)), starting an epoch and a guard blocking resumed
    participants (O(n)) visit every one. torchft recomputes every set: O(n^2).

    Not thread-safe: the server calls it from one event loop.
    """

    def __init__(self, config: QuorumConfig, *, last_quorum_id: int = 0, started_at: float = -math.inf,
                 max_step: int = 0, restart_evidence: str | None = None) -> None:
        """``restart_evidence``: why this lighthouse knows an earlier incarnation
        issued quorums (e.g. "its state dir holds quorum id 17"), shown in the
        startup grace's reason; None for a first start, which gets no grace:
        nobody can be training yet, so there is nobody to wait for. The holder
        timeout of a restored ``max_step`` counts from ``started_at``."""
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
        # Lineage fence: members dropped from the last quorum -> their step in it; and which of them the
        # others since redid that step without.
        self._dropped: OrderedDict[str, int] = OrderedDict()
        self._redone: set[str] = set()
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
        # How many of them just resumed from a durable checkpoint (resumed_from == step).
        self._healthy_resumed = 0
        self._healthy_prev_resumed = 0
        self._epochs = EpochBook(started_at)
        self._new_id_due = False  # an epoch started: its first quorum gets a new id whatever its members
        self.quorums_issued = 0

    # ------------------------------------------------------------ inputs

    def heartbeat(self, replica_id: str, now: float) -> None:
        """Record that ``replica_id`` is alive at ``now`` (ignored while it is fenced, see :meth:`join`)."""
        now = self._advance(now)
        epochs = self._epochs
        if epochs.is_fenced(replica_id):
            return
        epochs.saw(replica_id, now)
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
        """``member`` asks to be in the next quorum (a Quorum call).

        Raises :class:`StaleReplica` when it is from before the current epoch:
        then it is also forgotten (a call it had waiting is dropped) and fenced.
        """
        if not member.replica_id:
            raise ValueError("replica_id must be a non-empty string")
        try:
            self._epochs.check(member, self._max_step)
        except StaleReplica:
            self.fence(member.replica_id)
            raise
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
        self._epochs.dropped(replica_id, replica_id in self._prev_ids)
        return was_heartbeating or participant is not None

    def fence(self, replica_id: str) -> None:
        """Forget ``replica_id`` and ignore its heartbeats until it joins at a step the rules accept."""
        self.forget(replica_id)
        self._epochs.fence(replica_id)

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
            self._epochs.dropped(replica_id, replica_id in self._prev_ids)
        return expired

    def request_epoch(self, reason: str) -> None:
        """Ask for a new epoch at the next decision, if the stale-quorum guard blocks then (an operator's action)."""
        self._epochs.requested = reason

    # ------------------------------------------------------------ decisions

    def evaluate(self, now: float) -> Decision:
        """What the rules say at ``now``, without issuing anything or starting an epoch.

        Call :meth:`expire` first (``decide`` does) so health is current.
        """
        now = self._advance(now)
        cfg = self.config
        healthy = len(self._heartbeats)
        joined = self._healthy_participants
        prev = self._prev
        shrink_only = self._shrink_only()
        eligible = self._healthy_prev_participants if shrink_only else joined
        up_to_date = self._healthy_prev_up_to_date if shrink_only else self._healthy_up_to_date
        shrink_note = " (shrink_only: previous members only)" if shrink_only else ""

        if prev is not None and prev.members and self._healthy_prev_participants == len(prev.members):
            return Decision(
                Status.FAST_QUORUM,
                f"fast quorum: all {len(prev.members)} members of quorum {prev.quorum_id} rejoined"
                f"{shrink_note}, {plural(eligible, 'participant')}",
            )
        if joined == 0:
            return Decision(Status.NO_PARTICIPANTS, f"no participants; {plural(healthy, 'healthy replica')} heartbeating")
        grace_left = self._started_at + cfg.startup_grace - now
        if prev is None and self._restart_evidence is not None and grace_left > 0:
            return Decision(
                Status.STARTUP_GRACE,
                f"waiting: the lighthouse restarted ({self._restart_evidence}); replicas already training get "
                f"{cfg.startup_grace:.1f}s to re-register before the first quorum ({grace_left:.1f}s left, "
                f"{plural(joined, 'participant')})",
                wake_at=self._started_at + cfg.startup_grace,
            )
        if eligible < cfg.min_replicas:
            return Decision(
                Status.BELOW_MIN_REPLICAS,
                f"waiting: {plural(eligible, 'eligible participant')}{shrink_note}, need min_replicas={cfg.min_replicas}",
            )
        if self._max_step > 0 and up_to_date == 0:
            note, lifts_at = self._epochs.guard_note(now, self._max_step, cfg.holder_timeout, cfg.heartbeat_timeout,
                                                     self._all_resumed(shrink_only))
            return Decision(
                Status.BEHIND_COMMITTED,
                f"waiting: no participant{shrink_note} holds step {self._max_step}, the highest step a quorum reached; "
                f"a quorum without one would redo committed steps (fresh or behind replicas only); {note}",
                wake_at=lifts_at,
            )
        if eligible * 2 <= healthy:
            return Decision(
                Status.SPLIT_BRAIN_GUARD,
                f"waiting: {plural(eligible, 'participant')} is not more than half of {plural(healthy, 'healthy replica')} "
                "(split-brain guard)",
            )
        stragglers = healthy - joined
        if stragglers > 0:
            first_joined = self._first_joined()
            deadline = first_joined + cfg.join_timeout
            if now < deadline:
                return Decision(
                    Status.WAITING_FOR_STRAGGLERS,
                    f"waiting for {plural(stragglers, 'straggler')}, "
                    f"{deadline - now:.1f} s of join timeout left ({joined} of {healthy} healthy replicas joined)",
                    wake_at=deadline,
                )
            return Decision(
                Status.VALID_QUORUM,
                f"valid quorum: {plural(eligible, 'participant')}{shrink_note}; join timeout expired with "
                f"{plural(stragglers, 'healthy replica')} not joined",
            )
        return Decision(
            Status.VALID_QUORUM,
            f"valid quorum: {plural(eligible, 'participant')}{shrink_note}, all healthy replicas joined",
        )

    def decide(self, now: float) -> tuple[Decision, list[str]]:
        """Expire stale heartbeats, evaluate, start a new epoch when the stale-quorum guard
        blocks and one is due, and issue a quorum when ready.

        Returns the decision (with ``quorum`` set if one was issued, ``epoch``
        and ``fenced`` if an epoch started) and the replica ids whose heartbeat
        expired during this call. An operator's :meth:`request_epoch` counts for
        this decision only.
        """
        expired = self.expire(now)
        decision = self.evaluate(now)
        requested, self._epochs.requested = self._epochs.requested, None
        epoch, fenced = None, ()
        if decision.status is Status.BEHIND_COMMITTED:
            cfg = self.config
            why = requested or self._epochs.lift_reason(self._now, self._max_step, cfg.holder_timeout,
                                                        cfg.heartbeat_timeout, self._all_resumed(self._shrink_only()))
            if why is not None:
                epoch, fenced = self._start_epoch(self._now, why)
                decision = self.evaluate(now)
        if decision.ready:
            decision = replace(decision, quorum=self._issue(self._now))
        if epoch is not None:
            decision = replace(decision, epoch=epoch, fenced=fenced)
        return decision, expired

    # ------------------------------------------------------------ views

    @property
    def max_step(self) -> int:
        """The highest step an issued quorum reached (lowered only by a new epoch)."""
        return self._max_step

    @property
    def epoch(self) -> Epoch | None:
        """The latest epoch this state started; None before the first."""
        return self._epochs.current

    @property
    def epochs(self) -> EpochBook:  # holders of max_step, when one was last seen, who is fenced: read only
        return self._epochs

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
            if self._epochs.holders_seen_at == -math.inf:  # no start time was given: count from the first call
                self._epochs.holders_seen_at = now
            self._now = now
        return self._now

    def _shrink_only(self) -> bool:
        return self._prev is not None and self._healthy_shrink_only > 0

    def _all_resumed(self, shrink_only: bool) -> frozenset[str] | None:
        """The eligible participants' ids if every one just resumed from a durable checkpoint, else None."""
        resumed, eligible = ((self._healthy_prev_resumed, self._healthy_prev_participants) if shrink_only
                             else (self._healthy_resumed, self._healthy_participants))
        return frozenset(m.replica_id for m in self._eligible()) if resumed == eligible else None

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
        if member.resumed_from is not None and member.resumed_from == member.step:
            self._healthy_resumed += sign
            if in_prev:
                self._healthy_prev_resumed += sign

    def _recount(self) -> None:
        self._healthy_participants = self._healthy_prev_participants = self._healthy_shrink_only = 0
        self._healthy_up_to_date = self._healthy_prev_up_to_date = 0
        self._healthy_resumed = self._healthy_prev_resumed = 0
        for rid, participant in self._participants.items():
            if rid in self._heartbeats:
                self._count(participant.member, +1)

    def _first_joined(self) -> float:
        # Participants are kept in join order (see _issue for the re-queued ones).
        for participant in self._participants.values():
            return participant.joined_at
        return self._now

    def _eligible(self) -> list[Member]:
        """Healthy participants a quorum would take (previous members only under shrink_only), in join order."""
        shrink_only = self._shrink_only()
        heartbeats = self._heartbeats
        return [
            p.member
            for rid, p in self._participants.items()
            if rid in heartbeats and (not shrink_only or rid in self._prev_ids)
        ]

    def _start_epoch(self, now: float, reason: str) -> tuple[Epoch, tuple[Member, ...]]:
        eligible = self._eligible()
        to_step = max([0, *(m.step for m in eligible)])  # the guard blocked: below max_step
        holders = (m.replica_id for m in eligible if m.step >= to_step)
        epoch = self._epochs.start(now, self._max_step, to_step, reason, holders, self._quorum_id + 1)
        self._max_step = to_step
        self._new_id_due = True
        # Waiting above the new step but not eligible (no live heartbeat, or kept
        # out by shrink_only): from before the epoch, like a late Quorum call would be.
        fenced = tuple(p.member for p in self._participants.values() if p.member.step > to_step)
        for member in fenced:
            self.fence(member.replica_id)
        self._recount()
        return epoch, fenced

    def _fence_lineages(self, chosen: list[Member]) -> tuple[tuple[str, int, int], ...]:
        """The lineage fence: remember the members of the last quorum that ``chosen`` leaves out, note those
        whose step it redoes, and lower the step of each chosen member that committed a step the others redid.
        Returns what it lowered.

        A member of the last issued quorum that the next one leaves out (its heartbeat expired, its lease
        ended, or it did not rejoin within the join timeout) is remembered with the step it had there, S. If
        that next quorum (or a later one without it) is issued at highest step S, the others redo step S
        without it; if it then comes back reporting a step above S while another member of its new quorum
        reports as much, it committed step S on a lineage the others did not keep (its peers failed that step
        while it committed it). The quorum gives it step S instead, so every manager, ours and torchft's,
        heals it from the others: two lineages never both go on. A quorum that takes it in resolves it; the
        newest ``MAX_DROPPED`` are kept.
        """
        top = max((m.step for m in chosen), default=0)
        ids = {m.replica_id for m in chosen}
        if self._prev is not None:
            for member in self._prev.members:
                if member.replica_id not in ids:
                    self._dropped[member.replica_id] = member.step
                    self._dropped.move_to_end(member.replica_id)
                    self._redone.discard(member.replica_id)
            while len(self._dropped) > MAX_DROPPED:
                oldest, _ = self._dropped.popitem(last=False)
                self._redone.discard(oldest)
        for replica_id, step in self._dropped.items():
            if replica_id not in ids and step == top:
                self._redone.add(replica_id)
        lowered = []
        for i, member in enumerate(chosen):
            step = self._dropped.pop(member.replica_id, None)
            if step is None:
                continue
            redone = member.replica_id in self._redone
            self._redone.discard(member.replica_id)
            others_top = max((m.step for m in chosen if m is not member), default=-1)
            if redone and member.step > step and others_top >= member.step:
                chosen[i] = replace(member, step=step)
                lowered.append((member.replica_id, member.step, step))
        return tuple(lowered)

    def _issue(self, now: float) -> IssuedQuorum:
        chosen = self._eligible()
        chosen.sort(key=lambda m: m.replica_id)
        ids = frozenset(m.replica_id for m in chosen)
        if (ids != self._prev_ids or self._prev is None or self._new_id_due
                or any(m.commit_failures > 0 for m in chosen)):
            self._quorum_id += 1
        self._new_id_due = False
        lowered = self._fence_lineages(chosen)
        quorum = IssuedQuorum(self._quorum_id, tuple(chosen), now, lowered)
        self._max_step = max([self._max_step, *(m.step for m in chosen)])
        left = self._prev_ids - ids
        self._prev = quorum
        self._prev_ids = ids
        self.quorums_issued += 1
        self._epochs.issued(chosen, self._max_step, now, left=left, heartbeating=self._heartbeats)

        # Members are served; those left out wait for the next quorum.
        self._participants = {rid: p for rid, p in self._participants.items() if rid not in ids}
        for participant in self._participants.values():
            participant.joined_at = now
        self._recount()
        return quorum
