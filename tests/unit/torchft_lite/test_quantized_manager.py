"""Manager.allreduce(should_quantize=True) on the in-memory fakes: averaged within the bound, the same bytes
in every group, the non-finite guard still in force, and input it can never take raised to the caller."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
from torch.distributed import ReduceOp

from tests.conftest import block_amax, in_threads
from tests.unit.helpers import Replica
from torchft_lite.collectives import UnsupportedProcessGroupError, UnsupportedReduceOpError
from torchft_lite.errors import CollectiveError
from torchft_lite.health.nonfinite import HealthConfig
from torchft_lite.quantization import UnsupportedDtypeError
from torchft_lite.testing import InMemoryLighthouse, InMemoryProcessGroup

NUMEL = 3000
WAIT = 60.0


class _Work:
    def __init__(self, fut: torch.futures.Future) -> None:
        self._fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        settled = threading.Event()
        self._fut.add_done_callback(lambda _: settled.set())
        if not settled.wait(WAIT):
            raise TimeoutError("the in-memory collective's peers never came")
        self._fut.value()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut


class ExchangingInMemoryGroup(InMemoryProcessGroup):
    """InMemoryProcessGroup plus the two collectives the quantized path exchanges its rows with.

    They share the allreduce's numbering, so a rank that issued its collectives in another order than
    its peers would pair two different collectives and fail; ``sent`` counts the bytes each one hands over."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, int] = {}
        self.fail_alltoall = False

    def rank(self) -> int:
        return self._rank

    def _join(self, kind: str, payload: Any, finish: Callable[[dict[int, Any]], None]) -> _Work:
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            world = self._world
            if world.aborted is not None:
                fut.set_exception(CollectiveError(f"aborted: {world.aborted}"))
                return _Work(fut)
            entries = world.ops.setdefault(next(self._ops), {})
            entries[self._rank] = ((kind, payload), fut, kind)
            if len(entries) < world.size:
                return _Work(fut)
            done = {rank: entry for rank, entry in entries.items()}
            world.ops = {n: e for n, e in world.ops.items() if e is not entries}
        kinds = {entry[0][0] for entry in done.values()}
        if kinds != {kind}:
            error = CollectiveError(f"ranks paired different collectives: {sorted(kinds)}")
            for _, f, _ in done.values():
                f.set_exception(error)
            return _Work(fut)
        finish({rank: entry[0][1] for rank, entry in done.items()})
        for _, f, _ in done.values():
            f.set_result(None)
        return _Work(fut)

    def alltoall_base(self, output, input_, output_splits, input_splits, opts=None) -> _Work:
        world = self.size()
        if self.fail_alltoall:
            self.fail_alltoall = False
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_exception(CollectiveError("injected alltoall failure"))
            return _Work(fut)
        self.sent["alltoall_base"] = self.sent.get("alltoall_base", 0) + input_.numel() * (world - 1) // world

        def finish(payloads: dict[int, Any]) -> None:
            for r, (out, _) in payloads.items():
                for j, (_, inp) in payloads.items():
                    out.view(world, -1)[j].copy_(inp.view(world, -1)[r])

        return self._join("alltoall_base", (output, input_), finish)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> _Work:
        world = self.size()
        self.sent["allgather"] = self.sent.get("allgather", 0) + inputs[0].numel() * (world - 1)

        def finish(payloads: dict[int, Any]) -> None:
            for outs, _ in payloads.values():
                for j, (_, ins) in payloads.items():
                    outs[0].view(world, -1)[j].copy_(ins[0].view(-1))

        return self._join("allgather", (outputs, inputs), finish)


def run(groups: dict[str, Replica], step: Callable[[str, Replica], Any]) -> dict[str, Any]:
    """``step(name, group)`` for every group at once; what each returned, or the error it raised (the test
    asserts on it)."""
    results, raised = in_threads(groups, lambda name: step(name, groups[name]), WAIT, "a training thread hung")
    return {name: raised.get(name, results.get(name)) for name in groups}


@pytest.fixture
def pair():
    made: list[Replica] = []

    def make(pg_factory: Callable[[], Any] = ExchangingInMemoryGroup, **kwargs: Any) -> tuple[Replica, Replica]:
        lighthouse = InMemoryLighthouse(min_replicas=2)
        made.extend(Replica(lighthouse, name, size=NUMEL, pg=pg_factory(), min_replica_size=2, timeout_s=20.0, **kwargs)
                    for name in "ab")
        a, b = made[-2:]
        zero = torch.zeros(NUMEL)
        assert run({"a": a, "b": b}, lambda _, g: g.step(zero)[0]) == {"a": True, "b": True}  # b heals at step 0
        return a, b

    yield make
    for group in made:
        group.manager.shutdown()


