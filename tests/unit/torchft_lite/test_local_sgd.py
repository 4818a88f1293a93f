"""LocalSGD and DiLoCo against in-memory Managers: one group alone, or two groups in threads averaging."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from tests.conftest import all_in_threads, two_layers
from tests.unit.helpers import SoloManager
from torchft_lite.local_sgd import DiLoCo, LocalSGD, _buckets, extract_local_tensor

WAIT = 30.0


class Fleet:
    """Replica groups in threads: collectives and votes meet at a barrier (bounded by WAIT)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=WAIT)
        self.slots: list = [None] * size

    def exchange(self, index: int, value):
        self.slots[index] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


class FleetManager(SoloManager):
    """Group ``index`` of a fleet: allreduce averages over every group; a step commits if all vote yes."""

    def __init__(self, fleet: Fleet, index: int) -> None:
        super().__init__()
        self.fleet, self.index = fleet, index

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        values = self.fleet.exchange(self.index, tensor.clone())
        return tensor.copy_(torch.stack(values).mean(dim=0))

    def should_commit(self) -> bool:
        self.events.append("should_commit")
        decision = all(self.fleet.exchange(self.index, self.commit))
        if decision:
            self.step += 1
        return decision


def run_groups(*fns):
    """Each of ``fns`` at once, on a thread of its own (a replica group each); what they returned."""
    return list(all_in_threads(range(len(fns)), lambda index: fns[index](), WAIT, "a group's thread hung").values())


def inner_step(model: nn.Module, optimizer: torch.optim.Optimizer, grad: float) -> None:
    """An inner step with a known gradient on every parameter."""
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    optimizer.step()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_all_close(actual, expected) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


# ---------------------------------------------------------------- helpers


def test_extract_local_tensor_is_a_detached_copy():
    t = torch.rand(3, requires_grad=True)
    t.grad = torch.ones(3)
    copy = extract_local_tensor(t)
    assert torch.equal(copy, t) and copy.grad is None and not copy.requires_grad
    copy.add_(1)
    assert not torch.equal(copy, t)


def test_buckets_respect_the_cap_and_keep_dtypes_apart():
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(10)  # 16, 16, 40 bytes
    d = torch.zeros(2, dtype=torch.float64)
    buckets = list(_buckets([a, b, d, c], cap_bytes=32))
    assert [[t.numel() for t in bucket] for bucket in buckets] == [[4, 4], [10], [2]]
    assert [bucket[0].dtype for bucket in buckets] == [torch.float32, torch.float32, torch.float64]


# ---------------------------------------------------------------- LocalSGD


def test_local_sgd_syncs_every_sync_every_steps_to_the_average_of_two_groups():
    fleet = Fleet(2)
    start = params(two_layers())

    def group(index: int):
        model = two_layers()
        manager = FleetManager(fleet, index)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with LocalSGD(manager, model, optimizer, sync_every=2) as local_sgd:
            inner_step(model, optimizer, grad=index + 1)
            assert manager.events == [] and local_sgd._local_step == 1
            inner_step(model, optimizer, grad=index + 1)
        return manager, local_sgd, params(model)

    (m0, sgd0, p0), (m1, sgd1, p1) = run_groups(lambda: group(0), lambda: group(1))
    # Each group moved by 2 * 0.1 * (index + 1); the average moved by 0.3.
    assert_all_close(p0, [w - 0.3 for w in start])
    assert_all_close(p1, p0)
    assert m0.events == ["start_quorum", "should_commit"] and sgd0._local_step == 0
    assert len(m0.allreduced) == len(start)


