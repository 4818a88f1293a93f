"""DiLoCo with real Managers: two replica groups in threads, a real lighthouse, gloo between them.

Each group is one rank with its own TCPStore and ManagerServer (ports 0). The
process group wrapper below can fail every allreduce of one sync, in both
groups at once, to check that a sync that does not commit puts the global
parameters back.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import two_layers
from tests.integration.helpers import PAIR, make_manager, run_two
from torchft_lite.local_sgd import DiLoCo, LocalSGD
from torchft_lite.process_group import ProcessGroupGloo

pytestmark = [pytest.mark.integration, pytest.mark.lighthouse(min_replicas=2, join_timeout=2.0)]


class FailingGloo:
    """ProcessGroupGloo, except that while ``failing`` is set every allreduce fails without communicating."""

    def __init__(self) -> None:
        self.inner = ProcessGroupGloo(timeout=timedelta(seconds=20))
        self.failing = False

    def allreduce(self, tensors, opts):
        if not self.failing:
            return self.inner.allreduce(tensors, opts)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(RuntimeError("injected allreduce failure"))
        return SimpleNamespace(get_future=lambda: fut, wait=lambda timeout=None: True)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def snapshot(tensors) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def diloco_group(lighthouse, index: int, inner_steps: int, fail_sync_at_step: int, alpha: float = 0.0,
                 delay: int = 1, seed: int = 0, replica_id: str | None = None) -> dict:
    """Train one group; returns its global copy per manager step and what a failed sync left."""
    model = two_layers(seed)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    state = {"load_state_dict": lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
             "state_dict": lambda: {"model": model.state_dict(), "inner": inner.state_dict()}}
    pg = FailingGloo()
    manager = make_manager(lighthouse, pg, None, replica_id or f"diloco_{index}", **state, **PAIR)
    out: dict = {"globals": {}, "failed": None}
    try:
        with DiLoCo(manager, [model[0], model[1]], inner, outer, sync_every=4, fragment_sync_delay=delay,
                    fragment_update_alpha=alpha) as diloco:
            def global_copy():
                return [t for f in diloco._fragments for t in snapshot(f.original_parameters.values())]

            out["globals"][0] = global_copy()
            phase = "before"  # -> "prepared" (its averaging failed) -> "performed"
            for i in range(inner_steps):
                step = manager.current_step()
                # With a delay of 1, a fragment's averaging starts one inner step before the
                # step that waits for it: fail that averaging once, in both groups.
                pg.failing = phase == "before" and step == fail_sync_at_step and diloco._local_step == 0
                before = global_copy()
                for p in model.parameters():
                    p.grad = torch.full_like(p, 0.1 * (index + 1) * (i + 1))
                inner.step()
                if phase == "prepared":
                    phase = "performed"
                    out["failed"] = {"step_before": step, "step_after": manager.current_step(),
                                     "global_before": before, "global_after": global_copy(),
                                     "model_after": snapshot(model.parameters())}
                if pg.failing:
                    phase = "prepared"
                pg.failing = False
                out["globals"].setdefault(manager.current_step(), global_copy())
        out["final_model"] = snapshot(model.parameters())
        out["final_global"] = global_copy()
        out["step"] = manager.current_step()
        out["outer_state"] = outer.state_dict()["state"]
    finally:
        manager.shutdown(wait=False)
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_streaming_diloco_groups_agree_on_the_global_parameters_and_a_failed_sync_restores_them(lighthouse, alpha):
    # sync_every=4 with 2 fragments: a fragment syncs every 2 inner steps; 12 inner steps
    # are 6 syncs, the one at manager step 2 fails, so 5 commit.
    r0, r1 = run_two(lambda index: diloco_group(lighthouse, index, inner_steps=12, fail_sync_at_step=2,
                                                alpha=alpha))
    assert r0["step"] == r1["step"] == 5
    fragment0 = len(list(two_layers()[0].parameters()))
    assert sorted(r0["globals"]) == sorted(r1["globals"]) == list(range(6))
    for step in r0["globals"]:
        for a, b in zip(r0["globals"][step], r1["globals"][step]):
            torch.testing.assert_close(a, b, msg=f"global parameters differ at manager step {step}")
    for a, b in zip(r0["final_global"], r1["final_global"]):
        torch.testing.assert_close(a, b)
    if alpha == 0.0:
        # The last sync was fragment 0's (manager step 4): in the model it is the global copy,
        # the same in both groups; fragment 1 has taken local steps since, which differ.
        for a, b, g in zip(r0["final_model"][:fragment0], r1["final_model"][:fragment0], r0["final_global"]):
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(a, g)

    for result in (r0, r1):
        failed = result["failed"]
        assert failed is not None and failed["step_after"] == failed["step_before"] == 2
        # Nothing committed: the global copy is unchanged ...
        for a, b in zip(failed["global_before"], failed["global_after"]):
            torch.testing.assert_close(a, b)
        # ... and the fragment that failed to sync (fragment 0 at step 2) is back at it in the model.
        for a, b in zip(failed["model_after"][:fragment0], failed["global_after"][:fragment0]):
            torch.testing.assert_close(a, b)


def test_local_sgd_groups_end_with_identical_parameters(lighthouse):
    def group(index: int):
        model = two_layers()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = {"load_state_dict": lambda sd: model.load_state_dict(sd["model"]),
                 "state_dict": lambda: {"model": model.state_dict()}}
        manager = make_manager(lighthouse, ProcessGroupGloo(timeout=timedelta(seconds=20)), None, f"sgd_{index}",
                               **state, **PAIR)
        try:
            with LocalSGD(manager, model, optimizer, sync_every=2):
                for i in range(6):
                    for p in model.parameters():
                        p.grad = torch.full_like(p, float(index + i))
                    optimizer.step()
            return manager.current_step(), snapshot(model.parameters())
        finally:
            manager.shutdown(wait=False)

    (s0, p0), (s1, p1) = run_two(group)
    assert s0 == s1 == 3
    for a, b in zip(p0, p1):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("delay", [0, 1])
def test_a_restarted_group_heals_the_global_parameters_and_outer_optimizer(lighthouse, delay):
    # Group 1 trains 2 syncs, leaves, and comes back with a fresh model and fresh optimizers:
    # at its first sync it heals (model, inner optimizer, each fragment's global copy and
    # outer optimizer) from group 0, and from then on both agree.
    def group(index: int):
        if index == 0:
            return diloco_group(lighthouse, 0, inner_steps=12, fail_sync_at_step=-1, delay=delay)
        first = diloco_group(lighthouse, 1, inner_steps=4, fail_sync_at_step=-1, delay=delay)
        assert first["step"] == 2
        return diloco_group(lighthouse, 1, inner_steps=8, fail_sync_at_step=-1, delay=delay, seed=1,
                            replica_id="diloco_1_restarted")

    r0, r1 = run_two(group)
    assert r0["step"] == r1["step"] == 6
    # The restarted group started elsewhere, and agrees from its first sync (it healed at step 2) on.
    assert not torch.equal(r1["globals"][0][0], r0["globals"][0][0])
    for step in range(3, 7):
        for a, b in zip(r0["globals"][step], r1["globals"][step]):
            torch.testing.assert_close(a, b, msg=f"global parameters differ at manager step {step}")
    torch.testing.assert_close(r0["outer_state"], r1["outer_state"])
