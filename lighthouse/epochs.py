"""The stale-quorum guard's bounded way out: holders of the highest step, new epochs of the job, and the fence.

The guard (:mod:`lighthouse.quorum`) keeps participants that are all behind
``max_step``, the highest step a quorum reached, from forming a quorum while a
replica holding that step may come back. :class:`EpochBook` tells "may come
back" from "gone" (:meth:`EpochBook.lift_reason` states when a new epoch
starts) and fences a replica from before the epoch (:meth:`EpochBook.check`).

Pure data and rules, no clock: times are the caller's monotonic seconds.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Collection, Container, Iterable

from lighthouse.quorum_data import Epoch, Member

__all__ = ["MAX_FENCED", "RESUMED_FROM_KEY", "RESUMED_QUORUM_KEY", "EpochBook", "StaleReplica", "group_of",
           "resumed_from_of", "resumed_quorum_of"]

MAX_FENCED = 1024
RESUMED_FROM_KEY = "resumed_from"
RESUMED_QUORUM_KEY = "resumed_quorum"
_INT64_MAX = 2**63 - 1


def resumed_from_of(data: str) -> int | None:
    """The ``resumed_from`` step a member advertises in its ``QuorumMember.data``, or None.

    ``data`` is free-form (a JSON object by convention, and torchft managers put
    other things there): anything but a JSON object holding an integer from 0 to
    2**63-1 under ``resumed_from`` means None, never an error.
    """
    return _advertised_int(data, RESUMED_FROM_KEY)


def resumed_quorum_of(data: str) -> int | None:
    """The ``resumed_quorum`` a member advertises: the id of the quorum under which the state of the durable
    checkpoint it resumed from was committed (its manifest's ``quorum_id``); None as for :func:`resumed_from_of`."""
    return _advertised_int(data, RESUMED_QUORUM_KEY)


def _advertised_int(data: str, key: str) -> int | None:
    if not data:
        return None
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, an integer of too many digits, or nested absurdly deep
        return None
    value = parsed.get(key) if isinstance(parsed, dict) else None
    if type(value) is not int or not 0 <= value <= _INT64_MAX:  # type(): a bool is not a step
        return None
    return value


def group_of(replica_id: str) -> str | None:
    """The replica group ``replica_id`` belongs to: what precedes its last ``:`` (a Manager names its process
    ``<replica_id>:<uuid>``), or None for an id without one."""
    group, sep, _ = replica_id.rpartition(":")
    return group if sep and group else None


def _resumed_within(member: Member, epoch: Epoch) -> bool:
    """Whether ``member`` just resumed from a durable checkpoint of a step committed during ``epoch`` (under one
    of its quorums): a new process of this epoch's lineage, though above the step its last quorum reached
    (the step that quorum committed, saved by a group that then left). A checkpoint of the lineage from
    before the epoch names an older quorum; one that names none (an older manifest) is not admitted.

    The fence must admit it: a group that commits the step of the epoch's last quorum and saves it as it
    leaves holds ``max_step + 1``, and a whole job restarted from that checkpoint would otherwise be refused
    at every Quorum call, for good."""
    return (member.resumed_from is not None and member.resumed_from == member.step
            and member.resumed_quorum is not None and member.resumed_quorum >= epoch.first_quorum_id)


class StaleReplica(Exception):
    """A replica from before the current epoch asked to join; the message tells it what to do."""

    def __init__(self, replica_id: str, step: int, max_step: int, epoch: Epoch) -> None:
        super().__init__(
            f"replica {replica_id!r} is from before the job's current epoch (number {epoch.number} since this "
            f"lighthouse started, which started at step "
            f"{epoch.to_step}, down from {epoch.from_step}): it reports step {step}, above step {max_step} that "
            "quorums reached since, and was in none of them; it must restart, then it resumes from a checkpoint "
            "or heals from the current replicas"
        )
        self.replica_id = replica_id
        self.step = step
        self.epoch = epoch


class EpochBook:
    """The holders of ``max_step``, the current epoch and who may join after it.

    * **Holders**: the members of the last issued quorum at the new ``max_step``.
      ``holders_seen_at`` is the last time one of them was seen: the quorum's
      issue, then every heartbeat or join of a holder id. A lighthouse that
      restored ``max_step`` from its state directory counts from its start, and
      knows the holders saved with it (none from an older state directory).
    * **New epoch**: see :meth:`lift_reason` and :meth:`start`.
    * **Fence**: see :meth:`check`.

    Bounded memory: the ids admitted since the epoch are kept only while
    heartbeating or in the last quorum (one that is neither and later comes back
    above ``max_step`` is refused and restarts: it loses nothing but the restart,
    as it heals from the others); the fenced ids are the newest ``MAX_FENCED``
    (an older one's heartbeats count again, its Quorum calls are still refused).

    :class:`lighthouse.quorum.QuorumState` owns one and tells it what it sees;
    every call is O(1) except :meth:`issued` (O(quorum size)).
    """

    def __init__(self, started_at: float) -> None:
        self.holders: frozenset[str] = frozenset()
        self.holders_seen_at = started_at
        """When a holder was last seen; the lighthouse's start when it knows none."""
        self.current: Epoch | None = None
        self.requested: str | None = None
        """An operator's request for a new epoch (its reason), for the next decision."""
        self._admitted: set[str] = set()
        self._fenced: OrderedDict[str, None] = OrderedDict()

    @property
    def number(self) -> int:
        return 0 if self.current is None else self.current.number

    def is_fenced(self, replica_id: str) -> bool:
        return bool(self._fenced) and replica_id in self._fenced

    def is_admitted(self, replica_id: str) -> bool:
        """Whether ``replica_id`` is known to have been in a quorum issued since the epoch began."""
        return replica_id in self._admitted

    # ------------------------------------------------------------ what the state saw

    def saw(self, replica_id: str, now: float) -> None:
        """A heartbeat or join of ``replica_id``."""
        if replica_id in self.holders:
            self.holders_seen_at = now

    def issued(self, members: Iterable[Member], max_step: int, now: float, *, left: Iterable[str],
               heartbeating: Container[str]) -> None:
        """A quorum of ``members`` was issued; ``max_step`` is the new highest step, ``left``
        the members of the previous quorum not in it."""
        members = tuple(members)
        holders = frozenset(m.replica_id for m in members if m.step >= max_step)
        if holders:  # else every member is behind (a fast quorum ignores steps): the holders stay who they were
            self.holders, self.holders_seen_at = holders, now
        if self.current is not None:
            self._admitted.update(m.replica_id for m in members)
            for replica_id in left:
                if replica_id not in heartbeating:
                    self._admitted.discard(replica_id)

    def dropped(self, replica_id: str, in_last_quorum: bool) -> None:
        """``replica_id``'s heartbeat expired or it was forgotten."""
        if not in_last_quorum:
            self._admitted.discard(replica_id)

    def restore(self, holders: Iterable[str]) -> None:
        """The holders an earlier incarnation of the lighthouse saved with the step it restored (see
        :mod:`lighthouse.fencing`); not seen since this one started."""
        self.holders = frozenset(holders)

    # ------------------------------------------------------------ the guard's way out

    def superseded(self, resumed: Collection[str]) -> bool:
        """Whether every holder's replica group is among ``resumed`` (the ids of participants that just
        resumed from a checkpoint) under another id: each holder restarted, so no copy of ``max_step`` is
        left but a checkpoint's. True when no holder is known; False for a holder whose id names no group."""
        groups = {group_of(replica_id) for replica_id in resumed}
        return all(holder not in resumed and group_of(holder) in groups - {None} for holder in self.holders)

    def lift_reason(self, now: float, max_step: int, holder_timeout: float, heartbeat_timeout: float,
                    resumed: Collection[str] | None) -> str | None:
        """Why the guard, now blocking, should give way to a new epoch (an operator's request aside); None while
        it should hold. ``resumed``: the eligible participants' ids when every one just resumed from a durable
        checkpoint, else None.

        While the guard blocks (with at least ``min_replicas`` eligible participants) it gives way when (a) no
        holder was seen for ``holder_timeout`` (nor for ``heartbeat_timeout``, if that is longer: never while a
        holder may be healthy); or (b) every eligible participant just resumed from a durable checkpoint (its
        ``resumed_from`` equals its step), no holder is healthy (none seen within ``heartbeat_timeout``) and
        every holder is :meth:`superseded`: its replica group (:func:`group_of`; torchft's Managers and ours
        append a new uuid per process) is among the resumed participants under another id, so it restarted and
        its state is gone. A holder that is only hung or cut off is not, and the job waits for it up to
        ``holder_timeout``. With no holder known (a restored ``max_step`` from an older state directory), (b)
        needs no supersession. (c), an operator's request, is ``QuorumState.request_epoch``'s: it counts for
        the next decision only.
        """
        unseen = now - self.holders_seen_at
        if unseen >= max(holder_timeout, heartbeat_timeout):
            return f"{self._unseen(max_step, unseen)} (holder timeout {holder_timeout:.1f}s)"
        if resumed is not None and unseen >= heartbeat_timeout and self.superseded(resumed):
            return (f"every participant resumed from a durable checkpoint, {self._restarted()} and none is "
                    f"healthy: {self._unseen(max_step, unseen)}")
        return None

    def guard_note(self, now: float, max_step: int, holder_timeout: float, heartbeat_timeout: float,
                   resumed: Collection[str] | None) -> tuple[str, float]:
        """The blocking guard's countdown, for its reason, and the time it runs out."""
        lifts_at = self.holders_seen_at + max(holder_timeout, heartbeat_timeout)  # never while one may be healthy
        note = (f"{self._unseen(max_step, now - self.holders_seen_at)}; a new epoch starts at the participants' "
                f"step in {max(0.0, lifts_at - now):.1f}s unless one comes back (holder timeout {holder_timeout:.1f}s)")
        if resumed is not None and self.superseded(resumed):
            resumed_at = self.holders_seen_at + heartbeat_timeout
            note += (f", or in {max(0.0, resumed_at - now):.1f}s as every participant resumed from a checkpoint "
                     f"and {self._restarted()}")
            lifts_at = min(lifts_at, resumed_at)
        elif resumed is not None:
            note += ("; every participant resumed from a checkpoint, but not every holder's replica group "
                     "restarted (a holder may only be hung or cut off)")
        return note, lifts_at

    def _restarted(self) -> str:
        return "every holder's replica group restarted" if self.holders else "no holder is known"

    def _unseen(self, max_step: int, unseen: float) -> str:
        if self.holders:
            return f"no holder of step {max_step} seen for {unseen:.1f}s"
        return (f"no holder of step {max_step} seen in the {unseen:.1f}s since the lighthouse started "
                "(its state dir holds the step, not who holds it)")

    def start(self, now: float, from_step: int, to_step: int, reason: str, holders: Iterable[str],
              first_quorum_id: int) -> Epoch:
        """A new epoch begins: ``holders`` (the participants at ``to_step``) hold the new highest step;
        ``first_quorum_id``: the id its first quorum gets (ids only grow). ``to_step`` is the highest step
        among the eligible participants (0 at least), and the next quorum gets a new id, as after a restart."""
        self.current = Epoch(self.number + 1, now, from_step, to_step, reason, first_quorum_id)
        self.holders, self.holders_seen_at = frozenset(holders), now
        self._admitted.clear()
        return self.current

    # ------------------------------------------------------------ the fence

    def check(self, member: Member, max_step: int) -> None:
        """Raise :class:`StaleReplica` if ``member`` is from before the current epoch; else it is no longer fenced.

        After an epoch started in this process, a replica that reports a step above ``max_step`` and was in
        none of the quorums issued since the epoch began is from before it (say, a partitioned holder coming
        back): its join is refused instead of making it everyone's heal source, and its heartbeats are ignored
        (:meth:`fence`) until it joins at a step the rules accept, so it does not count as healthy either. The
        one replica above ``max_step`` admitted without a quorum since: one that just resumed from a durable
        checkpoint committed under a quorum of this epoch (:func:`_resumed_within`).
        """
        epoch = self.current
        if (epoch is not None and member.step > max_step and member.replica_id not in self._admitted
                and not _resumed_within(member, epoch)):
            raise StaleReplica(member.replica_id, member.step, max_step, epoch)
        if self._fenced:
            self._fenced.pop(member.replica_id, None)

    def fence(self, replica_id: str) -> None:
        """Ignore ``replica_id``'s heartbeats until it joins at a step the rules accept."""
        self._fenced[replica_id] = None
        self._fenced.move_to_end(replica_id)
        if len(self._fenced) > MAX_FENCED:
            self._fenced.popitem(last=False)