def test_local_sgd_keeps_the_local_parameters_when_the_step_does_not_commit():
    model = two_layers()
    start = params(model)
    manager = SoloManager(commit=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSGD(manager, model, optimizer, sync_every=1):
        inner_step(model, optimizer, grad=1.0)
    assert_all_close(params(model), [w - 0.1 for w in start])
    assert manager.events == ["start_quorum", "should_commit"]


def test_local_sgd_hooks_are_removed_on_exit():
    model = two_layers()
    manager = SoloManager()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with LocalSGD(manager, model, optimizer, sync_every=1):
        pass
    inner_step(model, optimizer, grad=1.0)
    assert manager.events == []
    with pytest.raises(ValueError):
        LocalSGD(manager, model, optimizer, sync_every=0)


# ---------------------------------------------------------------- DiLoCo


def test_diloco_two_groups_end_with_identical_global_parameters():
    fleet = Fleet(2)
    start = params(two_layers())

    def group(index: int):
        model = two_layers()
        manager = FleetManager(fleet, index)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=0.5)
        with DiLoCo(manager, [model], inner, outer, sync_every=2) as diloco:
            inner_step(model, inner, grad=index + 1)
            inner_step(model, inner, grad=index + 1)
        return manager, list(diloco._fragments[0].original_parameters.values()), params(model)

    (m0, g0, p0), (m1, g1, p1) = run_groups(lambda: group(0), lambda: group(1))
    # Pseudo-gradients 0.2 and 0.4, averaged 0.3; the outer step moves the global copy by 0.5 * 0.3.
    expected = [w - 0.15 for w in start]
    assert_all_close(g0, expected)
    assert_all_close(g1, expected)
    assert_all_close(p0, expected)
    assert_all_close(p1, expected)
    assert m0.events == m1.events == ["start_quorum", "should_commit"]


def test_diloco_restores_the_global_parameters_when_the_step_does_not_commit():
    model = two_layers()
    start = params(model)
    manager = SoloManager(commit=False)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    with DiLoCo(manager, [model], inner, outer, sync_every=2) as diloco:
        inner_step(model, inner, grad=1.0)
        assert_all_close(params(model), [w - 0.1 for w in start])
        inner_step(model, inner, grad=1.0)
    assert_all_close(params(model), start)  # the local steps are discarded
    assert_all_close(list(diloco._fragments[0].original_parameters.values()), start)
    assert outer.state_dict()["state"] == {}  # the outer optimizer never stepped
    assert all(p.grad is None for p in model.parameters())
    assert diloco._local_step == 0 and diloco._fragments[0]._grads == {}


def test_diloco_mixes_local_parameters_with_fragment_update_alpha():
    model = two_layers()
    start = params(model)
    manager = SoloManager()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.5)
    with DiLoCo(manager, [model], inner, outer, sync_every=2, fragment_update_alpha=0.5) as diloco:
        inner_step(model, inner, grad=1.0)
        inner_step(model, inner, grad=1.0)
    # local: w - 0.2; new global: w - 0.5 * 0.2; the model: halfway between.
    assert_all_close(list(diloco._fragments[0].original_parameters.values()), [w - 0.1 for w in start])
    assert_all_close(params(model), [w - 0.15 for w in start])


def test_streaming_diloco_syncs_fragments_in_turn_with_a_delay():
    model = two_layers()
    first, second = model[0], model[1]
    start_first, start_second = params(first), params(second)
    manager = SoloManager()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)  # one optimizer for both fragments
    with DiLoCo(manager, [first, second], inner, outer, sync_every=4, fragment_sync_delay=1) as diloco:
        sent = []
        for _ in range(4):
            inner_step(model, inner, grad=1.0)
            sent.append(len(manager.allreduced))
            manager.events.append("step")
    # Each fragment syncs every 2 inner steps: its averaging starts one step early.
    assert manager.events == ["start_quorum", "step", "should_commit", "step",
                              "start_quorum", "step", "should_commit", "step"]
    assert sent == [2, 2, 4, 4]
    # The first fragment's pseudo-gradient was taken after 1 inner step, the second's after 3.
    assert_all_close(list(diloco._fragments[0].original_parameters.values()), [w - 0.1 for w in start_first])
    assert_all_close(list(diloco._fragments[1].original_parameters.values()), [w - 0.3 for w in start_second])
    # The shared outer optimizer stepped only the fragment being synced: since its sync,
    # the first fragment took two local steps (w - 0.1 - 0.2).
    assert_all_close(params(first), [w - 0.3 for w in start_first])
    assert_all_close(params(second), [w - 0.3 for w in start_second])
    assert manager.step == 2 and diloco._local_step == 0


def test_streaming_diloco_picks_the_fragment_from_the_manager_step():
    model = two_layers()
    manager = SoloManager()
    manager.step = 1  # e.g. after a heal: every group syncs fragment step % 2
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outers = [torch.optim.SGD(layer.parameters(), lr=1.0, momentum=0.9) for layer in model]
    with DiLoCo(manager, [model[0], model[1]], inner, outers, sync_every=2):
        inner_step(model, inner, grad=1.0)
    # Fragment 1 (the second layer) was the one averaged and stepped.
    assert [t.shape for t in manager.allreduced] == [p.shape for p in model[1].parameters()]
    assert outers[0].state_dict()["state"] == {} and len(outers[1].state_dict()["state"]) == 2
    assert manager.step == 2


