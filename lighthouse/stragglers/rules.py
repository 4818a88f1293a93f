"""The quorum rules plus straggler scores, and (opt-in) leaving a straggler out of the next quorums.

:class:`StragglerQuorumState` is a :class:`~lighthouse.quorum.QuorumState` that
records the compute times of every issued quorum's members in a
:class:`~lighthouse.stragglers.scores.StragglerBook` (which says who is
flagged), logs each flag (WARNING) and recovery (INFO), and with ``evict`` on
leaves a flagged group out, within limits (the rules are on the class; what a
user sees is in docs/health.md, "Stragglers").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping

from lighthouse.decision_log import preview
from lighthouse.epochs import StaleReplica
from lighthouse.quorum import Decision, IssuedQuorum, Member, QuorumConfig, QuorumState
from lighthouse.stragglers.scores import ComputeSample, GroupScores, StragglerBook, StragglerConfig, compute_sample_of
from torchft_lite.rpc.refusals import CountedLog

__all__ = ["MAX_COOLDOWN_DOUBLINGS", "StragglerQuorumState", "StragglerStatistics"]

logger = logging.getLogger(__name__)

MAX_COOLDOWN_DOUBLINGS = 5
"""The cooldown doubles with each eviction in a row, up to 2**5 = 32 x ``patience`` quorums."""


@dataclass(frozen=True)
class StragglerStatistics:
    """What /api/status and /metrics show of stragglers."""

    config: StragglerConfig
    groups: tuple[GroupScores, ...]
    """Every group with a compute sample, by replica id."""
    evicted: Mapping[str, str]
    """Held groups -> when they come back, in words."""
    kept_in: Mapping[str, str]
    """Flagged groups that the limits kept in -> why."""
    evictions: int
    readmissions: int
    refused_samples: int
    """Quorum requests whose compute_ms/compute_step were garbage (ignored, the request served)."""


@dataclass
class _Held:
    since: int
    """``quorums_issued`` when it was evicted."""
    cooldown: int
    """Quorums issued without it before it is readmitted."""
    last_seen: float
    pending: Member | None
    """Its waiting Quorum call's member, joined to the rules when it is readmitted."""


class _SampleRefusals(CountedLog):
    def note(self, replica_id: str, problem: str) -> None:
        unlogged = self._count("compute_sample")
        if unlogged is not None:
            logger.warning("%s ignored the compute time that replica %s advertises: %s%s", self.server, replica_id,
                           problem, f" [{unlogged} more ignored since the last such line]" if unlogged else "")


