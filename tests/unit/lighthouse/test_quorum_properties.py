"""Property-based tests of the quorum rules: random sequences of inputs, checked against an independent model.

Each example draws a config and a sequence of heartbeats, joins (random replica
ids, steps, ``shrink_only``, commit failures, resumed from a checkpoint or not),
leaves, forgets, clock advances, operators' epoch requests and decisions, and
feeds them to one :class:`QuorumState` with literal timestamps. A model
written from the rules in the docstrings of QuorumState and EpochBook (no
incremental counters: every set is recomputed) follows the same inputs.

What is checked, because ``lighthouse/quorum.py`` promises it:

* every decision's status is the one the rules give when everything is
  recomputed from scratch (the O(1) counters never drift);
* every issued quorum is non-empty, sorted, has no duplicates, has at least
  ``min_replicas`` members, and is issued at the decision's ``now``;
* every member was waiting in a Quorum call (joined since its last quorum,
  not left or forgotten since) with its newest request, and had a live
  heartbeat at issue time;
* every healthy participant is in the quorum unless ``shrink_only`` keeps it
  out; members stop being participants, the others wait on with their join
  time restarted;
* quorum ids never decrease, the first one follows the seed, the id changes
  exactly when membership changes or a member reports commit failures, so
  one id always names one membership;
* split-brain guard: a quorum that is not a fast quorum holds strictly more
  than half of the healthy replicas, so two of them issued while the same
  replicas are healthy always share a member; a fast quorum keeps every
  member of the previous one;
* no first quorum before the startup grace has passed after a restart (a
  first start has no grace);
* stale-quorum guard: no quorum of replicas that are all behind the highest
  step an earlier quorum reached (or the persisted one), as long as a
  replica id never reports a lower step than it did before (ids are per
  process incarnation and steps only advance; a fast quorum does not look at
  steps, so it relies on that);
* new epochs (``lighthouse/epochs.py``): the guard gives way exactly when the
  holders of the highest step were not seen for the holder timeout, when every
  eligible participant resumed from a checkpoint, every holder's replica group
  is among them under another id and no holder is healthy, or
  on an operator's request, and then to the eligible participants' highest
  step; the epoch's first quorum has a new id; afterwards a join above the
  highest step from an id in none of the quorums since (kept while heartbeating
  or in the last quorum) is refused, and that id's heartbeats are ignored until
  it joins at an accepted step; the incremental counters equal a recount.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from lighthouse.quorum import IssuedQuorum, Member, QuorumConfig, QuorumState, StaleReplica, Status

# Ids as Managers name them, "<replica group>:<process>": three groups, so a holder's group can be back
# under another id (it restarted) or not.
REPLICAS = [f"g{i % 3}:{i}" for i in range(7)]

# Times are multiples of 1/8 s, exact in binary, so the model's health
# arithmetic gives the same answers as the state's at every boundary.
TICK = 0.125

configs = st.builds(
    QuorumConfig,
    min_replicas=st.sampled_from([1, 1, 2, 2, 3, 4]),
    join_timeout=st.sampled_from([0.0, 0.0, 0.5, 2.0, 30.0]),
    heartbeat_timeout=st.sampled_from([0.5, 1.0, 3.0]),
    startup_grace=st.sampled_from([0.0, 0.0, 0.0, 1.0]),
    holder_timeout=st.sampled_from([0.5, 2.0, 5.0, 30.0]),
)

replica_ids = st.sampled_from(REPLICAS)
step_increases = st.sampled_from([0, 0, 0, 1, 1, 2, 5, 40])
joins = st.tuples(
    st.just("join"),
    replica_ids,
    step_increases,
    st.sampled_from([False, False, False, True]),  # shrink_only
    st.sampled_from([0, 0, 0, 0, 1, 3]),  # commit_failures
)
_BY_KIND = {
    "join": joins,
    "join_all": st.tuples(st.just("join_all"), step_increases, st.sampled_from([False, False, False, True])),
    # (re)joins advertising the checkpoint it resumed from: just now (resumed_from == step), or steps ago
    "resume": st.tuples(st.just("resume"), replica_ids, st.sampled_from([0, 0, 1, 3]), step_increases),
    "resume_all": st.tuples(st.just("resume_all"), st.sampled_from([0, 0, 0, 1]), step_increases),
    "request_epoch": st.just(("request_epoch",)),
    "heartbeat_all": st.just(("heartbeat_all",)),
    "heartbeat": st.tuples(st.just("heartbeat"), replica_ids),
    "leave": st.tuples(st.just("leave"), replica_ids),
    "forget": st.tuples(st.just("forget"), replica_ids),
    "advance": st.tuples(st.just("advance"), st.integers(0, 8).map(lambda n: n * TICK)),
    "long_advance": st.tuples(st.just("advance"), st.integers(0, 40).map(lambda n: n * TICK)),
    "decide": st.just(("decide",)),
}
# Weighted by repetition: mostly joins, decisions and short waits, as in a run.
_KINDS = ["join"] * 6 + ["join_all"] * 2 + ["heartbeat_all"] * 2 + ["heartbeat", "leave", "forget"] \
    + ["advance"] * 3 + ["long_advance"] + ["decide"] * 5 + ["resume", "resume_all", "request_epoch"]
operations = st.sampled_from(_KINDS).flatmap(_BY_KIND.__getitem__)
histories = st.lists(operations, min_size=25, max_size=80)


@dataclass
class _Waiting:
    member: Member
    joined_at: float


@dataclass
class Model:
    """The rules, recomputed from plain inputs on every decision."""

    config: QuorumConfig
    started_at: float
    restarted: bool
    seed_id: int
    max_step: int
    last_heartbeat: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, _Waiting] = field(default_factory=dict)
    reported_step: dict[str, int] = field(default_factory=dict)
    prev: IssuedQuorum | None = None
    members_by_id: dict[int, frozenset[str]] = field(default_factory=dict)
    issued: list[tuple[IssuedQuorum, Status, frozenset[str]]] = field(default_factory=list)
    # new epochs (lighthouse/epochs.py)
    holders: frozenset[str] = frozenset()
    holders_seen_at: float = 0.0  # set to started_at by run()
    epoch: int = 0
    epoch_range: tuple[int, int] | None = None  # (from_step, to_step) of the latest
    new_id_due: bool = False
    admitted: set[str] = field(default_factory=set)  # in a quorum since the epoch (while heartbeating or in the last)
    fenced: set[str] = field(default_factory=set)
    requested: bool = False

    def healthy(self, now: float) -> set[str]:
        return {rid for rid, last in self.last_heartbeat.items() if now - last < self.config.heartbeat_timeout}

    @property
    def prev_ids(self) -> set[str]:
        return set(self.prev.replica_ids) if self.prev else set()

    def heartbeat(self, rid: str, now: float) -> None:
        if rid in self.fenced:
            return
        if rid in self.holders:
            self.holders_seen_at = now
        self.last_heartbeat[rid] = now

    def join(self, member: Member, now: float) -> bool:
        """Returns whether the join is refused (the replica is from before the epoch)."""
        rid = member.replica_id
        self.reported_step[rid] = member.step
        if self.epoch > 0 and member.step > self.max_step and rid not in self.admitted:
            self.forget(rid)
            self.fenced.add(rid)
            return True
        self.fenced.discard(rid)
        self.heartbeat(rid, now)
        old = self.waiting.get(member.replica_id)
        if old is None:
            self.waiting[member.replica_id] = _Waiting(member, now)
        else:
            old.member = member  # a retry keeps its join time
        return False

    def leave(self, rid: str) -> None:
        self.waiting.pop(rid, None)

    def forget(self, rid: str) -> None:
        self.last_heartbeat.pop(rid, None)
        self.waiting.pop(rid, None)
        self._prune_admitted()

    def expire(self, now: float) -> None:
        for rid in list(self.last_heartbeat):
            if now - self.last_heartbeat[rid] >= self.config.heartbeat_timeout:
                del self.last_heartbeat[rid]
        self._prune_admitted()

    def _prune_admitted(self) -> None:
        self.admitted &= self.last_heartbeat.keys() | self.prev_ids

    def eligible(self, now: float) -> list[Member]:
        healthy = self.healthy(now)
        joined = [w.member for rid, w in self.waiting.items() if rid in healthy]
        if self.prev is not None and any(m.shrink_only for m in joined):
            return [m for m in joined if m.replica_id in self.prev_ids]
        return joined

    def decide(self, now: float) -> tuple[Status, bool, set[str]]:
        """(status, whether an epoch started, the participants it dropped): call after :meth:`expire`."""
        status = self.status(now)
        requested, self.requested = self.requested, False
        if status is not Status.BEHIND_COMMITTED:
            return status, False, set()
        cfg = self.config
        eligible = self.eligible(now)
        unseen = now - self.holders_seen_at
        all_resumed = all(m.resumed_from == m.step for m in eligible)
        eligible_ids = {m.replica_id for m in eligible}
        back = {m.replica_id.split(":")[0] for m in eligible}
        superseded = all(h not in eligible_ids and h.split(":")[0] in back for h in self.holders)
        if not (requested or unseen >= max(cfg.holder_timeout, cfg.heartbeat_timeout)
                or (all_resumed and superseded and unseen >= cfg.heartbeat_timeout)):
            return status, False, set()
        to_step = max([0] + [m.step for m in eligible])
        assert to_step < self.max_step
        self.epoch += 1
        self.epoch_range = (self.max_step, to_step)
        self.max_step = to_step
        self.holders = frozenset(m.replica_id for m in eligible if m.step >= to_step)
        self.holders_seen_at = now
        self.admitted = set()
        self.new_id_due = True
        dropped = {rid for rid, w in self.waiting.items() if w.member.step > to_step}
        for rid in dropped:
            self.forget(rid)
            self.fenced.add(rid)
        return self.status(now), True, dropped

    def status(self, now: float) -> Status:
        """The decision of the rules at ``now`` (after expiry), every set recomputed."""
        cfg = self.config
        healthy = self.healthy(now)
        joined = [w.member for rid, w in self.waiting.items() if rid in healthy]
        prev_ids = set(self.prev.replica_ids) if self.prev else set()
        prev_joined = [m for m in joined if m.replica_id in prev_ids]
        shrink_only = self.prev is not None and any(m.shrink_only for m in joined)
        eligible = prev_joined if shrink_only else joined
        if self.prev is not None and self.prev.members and len(prev_joined) == len(self.prev.members):
            return Status.FAST_QUORUM
        if not joined:
            return Status.NO_PARTICIPANTS
        if self.prev is None and self.restarted and self.started_at + cfg.startup_grace - now > 0:
            return Status.STARTUP_GRACE
        if len(eligible) < cfg.min_replicas:
            return Status.BELOW_MIN_REPLICAS
        # The holder of the highest step must be one of the replicas the quorum would take.
        if self.max_step > 0 and not any(m.step >= self.max_step for m in eligible):
            return Status.BEHIND_COMMITTED
        if len(eligible) * 2 <= len(healthy):
            return Status.SPLIT_BRAIN_GUARD
        if len(healthy) > len(joined):
            first_joined = min(w.joined_at for w in self.waiting.values())
            if now < first_joined + cfg.join_timeout:
                return Status.WAITING_FOR_STRAGGLERS
        return Status.VALID_QUORUM

    def expected_members(self, now: float) -> list[Member]:
        healthy = self.healthy(now)
        joined = [w.member for rid, w in self.waiting.items() if rid in healthy]
        prev_ids = set(self.prev.replica_ids) if self.prev else set()
        if self.prev is not None and any(m.shrink_only for m in joined):
            joined = [m for m in joined if m.replica_id in prev_ids]
        return sorted(joined, key=lambda m: m.replica_id)


def check_issued(model: Model, quorum: IssuedQuorum, status: Status, now: float, monotone_steps: bool) -> None:
    """Everything an issued quorum must satisfy, then the model moves on past it."""
    cfg = model.config
    ids = quorum.replica_ids
    healthy = model.healthy(now)
    assert ids and list(ids) == sorted(set(ids)), ids
    assert len(ids) >= cfg.min_replicas
    assert quorum.issued_at == now
    # The lineage fence may give a member a lower step than it reported (so that it heals): only one the
    # quorum names, only below its report, and only when another member reports at least as much.
    lowered = {rid: (reported, given) for rid, reported, given in quorum.redone_by_others}
    as_requested = []
    for member in quorum.members:
        rid = member.replica_id
        assert rid in healthy, f"{rid} had no live heartbeat at {now}"
        assert rid in model.waiting, f"{rid} was not waiting in a Quorum call"
        newest = model.waiting[rid].member
        if rid in lowered:
            reported, given = lowered[rid]
            assert member.step == given < reported == newest.step
            assert any(model.waiting[o].member.step >= reported for o in ids if o != rid)
            member = replace(member, step=reported)
        assert (member, member.payload) == (newest, newest.payload), "an older request of the replica was used"
        as_requested.append(member)
    assert as_requested == model.expected_members(now), "a healthy eligible participant was left out"

    prev = model.prev
    if prev is None:
        assert quorum.quorum_id > model.seed_id
        if model.restarted:
            assert now >= model.started_at + cfg.startup_grace, "first quorum inside the startup grace"
    else:
        assert quorum.quorum_id >= prev.quorum_id
        same = set(ids) == set(prev.replica_ids) and not any(m.commit_failures > 0 for m in quorum.members)
        assert (quorum.quorum_id == prev.quorum_id) == (same and not model.new_id_due)
    members = frozenset(ids)
    assert model.members_by_id.setdefault(quorum.quorum_id, members) == members, "one quorum id, two memberships"

    if status is Status.FAST_QUORUM:
        assert prev is not None and set(prev.replica_ids) <= members
    else:
        assert status is Status.VALID_QUORUM
        assert 2 * len(ids) > len(healthy), "a non-fast quorum without a majority of the healthy replicas"
        for other, other_status, other_healthy in model.issued:
            if other_status is Status.VALID_QUORUM and other_healthy == frozenset(healthy):
                assert members & set(other.replica_ids), "two disjoint quorums from the same healthy replicas"

    highest = max(m.step for m in quorum.members)
    if model.max_step > 0 and (status is Status.VALID_QUORUM or monotone_steps):
        assert highest >= model.max_step, (
            f"quorum {quorum.quorum_id} at steps <= {highest} while step {model.max_step} was already reached"
        )

    model.issued.append((quorum, status, frozenset(healthy)))
    model.max_step = max(model.max_step, highest)
    model.new_id_due = False
    holders = frozenset(m.replica_id for m in quorum.members if m.step >= model.max_step)
    if holders:
        model.holders, model.holders_seen_at = holders, now
    if model.epoch > 0:
        model.admitted |= set(ids)
    model.prev = quorum
    model._prune_admitted()
    for rid in ids:
        del model.waiting[rid]
    for waiting in model.waiting.values():
        waiting.joined_at = now


def check_counters(state: QuorumState, model: Model) -> None:
    """The state's views agree with the inputs (nothing counted twice or lost)."""
    participants = {m.replica_id: (m, joined) for m, joined in state.participants()}
    assert participants.keys() == model.waiting.keys()
    for rid, (member, joined) in participants.items():
        assert member == model.waiting[rid].member and joined == model.waiting[rid].joined_at
    assert {rid for rid, _ in state.heartbeats()} <= model.last_heartbeat.keys()
    assert state.num_healthy_participants == sum(1 for rid in participants if state.is_heartbeating(rid))
    assert state.max_step == model.max_step
    assert {rid for rid, _ in state.heartbeats()} == model.last_heartbeat.keys()
    assert (0 if state.epoch is None else state.epoch.number) == model.epoch
    if state.epoch is not None:
        assert (state.epoch.from_step, state.epoch.to_step) == model.epoch_range
    assert state.epochs.holders == model.holders and state.epochs.holders_seen_at == model.holders_seen_at
    for rid in REPLICAS:
        assert state.epochs.is_fenced(rid) == (rid in model.fenced), rid
        assert state.epochs.is_admitted(rid) == (rid in model.admitted), rid
    check_recount(state)