@pytest.mark.parametrize("env", [False, True])
def test_bucketized_averaging_uses_fewer_collectives_and_gives_the_same_result(env, monkeypatch):
    results = []
    for bucketize in (False, True):
        model = two_layers()
        manager = SoloManager()
        manager.reduce = lambda t: t.mul_(2)  # visible in the result: the pseudo-gradients doubled
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        if env:
            monkeypatch.setenv("TORCHFT_USE_BUCKETIZATION", "True" if bucketize else "False")
        kwargs = {} if env else {"use_bucketization": bucketize}
        with DiLoCo(manager, [model], inner, outer, sync_every=1, bucket_cap_mb=1, **kwargs):
            inner_step(model, inner, grad=1.0)
        results.append((len(manager.allreduced), params(model)))
    (per_param, p0), (bucketized, p1) = results
    assert per_param == 4 and bucketized == 1
    assert_all_close(p1, p0)


def test_fragments_register_their_global_state_under_torchft_keys_and_heal_a_fresh_group():
    source_model, fresh_model = two_layers(), two_layers()
    source, fresh = SoloManager(), SoloManager()
    inner = torch.optim.SGD(source_model.parameters(), lr=0.1)
    outer = torch.optim.SGD(source_model.parameters(), lr=0.5, momentum=0.9)
    fresh_outer = torch.optim.SGD(fresh_model.parameters(), lr=0.5, momentum=0.9)
    with DiLoCo(source, [source_model], inner, outer, sync_every=1) as diloco:
        inner_step(source_model, inner, grad=1.0)
    fresh_diloco = DiLoCo(fresh, [fresh_model], torch.optim.SGD(fresh_model.parameters(), lr=0.1),
                          fresh_outer, sync_every=1)
    assert set(source.state_fns) == {"StreamingDiLoCoFragment_0"}
    state = source.state_fns["StreamingDiLoCoFragment_0"][1]()
    assert set(state) == {"original_parameters", "outer_optimizer"}
    assert set(state["original_parameters"]) == {name for name, _ in source_model.named_parameters()}

    fresh.state_fns["StreamingDiLoCoFragment_0"][0](state)
    torch.testing.assert_close(fresh_diloco._fragments[0].original_parameters,
                               diloco._fragments[0].original_parameters)
    torch.testing.assert_close(fresh_outer.state_dict()["state"], outer.state_dict()["state"])


@pytest.mark.parametrize("kwargs, match", [
    ({"sync_every": 3, "fragments": 2}, "multiple"),
    ({"sync_every": 1, "fragments": 2}, "only one syncs"),
    ({"sync_every": 4, "fragments": 2, "fragment_sync_delay": 2}, "fragment_sync_delay"),
    ({"sync_every": 2, "fragment_update_alpha": 1.5}, "fragment_update_alpha"),
    ({"sync_every": 2, "outer_optimizers": 2}, "outer optimizers"),
    ({"sync_every": 2, "async_quorum": True}, "use_async_quorum=False"),
])
def test_diloco_rejects_bad_arguments(kwargs, match):
    model = two_layers()
    manager = SoloManager()
    manager._use_async_quorum = kwargs.pop("async_quorum", False)
    fragments = [model[0], model[1]][:kwargs.pop("fragments", 1)]
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    n_outer = kwargs.pop("outer_optimizers", None)
    with pytest.raises(ValueError, match=match):
        DiLoCo(manager, fragments, torch.optim.SGD(model.parameters(), lr=0.1),
               [outer] * n_outer if n_outer else outer, **kwargs)


def test_diloco_with_should_quantize_refuses_a_parameter_8_bits_cannot_carry_at_construction():
    from torchft_lite.quantization import UnsupportedQuantization

    model = two_layers()
    model[1].double()
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(UnsupportedQuantization, match=r"fragment 1, parameter 'weight'.*torch.float64") as caught:
        DiLoCo(SoloManager(), [model[0], model[1]], torch.optim.SGD(model.parameters(), lr=0.1), outer,
               sync_every=2, should_quantize=True)
    assert isinstance(caught.value, TypeError)
    DiLoCo(SoloManager(), [model[0]], torch.optim.SGD(model.parameters(), lr=0.1), outer, sync_every=2,
           should_quantize=True)  # float32 only: accepted
