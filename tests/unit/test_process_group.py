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
    ProcessGroupDummy,
    ProcessGroupNCCL,
    ReconfigurableProcessGroup,
    StoreAddress,
    parse_store_addr,
)
from torchft_lite.process_group import base as base_module


def test_public_api_is_pinned() -> None:
    assert sorted(process_group.__all__) == [
        "CompletedWork", "ProcessGroup", "ProcessGroupBaby", "ProcessGroupBabyGloo", "ProcessGroupBabyNCCL",
        "ProcessGroupDummy", "ProcessGroupGloo", "ProcessGroupNCCL", "ReconfigurableProcessGroup", "StoreAddress", "TrackedWork", "parse_store_addr",
    ]


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
    def __init__(self, rank: int, world_size: int, timeout: timedelta) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.works: list[FakeWork] = []
        self.options: list[Any] = []
        self.aborted = False
        self.fail_next_call: Exception | None = None

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> FakeWork:
        if self.fail_next_call is not None:
            raise self.fail_next_call
        self.options.append(opts)
        self.works.append(FakeWork(tensors))
        return self.works[-1]

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
    monkeypatch.setattr(base_module, "connect_store", lambda address, timeout: None)
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
    monkeypatch.setattr(base_module, "connect_store", lambda address, timeout: None)

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