def check_recount(state: QuorumState) -> None:
    """The incremental counters equal a count from scratch over the state's own sets."""
    prev = state.previous_quorum
    prev_ids = set(prev.replica_ids) if prev else set()
    healthy = [m for m, _ in state.participants() if state.is_heartbeating(m.replica_id)]
    in_prev = [m for m in healthy if m.replica_id in prev_ids]
    resumed = [m for m in healthy if m.resumed_from is not None and m.resumed_from == m.step]
    assert (state._healthy_participants, state._healthy_prev_participants, state._healthy_shrink_only,
            state._healthy_up_to_date, state._healthy_prev_up_to_date,
            state._healthy_resumed, state._healthy_prev_resumed) == (
        len(healthy), len(in_prev), sum(m.shrink_only for m in healthy),
        sum(m.step >= state.max_step for m in healthy), sum(m.step >= state.max_step for m in in_prev),
        len(resumed), sum(m.replica_id in prev_ids for m in resumed))


def run(config: QuorumConfig, ops, *, started_at: float = 0.0, seed_id: int = 0, persisted_step: int = 0,
        monotone_steps: bool = True, restarted: bool = True) -> Model:
    state = QuorumState(config, last_quorum_id=seed_id, started_at=started_at, max_step=persisted_step,
                        restart_evidence="a restart in a property test" if restarted else None)
    model = Model(config, started_at, restarted, seed_id, persisted_step, holders_seen_at=started_at)
    now = started_at

    def join(member: Member) -> None:
        if model.join(member, now):
            with pytest.raises(StaleReplica):
                state.join(member, now)
        else:
            state.join(member, now)

    for op in ops:
        kind = op[0]
        if kind == "heartbeat":
            state.heartbeat(op[1], now)
            model.heartbeat(op[1], now)
        elif kind == "join":
            _, rid, increase, shrink_only, failures = op
            step = model.reported_step.get(rid, 0) + increase if monotone_steps else increase
            member = Member(rid, shrink_only, failures, payload=("request", len(model.issued), now), step=step)
            join(member)
        elif kind == "join_all":  # every healthy replica (re)joins, as after a step
            for rid in sorted(model.healthy(now)):
                step = model.reported_step.get(rid, 0) + op[1] if monotone_steps else op[1]
                join(Member(rid, op[2], payload=("rejoin", now), step=step))
        elif kind in ("resume", "resume_all"):
            for rid in [op[1]] if kind == "resume" else sorted(model.healthy(now)):
                committed_since, increase = op[-2:]
                step = model.reported_step.get(rid, 0) + increase if monotone_steps else increase
                join(Member(rid, payload=("resumed", now), step=step, resumed_from=max(0, step - committed_since)))
        elif kind == "request_epoch":
            state.request_epoch("an operator asked for it (property test)")
            model.requested = True
        elif kind == "heartbeat_all":  # the background heartbeats of every healthy replica
            for rid in sorted(model.healthy(now)):
                state.heartbeat(rid, now)
                model.heartbeat(rid, now)
        elif kind == "leave":
            state.leave(op[1])
            model.leave(op[1])
        elif kind == "forget":
            known = op[1] in model.last_heartbeat or op[1] in model.waiting
            assert state.forget(op[1]) == known
            model.forget(op[1])
        elif kind == "advance":
            now += op[1]
        elif kind == "decide":
            before = {rid for rid, _ in state.heartbeats()}
            decision, expired = state.decide(now)
            # expiry: exactly the entries whose heartbeat is too old, each once
            assert set(expired) == {rid for rid in before if rid not in model.healthy(now)}
            assert len(expired) == len(set(expired))
            model.expire(now)
            expected_status, epoch_started, dropped = model.decide(now)
            assert (decision.epoch is not None) == epoch_started, (decision.epoch, decision.reason)
            assert {m.replica_id for m in decision.fenced} == dropped
            assert decision.status is expected_status, (decision.status, expected_status, decision.reason)
            assert decision.reason
            assert decision.ready == (decision.quorum is not None)
            if decision.status in (Status.WAITING_FOR_STRAGGLERS, Status.STARTUP_GRACE, Status.BEHIND_COMMITTED):
                assert decision.wake_at is not None and decision.wake_at > now
            if decision.quorum is not None:
                check_issued(model, decision.quorum, decision.status, now, monotone_steps)
        check_counters(state, model)
    return model


