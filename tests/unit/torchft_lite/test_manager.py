"""The Manager's whole step with the in-memory fakes of ``torchft_lite.testing``: no sockets, no processes.

Every test runs real Managers on threads against an ``InMemoryLighthouse``:
quorum, heal (sender and receiver), the commit vote, a failed allreduce and a
torn heal.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from datetime import timedelta

import pytest
import torch

from tests.conftest import all_in_threads, in_threads
from tests.unit.helpers import Replica, replicas, train  # noqa: F401  (the fixture)
from torchft_lite.errors import CheckpointTransferError, LeavingError, ManagerError
from torchft_lite.testing import InMemoryLighthouse


def test_two_replicas_heal_at_step_zero_then_average_their_gradients(replicas):
    lighthouse = InMemoryLighthouse(min_replicas=2)
    a, b = replicas(lighthouse, "a", 1.0), replicas(lighthouse, "b", 5.0)
    assert train({"a": a, "b": b}, 1, grads={"a": 1.0, "b": 3.0}) == {"a": [True], "b": [True]}
    # init_sync: b (not the primary) took a's weights at step 0 and contributed zeros while healing; both
    # count at step 0 (torchft's rule), so a's gradient is halved
    assert b.loads == 1 and a.loads == 0
    assert torch.equal(a.weights, b.weights) and a.weights.tolist() == [0.5, 0.5, 0.5]
    assert train({"a": a, "b": b}, 1, grads={"a": 1.0, "b": 3.0}) == {"a": [True], "b": [True]}
    assert a.weights.tolist() == [-1.5, -1.5, -1.5] == b.weights.tolist()  # minus the average of 1 and 3
    assert a.manager.current_step() == b.manager.current_step() == 2
    assert a.manager.num_participants() == 2 and a.manager.batches_committed() == 4
    assert a.manager._healer.transport.sends == [([1], 0)]  # a served b (replica rank 1) at step 0


def test_a_failed_allreduce_is_recorded_and_the_step_is_retried(replicas):
    lighthouse = InMemoryLighthouse()
    solo = replicas(lighthouse, "solo", 1.0)
    solo.pg.fail_next = True
    committed, _ = solo.step()
    assert not committed and "injected allreduce failure" in str(solo.manager.errored())
    assert solo.manager.current_step() == 0 and solo.weights.tolist() == [1.0, 1.0, 1.0]
    assert solo.step()[0] and solo.manager.current_step() == 1 and solo.manager.errored() is None


def test_a_restarted_replica_rejoins_with_min_replica_size_two(replicas):
    """The healing replica does not count at its heal step; the heal survives that uncommitted step."""
    lighthouse = InMemoryLighthouse(min_replicas=2)
    a = replicas(lighthouse, "a", 1.0, min_replica_size=2)
    a.manager.load_state_dict({"step": 7, "batches_committed": 14})
    b = replicas(lighthouse, "b", 9.0, min_replica_size=2)
    assert train({"a": a, "b": b}, 2) == {"a": [False, True], "b": [False, True]}
    assert a.manager.current_step() == b.manager.current_step() == 8
    assert torch.equal(a.weights, b.weights)


def test_a_killed_replica_leaves_the_survivor_training_alone(replicas):
    lighthouse = InMemoryLighthouse()
    a, b = replicas(lighthouse, "a", 1.0), replicas(lighthouse, "b", 1.0)
    train({"a": a, "b": b}, 2)
    lighthouse.kill(b.manager.replica_id)
    assert train({"a": a}, 2) == {"a": [True, True]}
    assert a.manager.num_participants() == 1 and a.manager.current_step() == 4


def test_a_heal_that_fails_leaves_the_replica_behind_and_heals_at_the_next_quorum(replicas):
    lighthouse = InMemoryLighthouse(min_replicas=2)
    # a waits for its receiver up to its timeout before it moves on, and b's first receive never comes
    a, b = replicas(lighthouse, "a", 1.0, timeout_s=2.0), replicas(lighthouse, "b", 2.0, timeout_s=2.0)
    transport = b.manager._healer.transport
    real = transport.recv_checkpoint
    calls = []

    def fail_once(**kwargs):
        calls.append(kwargs["step"])
        if len(calls) == 1:
            raise CheckpointTransferError("injected: the connection closed")
        return real(**kwargs)

    transport.recv_checkpoint = fail_once
    assert train({"a": a, "b": b}, 1) == {"a": [True], "b": [False]}
    assert b.manager.current_step() == 0 and b.loads == 0
    assert train({"a": a, "b": b}, 1) == {"a": [True], "b": [True]}  # b heals to step 1 and commits step 1
    assert calls == [0, 1] and torch.equal(a.weights, b.weights)
    assert a.manager.current_step() == b.manager.current_step() == 2


def test_a_torn_replica_that_a_quorum_makes_up_to_date_fails_stop(replicas):
    """Its source left after a heal failed part-way: nobody can repair its state, so it must not train on."""
    lighthouse = InMemoryLighthouse(min_replicas=2)
    a, b = replicas(lighthouse, "a", 1.0, timeout_s=2.0), replicas(lighthouse, "b", 2.0, timeout_s=2.0)

    def tear(**kwargs):
        b.manager.context.state.torn = True  # as an in-place receive that wrote part of a tensor
        raise CheckpointTransferError("injected: lost mid-heal")

    b.manager._healer.transport.recv_checkpoint = tear
    assert train({"a": a, "b": b}, 1) == {"a": [True], "b": [False]}
    lighthouse.min_replicas = 1
    lighthouse.kill(a.manager.replica_id)
    with pytest.raises(AssertionError, match="ManagerError.*failed heal"):
        train({"b": b}, 1)
    assert isinstance(b.manager.errored(), Exception) and b.manager.current_step() == 0


def test_a_member_gone_during_a_collective_aborts_it_and_the_step_does_not_commit(replicas):
    lighthouse = InMemoryLighthouse()
    a, b = replicas(lighthouse, "a", 1.0), replicas(lighthouse, "b", 1.0)
    train({"a": a, "b": b}, 1)
    # b starts its step's quorum with a, then dies before its allreduce: a's allreduce would wait for it
    started = threading.Event()

    def b_dies() -> None:
        b.manager.start_quorum()
        b.manager.wait_quorum()
        started.set()

    thread = threading.Thread(target=b_dies)
    thread.start()
    a.manager.start_quorum()
    started.wait(30)
    thread.join(30)
    work = a.manager.allreduce(torch.ones(3))
    lighthouse.kill(b.manager.replica_id)
    work.wait()
    assert "left the quorum" in str(a.manager.errored()) and a.pg.aborts == 1
    assert a.manager.should_commit() is False
    assert train({"a": a}, 1) == {"a": [True]}  # the next quorum is a alone


def test_the_commit_vote_is_the_and_of_the_group_and_a_failed_vote_fails_stop(replicas):
    lighthouse = InMemoryLighthouse()
    solo = replicas(lighthouse, "solo", 1.0)

    def broken_vote(*args, **kwargs):
        raise ConnectionError("the ManagerServer is gone")

    solo.manager._client.should_commit = broken_vote
    solo.manager.start_quorum()
    with pytest.raises(ManagerError, match="commit vote for step 0 failed"):
        solo.manager.should_commit()


def test_the_vote_waits_long_enough_for_a_peer_rank_still_in_its_rendezvous_or_a_timed_out_collective(replicas):
    """Ranks of a group are in different rings: one can reach its vote while another is still in a rendezvous
    (or a collective) that may take the whole ``timeout`` before it fails and votes. Waiting only ``timeout``
    made the early rank give up on a vote that was coming, and fail-stop its group for nothing."""
    lighthouse = InMemoryLighthouse()
    solo = replicas(lighthouse, "solo", 1.0, timeout_s=3.0)
    waits: list[float] = []

    def vote(group_rank, step, clean, timeout):
        waits.append(timeout.total_seconds())
        return clean

    solo.manager._client.should_commit = vote
    for explicit in (None, timedelta(seconds=1.5)):
        solo.manager.start_quorum()
        assert solo.manager.should_commit(timeout=explicit)
    assert waits == [2 * 3.0 + 5.0, 1.5]  # the default covers a peer's rendezvous and its grace; explicit wins


def test_should_commit_again_after_a_step_that_served_a_heal_does_not_serve_it_again(replicas):
    """torchft's scripts may vote twice on one quorum (its DiLoCo regression test does): the second vote
    must not try to serve the step the first one already served and moved past."""
    lighthouse = InMemoryLighthouse(min_replicas=2)
    a, b = replicas(lighthouse, "a", 1.0), replicas(lighthouse, "b", 2.0)
    results: dict[str, list[bool]] = {}

    def twice(replica: Replica) -> None:
        replica.manager.start_quorum()
        replica.manager.wait_quorum()
        results[replica.manager.replica_id] = [replica.manager.should_commit(), replica.manager.should_commit()]

    threads = [threading.Thread(target=twice, args=(r,)) for r in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert list(results.values()) == [[True, True], [True, True]]
    assert a.manager._healer.transport.sends == [([1], 0)] and b.loads == 1


def test_durations_the_manager_reports_come_from_the_injected_clock(replicas, caplog):
    ticks = iter(range(0, 10_000, 5))  # every reading is 5 s after the last
    lighthouse = InMemoryLighthouse(min_replicas=2, clock=lambda: float(next(ticks)))
    a, b = replicas(lighthouse, "a", 1.0), replicas(lighthouse, "b", 2.0)
    with caplog.at_level("INFO", logger="torchft_lite"):
        train({"a": a, "b": b}, 1)
    # Both managers read the one fake clock, so a duration is some multiple of 5 s (real ones are ~0.00 s).
    for what in ("healed:", "reconfigured"):
        seconds = [float(m) for r in caplog.records if what in r.getMessage()
                   for m in re.findall(r" in (\d+\.\d\d)s", r.getMessage())]
        assert seconds and all(s > 0 and s % 5 == 0 for s in seconds), (what, seconds)


def test_a_read_of_the_state_waits_while_the_training_loop_has_disallowed_it(replicas):
    """torchft's contract for allow/disallow_state_dict_read: _manager_state_dict waits (bounded) in between."""
    solo = replicas(InMemoryLighthouse(), "solo", 1.0, timeout_s=0.2)
    manager = solo.manager
    assert solo.step()[0]
    manager.disallow_state_dict_read()
    manager.disallow_state_dict_read()  # a no-op while disallowed
    outcome: list[Any] = []
    reader = threading.Thread(target=lambda: outcome.append(_read_or_error(manager)))
    reader.start()
    reader.join(10)
    assert isinstance(outcome[0], TimeoutError)  # waited the step timeout, then gave up
    manager.allow_state_dict_read()
    manager.allow_state_dict_read()
    assert _read_or_error(manager)["torchft"] == {"step": 1, "batches_committed": 1}
    assert torch.equal(_read_or_error(manager)["user"]["default"]["w"], solo.weights)


