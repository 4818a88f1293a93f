"""Process group pieces that need no network: store addresses, Work wrapping, error marking.

The reconfigurable machinery runs here over an in-memory fake backend (the
store connection is replaced); real gloo groups are in
tests/integration/test_process_group.py.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.conftest import wait_until_sync
from torchft_lite import process_group
from torchft_lite.errors import CollectiveError, CollectiveTimeout, ConfigError
from torchft_lite.process_group import (
    CompletedWork, ProcessGroup, ProcessGroupClosed, ProcessGroupDummy, ProcessGroupNCCL, ReconfigurableProcessGroup,
    ReconfigureOptions, StoreAddress, parse_store_addr, plan_rendezvous, reconfigurable as reconfigurable_module,
)
from torchft_lite.process_group.handles import make_handle
from torchft_lite.work import _DummyWork


def test_public_api_is_pinned() -> None:
    assert sorted(process_group.__all__) == [
        "CompletedWork", "ErrorSwallowingProcessGroupWrapper", "FakeProcessGroupWrapper", "ManagedProcessGroup",
        "ProcessGroup", "ProcessGroupBaby", "ProcessGroupBabyGloo", "ProcessGroupBabyNCCL", "ProcessGroupClosed",
        "ProcessGroupDummy", "ProcessGroupGloo", "ProcessGroupNCCL", "ProcessGroupWrapper", "ReconfigurableProcessGroup",
        "ReconfigureOptions", "Rendezvous", "StoreAddress", "TrackedWork", "create_store_client", "parse_store_addr",
        "plan_rendezvous", "reconfigure_with_store",
    ]
    for name in process_group.__all__:
        assert getattr(process_group, name) is not None


@pytest.mark.parametrize("addr, expected", [
    ("localhost:1234/torchft/3/0", StoreAddress("localhost", 1234, "torchft/3/0")),
    ("10.0.0.1:29500/p", StoreAddress("10.0.0.1", 29500, "p")),
    ("[::1]:80/x/y", StoreAddress("::1", 80, "x/y")),
    ("[fe80::1%eth0]:80/x", StoreAddress("fe80::1%eth0", 80, "x")),
    ("fd00::5:29500/q", StoreAddress("fd00::5", 29500, "q")),  # bare IPv6: the port follows the last colon
    ("node-7.cluster.local:65535/a", StoreAddress("node-7.cluster.local", 65535, "a")),
])
def test_store_addresses_parse(addr: str, expected: StoreAddress) -> None:
    assert parse_store_addr(addr) == expected


@pytest.mark.parametrize("addr", [
    "", "localhost", "localhost:1234", "localhost:1234/", "localhost:1234//", "localhost/prefix", ":1234/p",
    "localhost:0/p", "localhost:65536/p", "localhost:-1/p", "localhost:12a/p", "localhost:/p", "[::1/p",
    "[::1]/p", "[::1]1234/p", "[not-ipv6]:1234/p", "::1]:1234/p", "local host:1234/p", "[]:1234/p",
])
def test_malformed_store_addresses_are_config_errors(addr: str) -> None:
    with pytest.raises(ConfigError):
        parse_store_addr(addr)


def test_store_address_round_trips_through_str() -> None:
    for addr in ("[::1]:80/x/y", "host:1/p"):
        assert str(parse_store_addr(addr)) == addr


# --------------------------------------------------------------- fake backend


class FakeWork(dist.Work):
    """A c10d-like Work completed by the test."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.tensors = tensors
        self.future: torch.futures.Future = torch.futures.Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.future.done():
            raise RuntimeError("Operation timed out!")
        self.future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()


