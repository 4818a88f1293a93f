"""The non-finite guard (torchft_lite.health.nonfinite) on the in-memory fakes: a NaN group is left out of the average
and everyone commits the same step; all-NaN or a non-finite average commits nothing; K in a row leaves."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from tests.unit.helpers import Replica, replicas, train  # noqa: F401  (the fixture)
from torchft_lite.cluster.exit_codes import EXIT_CODE_BAD_REPLICA, exit_code_for
from torchft_lite.core.step import Step
from torchft_lite.errors import ConfigError, NonFiniteError
from torchft_lite.health import nonfinite
from torchft_lite.health.nonfinite import HealthConfig, NonFiniteGuard
from torchft_lite.testing import InMemoryLighthouse, InMemoryProcessGroup
from torchft_lite.work import DoneWork

NAN = float("nan")


def two_groups(replicas, pg_factory: Any = None, **kwargs) -> tuple[Replica, Replica]:
    lighthouse = InMemoryLighthouse(min_replicas=2)
    a, b = (replicas(lighthouse, name, 1.0, min_replica_size=2, pg=pg_factory and pg_factory(), **kwargs)
            for name in "ab")
    assert train({"a": a, "b": b}, 1) == {"a": [True], "b": [True]}  # step 0: b heals from a, both commit
    return a, b


def test_a_group_with_nan_gradients_is_left_out_and_both_commit_the_others_average(replicas, caplog):
    a, b = two_groups(replicas)
    before = a.weights.clone()
    with caplog.at_level(logging.WARNING, logger="torchft_lite.manager"):
        assert train({"a": a, "b": b}, 1, grads={"a": NAN, "b": 4.0}) == {"a": [True], "b": [True]}
    # Only b's gradient counted: the average is 4.0, not (NaN + 4) / 2, nor 4 / 2.
    assert torch.equal(a.weights, b.weights) and a.weights.tolist() == (before - 4.0).tolist()
    assert a.manager._guard.steps_skipped == 1 and b.manager._guard.steps_skipped == 0
    assert any("non-finite" in r.getMessage() and "[a" in r.getMessage() for r in caplog.records)
    # The next clean step counts both again, and resets a's run of bad steps.
    assert train({"a": a, "b": b}, 1, grads={"a": 1.0, "b": 3.0}) == {"a": [True], "b": [True]}
    assert a.weights.tolist() == (before - 4.0 - 2.0).tolist() and a.manager._guard.in_a_row == 0


def test_when_every_group_is_non_finite_nothing_commits_and_nothing_changes(replicas):
    a, b = two_groups(replicas)
    before, step = a.weights.clone(), a.manager.current_step()
    assert train({"a": a, "b": b}, 1, grads={"a": NAN, "b": math.inf}) == {"a": [False], "b": [False]}
    assert isinstance(a.manager.errored().original_exception, NonFiniteError)
    assert isinstance(b.manager.errored().original_exception, NonFiniteError)
    assert torch.equal(a.weights, before) and torch.equal(b.weights, before) and a.manager.current_step() == step


def test_a_non_finite_average_of_finite_gradients_commits_nowhere(replicas):
    a, b = two_groups(replicas)
    big = torch.finfo(torch.float32).max
    assert train({"a": a, "b": b}, 1, grads={"a": big, "b": big}) == {"a": [False], "b": [False]}
    assert "average" in str(a.manager.errored())


def test_non_finite_gradients_k_steps_in_a_row_make_the_group_leave_with_its_exit_code(replicas):
    a, b = two_groups(replicas, health=HealthConfig(max_nonfinite_steps=2))
    assert train({"a": a, "b": b}, 1, grads={"a": NAN, "b": 1.0}) == {"a": [True], "b": [True]}
    before, step = b.weights.clone(), b.manager.current_step()
    with pytest.raises(AssertionError, match="NonFiniteError") as raised:
        train({"a": a, "b": b}, 1, grads={"a": NAN, "b": 1.0})
    error = raised.value.__cause__
    assert isinstance(error, NonFiniteError) and "2 steps in a row" in str(error)
    assert exit_code_for(error) == EXIT_CODE_BAD_REPLICA == 65
    # a voted before it raised, so b committed the step on its own gradient alone.
    assert b.weights.tolist() == (before - 1.0).tolist() and b.manager.current_step() == step + 1


def test_with_the_guard_off_a_nan_spreads_to_every_group(replicas):
    a, b = two_groups(replicas, health=HealthConfig(nonfinite_guard=False))
    assert train({"a": a, "b": b}, 1, grads={"a": NAN, "b": 4.0}) == {"a": [True], "b": [True]}
    assert torch.isnan(a.weights).all() and torch.isnan(b.weights).all()


def test_the_settings_come_from_the_environment_and_bad_ones_are_named():
    assert HealthConfig.from_env({}) == HealthConfig(nonfinite_guard=True, max_nonfinite_steps=3)
    assert HealthConfig.from_env({"TORCHFT_LITE_NONFINITE_GUARD": "0", "TORCHFT_LITE_MAX_NONFINITE_STEPS": "5"}) \
        == HealthConfig(nonfinite_guard=False, max_nonfinite_steps=5)
    with pytest.raises(ConfigError, match="TORCHFT_LITE_NONFINITE_GUARD"):
        HealthConfig.from_env({"TORCHFT_LITE_NONFINITE_GUARD": "maybe"})
    with pytest.raises(ConfigError, match="TORCHFT_LITE_MAX_NONFINITE_STEPS"):
        HealthConfig.from_env({"TORCHFT_LITE_MAX_NONFINITE_STEPS": "three"})
    with pytest.raises(ConfigError, match="max_nonfinite_steps"):
        HealthConfig(max_nonfinite_steps=0)


def test_the_group_left_out_tells_the_lighthouse_how_often_in_its_member_data(replicas):
    advertised: dict[str, object] = {}
    a, b = two_groups(replicas)
    a.manager._guard._advertise = advertised.__setitem__  # the in-memory wiring has no ManagerServer to carry it
    train({"a": a, "b": b}, 2, grads={"a": NAN, "b": 1.0})
    assert advertised == {"nonfinite_steps": 2}


class OtherGroupAdds:
    """A process group of two groups, seen from one: its allreduces add the other group's tensors (``others``,
    one per call, in order), and it records what each call sent."""

    def __init__(self, *others: torch.Tensor) -> None:
        self.others, self.sent = list(others), []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self.sent.append([t.tolist() for t in tensors])
        tensors[0].add_(self.others.pop(0))
        return DoneWork(tensors)


def guarded(tensor: torch.Tensor, *others: torch.Tensor, counts: bool = True) -> tuple[torch.Tensor, OtherGroupAdds,
                                                                                        Step]:
    pg, step = OtherGroupAdds(*others), Step(number=0)
    guard = NonFiniteGuard(HealthConfig(), lambda *a, **k: None, lambda s, e: s.record(e))
    result = guard.start(pg, tensor, ReduceOp.AVG, 2, step, counts, []).wait()
    assert result is tensor and pg.others == []
    return tensor, pg, step


def test_a_bucket_and_its_left_out_count_travel_in_one_collective():
    tensor, pg, step = guarded(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0, 0.0]))
    assert pg.sent == [[[1.0, 2.0, 3.0, 0.0]]]
    assert tensor.tolist() == [2.0, 2.0, 2.0] and not step.nonfinite and step.error is None


def test_a_non_finite_bucket_goes_as_zeros_and_a_one_and_gets_the_others_average():
    tensor, pg, step = guarded(torch.tensor([1.0, NAN, 3.0]), torch.tensor([3.0, 2.0, 1.0, 0.0]))
    assert pg.sent == [[[0.0, 0.0, 0.0, 1.0]]]
    assert tensor.tolist() == [3.0, 2.0, 1.0] and step.nonfinite and step.error is None
    # A group the quorum does not count (healing) sends no one: its zeros are not missed.
    tensor, pg, step = guarded(torch.tensor([math.inf]), torch.tensor([4.0, 0.0]), counts=False)
    assert pg.sent == [[[0.0, 0.0]]] and tensor.tolist() == [2.0] and not step.nonfinite


def test_a_tensor_above_the_packing_limit_sends_its_count_in_a_collective_of_its_own(monkeypatch):
    monkeypatch.setattr(nonfinite, "PACK_COUNT_MAX_BYTES", 8)  # two float32s
    tensor, pg, step = guarded(torch.tensor([1.0, NAN, 3.0]), torch.tensor([3.0, 2.0, 1.0]), torch.tensor([0.0]))
    assert pg.sent == [[[0.0, 0.0, 0.0]], [[1.0]]]  # the sum, then the count, in every group's order
    assert tensor.tolist() == [3.0, 2.0, 1.0] and step.nonfinite
    tensor, pg, step = guarded(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 2.0, 0.0]))  # at the limit: one
    assert pg.sent == [[[1.0, 2.0, 0.0]]] and tensor.tolist() == [2.0, 2.0]


def test_a_tensor_that_is_not_contiguous_is_averaged_in_place():
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    view = base.t()  # [[1, 3], [2, 4]], not contiguous
    guarded(view, torch.tensor([1.0, 3.0, 2.0, 4.0, 0.0]))
    assert base.tolist() == [[1.0, 2.0], [3.0, 4.0]] and view.tolist() == [[1.0, 3.0], [2.0, 4.0]]
    half = torch.tensor([2.0, 6.0], dtype=torch.bfloat16)
    guarded(half, torch.tensor([0.0, 2.0, 0.0], dtype=torch.bfloat16))
    assert half.tolist() == [1.0, 4.0]


class WaitOnlyGroup(InMemoryProcessGroup):
    """The in-memory group, but its works have no torch future (``get_future`` raises, as c10d's "not implemented"
    does): done when ``wait()`` returns."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        inner = super().allreduce(tensors, opts).get_future()

        class Work:
            def get_future(self) -> Any:
                raise RuntimeError("ProcessGroup::getFuture not implemented")

            def wait(self, timeout: Any = None) -> bool:
                inner.wait()
                return True

        return Work()


@pytest.mark.parametrize("collectives", [1, 2])
def test_a_process_group_whose_works_have_no_future_averages_and_leaves_out_a_nan(replicas, monkeypatch, collectives):
    if collectives == 2:
        monkeypatch.setattr(nonfinite, "PACK_COUNT_MAX_BYTES", 4)  # the weights are 3 float32s
    a, b = two_groups(replicas, pg_factory=WaitOnlyGroup)
    before = a.weights.clone()
    assert train({"a": a, "b": b}, 1, grads={"a": NAN, "b": 4.0}) == {"a": [True], "b": [True]}
    assert torch.equal(a.weights, b.weights) and a.weights.tolist() == (before - 4.0).tolist()
