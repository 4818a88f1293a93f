"""torchft's manager_test.py scenarios, ported to the in-memory fakes of ``torchft_lite.testing``.

torchft's versions drive the Manager through a MagicMock process group and count its calls, or set its
private per-step fields to fake a quorum; ``make compat`` runs them unchanged (but test_quorum_checkpoint_errors,
left out with its reason in tests/compat/cases.py). Here each runs against real (in-memory) quorums, process
groups and heals as well, which checks the values a mock can't; a test's name is the torchft test it ports.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
from torch.distributed import ReduceOp

from tests.unit.helpers import Replica, replicas, train  # noqa: F401  (the fixture)
from torchft_lite.errors import ExceptionWithTraceback
from torchft_lite.manager import WorldSizeMode
from torchft_lite.testing import InMemoryLighthouse, InMemoryProcessGroup, InMemoryTransport


def together(**work: Callable[[], Any]) -> dict[str, Any]:
    """Run each callable on a thread of its own (a quorum waits for every live replica); their results."""
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        try:
            results[name] = work[name]()
        except BaseException as exc:  # surfaced below
            results[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a replica's thread hung"
    for name, result in results.items():
        if isinstance(result, BaseException):
            raise AssertionError(f"{name} raised {result!r}") from result
    return results


def ahead(replicas, lighthouse: InMemoryLighthouse, steps: int, **kwargs: Any) -> Replica:
    """Replica "a", trained alone to ``steps`` before the others join."""
    a = replicas(lighthouse, "a", 1.0, **kwargs)
    assert train({"a": a}, steps) == {"a": [True] * steps}
    return a


class CountingGroup(InMemoryProcessGroup):
    def __init__(self) -> None:
        super().__init__()
        self.allreduces = 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self.allreduces += 1
        return super().allreduce(tensors, opts)


def test_quorum_happy(replicas):
    lighthouse = InMemoryLighthouse(min_replicas=2)
    a, b = replicas(lighthouse, "a", 1.0, min_replica_size=2), replicas(lighthouse, "b", 1.0, min_replica_size=2)
    assert (a.manager._quorum_id, a.manager.current_step(), a.manager.batches_committed()) == (-1, 0, 0)
    assert train({"a": a, "b": b}, 1) == {"a": [True], "b": [True]}
    assert a.manager._quorum_id > 0 and a.manager._quorum_id == b.manager._quorum_id
    assert a.manager.current_step() == 1 and a.manager.batches_committed() == 2


def test_quorum_heal_sync(replicas):
    lighthouse = InMemoryLighthouse()
    a = ahead(replicas, lighthouse, 3)
    b = replicas(lighthouse, "b", 9.0, use_async_quorum=False)
    assert (b.manager.num_participants(), b.manager.participating_rank()) == (0, None)

    def b_step() -> tuple[bool, bool, int, bool]:
        b.manager.start_quorum()  # returns with the heal applied
        healed = (not b.manager._healing, b.manager.is_participating(), b.manager.num_participants())
        b.manager.allreduce(torch.ones(3)).wait()
        return (*healed, b.manager.should_commit())

    results = together(a=lambda: a.step(), b=b_step)
    assert results["b"] == (True, True, 2, True) and results["a"][0]
    assert b.loads == 1 and b.manager.current_step() == 4 == a.manager.current_step()


@pytest.mark.parametrize("min_replica_size", [2, 1], ids=["not_enough_participants", "zero_grad"])
def test_quorum_heal_async(replicas, min_replica_size):
    """torchft's test_quorum_heal_async_not_enough_participants and test_quorum_heal_async_zero_grad."""
    lighthouse = InMemoryLighthouse()
    a = ahead(replicas, lighthouse, 3)
    b = replicas(lighthouse, "b", 9.0, min_replica_size=min_replica_size)

    def b_step() -> tuple[Any, ...]:
        b.manager.start_quorum()
        b.manager._quorum_future.result(30)
        seen = (b.manager._healing, b.manager.is_participating(), b.manager.num_participants())
        grad = torch.ones(3)
        b.manager.allreduce(grad).wait()
        return (*seen, grad.tolist(), b.manager.should_commit())

    results = together(a=lambda: a.step(), b=b_step)
    healing, participating, participants, grad, committed = results["b"]
    # A healing replica sends zeros and gets the participants' average (a's gradient of 1, over 1 participant).
    assert (healing, participating, participants, grad) == (True, False, 1, [1.0] * 3)
    assert b.loads == 1
    # The heal brought a's step and batches (3 and 3); it is kept even when the step does not commit.
    if min_replica_size == 2:  # one participant is too few
        assert not committed and b.manager.current_step() == 3 and b.manager.batches_committed() == 3
    else:
        assert committed and b.manager.current_step() == 4 and b.manager.batches_committed() == 3 + 1