class FakeBackend:
    """Records every collective (``calls``: name and arguments) and hands out a FakeWork for it."""

    def __init__(self, rank: int, world_size: int, timeout: timedelta) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.works: list[FakeWork] = []
        self.options: list[Any] = []
        self.calls: list[tuple[str, tuple]] = []
        self.timeouts_set: list[timedelta] = []
        self.aborted = False
        self.fail_next_call: Exception | None = None

    def _record(self, name: str, *args: Any) -> FakeWork:
        if self.fail_next_call is not None:
            raise self.fail_next_call
        self.calls.append((name, args))
        self.options.append(args[-1])
        self.works.append(FakeWork([a for a in args if isinstance(a, torch.Tensor)]))
        return self.works[-1]

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> FakeWork:
        return self._record("allreduce", tensors, opts)

    def __getattr__(self, name: str) -> Any:
        if name in ("allreduce_coalesced", "allgather_into_tensor_coalesced", "alltoall_base", "reduce_scatter",
                    "reduce_scatter_tensor_coalesced", "allgather", "broadcast", "barrier"):
            return lambda *args: self._record(name, *args)
        raise AttributeError(name)

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeouts_set.append(timeout)

    def abort(self) -> None:
        self.aborted = True


class FakeGroup(ReconfigurableProcessGroup):
    def __init__(self, timeout: timedelta = timedelta(seconds=7)) -> None:
        super().__init__(timeout)
        self.backends: list[FakeBackend] = []

    def _create_backend(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> FakeBackend:
        self.backends.append(FakeBackend(rank, world_size, timeout))
        return self.backends[-1]

    def getBackendName(self) -> str:
        return "fake"


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> FakeGroup:
    monkeypatch.setattr(reconfigurable_module, "connect_store", lambda address, timeout: None)
    pg = FakeGroup()
    pg.configure("store:1/torchft/1/0", "replica-a", 0, 2)
    return pg


def test_collectives_before_configure_are_refused() -> None:
    with pytest.raises(CollectiveError, match="before configure"):
        FakeGroup().allreduce([torch.ones(1)])


@pytest.mark.parametrize("rank, world_size", [(2, 2), (-1, 2), (0, 0), (True, 2), (0, 2.0)])
def test_configure_rejects_bad_ranks(group: FakeGroup, rank: Any, world_size: Any) -> None:
    with pytest.raises(ConfigError):
        group.configure("store:1/torchft/2/0", "replica-a", rank, world_size)


def test_configure_rejects_a_malformed_address_before_tearing_down(group: FakeGroup) -> None:
    with pytest.raises(ConfigError):
        group.configure("store-without-port/torchft/2/0", "replica-a", 0, 2)
    assert not group.backends[0].aborted


def test_collectives_carry_the_group_timeout_unless_the_caller_set_one(group: FakeGroup) -> None:
    group.allreduce([torch.ones(1)])
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    opts.timeout = timedelta(seconds=2)
    group.allreduce([torch.ones(1)], opts)
    group.allreduce([torch.ones(1)], dist.ReduceOp.MIN)
    first, second, third = group.backends[0].options
    assert first.timeout == timedelta(seconds=7) and first.reduceOp == dist.ReduceOp.SUM
    assert second.timeout == timedelta(seconds=2) and second.reduceOp == dist.ReduceOp.MAX
    assert third.reduceOp == dist.ReduceOp.MIN
    with pytest.raises(TypeError):
        group.allreduce([torch.ones(1)], "sum")


def test_future_success_carries_the_result(group: FakeGroup) -> None:
    tensor = torch.ones(2)
    future = group.allreduce([tensor]).get_future()
    group.backends[0].works[0].future.set_result([tensor])
    assert future.wait() == [tensor]
    assert group.errored() is None


def test_a_failed_future_propagates_a_collective_error_and_marks_the_group(group: FakeGroup) -> None:
    work = group.allreduce([torch.ones(2)])
    future = work.get_future()
    cause = RuntimeError("Connection closed by peer [10.0.0.2]:4242")
    group.backends[0].works[0].future.set_exception(cause)

    with pytest.raises(CollectiveError, match="Connection closed by peer") as caught:
        future.wait()
    assert caught.value.__cause__ is cause
    assert group.errored() is caught.value
    assert work.exception() is caught.value and work.is_completed()
    with pytest.raises(CollectiveError):
        work.wait()
    # The errored communicator is aborted and dropped (on a teardown thread) ...
    wait_until_sync(lambda: group.backends[0].aborted, "the failed fake backend to be aborted")
    # ... and later collectives fail fast until the next configure.
    with pytest.raises(CollectiveError, match="errored until the next configure"):
        group.allreduce([torch.ones(2)])


def test_a_wait_that_times_out_is_a_collective_timeout(group: FakeGroup) -> None:
    work = group.allreduce([torch.ones(2)])
    with pytest.raises(CollectiveTimeout, match="timed out after 7 seconds"):
        work.wait()
    assert isinstance(group.errored(), CollectiveTimeout)
    with pytest.raises(CollectiveTimeout):
        work.get_future().wait()


def test_an_exception_from_the_call_marks_the_group(group: FakeGroup) -> None:
    group.backends[0].fail_next_call = RuntimeError("gloo: pair closed")
    with pytest.raises(CollectiveError, match="pair closed"):
        group.allreduce([torch.ones(1)])
    assert isinstance(group.errored(), CollectiveError)


def test_configure_clears_the_error_and_old_work_cannot_mark_the_new_group(group: FakeGroup) -> None:
    old_future = group.allreduce([torch.ones(1)]).get_future()
    group.configure("store:1/torchft/2/0", "replica-a", 1, 3)
    assert (group.rank(), group.size(), group.errored()) == (1, 3, None)

    group.backends[0].works[0].future.set_exception(RuntimeError("late failure of the old communicator"))
    with pytest.raises(CollectiveError):
        old_future.wait()
    assert group.errored() is None
    tensor = torch.ones(1)
    group.allreduce([tensor])
    group.backends[1].works[0].future.set_result([tensor])


def test_abort_errors_the_group_until_configure(group: FakeGroup) -> None:
    group.abort()
    assert isinstance(group.errored(), CollectiveError)
    with pytest.raises(CollectiveError):
        group.allreduce([torch.ones(1)])
    group.configure("store:1/torchft/2/0", "replica-a", 0, 1)
    assert group.errored() is None


def test_rendezvous_timeout_names_the_store_and_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reconfigurable_module, "connect_store", lambda address, timeout: None)

    class SlowGroup(FakeGroup):
        def _create_backend(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> FakeBackend:
            raise dist.DistStoreError("wait timeout after 7000ms, keys: /torchft/4/0/1")

    pg = SlowGroup()
    with pytest.raises(CollectiveTimeout, match=r"store:1.*'torchft/4/0'") as caught:
        pg.configure("store:1/torchft/4/0", "replica-a", 0, 2)
    assert isinstance(caught.value.__cause__, dist.DistStoreError)
    assert pg.errored() is caught.value


def test_set_timeout_validates_and_applies_to_later_collectives(group: FakeGroup) -> None:
    with pytest.raises(ConfigError):
        group.set_timeout(timedelta(0))
    group.set_timeout(timedelta(seconds=3))
    group.allreduce([torch.ones(1)])
    assert group.backends[0].options[-1].timeout == timedelta(seconds=3)


def test_dummy_group_completes_at_once() -> None:
    pg = ProcessGroupDummy(0, 1)
    tensor = torch.full((2,), 5.0)
    assert pg.allreduce([tensor]).get_future().wait() == [tensor]
    assert tensor.tolist() == [5.0, 5.0]
    assert pg.barrier().wait() and isinstance(pg, dist.ProcessGroup)
    pg.configure("ignored", "replica", 2, 4)
    assert (pg.rank(), pg.size(), pg.configure_count, pg.errored()) == (2, 4, 1, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nccl_group_constructs_but_will_not_configure_without_cuda() -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=5))
    assert pg.getBackendName() == "torchft-nccl" and pg.errored() is None
    with pytest.raises(ConfigError, match="CUDA"):
        pg.configure("127.0.0.1:1/torchft/1/0", "replica-a", 0, 1)


