"""The Manager's state transitions with in-memory fakes: a fake process group and transport.

A real lighthouse and ManagerServer run in this process (ports 0); the
process group and checkpoint transport are fakes, so failures can be injected
exactly where wanted.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import TCPStore

from lighthouse.thread import BackgroundLighthouse
from tests.conftest import all_in_threads, lighthouse_config, wait_until_sync
from tests.integration.helpers import make_manager
from torchft_lite.checkpointing import CheckpointTransport, _http_client, _streams
from torchft_lite.errors import CheckpointTransferError, ManagerTimeout
from torchft_lite.manager import MEMBER_GONE_GRACE, Manager
from torchft_lite.rpc.protocol import torchft_pb2 as pb
from torchft_lite.testing import ConfiguredByHandles

pytestmark = pytest.mark.integration


class FakeProcessGroup(ConfiguredByHandles):
    """Allreduce returns the input (a one-replica sum); ``fail_next`` injects an error."""

    def __init__(self) -> None:
        self.configures: list[tuple[str, int, int]] = []
        self.allreduced: list[torch.Tensor] = []
        self.aborts = 0
        self.fail_next = False
        self.hold_next = False  # the next allreduce stays in flight until abort()
        self.held: list[torch.futures.Future] = []

    def abort(self) -> None:
        self.aborts += 1
        for fut in self.held:
            fut.set_exception(RuntimeError("aborted"))
        self.held = []

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        self.configures.append((store_addr, rank, world_size))

    def allreduce(self, tensors, opts):
        self.allreduced.append(tensors[0].clone())
        fut = torch.futures.Future()
        if self.fail_next:
            self.fail_next = False
            fut.set_exception(RuntimeError("injected allreduce failure"))
        elif self.hold_next:
            self.hold_next = False
            self.held.append(fut)
        else:
            fut.set_result(tensors)
        return SimpleNamespace(get_future=lambda: fut)


class InMemoryTransport(CheckpointTransport):
    """Checkpoints pass through a dict shared by the transports of one test."""

    def __init__(self, shelf: dict, name: str) -> None:
        self.shelf, self.name = shelf, name
        self.published = threading.Condition()

    def metadata(self) -> str:
        return self.name

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        with self.published:
            self.shelf[(self.name, step)] = state_dict
            self.published.notify_all()

    def disallow_checkpoint(self) -> None:
        pass

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        with self.published:
            assert self.published.wait_for(lambda: (metadata, step) in self.shelf, timeout.total_seconds())
            return self.shelf[(metadata, step)]

    def shutdown(self, wait: bool = True) -> None:
        pass


def test_steps_commit_and_an_injected_allreduce_error_retries_the_step(lighthouse):
    pg = FakeProcessGroup()
    manager = make_manager(lighthouse, pg, InMemoryTransport({}, "a"), "solo")
    try:
        manager.start_quorum()
        grad = torch.ones(3)
        manager.allreduce(grad).wait()
        assert manager.should_commit() and manager.current_step() == 1
        assert manager.batches_committed() == 1 and manager.num_participants() == 1
        assert len(pg.configures) == 1 and "/torchft/" in pg.configures[0][0]

        manager.start_quorum()
        pg.fail_next = True
        work = manager.allreduce(torch.ones(3))
        work.wait()  # never raises into the training loop
        assert "injected" in str(manager.errored())
        assert manager.should_commit() is False
        assert manager.current_step() == 1  # not lost, not advanced

        manager.start_quorum()  # the retry: commit_failures makes a new quorum id -> reconfigure
        assert manager.errored() is None
        manager.allreduce(torch.ones(3)).wait()
        assert manager.should_commit() and manager.current_step() == 2
        assert len(pg.configures) == 2
    finally:
        manager.shutdown()


def test_max_retries_exceeded_raises(lighthouse):
    pg = FakeProcessGroup()
    manager = make_manager(lighthouse, pg, InMemoryTransport({}, "a"), "flaky", max_retries=1)
    try:
        for attempt in range(2):
            manager.start_quorum()
            manager.report_error(RuntimeError(f"boom {attempt}"))
            if attempt == 0:
                assert manager.should_commit() is False
        with pytest.raises(RuntimeError, match="should_commit failed 2 times consecutively, exceeding max_retries=1"):
            manager.should_commit()
    finally:
        manager.shutdown()


def test_init_sync_heals_the_second_replica_on_its_training_thread():
    with BackgroundLighthouse(lighthouse_config(min_replicas=2, join_timeout=30.0)) as lighthouse:
        _heal_two_replicas(lighthouse)


def _heal_two_replicas(lighthouse) -> None:
    shelf: dict = {}
    managers, states, load_threads, train_threads = {}, {}, {}, {}

    def run(name: str, value: float) -> None:
        train_threads[name] = threading.get_ident()
        states[name] = {"w": torch.full((3,), value)}
        state = states[name]

        def load(sd):
            load_threads[name] = threading.get_ident()
            state["w"] = sd["w"].clone()

        manager = make_manager(lighthouse, FakeProcessGroup(), InMemoryTransport(shelf, name), name, state=state)
        manager.context.state.load_fns["default"] = load
        managers[name] = manager
        manager.start_quorum()
        manager.allreduce(torch.ones(3)).wait()
        manager.should_commit()

    threads = [threading.Thread(target=run, args=(n, v)) for n, v in (("a", 1.0), ("b", 2.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert set(managers) == {"a", "b"}
        # "a:<suffix>" sorts first, so it is the primary and "b" takes its weights at step 0
        assert torch.equal(states["b"]["w"], torch.full((3,), 1.0))
        assert torch.equal(states["a"]["w"], torch.full((3,), 1.0))
        assert set(load_threads) == {"b"}
        assert load_threads["b"] == train_threads["b"], "state dict applied off the training thread"
        assert managers["b"].current_step() == 1 and managers["a"].current_step() == 1
    finally:
        for manager in managers.values():
            manager.shutdown()


def test_an_errored_participant_aborts_the_collective_instead_of_skewing_it(lighthouse):
    """Zeros from a counted participant would scale everyone's average by (n-1)/n;
    skipping silently would stall the peers until their timeout. Abort fails them fast."""
    pg = FakeProcessGroup()
    manager = make_manager(lighthouse, pg, InMemoryTransport({}, "a"), "errored")
    try:
        manager.start_quorum()
        manager.wait_quorum()
        manager.report_error(RuntimeError("publish failed"))
        manager.allreduce(torch.full((3,), 5.0)).wait()
        assert pg.aborts == 1 and pg.allreduced == []
        assert manager.should_commit() is False
    finally:
        manager.shutdown()


# ---------------------------------------------------------------- several sources, in-place heals


class StripingTransport(InMemoryTransport):
    """Stripes for real over the shelf: the user state from the last source, the rest from the first."""

    def __init__(self, shelf: dict, name: str) -> None:
        super().__init__(shelf, name)
        self.sent_to: list[list[int]] = []
        self.striped_from: list[list[tuple[int, str]]] = []

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        self.sent_to.append(list(dst_ranks))
        super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    def recv_checkpoint_striped(self, sources, step, timeout):
        self.striped_from.append(list(sources))
        parts = [self.recv_checkpoint(rank, metadata, step, timeout) for rank, metadata in sources]
        return {"user": parts[-1]["user"], "torchft": parts[0]["torchft"]}


def run_steps(managers: dict[str, Manager], steps: int, before_step=None) -> dict[str, list]:
    """Each manager trains ``steps`` steps on its own thread; returns its should_commit results."""
    def train(name: str) -> list:
        committed = []
        for step in range(steps):
            if before_step is not None:
                before_step(name, step)
            manager = managers[name]
            manager.start_quorum()
            manager.allreduce(torch.ones(3)).wait()
            committed.append(manager.should_commit())
        return committed

    return all_in_threads(managers, train, 120, "a training thread hung")


@pytest.mark.parametrize("b_heal_sources", [2, 1])
def test_a_late_replica_heals_from_two_sources_when_every_member_can_stripe(b_heal_sources):
    shelf: dict = {}
    states = {"a": {"w": torch.full((3,), 1.0)}, "b": {"w": torch.full((3,), 1.0)}, "c": {"w": torch.full((3,), 7.0)}}
    with BackgroundLighthouse(lighthouse_config(min_replicas=3, join_timeout=30.0)) as lighthouse:
        managers = {
            name: make_manager(lighthouse, FakeProcessGroup(), StripingTransport(shelf, name), name, state=states[name],
                               heal_sources=b_heal_sources if name == "b" else 2)
            for name in ("a", "b", "c")
        }
        try:
            for name in ("a", "b"):
                managers[name].load_state_dict({"step": 5, "batches_committed": 10})
            results = run_steps(managers, 1)
            assert results == {"a": [True], "b": [True], "c": [True]}
            transports = {name: managers[name]._healer.transport for name in managers}
            if b_heal_sources == 2:
                assert transports["c"].striped_from == [[(0, "a"), (1, "b")]]
                assert transports["a"].sent_to == [[2]] and transports["b"].sent_to == [[2]]
            else:  # b advertises one source: torchft's assignment for everyone
                assert transports["c"].striped_from == []
                assert transports["a"].sent_to == [[2]] and transports["b"].sent_to == []
            assert torch.equal(states["c"]["w"], torch.full((3,), 1.0))
            assert [managers[name].current_step() for name in ("a", "b", "c")] == [6, 6, 6]
        finally:
            for manager in managers.values():
                manager.shutdown()


def test_heal_sources_above_one_is_not_advertised_by_a_transport_that_cannot_stripe(lighthouse):
    manager = make_manager(lighthouse, FakeProcessGroup(), InMemoryTransport({}, "a"), "plain", heal_sources=3)
    try:
        assert manager._client._server.config.heal_sources == 1
    finally:
        manager.shutdown()


def test_a_secondary_source_without_metadata_is_left_out_but_the_primary_is_required(lighthouse):
    manager = make_manager(lighthouse, FakeProcessGroup(), InMemoryTransport({}, "meta-a"), "a", timeout=2.0)
    try:
        run_steps({"a": manager}, 1)  # its ManagerServer now holds rank 0's checkpoint metadata
        alive, dead = manager._client.address, "http://127.0.0.1:1"  # nothing listens on port 1
        warnings = []
        healer = manager._healer
        healer._log = lambda level, msg, *args: warnings.append(msg % args)

        def ask(sources):
            return manager._control.submit(healer._metadata_of(sources, 0)).result(30)

        assert ask([(0, alive), (1, dead)]) == [(0, alive, "meta-a")]
        assert len(warnings) == 1 and "without replica 1" in warnings[0]
        with pytest.raises(ManagerTimeout, match="127.0.0.1:1"):
            ask([(1, dead), (0, alive)])
    finally:
        manager.shutdown()


def test_default_transport_receives_in_place_into_data_aliases(lighthouse):
    manager = make_manager(lighthouse, FakeProcessGroup(), None, "inplace")
    off = make_manager(lighthouse, FakeProcessGroup(), None, "allocating", heal_in_place=False)
    try:
        assert manager._healer.transport._state_dict is not None
        assert off._healer.transport._state_dict is None
        model = torch.nn.Linear(3, 3)
        manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        targets = manager.context.state.in_place_targets()
        assert targets["user"]["model"]["weight"].data_ptr() == model.weight.data_ptr()
        assert set(targets) == set(manager.context.state.state_dict()) == {"user", "torchft"}  # the paths a source sends
        # A receive lands while the training thread's backward is still to run (copy_ is what a
        # GPU or non-contiguous target gets): state_dict()'s own tensors share the parameters'
        # version counter and would fail that backward; the aliases don't.
        loss = model(torch.ones(1, 3)).pow(2).sum()
        targets["user"]["model"]["weight"].copy_(torch.zeros(3, 3))
        loss.backward()
        assert torch.equal(model.weight.detach(), torch.zeros(3, 3))
    finally:
        manager.shutdown()
        off.shutdown()


def test_the_default_transports_server_starts_after_the_second_steps_vote_not_before(lighthouse):
    """A restarted replica's join path, up to its first committed step, does not start (or import) the HTTP
    server it needs only as a source."""
    manager = make_manager(lighthouse, FakeProcessGroup(), None, "deferred")
    try:
        transport = manager._healer.transport
        assert transport._server is None and transport.port > 0  # bound, not served yet
        warm_ups = []
        real_warm_up = transport.warm_up
        transport.warm_up = lambda: (warm_ups.append(manager.current_step()), real_warm_up())
        for _ in range(2):
            manager.start_quorum()
            manager.allreduce(torch.ones(2)).wait()
            assert transport._server is None  # the step's collectives ran without it
            assert manager.should_commit()
        assert warm_ups == [1]  # asked once, at the second step's vote (the step then was still 1)
        wait_until_sync(lambda: transport._server is not None, "the checkpoint server to start after the vote")
    finally:
        manager.shutdown()


def fail_first_receive(manager: Manager, calls: list) -> None:
    """The next receive writes part of a tensor in place, then fails, as a connection lost mid-heal would."""
    real = manager._healer.transport.recv_checkpoint

    def recv_checkpoint(**kw):
        calls.append(kw["src_rank"])
        if len(calls) > 1:
            return real(**kw)
        manager.context.state.in_place_targets()["user"]["default"]["w"][:1] = 99.0
        raise CheckpointTransferError("injected: the connection closed after 4 bytes")

    manager._healer.transport.recv_checkpoint = recv_checkpoint


def test_a_heal_that_fails_part_way_in_place_stays_behind_and_heals_at_the_next_quorum():
    states = {"a": {"w": torch.full((3,), 1.0)}, "b": {"w": torch.full((3,), 2.0)}}
    with BackgroundLighthouse(lighthouse_config(min_replicas=2, join_timeout=30.0)) as lighthouse:
        managers = {name: make_manager(lighthouse, FakeProcessGroup(), None, name, state=states[name], timeout=3.0)
                    for name in states}
        try:
            calls: list = []
            fail_first_receive(managers["b"], calls)
            assert run_steps(managers, 1) == {"a": [True], "b": [False]}
            assert managers["b"].current_step() == 0 and "injected" in str(managers["b"].errored())
            assert states["b"]["w"].tolist() == [99.0, 2.0, 2.0]  # torn, and not committed
            assert run_steps(managers, 2) == {"a": [True, True], "b": [True, True]}
            assert calls == [0, 0]
            assert torch.equal(states["a"]["w"], states["b"]["w"])
            assert managers["a"].current_step() == managers["b"].current_step() == 3
        finally:
            for manager in managers.values():
                manager.shutdown()


def test_on_a_host_with_cores_to_spare_the_default_heal_comes_in_place_over_several_streams(monkeypatch):
    """The Manager leaves num_chunks to the defaults: with 8 CPUs a heal takes ranges, each on a thread."""
    monkeypatch.setattr(_streams, "usable_cpus", lambda: 8)
    monkeypatch.setattr(_streams, "BYTES_PER_STREAM", 1 << 20)  # 4 MiB of weights: the 4 streams a source serves
    readers: set[int] = set()
    real_run = _http_client._ThreadedResponse.run

    def run(self, *args):
        readers.add(threading.get_ident())
        return real_run(self, *args)

    monkeypatch.setattr(_http_client._ThreadedResponse, "run", run)
    generator = torch.Generator().manual_seed(3)
    states = {"a": {"w": torch.randn(1 << 20, generator=generator)}, "b": {"w": torch.zeros(1 << 20)}}
    b_weights = states["b"]["w"]
    with BackgroundLighthouse(lighthouse_config(min_replicas=2, join_timeout=30.0)) as lighthouse:
        managers = {name: make_manager(lighthouse, FakeProcessGroup(), None, name, state=states[name])
                    for name in states}
        try:
            assert run_steps(managers, 1) == {"a": [True], "b": [True]}  # step 0: b heals from a (init_sync)
            assert torch.equal(states["b"]["w"], states["a"]["w"])
            assert torch.equal(b_weights, states["a"]["w"])  # landed in the tensor b held (then loaded, cloned)
            assert len(readers) == 4
        finally:
            for manager in managers.values():
                manager.shutdown()


@pytest.mark.parametrize("in_place", [True, False])
def test_a_torn_replica_that_a_quorum_makes_up_to_date_fails_stop(in_place):
    """Its source left after a heal failed part-way: nobody can repair it, so it must not train on."""
    states = {"a": {"w": torch.full((3,), 1.0)}, "b": {"w": torch.full((3,), 2.0)}}
    # Both heartbeat before either joins, so the first quorum waits (join timeout) for both.
    with BackgroundLighthouse(lighthouse_config(min_replicas=1, join_timeout=3.0)) as lighthouse:
        managers = {name: make_manager(lighthouse, FakeProcessGroup(), None, name, state=states[name], timeout=3.0,
                                       heal_in_place=in_place)
                    for name in states}
        try:
            fail_first_receive(managers["b"], [])
            assert run_steps(managers, 1) == {"a": [True], "b": [False]}  # step 0: b heals from a, and fails
            managers["a"].shutdown()
            alone = {"b": managers["b"]}
            # Two steps: the first may also fail on the lighthouse's late "a is gone" event.
            if in_place:
                with pytest.raises(AssertionError, match="ManagerError.*failed heal"):
                    run_steps(alone, 2)
                assert managers["b"]._healer.transport.statistics().published_step is None  # served nothing
            else:  # an allocating receive never touched the live tensors: b trains on from its own
                assert True in run_steps(alone, 2)["b"]
        finally:
            for manager in managers.values():
                manager.shutdown()


def test_a_synchronous_quorum_returns_with_the_heal_applied():
    shelf: dict = {}
    states = {"a": {"w": torch.full((3,), 1.0)}, "b": {"w": torch.full((3,), 2.0)}}
    seen_after_start: dict[str, list[float]] = {}
    with BackgroundLighthouse(lighthouse_config(min_replicas=2, join_timeout=30.0)) as lighthouse:
        managers = {name: make_manager(lighthouse, FakeProcessGroup(), InMemoryTransport(shelf, name), name,
                                       state=states[name], use_async_quorum=False) for name in states}
        original = managers["b"].start_quorum

        def start_quorum(*args, **kw):
            original(*args, **kw)
            seen_after_start["b"] = states["b"]["w"].tolist()

        managers["b"].start_quorum = start_quorum
        try:
            # a publishes only at its first allreduce, after its own synchronous start_quorum
            assert run_steps(managers, 1) == {"a": [True], "b": [True]}
            assert seen_after_start["b"] == [1.0, 1.0, 1.0]
        finally:
            for manager in managers.values():
                manager.shutdown()


@pytest.mark.parametrize("use_async_quorum", [True, False])
def test_a_restarted_replica_rejoins_when_min_replica_size_counts_every_group(use_async_quorum):
    """Two groups, min_replica_size=2, one restarted from scratch: it must get back to training.

    With an asynchronous quorum the healing replica does not count at its heal
    step, so that step can't commit; the heal is kept (as torchft keeps it) and
    the next quorum has two up-to-date replicas. A synchronous quorum applies
    the heal first, so both take part at once.
    """
    shelf: dict = {}
    states = {"a": {"w": torch.full((3,), 1.0)}, "b": {"w": torch.full((3,), 2.0)}}
    with BackgroundLighthouse(lighthouse_config(min_replicas=2, join_timeout=30.0)) as lighthouse:
        managers = {name: make_manager(lighthouse, FakeProcessGroup(), InMemoryTransport(shelf, name), name,
                                       state=states[name], min_replica_size=2, use_async_quorum=use_async_quorum)
                    for name in states}
        managers["a"].load_state_dict({"step": 7, "batches_committed": 14})  # the survivor; b just restarted
        try:
            first = run_steps(managers, 1)
            if use_async_quorum:  # b healed but did not count: too few replicas to commit
                assert first == {"a": [False], "b": [False]}
                assert managers["b"].current_step() == 7, "the heal was undone with the uncommitted step"
                assert run_steps(managers, 1) == {"a": [True], "b": [True]}
            else:
                assert first == {"a": [True], "b": [True]}
            assert managers["a"].current_step() == managers["b"].current_step() == 8
            assert managers["b"].num_participants() == 2
            assert torch.equal(states["a"]["w"], states["b"]["w"])
        finally:
            for manager in managers.values():
                manager.shutdown()


def test_a_heal_is_undone_when_another_rank_of_the_group_failed_the_step():
    """The kept heal is only one every rank of the group got through: one failed rank rolls the step back."""
    shelf: dict = {}
    states = {"a": {"w": torch.full((3,), 1.0)}, "b": {"w": torch.full((3,), 2.0)}}
    with BackgroundLighthouse(lighthouse_config(min_replicas=2, join_timeout=30.0)) as lighthouse:
        managers = {name: make_manager(lighthouse, FakeProcessGroup(), InMemoryTransport(shelf, name), name,
                                       state=states[name], min_replica_size=2) for name in states}
        managers["a"].load_state_dict({"step": 7, "batches_committed": 14})

        def fail_b_once(name: str, step: int) -> None:
            if name == "b" and step == 0:
                managers["b"]._pg.fail_next = True  # its allreduce fails: the group voted no

        try:
            assert run_steps(managers, 1, before_step=fail_b_once) == {"a": [False], "b": [False]}
            assert managers["b"].current_step() == 0, "a heal kept although the group's step failed"
            assert run_steps(managers, 2) == {"a": [False, True], "b": [False, True]}
            assert managers["a"].current_step() == managers["b"].current_step() == 8
        finally:
            for manager in managers.values():
                manager.shutdown()


def member_gone(manager: Manager, replica_id: str = "peer", member: bool = True, left_in: int = 0) -> None:
    """The lighthouse says ``replica_id`` (a member of this step's quorum, if ``member``) has gone (on the loop),
    when quorum ``left_in`` was its last (0: an event without an id)."""
    if member:
        manager._current.members = manager._current.members | {replica_id}
    event = pb.LeaseEvent(kind=pb.LeaseEvent.MEMBER_GONE, replica_id=replica_id, quorum_id=left_in,
                          reason="lease ended")

    async def deliver() -> None:
        manager._members.on_event(event)

    manager._control.run(deliver(), 10, "the event")


def test_a_member_leaving_after_the_steps_collectives_does_not_fail_the_step(lighthouse):
    """It contributed to every collective (say it committed its last step and exited): ours commits."""
    pg = FakeProcessGroup()
    manager = make_manager(lighthouse, pg, InMemoryTransport({}, "a"), "stays")
    try:
        manager.start_quorum()
        manager.allreduce(torch.ones(3)).wait()
        member_gone(manager)
        assert manager.errored() is None and pg.aborts == 0
        assert manager.should_commit()

        manager.start_quorum()  # a collective started after the event fails at once, without waiting for it
        manager.allreduce(torch.ones(3)).wait()
        member_gone(manager)
        allreduced = len(pg.allreduced)
        manager.allreduce(torch.ones(3)).wait()
        assert len(pg.allreduced) == allreduced and "left the quorum" in str(manager.errored())
        assert manager.should_commit() is False
    finally:
        manager.shutdown()


def test_a_member_that_left_before_the_steps_quorum_took_it_back_does_not_fail_the_step(lighthouse):
    """The event is of an older quorum: the member left, came back, and this step's quorum has it. Its
    collectives run (the member waits in them) and the step commits."""
    pg = FakeProcessGroup()
    manager = make_manager(lighthouse, pg, InMemoryTransport({}, "a"), "took-back")
    try:
        manager.start_quorum()
        manager.wait_quorum()
        member_gone(manager, left_in=manager._quorum_id - 1)
        allreduced = len(pg.allreduced)
        manager.allreduce(torch.ones(3)).wait()
        assert len(pg.allreduced) == allreduced + 1 and manager.errored() is None and pg.aborts == 0
        assert manager.should_commit()
    finally:
        manager.shutdown()


def test_a_collective_that_finishes_within_the_grace_after_a_member_left_commits(lighthouse):
    pg = FakeProcessGroup()
    manager = make_manager(lighthouse, pg, InMemoryTransport({}, "a"), "late-completion")
    try:
        manager.start_quorum()
        pg.hold_next = True
        work = manager.allreduce(torch.ones(3))
        member_gone(manager)
        pg.held.pop().set_result([torch.ones(3)])  # our end completes just after the event
        work.wait()
        time.sleep(MEMBER_GONE_GRACE * 2)
        assert pg.aborts == 0 and manager.errored() is None
        assert manager.should_commit()
    finally:
        manager.shutdown()


def test_a_member_leaving_during_a_collective_aborts_it(lighthouse):
    pg = FakeProcessGroup()
    manager = make_manager(lighthouse, pg, InMemoryTransport({}, "a"), "aborts")
    try:
        manager.start_quorum()
        pg.hold_next = True
        work = manager.allreduce(torch.ones(3))
        member_gone(manager)
        work.wait()  # the abort (on its own thread) fails the held collective
        assert pg.aborts == 1 and "left the quorum" in str(manager.errored())
        assert manager.should_commit() is False
    finally:
        manager.shutdown()


def test_an_event_before_the_quorum_answer_about_a_replica_left_out_of_it_does_not_fail_the_step(lighthouse):
    """The usual order after a kill: the lighthouse forms the next quorum without the dead replica, and the
    survivors' "member gone" event can reach a rank after its start_quorum but before its quorum answer. Counting
    it then failed that rank's collectives at once while its peers waited for them (a 10 s stall in the demo)."""
    pg = FakeProcessGroup()
    manager = make_manager(lighthouse, pg, InMemoryTransport({}, "a"), "early-event")
    gate = threading.Event()
    original = manager._client._server.local_quorum

    async def held_quorum(*args, **kwargs):
        await asyncio.to_thread(gate.wait, 30)
        return await original(*args, **kwargs)

    manager._client._server.local_quorum = held_quorum
    try:
        manager._current.members = frozenset({"early-event", "killed"})  # the previous step's quorum had it
        manager.start_quorum()
        member_gone(manager, "killed", member=False)
        gate.set()
        manager.allreduce(torch.ones(3)).wait()
        assert manager.errored() is None and pg.aborts == 0
        assert manager.should_commit()
    finally:
        gate.set()
        manager.shutdown()


def test_a_synchronous_quorum_that_times_out_raises_and_so_does_a_timed_out_vote(lighthouse):
    """torchft's behaviour: with use_async_quorum=False, start_quorum raises a failed
    quorum (a TimeoutError here, with torchft's words), and should_commit raises a
    vote its group never completed."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=FakeProcessGroup(), load_state_dict=lambda sd: None, state_dict=lambda: {}, min_replica_size=2,
        rank=0, world_size=2, store_addr="127.0.0.1", store_port=store.port,  # rank 1 never comes
        lighthouse_addr=lighthouse.server.address(), replica_id="sync", hostname="127.0.0.1",
        checkpoint_transport=InMemoryTransport({}, "sync"), use_async_quorum=False, preemption_signals=(),
    )
    try:
        with pytest.raises(TimeoutError, match="status: Cancelled, message.*Timeout expired"):
            manager.start_quorum(timeout=timedelta(seconds=0.01))
        with pytest.raises(TimeoutError, match="commit vote for step 0"):
            manager.should_commit(timeout=timedelta(seconds=0.01))
        assert manager.current_step() == 0
    finally:
        manager.shutdown()


def test_a_replica_the_lighthouse_declared_gone_does_not_commit_the_step_its_peers_abort(lighthouse):
    """Hung past the heartbeat timeout, then resumed: its collective may still complete with what the peers
    had sent before they aborted, and committing it would leave it a step apart from them (a chaos run saw
    that divergence). Behind instead, it heals at the next quorum."""
    pg = FakeProcessGroup()
    manager = make_manager(lighthouse, pg, InMemoryTransport({}, "a"), "declared-gone")
    try:
        manager.start_quorum()
        manager.allreduce(torch.ones(3)).wait()
        member_gone(manager, manager.replica_id, member=False)
        assert "declared this replica gone" in str(manager.errored())
        assert not manager.should_commit() and manager.current_step() == 0
    finally:
        manager.shutdown()


@pytest.mark.parametrize("use_async_quorum", [True, False])
def test_a_preemption_signal_during_the_quorum_leaves_with_143_instead_of_raising_cancelled(use_async_quorum):
    """The signal handler abandons the quorum in flight; the training thread must take that as a failed
    step and leave at its safe point (exit code 143), not die of the asyncio.CancelledError (exit code 1)."""
    import os
    import signal

    from torchft_lite.cluster.exit_codes import EXIT_CODE_PREEMPTED

    # min_replicas=2 and one Manager: its quorum stays in flight until the signal abandons it
    with BackgroundLighthouse(lighthouse_config(min_replicas=2, join_timeout=1.0)) as lh:
        manager = make_manager(lh, FakeProcessGroup(), InMemoryTransport({}, "preempted"), "preempted",
                               use_async_quorum=use_async_quorum, preemption_signals=(signal.SIGUSR1,))
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
        try:
            timer.start()
            with pytest.raises(SystemExit) as left:
                manager.start_quorum()
                manager.allreduce(torch.ones(3)).wait()
                manager.should_commit()
            assert left.value.code == EXIT_CODE_PREEMPTED
            assert manager.current_step() == 0
        finally:
            timer.cancel()
            manager.shutdown()