def _read_or_error(manager: Manager) -> Any:
    try:
        return manager._manager_state_dict()
    except TimeoutError as exc:
        return exc


def test_a_source_serves_from_wait_quorum_so_a_synchronous_receiver_never_waits_for_its_collectives(replicas):
    """torchft's sources send from their quorum: a receiver whose start_quorum heals synchronously must get the
    state while the source waits on something out of band (here a barrier with that receiver, as torchft's
    DiLoCo regression test does) rather than at the source's first collective, which never comes."""
    lighthouse = InMemoryLighthouse()
    a = replicas(lighthouse, "a", 1.0, timeout_s=5.0)
    assert train({"a": a}, 2) == {"a": [True, True]}
    b = replicas(lighthouse, "b", 9.0, timeout_s=5.0, use_async_quorum=False)
    barrier = threading.Barrier(2, timeout=30)
    outcome: dict[str, Any] = {}

    def run(name: str, replica: Replica) -> None:
        try:
            replica.manager.start_quorum()
            replica.manager.wait_quorum()
            barrier.wait()
            outcome[name] = replica.manager.should_commit()
        except BaseException as exc:  # surfaced below
            outcome[name] = exc

    threads = [threading.Thread(target=run, args=item) for item in (("a", a), ("b", b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert outcome == {"a": True, "b": True}
    assert b.loads == 1 and torch.equal(a.weights, b.weights) and b.manager.current_step() == 3


def test_a_group_leaving_on_a_preemption_signal_votes_no_and_leaves_at_the_step_its_peer_had(replicas):
    """Committed, its step could exist only in the group that leaves (a chaos run: its only peer in the quorum was
    healing, so the job redid that step without it, and the checkpoint saved on the way out forked the job)."""
    from torchft_lite.cluster.exit_codes import EXIT_CODE_PREEMPTED

    lighthouse = InMemoryLighthouse(min_replicas=2)
    group = {"a": replicas(lighthouse, "a", 1.0, preemption_signals=(signal.SIGUSR1,)),
             "b": replicas(lighthouse, "b", 1.0)}
    assert train(group, 1) == {"a": [True], "b": [True]}

    def exchange(name: str) -> None:
        group[name].manager.start_quorum()
        group[name].manager.allreduce(torch.ones(3)).wait()

    all_in_threads(group, exchange)
    os.kill(os.getpid(), signal.SIGUSR1)  # handled here, on the main thread, before either group votes
    voted, left = in_threads(group, lambda name: group[name].manager.should_commit())
    assert voted == {"b": True} and isinstance(left["a"], SystemExit) and left["a"].code == EXIT_CODE_PREEMPTED
    assert group["a"].manager.current_step() == 1 and group["b"].manager.current_step() == 2
    assert isinstance(group["a"].manager.errored().original_exception, LeavingError)
