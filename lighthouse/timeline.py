"""What the job did and is doing, as the lighthouse sees it: its history, fed, and the status line.

Pure: no clock, network or asyncio. The server (a thin feeder) tells
:class:`Timeline` what happens, each with ``now`` (monotonic seconds); it keeps
a :class:`~lighthouse.history.History` of samples and markers (steps, stalls,
heals, groups gone and back, new epochs, rewinds, straggler evictions) and
says the status line (:class:`JobStatus`). How it knows each of these is on
:class:`Timeline`; what the dashboard shows is in docs/lighthouse.md.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Collection, Mapping

from lighthouse.decision_log import preview
from lighthouse.epochs import group_of
from lighthouse.history import SAMPLE_INTERVAL, History, Marker, Sample
from lighthouse.quorum_data import Epoch, IssuedQuorum, Status, plural

__all__ = ["HealInProgress", "JobStatus", "STALL_AFTER", "Timeline", "TimelineStatistics", "name_of"]

STALL_AFTER = 1.0
"""Seconds: the shortest gap between quorums that counts as a stall."""
STALL_FACTOR = 3.0
"""A gap counts as a stall only above this many times the median recent gap, too."""
PACE_UNKNOWN = 10.0
"""Seconds: the shortest stall while the job's pace is unknown (before its second quorum, and after a new epoch)."""
RECENT_QUORUMS = 64
"""Quorums kept for the step rate and the median gap."""
RATE_WINDOW = 10.0
"""Seconds the status line's steps/s looks back (at least)."""
MAX_GONE = 1024
"""Groups gone and not back yet that are remembered (the newest), to mark their return."""


def name_of(replica_id: str) -> str:
    """What a person calls the group: ``train_ddp_1`` for a Manager's ``train_ddp_1:<uuid>``."""
    return group_of(replica_id) or replica_id


def _names(ids: Collection[str]) -> str:
    return preview(sorted({name_of(rid) for rid in ids}), limit=3)


@dataclass(frozen=True)
class HealInProgress:
    replica_id: str
    sources: tuple[str, ...]
    """The members at the highest step of the quorum it began in (where its state comes from)."""
    steps_behind: int
    since: float
    quorum_id: int


@dataclass(frozen=True)
class JobStatus:
    """The status line: what the job is doing now, in words a person reads at a glance."""

    state: str
    """One of :data:`lighthouse.history.STATES`."""
    headline: str
    """E.g. 'training: 2 groups at step 324, 13.1 steps/s'."""
    detail: str
    """What the quorum rules say now (their reason, unchanged)."""
    trouble: bool
    """Whether a person should look (a stall; a job that does not start): the page colours only then."""
    since: float | None
    """Monotonic time the state began, for the states that last (waiting, healing, stalled, stopped)."""
    step: int | None
    steps_per_s: float | None
    groups: int
    """Members of the last quorum."""
    healing: tuple[HealInProgress, ...]

    def to_json(self, now: float) -> dict:
        return {
            "state": self.state, "headline": self.headline, "detail": self.detail, "trouble": self.trouble,
            "for_s": None if self.since is None else round(now - self.since, 3),
            "step": self.step,
            "steps_per_s": None if self.steps_per_s is None else round(self.steps_per_s, 3),
            "groups": self.groups,
            "healing": [{"replica_id": h.replica_id, "sources": list(h.sources), "steps_behind": h.steps_behind,
                         "for_s": round(now - h.since, 3), "quorum_id": h.quorum_id} for h in self.healing],
        }


@dataclass(frozen=True)
class TimelineStatistics:
    """Counts of what the timeline saw (read by /metrics)."""

    state: str
    steps_per_second: float
    stalls: int
    stall_seconds: float
    heals: int
    heal_seconds: float
    heals_failed: int
    groups_gone: int
    groups_back: int
    samples: int
    markers: int


@dataclass(frozen=True)
class _Quorum:
    """What the timeline keeps of the last issued quorum."""

    quorum_id: int
    issued_at: float
    steps: Mapping[str, int]
    top: int
    groups: frozenset[str]