# ------------------------------------------------------ every collective, and the lifecycle


def test_every_collective_reaches_the_backend_with_the_group_timeout_and_reduce_op(group: FakeGroup) -> None:
    a, b, out = torch.ones(2), torch.ones(2), torch.zeros(4)
    group.allreduce_coalesced([a, b], dist.ReduceOp.MAX)
    group.allgather_into_tensor_coalesced([out], [a])
    group.alltoall_base(out, torch.ones(4), [2, 2], [2, 2])
    group.reduce_scatter([a], [[b, b]], dist.ReduceOp.MIN)
    group.reduce_scatter_tensor_coalesced([a], [out])
    backend = group.backends[0]
    assert [name for name, _ in backend.calls] == [
        "allreduce_coalesced", "allgather_into_tensor_coalesced", "alltoall_base", "reduce_scatter",
        "reduce_scatter_tensor_coalesced"]
    assert all(opts.timeout == timedelta(seconds=7) for opts in backend.options)
    assert backend.options[0].reduceOp == dist.ReduceOp.MAX and backend.options[3].reduceOp == dist.ReduceOp.MIN
    assert backend.options[4].reduceOp == dist.ReduceOp.SUM
    assert backend.calls[2][1][2:4] == ([2, 2], [2, 2])


def test_allreduce_coalesced_takes_options_a_reduce_op_or_nothing(group: FakeGroup) -> None:
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp, opts.timeout = dist.ReduceOp.PRODUCT, timedelta(seconds=2)
    group.allreduce_coalesced([torch.ones(1)], opts)
    group.allreduce_coalesced([torch.ones(1)])
    first, second = group.backends[0].options
    assert (first.reduceOp, first.timeout) == (dist.ReduceOp.PRODUCT, timedelta(seconds=2))
    assert (second.reduceOp, second.timeout) == (dist.ReduceOp.SUM, timedelta(seconds=7))
    with pytest.raises(TypeError):
        group.allreduce_coalesced([torch.ones(1)], dist.BroadcastOptions())