def gradients(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * (seed + 1)


def test_quantized_gradients_are_averaged_within_the_bound_and_identical_in_both_groups(pair):
    a, b = pair()
    grads = {"a": gradients(1), "b": gradients(2)}
    results = run({"a": a, "b": b}, lambda name, g: g.step(grads[name], should_quantize=True))
    (committed_a, avg_a), (committed_b, avg_b) = results["a"], results["b"]
    assert committed_a and committed_b and torch.equal(avg_a, avg_b) and torch.equal(a.weights, b.weights)
    exact = (grads["a"] + grads["b"]) / 2
    bound = (block_amax(grads["a"]) + block_amax(grads["b"])) / 127 / 2
    assert bool(((avg_a - exact).abs() <= bound * (1 + 1e-5)).all())
    assert not torch.equal(avg_a, exact)  # it did go through 8 bits
    # 3000 values are 3 blocks, 2 per rank's row: 2 x (4 + 1024) bytes; each phase sends the peer one row,
    # 4112 bytes in all where a float32 ring allreduce sends 2 x 1/2 x 12000
    assert a.pg.sent == b.pg.sent == {"alltoall_base": 2056, "allgather": 2056}


def test_a_non_finite_group_is_still_left_out_when_quantized(pair):
    a, b = pair()
    bad = gradients(3)
    bad[7] = float("nan")
    grads = {"a": bad, "b": gradients(4)}
    results = run({"a": a, "b": b}, lambda name, g: g.step(grads[name], should_quantize=True))
    assert results["a"][0] and results["b"][0]
    # only b counted: the average is b's gradient (through 8 bits twice), not half of it, and not NaN
    assert bool(((results["a"][1] - grads["b"]).abs() <= block_amax(grads["b"]) / 127 * (1 + 1e-5)).all())
    assert a.manager._guard.steps_skipped == 1 and b.manager._guard.steps_skipped == 0
    assert a.pg.sent["alltoall_base"] > 0 and b.pg.sent["allgather"] > 0  # the zeroed bucket went through 8 bits


def test_with_the_guard_off_a_quantized_nan_spreads_and_never_comes_back_finite(pair):
    a, b = pair(health=HealthConfig(nonfinite_guard=False))
    bad = gradients(5)
    bad[0] = float("inf")
    grads = {"a": bad, "b": gradients(6)}
    results = run({"a": a, "b": b}, lambda name, g: g.step(grads[name], should_quantize=True))
    assert bool(results["a"][1][:1024].isnan().all()) and bool(results["b"][1][:1024].isnan().all())
    assert torch.equal(results["a"][1][1024:], results["b"][1][1024:])


def test_a_quantized_sum_divides_by_nobody(pair):
    a, b = pair()
    grads = {"a": gradients(7), "b": gradients(8)}
    results = run({"a": a, "b": b}, lambda name, g: g.step(grads[name], should_quantize=True,
                                                            reduce_op=ReduceOp.SUM))
    exact = grads["a"] + grads["b"]
    bound = (block_amax(grads["a"]) + block_amax(grads["b"])) / 127
    assert bool(((results["a"][1] - exact).abs() <= bound * (1 + 1e-5)).all())


def test_an_unsupported_dtype_raises_to_the_caller_and_the_step_stays_clean(pair):
    a, b = pair()

    def misuse(name: str, group: Replica) -> Any:
        group.manager.start_quorum()
        try:
            group.manager.allreduce(torch.ones(4, dtype=torch.int64), should_quantize=True)
        except UnsupportedDtypeError as exc:
            raised = exc
        else:
            raised = None
        error = group.manager.errored()
        # the same step goes on with a supported tensor and commits: the misuse failed nothing
        group.manager.allreduce(torch.ones(NUMEL), should_quantize=True).wait()
        return raised, error, group.manager.should_commit()

    results = run({"a": a, "b": b}, misuse)
    for name in ("a", "b"):
        raised, error, committed = results[name]
        assert isinstance(raised, TypeError) and "torch.int64" in str(raised) and "should_quantize=False" in str(raised)
        assert error is None and committed is True


def test_an_unsupported_reduce_op_and_a_group_without_the_collectives_raise_too(pair):
    a, b = pair(pg_factory=InMemoryProcessGroup)

    def misuse(name: str, group: Replica) -> Any:
        group.manager.start_quorum()
        raised = []
        for kwargs in ({"reduce_op": ReduceOp.MAX}, {}):
            try:
                group.manager.allreduce(torch.ones(NUMEL), should_quantize=True, **kwargs)
            except Exception as exc:  # asserted on below
                raised.append(exc)
        group.manager.allreduce(torch.ones(NUMEL)).wait()  # unquantized: this group can
        return raised, group.manager.should_commit()

    results = run({"a": a, "b": b}, misuse)
    for name in ("a", "b"):
        raised, committed = results[name]
        assert [type(e) for e in raised] == [UnsupportedReduceOpError, UnsupportedProcessGroupError]
        assert "alltoall_base" in str(raised[1]) and committed is True


def test_a_failed_exchange_fails_the_step_in_every_group_and_the_next_one_commits(pair):
    a, b = pair()
    a.pg.fail_alltoall = b.pg.fail_alltoall = True
    before = a.weights.clone()
    results = run({"a": a, "b": b}, lambda name, g: (g.step(gradients(9), should_quantize=True)[0],
                                                      g.manager.errored()))
    for name in ("a", "b"):
        committed, error = results[name]
        assert committed is False and "injected alltoall failure" in str(error)
    assert torch.equal(a.weights, before) and torch.equal(b.weights, before)
    results = run({"a": a, "b": b}, lambda name, g: g.step(gradients(10), should_quantize=True)[0])
    assert results == {"a": True, "b": True} and torch.equal(a.weights, b.weights)
