"""should_quantize=True with real Managers: two replica groups in threads, a real lighthouse, gloo between them.

Each group is one rank with its own TCPStore and ManagerServer (ports 0). The bound on each averaged value
is the format's: ``(a_0 + a_1) / 127 / 2``, ``a_j`` the largest magnitude of its block in group j.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch import nn

from tests.conftest import block_amax
from tests.integration.helpers import PAIR, make_manager, run_two
from torchft_lite.local_sgd import DiLoCo
from torchft_lite.process_group import ProcessGroupGloo

pytestmark = [pytest.mark.integration, pytest.mark.lighthouse(min_replicas=2, join_timeout=2.0)]

BLOCK = 1024
SLACK = 1e-5


class CountingGloo:
    """ProcessGroupGloo that counts the collectives it is asked for, by name."""

    def __init__(self) -> None:
        self.inner = ProcessGroupGloo(timeout=timedelta(seconds=20))
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        attribute = getattr(self.inner, name)
        if name not in ("allreduce", "alltoall_base", "allgather_into_tensor_coalesced"):
            return attribute

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attribute(*args, **kwargs)

        return counted


def gradient(index: int, step: int, shape=(5000,)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * index + step)
    return torch.randn(shape, generator=generator) * (index + 1)


def test_two_groups_average_quantized_gradients_within_the_bound(lighthouse):
    def group(index: int):
        weights = {"w": torch.zeros(5000)}
        pg = CountingGloo()
        manager = make_manager(lighthouse, pg, None, f"q_{index}", **PAIR,
                               load_state_dict=lambda sd: weights.update(w=sd["w"].clone()),
                               state_dict=lambda: dict(weights))
        averaged = []
        try:
            while len(averaged) < 3:
                manager.start_quorum()
                step = manager.current_step()
                grad = gradient(index, step)
                manager.allreduce(grad, should_quantize=True).wait()
                if manager.should_commit():
                    weights["w"] = weights["w"] - grad
                    averaged.append((step, manager.num_participants(), grad))
            return averaged, weights["w"], dict(pg.calls)
        finally:
            manager.shutdown(wait=False)

    (avg0, w0, calls0), (avg1, w1, calls1) = run_two(group)
    assert torch.equal(w0, w1)  # the same bytes reached both groups
    assert calls0["alltoall_base"] >= 3 and calls0["allgather_into_tensor_coalesced"] >= 3
    checked = 0
    for (step, participants, got), (step1, _, got1) in zip(avg0, avg1):
        assert step == step1 and torch.equal(got, got1)
        if participants == 2 and step > 0:  # at step 0 group 1 heals and sends zeros
            exact = (gradient(0, step) + gradient(1, step)) / 2
            bound = (block_amax(gradient(0, step), BLOCK) + block_amax(gradient(1, step), BLOCK)) / 127 / 2
            assert bool(((got - exact).abs() <= bound * (1 + SLACK)).all()), step
            assert not torch.equal(got, exact)
            checked += 1
    assert checked >= 2


def test_diloco_with_should_quantize_moves_both_groups_by_the_quantized_average(lighthouse):
    # One fragment, outer SGD with lr 1: each sync moves the global copy by minus the average pseudo-gradient
    # (the global copy less the group's model after its inner steps: 0.1 x the sum of its gradients).
    def group(index: int):
        model = nn.Linear(64, 40)  # a weight of 2560 values: three blocks, the last one partial
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        pg = CountingGloo()
        manager = make_manager(lighthouse, pg, None, f"dq_{index}", **PAIR,
                               load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                               state_dict=lambda: {"model": model.state_dict()})
        syncs = []
        try:
            with DiLoCo(manager, [model], inner, outer, sync_every=2, should_quantize=True) as diloco:
                fragment = diloco._fragments[0]
                for i in range(8):
                    before = [t.detach().clone() for t in fragment.original_parameters.values()]
                    step = manager.current_step()
                    for n, p in enumerate(model.parameters()):
                        p.grad = gradient(index, 10 * i + n, p.shape)
                    inner.step()
                    if manager.current_step() != step:
                        after = [t.detach().clone() for t in fragment.original_parameters.values()]
                        syncs.append((step, manager.num_participants(), before, after))
            return syncs, dict(pg.calls)
        finally:
            manager.shutdown(wait=False)

    (syncs0, calls0), (syncs1, _) = run_two(group)
    assert len(syncs0) == len(syncs1) == 4 and calls0["alltoall_base"] >= 8
    for (step, participants, before, after), (step1, _, before1, after1) in zip(syncs0, syncs1):
        assert step == step1
        for a, b in zip(after, after1):
            assert torch.equal(a, b), f"global parameters differ after the sync at step {step}"
        if step == 0:
            continue  # group 1 healed at the first sync
        i = 2 * step + 1  # the inner step that synced; its gradients and the one before make the pseudo-gradient
        for n, (b, a) in enumerate(zip(before, after)):
            pseudo = [0.1 * (gradient(g, 10 * (i - 1) + n, b.shape) + gradient(g, 10 * i + n, b.shape))
                      for g in range(2)]
            exact = (pseudo[0] + pseudo[1]) / 2
            bound = (block_amax(pseudo[0], BLOCK) + block_amax(pseudo[1], BLOCK)) / 127 / 2
            moved = b - a
            assert bool(((moved - exact).abs() <= bound * (1 + SLACK) + 1e-5).all()), (step, n)  # + float32 rounding
            assert participants == 2