def test_allreduce_error():
    pg = CountingGroup()
    manager = InMemoryLighthouse().manager("solo", pg, load_state_dict=lambda sd: None, state_dict=lambda: {},
                                           min_replica_size=1, timeout=timedelta(seconds=10))
    try:
        manager.start_quorum()
        manager.allreduce(torch.ones(1)).wait()
        issued = pg.allreduces
        assert issued == 1  # one collective, the non-finite guard's count included
        pg.fail_next = True
        manager.allreduce(torch.ones(1)).wait()  # fails: recorded, never raised
        assert isinstance(manager.errored(), ExceptionWithTraceback)
        failed = pg.allreduces
        manager.allreduce(torch.ones(1)).wait()  # skipped: the step is failed already
        assert pg.allreduces == failed > issued
        assert not manager.should_commit() and manager._errored is not None
        manager.start_quorum()  # the next step starts clean and commits
        assert manager.errored() is None
        manager.allreduce(torch.ones(1)).wait()
        assert manager.should_commit()
    finally:
        manager.shutdown()


def test_quorum_fixed_world_size(replicas):
    lighthouse = InMemoryLighthouse(min_replicas=3)
    group = {name: replicas(lighthouse, name, 1.0, min_replica_size=2, world_size_mode=WorldSizeMode.FIXED_WITH_SPARES)
             for name in ("a", "b", "c")}
    train(group, 1)  # past step 0, where init_sync heals all but the primary

    def step(replica: Replica) -> Callable[[], tuple[bool, int, bool]]:
        def run() -> tuple[bool, int, bool]:
            replica.manager.start_quorum()
            replica.manager.allreduce(torch.ones(3)).wait()
            manager = replica.manager
            return manager.is_participating(), manager.num_participants(), manager.should_commit()
        return run

    results = together(**{name: step(replica) for name, replica in group.items()})
    assert results == {"a": (True, 2, True), "b": (True, 2, True), "c": (False, 2, True)}  # replica rank 2: a spare
    assert all(r.manager.batches_committed() == 4 and r.manager.current_step() == 2 for r in group.values())


def test_quorum_no_healing(replicas):
    lighthouse = InMemoryLighthouse()
    a = ahead(replicas, lighthouse, 2)
    b = replicas(lighthouse, "b", 9.0)

    def b_step() -> tuple[bool, int, bool]:
        b.manager.start_quorum(allow_heal=False)
        b.manager.allreduce(torch.ones(3)).wait()
        return b.manager.is_participating(), b.manager.num_participants(), b.manager.should_commit()

    results = together(a=lambda: a.step(), b=b_step)
    assert results["b"] == (False, 1, True)  # behind, not healed: it sits the step out and still commits
    assert b.loads == 0 and b.manager.current_step() == 1 and b.weights.tolist() == [9.0] * 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.long])
def test_manager_numerics(replicas, dtype):
    lighthouse = InMemoryLighthouse(min_replicas=2)
    a, b = replicas(lighthouse, "a", 1.0), replicas(lighthouse, "b", 1.0)
    train({"a": a, "b": b}, 1)
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT]
    if dtype.is_floating_point:
        ops.insert(0, ReduceOp.AVG)

    def reduce_all(replica: Replica, value: int) -> Callable[[], list[float]]:
        def run() -> list[float]:
            replica.manager.start_quorum()
            out = []
            for op in ops:
                tensor = torch.tensor([value], dtype=dtype)
                replica.manager.allreduce(tensor, reduce_op=op).wait()
                out.append(tensor.item())
            replica.manager.should_commit()
            return out

        return run

    results = together(a=reduce_all(a, 10), b=reduce_all(b, 30))
    expected = ([20.0] if dtype.is_floating_point else []) + [40.0, 30.0, 10.0, 300.0]
    assert results == {"a": expected, "b": expected}


class FailingTransport(InMemoryTransport):
    def __init__(self, lighthouse: InMemoryLighthouse, name: str, fail: str) -> None:
        super().__init__(lighthouse.shelf, name, lighthouse.published)
        self.fail = fail

    def send_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        if self.fail == "send":
            raise RuntimeError("send failure")
        super().send_checkpoint(*args, **kwargs)

    def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail == "recv":
            raise RuntimeError("recv failure")
        return super().recv_checkpoint(*args, **kwargs)


@pytest.mark.parametrize("failing", ["recv", "send"])
def test_quorum_checkpoint_errors(replicas, failing):
    lighthouse = InMemoryLighthouse()
    a = ahead(replicas, lighthouse, 2, checkpoint_transport=FailingTransport(lighthouse, "a",
                                                                            "send" if failing == "send" else ""),
              timeout_s=2.0)
    b = replicas(lighthouse, "b", 9.0, timeout_s=2.0,
                 checkpoint_transport=FailingTransport(lighthouse, "b", "recv" if failing == "recv" else ""))
    results = together(a=lambda: a.step(), b=lambda: b.step())
    failed = a if failing == "send" else b
    error = failed.manager.errored()
    assert isinstance(error, ExceptionWithTraceback) and str(error.original_exception) == f"{failing} failure"
    assert f"{failing} failure" in error.stack_trace
    assert results["b"][0] is False and b.loads == 0  # the heal did not happen either way