class StragglerQuorumState(QuorumState):
    """The quorum rules, with straggler scores and eviction.

    With ``evict`` on it acts on a flag:

    * **Eviction**: a flagged group is left out of the next quorums. The quorum
      rules forget it (so nobody waits for it: no join timeout, no split-brain
      count), while this class keeps it *held*: its heartbeats keep it alive here,
      and its Quorum call, if it makes one, waits (it is answered once it is
      readmitted and a quorum with it is issued). Waiting, not an error, is what
      both torchft's managers and ours already do for a quorum that leaves them
      out, and a manager whose call times out simply calls again.
    * **Limits**, checked before each eviction and again before every decision:
      the groups left in must be at least ``min_replicas`` and a strict majority
      of all healthy groups (the evicted ones counted): so never more than a
      minority is out, and never one of two. A flagged group that may not be
      evicted is only reported, with a WARNING saying why (once per reason). When
      the limits break later (a group died, its heartbeat expired or its lease
      ended) the held groups are readmitted at once, longest held first, until
      they hold again: an eviction never holds a quorum back.
    * **Cooldown**: a held group is readmitted after ``patience`` quorums were
      issued without it (counted in quorums, not seconds, because what an
      eviction saves and costs is the others' steps), doubled for each eviction in
      a row (up to 32 x, :data:`MAX_COOLDOWN_DOUBLINGS`): a group that is slow for
      good costs the others ever fewer slow steps. Readmitted, it rejoins behind
      and heals from the others.
    * **Probation**: back, it is judged on new relative scores only; once its
      smoothed relative score has been at or below the threshold for
      ``patience`` quorums in a row, its evictions in a row reset.

    Everything takes ``now`` from the caller, like the rules it extends; the only
    clock is ``log_clock``, which rate-limits the WARNING about refused samples.
    """

    def __init__(self, config: QuorumConfig, stragglers: StragglerConfig | None = None, *,
                 log_clock: Callable[[], float] = time.monotonic, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.stragglers = StragglerBook(stragglers)
        self._held: dict[str, _Held] = {}  # eviction order: the longest held first
        self._in_a_row: dict[str, int] = {}  # evictions in a row, until its probation ends
        self._kept_in: dict[str, str] = {}
        self._refusals = _SampleRefusals("lighthouse", clock=log_clock)
        self.evictions = 0
        self.readmissions = 0

    def sample_of(self, replica_id: str, data: str) -> ComputeSample | None:
        """The compute sample in a member's ``data`` (:func:`compute_sample_of`); garbage is counted, logged at
        most every 10 s, and ignored."""
        sample, problem = compute_sample_of(data)
        if problem is not None:
            self._refusals.note(replica_id, problem)
        return sample

    # ------------------------------------------------------------ inputs

    def heartbeat(self, replica_id: str, now: float) -> None:
        held = self._held.get(replica_id)
        if held is None:
            super().heartbeat(replica_id, now)
            return
        held.last_seen = max(held.last_seen, now)
        self.epochs.saw(replica_id, now)

    def join(self, member: Member, now: float) -> None:
        held = self._held.get(member.replica_id)
        if held is None:
            super().join(member, now)
            return
        try:
            self.epochs.check(member, self.max_step)
        except StaleReplica:
            self.fence(member.replica_id)
            raise
        held.pending = member  # waits until it is readmitted
        held.last_seen = max(held.last_seen, now)

    def leave(self, replica_id: str) -> None:
        held = self._held.get(replica_id)
        if held is None:
            super().leave(replica_id)
        else:
            held.pending = None

    def forget(self, replica_id: str) -> bool:
        held = self._held.pop(replica_id, None)
        known = super().forget(replica_id)
        self._drop(replica_id)
        return known or held is not None

    def expire(self, now: float) -> list[str]:
        expired = super().expire(now)
        if self._held:
            deadline = now - self.config.heartbeat_timeout
            for replica_id in [rid for rid, held in self._held.items() if held.last_seen <= deadline]:
                del self._held[replica_id]
                logger.info("straggler %s, left out of quorums, stopped heartbeating: forgotten", replica_id)
                expired.append(replica_id)
        for replica_id in expired:
            self._drop(replica_id)
        return expired

    # ------------------------------------------------------------ decisions

    def evaluate(self, now: float) -> Decision:
        decision = super().evaluate(now)
        if not self._held:
            return decision
        return replace(decision, reason=f"{decision.reason}; left out as stragglers: {self._held_note()}")

    def decide(self, now: float) -> tuple[Decision, list[str]]:
        expired = self.expire(now)
        self._readmit_while_limits_break(now)
        decision, more = super().decide(now)
        if decision.quorum is not None:
            self._after_issue(decision.quorum, now)
        return decision, expired + more

    # ------------------------------------------------------------ views

    def heartbeats(self) -> Iterator[tuple[str, float]]:
        """Held groups included: they are alive, just left out."""
        yield from super().heartbeats()
        for replica_id, held in self._held.items():
            yield replica_id, held.last_seen

    def is_heartbeating(self, replica_id: str) -> bool:
        return replica_id in self._held or super().is_heartbeating(replica_id)

    def is_healthy(self, replica_id: str, now: float) -> bool:
        held = self._held.get(replica_id)
        if held is None:
            return super().is_healthy(replica_id, now)
        return now - held.last_seen < self.config.heartbeat_timeout

    @property
    def num_heartbeating(self) -> int:
        return super().num_heartbeating + len(self._held)

    def is_evicted(self, replica_id: str) -> bool:
        return replica_id in self._held

    def straggler_statistics(self) -> StragglerStatistics:
        return StragglerStatistics(
            config=self.stragglers.config,
            groups=self.stragglers.all_scores(),
            evicted={rid: self._back_in(held) for rid, held in self._held.items()},
            kept_in=dict(self._kept_in),
            evictions=self.evictions,
            readmissions=self.readmissions,
            refused_samples=self._refusals.total,
        )

    # ------------------------------------------------------------ internals

    def _after_issue(self, quorum: IssuedQuorum, now: float) -> None:
        book = self.stragglers
        cfg = book.config
        for change in book.record({m.replica_id: m.compute for m in quorum.members}):
            self._log_transition(change.scores, change.flagged)
        for replica_id, held in list(self._held.items()):
            if self.quorums_issued - held.since >= held.cooldown:
                self._readmit(replica_id, now, f"its cooldown of {held.cooldown} quorums without it passed")
        for replica_id in list(self._in_a_row):
            if replica_id not in self._held and book.calm_streak(replica_id) >= cfg.patience:
                del self._in_a_row[replica_id]
                logger.info("straggler %s passed its probation: %d quorums in a row at or below the threshold "
                            "since it was readmitted", replica_id, cfg.patience)
        if cfg.evict:
            for member in quorum.members:
                if book.is_flagged(member.replica_id):
                    self._evict(member.replica_id, now)

    def _evict(self, replica_id: str, now: float) -> None:
        why_not = self._eviction_blocked()
        if why_not is not None:
            if self._kept_in.get(replica_id) != why_not:
                self._kept_in[replica_id] = why_not
                logger.warning("straggler %s is flagged but stays in the quorum: %s", replica_id, why_not)
            return
        self._kept_in.pop(replica_id, None)
        count = self._in_a_row.get(replica_id, 0) + 1
        self._in_a_row[replica_id] = count
        cooldown = self.stragglers.config.patience * 2 ** min(count - 1, MAX_COOLDOWN_DOUBLINGS)
        pending = next((m for m, _ in self.participants() if m.replica_id == replica_id), None)
        QuorumState.forget(self, replica_id)  # the rules' own: this class's would drop its scores
        self._held[replica_id] = _Held(self.quorums_issued, cooldown, now, pending)
        self.evictions += 1
        scores = self.stragglers.scores(replica_id)
        logger.warning("evicting straggler %s from the next quorums (eviction %d in a row): %s; readmitted on "
                       "probation after %d quorums without it", replica_id, count,
                       _describe(scores) if scores else "no scores", cooldown)

    def _eviction_blocked(self) -> str | None:
        """Why one more group may not be left out now, or None."""
        healthy = self.num_heartbeating  # the held ones included
        stay = healthy - len(self._held) - 1
        if healthy <= 2:
            return f"only {healthy} healthy groups: with two, neither is a majority of the other"
        if stay < self.config.min_replicas:
            return f"evicting it would leave {stay} groups in, below min_replicas={self.config.min_replicas}"
        if stay * 2 <= healthy:
            return (f"evicting it would leave {stay} of {healthy} healthy groups in, not a strict majority "
                    f"({len(self._held)} already left out)")
        return None

    def _readmit_while_limits_break(self, now: float) -> None:
        while self._held:
            healthy = self.num_heartbeating
            stay = healthy - len(self._held)
            if stay >= self.config.min_replicas and stay * 2 > healthy:
                return
            replica_id = next(iter(self._held))
            self._readmit(replica_id, now, f"only {stay} of {healthy} healthy groups are left in, below "
                          f"min_replicas={self.config.min_replicas} or not a strict majority")

    def _readmit(self, replica_id: str, now: float, why: str) -> None:
        held = self._held.pop(replica_id)
        self.readmissions += 1
        self.stragglers.readmitted(replica_id)
        QuorumState.heartbeat(self, replica_id, now)  # it heartbeated within the timeout, or it was expired
        logger.info("readmitting straggler %s on probation after %d quorums without it: %s", replica_id,
                    self.quorums_issued - held.since, why)
        if held.pending is not None:
            try:
                QuorumState.join(self, held.pending, now)
            except StaleReplica as exc:  # an epoch started while it was held: its next call is refused
                logger.warning("straggler %s not readmitted: %s", replica_id, exc)

    def _drop(self, replica_id: str) -> None:
        self.stragglers.forget(replica_id)
        self._in_a_row.pop(replica_id, None)
        self._kept_in.pop(replica_id, None)

    def _back_in(self, held: _Held) -> str:
        left = max(0, held.cooldown - (self.quorums_issued - held.since))
        return f"readmitted after {left} more quorum{'' if left == 1 else 's'}"

    def _held_note(self) -> str:
        return preview(f"{rid} ({self._back_in(held)})" for rid, held in self._held.items())

    def _log_transition(self, scores: GroupScores, flagged: bool) -> None:
        cfg = self.stragglers.config
        if flagged:
            logger.warning("straggler %s flagged: %s, above %.2f for %d quorums in a row%s", scores.replica_id,
                           _describe(scores), cfg.threshold, cfg.patience,
                           "" if cfg.evict else " (only reported: the lighthouse runs without --evict-stragglers)")
        else:
            logger.info("straggler %s recovered: %s, at or below %.2f", scores.replica_id, _describe(scores),
                        cfg.threshold)


def _describe(s: GroupScores) -> str:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    return (f"compute {s.compute_ms:.1f} ms at step {s.compute_step}, relative score {ratio(s.relative)} "
            f"(quorum median {ms(s.quorum_median_ms)}), individual score {ratio(s.individual)} "
            f"(own median {ms(s.own_median_ms)})")
