"""Wrapping process groups, over in-memory groups: forwarding, swallowed errors, injected errors, the Manager's group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit.helpers import FailingWork
from torchft_lite.errors import CollectiveError, ConfigError
from torchft_lite.process_group import (
    CompletedWork, ErrorSwallowingProcessGroupWrapper, FakeProcessGroupWrapper, ManagedProcessGroup, ProcessGroupDummy,
    ProcessGroupWrapper, ReconfigureOptions,
)
from torchft_lite.process_group.handles import make_handle
from torchft_lite.process_group.wrappers import _ErrorSwallowingWork
from torchft_lite.work import ManagedWork, completed_future


class FlakyGroup(ProcessGroupDummy):
    """A dummy group whose next allreduce fails, either in the call or in its Work."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.fail_work: Exception | None = None
        self.fail_call: Exception | None = None
        self.allreduces = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = dist.ReduceOp.SUM) -> dist.Work:
        self.allreduces += 1
        if self.fail_call is not None:
            raise self.fail_call
        if self.fail_work is not None:
            return FailingWork(self.fail_work)
        return super().allreduce(tensors, opts)


def reconfigure_alone(pg: Any) -> None:
    opts = ReconfigureOptions()
    opts.handles = [make_handle(pg._handle_id(), "me", 1, None)]
    pg.reconfigure(opts).wait()


def test_the_wrapper_forwards_everything_to_the_wrapped_group() -> None:
    inner = ProcessGroupDummy(0, 1)
    wrapper = ProcessGroupWrapper(pg=inner)
    assert wrapper.parent is inner
    reconfigure_alone(wrapper)  # the handle is the wrapped group's
    assert inner.reconfigure_count == 1
    wrapper.configure("ignored", "replica", 1, 3)
    assert (wrapper.rank(), wrapper.size(), wrapper.getBackendName()) == (1, 3, "torchft-dummy")
    out = torch.zeros(2)
    assert isinstance(wrapper.allgather_into_tensor_coalesced([out], [torch.ones(1)]), CompletedWork)
    assert out.tolist() == [1.0, 1.0]
    assert repr(wrapper) == "ProcessGroupWrapper(pg=ProcessGroupDummy())"


def test_a_wrapper_without_a_group_says_so() -> None:
    wrapper = ProcessGroupWrapper()
    with pytest.raises(CollectiveError, match="process group not initialized"):
        wrapper.allreduce([torch.ones(1)])
    with pytest.raises(CollectiveError, match="not initialized"):
        wrapper.get_reconfigure_handle()


def test_a_wrapped_torch_group_runs_collectives_but_cannot_be_reconfigured() -> None:
    store = dist.HashStore()
    torch_group = dist.ProcessGroup(store, 0, 1)
    wrapper = ProcessGroupWrapper(pg=torch_group)
    with pytest.raises(ConfigError, match="cannot be configured"):
        wrapper.configure("host:1/p", "replica", 0, 1)
    assert wrapper.errored() is None


def test_error_swallowing_records_the_error_and_skips_allreduces_until_reconfigured() -> None:
    inner = FlakyGroup()
    wrapper = ErrorSwallowingProcessGroupWrapper(inner)
    tensor = torch.ones(2)
    work = wrapper.allreduce([tensor])
    assert isinstance(work, _ErrorSwallowingWork) and work.wait() and wrapper.error() is None

    error = RuntimeError("Connection closed by peer")
    inner.fail_work = error
    failing = wrapper.allreduce([tensor])
    assert failing.get_future().wait() == [tensor]  # the default result instead of the error
    assert wrapper.error() is error
    skipped = wrapper.allreduce([tensor])
    assert isinstance(skipped, CompletedWork) and inner.allreduces == 2
    assert isinstance(wrapper.barrier(), CompletedWork)  # other collectives go through as they are

    inner.fail_work = None
    reconfigure_alone(wrapper)
    assert wrapper.error() is None
    wrapper.allreduce([tensor]).wait()
    assert inner.allreduces == 3


def test_error_swallowing_catches_a_failing_call_and_a_failing_wait() -> None:
    inner = FlakyGroup()
    wrapper = ErrorSwallowingProcessGroupWrapper(inner)
    inner.fail_call = RuntimeError("refused")
    assert isinstance(wrapper.allreduce([torch.ones(1)]), CompletedWork)
    assert str(wrapper.error()) == "refused"
    wrapper.configure("ignored", "replica", 0, 1)
    inner.fail_call, inner.fail_work = None, RuntimeError("timed out")
    assert wrapper.allreduce([torch.ones(1)]).wait() is True
    assert str(wrapper.error()) == "timed out"


def test_fake_wrapper_fails_the_next_allreduce_future_only() -> None:
    wrapper = FakeProcessGroupWrapper(ProcessGroupDummy(0, 1))
    injected = RuntimeError("injected")
    wrapper.report_future_error(injected)
    work = wrapper.allreduce([torch.ones(1)])
    assert work.wait()
    with pytest.raises(RuntimeError, match="injected"):
        work.get_future().wait()
    wrapper.allreduce([torch.ones(1)]).get_future().wait()


class FakeManager:
    """What ManagedProcessGroup uses of a Manager: its group, allreduce, and the step's participants."""

    def __init__(self) -> None:
        self._pg = ProcessGroupDummy(0, 1)
        self.allreduces: list[tuple[torch.Tensor, Any]] = []

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: Any = dist.ReduceOp.AVG) -> ManagedWork:
        self.allreduces.append((tensor, reduce_op))
        return ManagedWork(completed_future(tensor))

    def num_participants(self) -> int:
        return 5


def test_managed_group_allreduces_through_the_manager_and_reports_its_participants() -> None:
    manager = FakeManager()
    pg = ManagedProcessGroup(manager)  # type: ignore[arg-type]
    tensor = torch.ones(1)
    work = pg.allreduce([tensor], dist.ReduceOp.SUM)
    assert isinstance(work, dist.Work) and work.wait() and work.get_future().wait() is tensor
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([tensor], opts)
    assert [op for _, op in manager.allreduces] == [dist.ReduceOp.SUM, dist.ReduceOp.MAX]
    assert (pg.size(), pg.getBackendName()) == (5, "torchft-dummy")
    pg.allreduce_coalesced([tensor]).wait()  # not through the Manager
    assert len(manager.allreduces) == 2
    with pytest.raises(ValueError, match="exactly one tensor"):
        pg.allreduce([tensor, tensor])