# The stale-quorum guard's blind spot in shrink_only mode, found by these
# properties: the only holder of step 10 was waiting but not a member of the
# previous quorum, so shrink_only kept it out, yet it satisfied the guard for
# the previous members, all at step 0.
SHRINK_ONLY_HOLDER = [
    ("join", "r0", 10, False, 0), ("join", "r6", 10, False, 0), ("decide",),    # quorum 1 at step 10
    ("forget", "r6"),                                                            # r6 cut off
    ("join", "r0", 0, False, 0), ("join", "r1", 0, False, 0), ("join", "r2", 0, False, 0),
    ("decide",),                                                                 # quorum 2: r1, r2 heal from r0
    ("forget", "r0"),                                                            # the only holder in it dies
    ("join", "r1", 0, True, 0), ("join", "r2", 0, True, 0),                      # heals failed: still step 0
    ("join", "r6", 0, False, 0),                                                 # the old holder is back
    ("decide",),
]


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, ops=histories, started_at=st.sampled_from([0.0, 100.0]),
       seed_id=st.sampled_from([0, 41, 2**40]), persisted_step=st.sampled_from([0, 0, 0, 7, 1000]),
       restarted=st.booleans())
@example(config=QuorumConfig(1, join_timeout=0.0, heartbeat_timeout=3.0), ops=SHRINK_ONLY_HOLDER,
         started_at=0.0, seed_id=0, persisted_step=0, restarted=True)