@dataclass
class _Second:
    """What the second under way saw so far."""

    quorums: int = 0
    smallest_quorum: int | None = None
    fewest_healthy: int | None = None
    most_participants: int = 0


class Timeline:
    """Feeds a :class:`~lighthouse.history.History` and tells the status line.

    Inputs: :meth:`observe` after every decision of the quorum rules (O(1): folds
    health and participants into the second under way and keeps a
    :class:`~lighthouse.history.Sample` once a second has passed);
    :meth:`quorum_issued` with every issued quorum (O(members): steps, stalls,
    groups back or joined, heals begun and finished, rewinds); :meth:`gone`,
    :meth:`epoch_started` and :meth:`left_out` (groups gone, new epochs,
    straggler evictions).

    What it can know, and how:

    * **Steps** are the highest step of each issued quorum (the members report
      their committed step when they ask for the next quorum), so steps/s is what
      the job commits, for torchft's managers too.
    * **A stall** is a gap between two quorums longer than
      ``max(STALL_AFTER, STALL_FACTOR x the median gap of the last RECENT_QUORUMS)``
      (``PACE_UNKNOWN`` while no gap is known yet): a job whose steps take a minute
      does not stall at each one. It is marked when the next quorum of the same job
      (a member, or a member's group, of the last one) is issued; while it lasts the
      status line says so. Its sentence says which groups went meanwhile and what
      the quorum rules waited for, if anyone waited.
    * **A heal** begins when a quorum holds a member behind its highest step (it
      receives the state from the members at that step; a striped heal takes from
      several) and ends at the first later quorum where it is at that step. Its
      size is the steps it was behind; the bytes are known to the trainers only
      (``torchft_lite_heal_bytes_total``).
    * **Gone and back** go by replica group: a Manager names its process
      ``<group>:<uuid>`` (:func:`lighthouse.epochs.group_of`), so a restarted group
      is the same group under a new id.
    """

    def __init__(self, now: float, *, restart_evidence: str | None = None, history: History | None = None) -> None:
        self.history = History() if history is None else history
        self._next_sample_at = now + SAMPLE_INTERVAL
        self._second = _Second()
        self._previous_sample: tuple[float, int] | None = None  # (t, step); None: no rate for the next one
        self._last: _Quorum | None = None
        self._recent: deque[tuple[float, int]] = deque(maxlen=RECENT_QUORUMS)  # (issued at, highest step)
        self._stall_after = PACE_UNKNOWN
        self._healing: dict[str, HealInProgress] = {}
        self._gone: OrderedDict[str, tuple[float, str]] = OrderedDict()  # group -> (when, why)
        self._gone_in_gap: list[str] = []  # members of the last quorum gone since it was issued
        self._waited: str | None = None  # what the quorum rules last held participants for, since then
        self._left_out: dict[str, str] = {}
        self._healthy = 0
        self._participants = 0
        self._counts = dict(stalls=0, stall_seconds=0.0, heals=0, heal_seconds=0.0, heals_failed=0, gone=0, back=0)
        if restart_evidence is not None:
            self._mark(now, "restart", f"lighthouse restarted ({restart_evidence}); what it saw before is not kept")

    # ------------------------------------------------------------ inputs

    def observe(self, now: float, status: Status, reason: str, healthy: int, participants: int) -> None:
        """The quorum rules decided ``status`` (``reason``) with ``healthy`` replicas heartbeating and
        ``participants`` waiting in a Quorum call. O(1)."""
        if not status.ready and status is not Status.NO_PARTICIPANTS:
            self._waited = reason
        self._healthy, self._participants = healthy, participants
        second = self._second
        second.fewest_healthy = healthy if second.fewest_healthy is None else min(second.fewest_healthy, healthy)
        second.most_participants = max(second.most_participants, participants)
        if now >= self._next_sample_at:
            self._take_sample(now)

    def quorum_issued(self, quorum: IssuedQuorum, now: float) -> None:
        """``quorum`` was issued at ``now``."""
        steps = {m.replica_id: m.step for m in quorum.members}
        top = max(steps.values(), default=0)
        groups = frozenset(map(name_of, steps))
        last = self._last
        if last is not None:
            gap = now - last.issued_at
            same_job = not last.steps.keys().isdisjoint(steps) or not last.groups.isdisjoint(groups)
            if gap > self._stall_after and same_job:
                self._mark_stall(last, gap)
            for replica_id, step in steps.items():
                if replica_id not in last.steps:
                    self._arrived(replica_id, step, quorum.quorum_id, now, last)
        self._heals(quorum, steps, top, now)
        for replica_id, reported, given in quorum.redone_by_others:
            self._mark(now, "rewind", f"{name_of(replica_id)} reported step {reported}, from a lineage the job did "
                       f"not keep (the others redid step {given} without it): given step {given}, it heals",
                       replica_id, steps=reported - given)
        if last is not None and top < last.top:
            self._recent.clear()  # a new epoch: the rate starts again
        self._recent.append((now, top))
        gaps = [b[0] - a[0] for a, b in zip(self._recent, list(self._recent)[1:])]
        self._stall_after = max(STALL_AFTER, STALL_FACTOR * statistics.median(gaps)) if gaps else PACE_UNKNOWN
        self._last = _Quorum(quorum.quorum_id, now, steps, top, groups)
        self._gone_in_gap.clear()
        self._waited = None
        second = self._second
        second.quorums += 1
        size = len(steps)
        second.smallest_quorum = size if second.smallest_quorum is None else min(second.smallest_quorum, size)

    def gone(self, replica_id: str, why: str, now: float) -> None:
        """``replica_id`` is gone (``why``: its lease ended, its heartbeat expired, it was refused)."""
        heal = self._healing.pop(replica_id, None)
        if heal is not None:
            self._counts["heals_failed"] += 1
            self._mark(heal.since, "heal_failed", f"{name_of(replica_id)} went while healing from "
                       f"{_names(heal.sources)} ({why})", replica_id, now - heal.since, heal.steps_behind)
        last = self._last
        if last is None or replica_id not in last.steps or replica_id in self._gone_in_gap:
            return  # only members of the last quorum are the job's groups going
        group = name_of(replica_id)
        self._gone[group] = (now, why)
        self._gone.move_to_end(group)
        while len(self._gone) > MAX_GONE:
            self._gone.popitem(last=False)
        self._gone_in_gap.append(replica_id)
        self._counts["gone"] += 1
        self._mark(now, "gone", f"{group} gone: {why} (in quorum {last.quorum_id}, at step "
                   f"{last.steps[replica_id]})", replica_id)

    def epoch_started(self, epoch: Epoch) -> None:
        """The stale-quorum guard gave way: the highest step went down (see :mod:`lighthouse.epochs`)."""
        self._recent.clear()
        self._previous_sample = None
        self._mark(epoch.started_at, "epoch", f"new epoch of the job (number {epoch.number} since the lighthouse "
                   f"started): the highest step went from {epoch.from_step} to {epoch.to_step} because "
                   f"{epoch.reason}", steps=epoch.from_step - epoch.to_step)

    def left_out(self, evicted: Mapping[str, str], now: float) -> None:
        """The groups left out as stragglers now (replica id -> when they come back, in words)."""
        for replica_id, back in evicted.items():
            if replica_id not in self._left_out:
                self._mark(now, "evicted", f"{name_of(replica_id)} left out of the next quorums as a straggler; "
                           f"{back}", replica_id)
        for replica_id in self._left_out.keys() - evicted.keys():
            self._mark(now, "readmitted", f"{name_of(replica_id)} no longer left out as a straggler", replica_id)
        self._left_out = dict(evicted)

    # ------------------------------------------------------------ views

    def state(self, now: float) -> str:
        """What the job is doing at ``now``, in one word (:data:`lighthouse.history.STATES`). O(1)."""
        last = self._last
        if last is None:
            return "waiting" if self._participants else "idle"
        if self._healing:
            return "healing"
        if now - last.issued_at <= self._stall_after:
            return "training"
        return "stalled" if self._healthy or self._participants else "stopped"

    def steps_per_s(self, now: float) -> float | None:
        """Steps the job committed per second: from the oldest of the recent quorums issued within the last
        ``RATE_WINDOW`` seconds to now (so a stall that ended is soon forgotten), or from the newest before
        that while fewer than two fall within it (so the rate falls during a stall). None before two quorums."""
        recent = self._recent
        if len(recent) < 2:
            return None
        window = [entry for entry in recent if entry[0] >= now - RATE_WINDOW]
        base = window[0] if len(window) >= 2 else recent[-1 - len(window)]
        return (recent[-1][1] - base[1]) / (now - base[0]) if now > base[0] else None

    def status(self, now: float, status: Status, reason: str, heartbeat_age: Mapping[str, float],
               joined: Mapping[str, float], left_out: Collection[str] = ()) -> JobStatus:
        """The status line at ``now``. ``status``/``reason``: the quorum rules' current decision;
        ``heartbeat_age``: replica id -> seconds since its heartbeat; ``joined``: participants -> when they
        joined; ``left_out``: groups held out as stragglers (nobody waits for them)."""
        state = self.state(now)
        last = self._last
        rate = self.steps_per_s(now)
        step, groups = (None, 0) if last is None else (last.top, len(last.steps))
        since: float | None = None
        trouble = False
        if state == "idle":
            headline = "idle: no replica group has asked for a quorum yet" + (
                f" ({plural(len(heartbeat_age), 'replica')} heartbeating)" if heartbeat_age else "")
        elif state == "waiting":
            since = min(joined.values(), default=now)
            trouble = now - since > STALL_AFTER
            headline = f"starting: waiting {now - since:.1f} s for the first quorum: {_short(reason)}"
        elif state == "healing":
            healing = list(self._healing.values())
            since = min(h.since for h in healing)
            sources = {rid for h in healing for rid in h.sources}
            behind = max(h.steps_behind for h in healing)
            headline = (f"healing {_names(self._healing)} from {_names(sources)} "
                        f"({plural(behind, 'step')} behind, {now - since:.1f} s so far)")
        elif state == "training":
            headline = f"training: {plural(groups, 'group')} at step {step}" + (
                f", {rate:.1f} steps/s" if rate is not None else "")
        elif state == "stopped":
            since = last.issued_at
            headline = (f"stopped: no replica group is heartbeating; the last quorum ({plural(groups, 'group')} "
                        f"at step {step}) was {now - since:.1f} s ago")
        else:  # stalled
            since = last.issued_at
            trouble = True
            headline = f"stalled {now - since:.1f} s: {self._stall_cause(status, reason, heartbeat_age, joined, left_out)}"
            if self._gone_in_gap:
                went = "; ".join(f"{name_of(rid)} gone {now - self._gone[name_of(rid)][0]:.1f} s ago "
                                 f"({self._gone[name_of(rid)][1]})" for rid in self._gone_in_gap[:3]
                                 if name_of(rid) in self._gone)
                headline += f"; {went}" if went else ""
        return JobStatus(state, headline, reason, trouble, since, step, rate, groups, tuple(self._healing.values()))

    def statistics(self, now: float) -> TimelineStatistics:
        c = self._counts
        return TimelineStatistics(
            state=self.state(now), steps_per_second=self.steps_per_s(now) or 0.0, stalls=c["stalls"],
            stall_seconds=c["stall_seconds"], heals=c["heals"], heal_seconds=c["heal_seconds"],
            heals_failed=c["heals_failed"], groups_gone=c["gone"], groups_back=c["back"],
            samples=self.history.sample_count, markers=self.history.marker_count,
        )

    # ------------------------------------------------------------ internals

    def _stall_cause(self, status: Status, reason: str, heartbeat_age: Mapping[str, float],
                     joined: Mapping[str, float], left_out: Collection[str]) -> str:
        """Why the job is stalled, naming whom it waits for where the lighthouse knows."""
        if status is Status.WAITING_FOR_STRAGGLERS:
            late = sorted((age, rid) for rid, age in heartbeat_age.items()
                          if rid not in joined and rid not in left_out)[::-1]
            if late:
                named = ", ".join(f"{name_of(rid)} (heartbeat {age:.1f} s old)" for age, rid in late[:3])
                more = f" and {len(late) - 3} more" if len(late) > 3 else ""
                return f"waiting for {named}{more}"
        if joined:
            return _short(reason)
        return f"no group asked for the next quorum after step {self._last.top}"

    def _arrived(self, replica_id: str, step: int, quorum_id: int, now: float, last: _Quorum) -> None:
        group = name_of(replica_id)
        gone = self._gone.pop(group, None)
        if gone is None and group not in last.groups:
            self._mark(now, "joined", f"{group} joined quorum {quorum_id} at step {step}", replica_id)
            return
        self._counts["back"] += 1
        after = f", {now - gone[0]:.1f} s after it was gone ({gone[1]})" if gone is not None else " (restarted)"
        self._mark(now, "back", f"{group} back in quorum {quorum_id} at step {step}{after}", replica_id)

    def _heals(self, quorum: IssuedQuorum, steps: Mapping[str, int], top: int, now: float) -> None:
        for replica_id, heal in list(self._healing.items()):
            step = steps.get(replica_id)
            if step is not None and step < top:
                continue  # still behind: healing on
            del self._healing[replica_id]
            took = now - heal.since
            if step is None:
                self._counts["heals_failed"] += 1
                self._mark(heal.since, "heal_failed", f"{name_of(replica_id)}'s heal from {_names(heal.sources)} did "
                           f"not finish: it is not in quorum {quorum.quorum_id}", replica_id, took, heal.steps_behind)
                continue
            self._counts["heals"] += 1
            self._counts["heal_seconds"] += took
            quorums = (f"quorum {quorum.quorum_id}" if quorum.quorum_id == heal.quorum_id
                       else f"quorums {heal.quorum_id} to {quorum.quorum_id}")
            self._mark(heal.since, "heal", f"{name_of(replica_id)} healed {plural(heal.steps_behind, 'step')} from "
                       f"{_names(heal.sources)} in {took:.1f} s ({quorums})", replica_id, took, heal.steps_behind)
        sources = tuple(rid for rid, step in steps.items() if step == top)
        for replica_id, step in steps.items():
            if step < top and replica_id not in self._healing:
                self._healing[replica_id] = HealInProgress(replica_id, sources, top - step, now, quorum.quorum_id)

    def _mark_stall(self, last: _Quorum, gap: float) -> None:
        self._counts["stalls"] += 1
        self._counts["stall_seconds"] += gap
        parts = [f"{gap:.1f} s without a quorum after step {last.top}"]
        if self._gone_in_gap:
            parts.append(f"gone meanwhile: {_names(self._gone_in_gap)}")
        parts.append(f"the quorum rules last said: {self._waited}" if self._waited is not None
                     else "no group asked for the next quorum sooner")
        self._mark(last.issued_at, "stall", "; ".join(parts), duration=gap)

    def _take_sample(self, now: float) -> None:
        second, last = self._second, self._last
        step = 0 if last is None else last.top
        rate = None
        if self._previous_sample is not None:
            t, previous = self._previous_sample
            rate = (step - previous) / (now - t) if step >= previous and now > t else None
        size = second.smallest_quorum if second.smallest_quorum is not None else (0 if last is None else len(last.steps))
        self.history.add_sample(Sample(now, step, rate, second.quorums, size,
                                       self._healthy if second.fewest_healthy is None else second.fewest_healthy,
                                       second.most_participants, self.state(now)))
        self._previous_sample = (now, step)
        self._second = _Second(fewest_healthy=self._healthy, most_participants=self._participants)
        self._next_sample_at = now + SAMPLE_INTERVAL

    def _mark(self, t: float, kind: str, text: str, replica_id: str = "", duration: float | None = None,
              steps: int | None = None) -> None:
        self.history.add_marker(Marker(t, kind, text, replica_id, duration, steps))


def _short(reason: str) -> str:
    """A rule's reason without its leading 'waiting: ' (the status line already says it waits)."""
    return reason[len("waiting: "):] if reason.startswith("waiting: ") else reason