def test_new_collectives_refuse_strided_tensors_before_the_backend(group: FakeGroup) -> None:
    strided = torch.ones(4, 4)[:, 0]
    with pytest.raises(ValueError, match="contiguous"):
        group.reduce_scatter_tensor_coalesced([torch.zeros(2)], [strided])
    with pytest.raises(TypeError):
        group.reduce_scatter([torch.zeros(2)], [torch.ones(2)])  # inputs must be a list of lists
    assert group.backends[0].calls == [] and group.errored() is None


def test_a_failure_says_the_communicator_was_aborted(group: FakeGroup) -> None:
    work = group.allreduce_coalesced([torch.ones(1)])
    group.backends[0].works[0].future.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer.*aborted"):
        work.wait()
    assert "aborted" in str(group.errored()) and isinstance(group.errored(), RuntimeError)


def test_shutdown_closes_the_group_like_a_handle_until_the_next_configure(group: FakeGroup) -> None:
    group.shutdown()
    with pytest.raises(ProcessGroupClosed, match="handle is closed") as caught:
        group.allreduce([torch.ones(1)])
    assert isinstance(caught.value, OSError) and isinstance(caught.value, CollectiveError)
    assert group.errored() is None
    group.configure("store:1/torchft/2/0", "replica-a", 0, 1)
    group.allreduce([torch.ones(1)])


def test_a_configure_timeout_bounds_the_rendezvous_only(group: FakeGroup) -> None:
    group.configure("store:1/torchft/2/0", "replica-a", 0, 2, timeout=timedelta(seconds=30))
    backend = group.backends[1]
    assert backend.timeout == timedelta(seconds=30)  # the rendezvous
    assert backend.timeouts_set == [timedelta(seconds=7)]  # then the group's own, for send/recv
    group.allreduce([torch.ones(1)])
    assert backend.options[-1].timeout == timedelta(seconds=7)
    with pytest.raises(ConfigError):
        group.configure("store:1/torchft/3/0", "replica-a", 0, 2, timeout=timedelta(0))


def test_an_unsupported_collective_says_so_as_torchft_callers_expect() -> None:
    class Minimal(ProcessGroup):
        pass

    with pytest.raises(NotImplementedError, match="Minimal does not support alltoall_base") as caught:
        Minimal().alltoall_base(torch.zeros(1), torch.zeros(1), [1], [1])
    assert isinstance(caught.value, RuntimeError)


def test_register_needs_torchs_default_group() -> None:
    if dist.is_initialized():
        pytest.skip("another test initialized torch's default group")
    with pytest.raises(ConfigError, match="init_process_group"):
        ProcessGroupDummy(0, 1).register("x")
    with pytest.raises(ValueError, match="register"):
        ProcessGroupDummy(0, 1).group_name  # noqa: B018


# ------------------------------------------------------------- reconfigure handles