def test_random_histories_keep_every_promise(config, ops, started_at, seed_id, persisted_step, restarted):
    run(config, ops, started_at=started_at, seed_id=seed_id, persisted_step=persisted_step, restarted=restarted)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, ops=histories, persisted_step=st.sampled_from([0, 5, 1000]))
def test_steps_going_backwards_still_keep_non_fast_quorums_at_the_highest_step(config, ops, persisted_step):
    """Without the monotone-step assumption (a client that lies, a reloaded old checkpoint) every
    other promise still holds, and a quorum that is not a fast one still includes a holder."""
    run(config, ops, persisted_step=persisted_step, monotone_steps=False)


def test_shrink_only_cannot_use_an_excluded_holder_to_pass_the_stale_quorum_guard():
    model = run(QuorumConfig(1, join_timeout=0.0, heartbeat_timeout=3.0), SHRINK_ONLY_HOLDER)
    assert [q.replica_ids for q, _, _ in model.issued] == [("r0", "r6"), ("r0", "r1", "r2")]
    assert model.status(0.0) is Status.BEHIND_COMMITTED  # r1 and r2 (shrink_only, step 0) wait for a holder


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    steps=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=6),
    persisted_step=st.integers(0, 2**63 - 1),
)
def test_absurd_steps_never_lower_the_highest_step(steps, persisted_step):
    """Negative or int64-extreme steps (anything a wire message can carry) only ever raise max_step."""
    state = QuorumState(QuorumConfig(1, join_timeout=0.0), max_step=persisted_step)
    for i, step in enumerate(steps):
        state.join(Member(f"r{i}", step=step), 0.0)
    decision, _ = state.decide(0.0)
    assert state.max_step >= persisted_step
    if decision.quorum is not None:
        assert state.max_step == max(persisted_step, *steps)
        assert persisted_step == 0 or max(steps) >= persisted_step
    else:
        assert decision.status is Status.BEHIND_COMMITTED and max(steps) < persisted_step


@settings(max_examples=200, deadline=None, derandomize=True)
@given(times=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=30),
       timeout=st.sampled_from([0.5, 5.0]))
def test_time_going_backwards_never_resurrects_or_reorders_heartbeats(times, timeout):
    """The state clamps ``now`` to the latest time seen: expiry stays in heartbeat order."""
    state = QuorumState(QuorumConfig(1, heartbeat_timeout=timeout))
    latest = -math.inf
    for i, now in enumerate(times):
        state.heartbeat(f"r{i}", now)
        latest = max(latest, now)
        expired = state.expire(now)
        assert all(not state.is_heartbeating(rid) for rid in expired)
        assert all(last > latest - timeout for _, last in state.heartbeats())
        recorded = [last for _, last in state.heartbeats()]
        assert recorded == sorted(recorded)