def handle(handle_id: str, port: int = 1, global_rank: int | None = None) -> str:
    return make_handle(handle_id, f"host-{handle_id}", port, global_rank)


def options(handles: list[str], uuid: int = 7, timeout: timedelta | None = None) -> ReconfigureOptions:
    opts = ReconfigureOptions()
    opts.uuid, opts.handles, opts.timeout = uuid, handles, timeout
    return opts


def test_a_members_rank_is_the_position_of_its_handle_and_all_meet_on_the_first_store() -> None:
    opts = options([handle("a", 11, 3), handle("b", 12, 5), handle("c", 13, 9)])
    plan = plan_rendezvous(opts, "b")
    assert (plan.store_addr, plan.rank, plan.world_size, plan.uuid) == ("host-a:11/torchft/7", 1, 3, 7)
    assert plan.global_ranks == [3, 5, 9]
    assert plan_rendezvous(options([handle("a", 11, 3), handle("b")]), "a").global_ranks is None


def test_ipv6_hosts_in_handles_are_bracketed() -> None:
    plan = plan_rendezvous(options([make_handle("a", "fd00::5", 29500, None)]), "a")
    assert parse_store_addr(plan.store_addr) == StoreAddress("fd00::5", 29500, "torchft/7")


@pytest.mark.parametrize("handles, uuid, match", [
    ([handle("a"), handle("b")], 7, "appears 0 times"),
    ([handle("me"), handle("me")], 7, "appears 2 times"),
    ([], 7, "no handles"),
    ([handle("me"), "not json"], 7, "not JSON"),
    ([handle("me"), '{"id": 1, "store": "h:1"}'], 7, "'id' and 'store'"),
    ([handle("me")], -1, "uuid"),
])
def test_bad_handles_are_config_errors(handles: list[str], uuid: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_rendezvous(options(handles, uuid), "me")


def test_unordered_handles_are_refused_they_would_give_no_rank_order() -> None:
    with pytest.raises(ConfigError, match="ordered list"):
        plan_rendezvous(options({handle("me")}), "me")  # type: ignore[arg-type]


def test_reconfigure_configures_from_the_handles_with_their_timeout(group: FakeGroup) -> None:
    group.set_rank_info("replica-b", 0, 1, global_rank=4)
    opts = options([handle("peer", 21), make_handle(group._handle_id(), "me", 22, 4)], uuid=9,
                   timeout=timedelta(seconds=30))
    work = group.reconfigure(opts)
    assert isinstance(work, _DummyWork) and work.wait()
    assert (group.rank(), group.size(), str(group._address)) == (1, 2, "host-peer:21/torchft/9")
    assert group.backends[-1].timeout == timedelta(seconds=30)
    assert group.supports_reconfigure


def test_dummy_reconfigures_from_handles_and_counts() -> None:
    pg = ProcessGroupDummy(0, 1)
    pg.reconfigure(options([handle("x"), make_handle(pg._handle_id(), "me", 1, None)]))
    assert (pg.rank(), pg.size(), pg.reconfigure_count, repr(pg)) == (1, 2, 1, "ProcessGroupDummy()")


def test_dummy_collectives_copy_this_ranks_input_and_return_completed_work() -> None:
    pg = ProcessGroupDummy(1, 2)
    value = torch.tensor([1.0, 2.0])
    gathered = torch.zeros(4)
    works = [pg.allreduce_coalesced([value.clone()]), pg.allgather_into_tensor_coalesced([gathered], [value])]
    scattered, rows = torch.zeros(2), torch.arange(4.0)
    works.append(pg.reduce_scatter_tensor_coalesced([scattered], [rows]))
    listed = torch.zeros(2)
    works.append(pg.reduce_scatter([listed], [[torch.zeros(2), value]]))
    moved = torch.zeros(2)
    works.append(pg.alltoall_base(moved, value, [1, 1], [1, 1]))
    assert all(isinstance(work, CompletedWork) and isinstance(work, _DummyWork) and work.wait() for work in works)
    assert gathered.tolist() == [1.0, 2.0, 1.0, 2.0]
    assert scattered.tolist() == [2.0, 3.0] and listed.tolist() == [1.0, 2.0] and moved.tolist() == [1.0, 2.0]
