"""Replica fingerprints (torchft_lite.health.fingerprint, _fingerprint_vote): a flipped bit is found by majority and
healed from the majority; with no majority nothing commits and every group stops with its exit code."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.conftest import in_threads
from tests.unit.helpers import Replica, flip_bit, rank_fingerprint, replicas, train  # noqa: F401  (the fixture)
from torchft_lite.cluster.exit_codes import EXIT_CODE_DIVERGED, exit_code_for
from torchft_lite.errors import ConfigError, StateDivergedError
from torchft_lite.group_server.quorum_compute import QuorumMember, compute_quorum_result
from torchft_lite.health.fingerprint import Fingerprinter, fingerprint_of
from torchft_lite.health.fingerprint_vote import (
    Advertised, differing_ranks, first_difference, group_fingerprint, parse_fingerprint, vote,
)
from torchft_lite.health.nonfinite import HealthConfig
from torchft_lite.testing import InMemoryLighthouse

EVERY_2 = HealthConfig(fingerprint_every=2)


def state() -> dict:
    torch.manual_seed(0)
    return {"model": {"layer.weight": torch.randn(4, 3), "bn.running_mean": torch.randn(3)},
            "optim": {"state": {0: {"exp_avg": torch.randn(4, 3), "step": torch.tensor(7)}}, "lr": 0.1}}


def test_a_single_flipped_bit_changes_the_fingerprint_and_the_differing_tensor_is_named():
    a, b = state(), state()
    assert fingerprint_of(a).digest == fingerprint_of(b).digest
    flip_bit(b["optim"]["state"][0]["exp_avg"], index=5, bit=0)
    fa, fb = fingerprint_of(a), fingerprint_of(b)
    assert fa.digest != fb.digest
    index = first_difference(fa.sums, fb.sums)
    assert fa.runs[index] == ("optim.state.0.exp_avg", "optim.state.0.exp_avg")


def test_integer_tensors_other_values_and_batchnorm_statistics_are_not_covered():
    a, b = state(), state()
    b["optim"]["state"][0]["step"] += 1  # a counter groups may hold differently
    b["optim"]["lr"] = 0.2
    b["model"]["bn.running_mean"] += 1.0  # DDP does not average BatchNorm statistics across groups
    assert fingerprint_of(a).digest == fingerprint_of(b).digest
    assert fingerprint_of(a, exclude=None).digest != fingerprint_of(b, exclude=None).digest


def test_odd_sizes_views_and_low_precision_tensors_are_fingerprinted_exactly():
    base = torch.arange(40, dtype=torch.float32)
    odd = {"half": torch.ones(3, dtype=torch.float16), "view": base[3:10], "strided": base.view(8, 5)[:, 1]}
    same = {k: v.clone() for k, v in odd.items()}
    assert fingerprint_of(odd).digest == fingerprint_of(same).digest
    same["half"][2] = 2.0  # in the zero-padded last word
    assert fingerprint_of(odd).digest != fingerprint_of(same).digest


def fp(step: int, digest: str) -> Advertised:
    return Advertised(step, digest)


def test_the_vote_finds_the_minority_and_a_split_and_judges_nothing_without_every_fingerprint():
    d1, d2, d3 = "1" * 32, "2" * 32, "3" * 32
    verdict = vote([("a", 5, fp(5, d1)), ("b", 5, fp(5, d1)), ("c", 5, fp(5, d2))])
    assert (verdict.majority, verdict.corrupt, verdict.split) == (("a", "b"), ("c",), False)
    assert vote([("a", 5, fp(5, d1)), ("b", 5, fp(5, d2))]).split
    assert vote([("a", 5, fp(5, d1)), ("b", 5, fp(5, d2)), ("c", 5, fp(5, d3))]).split
    assert not vote([("a", 5, fp(5, d1)), ("b", 5, fp(5, d1))]).corrupt
    assert vote([("a", 5, fp(5, d1)), ("b", 5, None)]) is None  # a torchft manager advertises none
    assert vote([("a", 5, fp(5, d1)), ("b", 5, fp(4, d2))]) is None  # a stale fingerprint
    # A member behind the max step does not vote (it heals anyway).
    assert not vote([("a", 5, fp(5, d1)), ("b", 5, fp(5, d1)), ("c", 3, fp(3, d2))]).corrupt


@pytest.mark.parametrize("data", ["", "not json", "[1]", '{"fingerprint": 3}', '{"fingerprint": {"step": -1, '
                                  '"digest": "' + "a" * 32 + '"}}', '{"fingerprint": {"step": 1, "digest": "x"}}',
                                  '{"fingerprint": {"step": 1, "digest": "' + "A" * 32 + '"}}'])
def test_garbage_in_a_peers_data_is_no_fingerprint(data):
    assert parse_fingerprint(data) is None


def test_undecodable_sums_are_dropped_but_the_digest_still_votes():
    parsed = parse_fingerprint('{"fingerprint": {"step": 1, "digest": "' + "a" * 32 + '", "sums": "***"}}')
    assert parsed == Advertised(1, "a" * 32, ())


def member(rid: str, step: int, digest: str | None) -> QuorumMember:
    return QuorumMember(rid, f"addr-{rid}", f"store-{rid}", step,
                        fingerprint=None if digest is None else fp(step, digest))


def test_the_quorum_heals_the_corrupt_member_from_the_majority_and_a_split_fails_everywhere():
    members = [member("a", 9, "1" * 32), member("b", 9, "2" * 32), member("c", 9, "1" * 32)]
    b = compute_quorum_result(4, members, "b", 0)
    assert b.heal and b.max_replica_rank is None and b.max_world_size == 2
    assert b.recover_src_manager_address in ("addr-a", "addr-c")
    a = compute_quorum_result(4, members, "a", 0)
    assert not a.heal and a.max_world_size == 2 and a.store_address in ("store-a", "store-c")
    source = compute_quorum_result(4, members, b.recover_src_manager_address[-1], 0)
    assert source.recover_dst_replica_ranks == [1]
    with pytest.raises(StateDivergedError, match="no majority"):
        compute_quorum_result(4, members[:2], "a", 0)


def test_every_rank_fingerprints_every_n_steps_for_its_quorum_request_of_that_step_only():
    s = state()
    printer = Fingerprinter(3, lambda: s, lambda *a, **k: None)
    printer.step_starting(0)
    printer.step_starting(2)
    assert printer.for_step(0) == printer.for_step(2) == ""
    printer.step_starting(3)
    sent = printer.for_step(3)
    assert parse_fingerprint('{"fingerprint": %s}' % sent) == Advertised(3, fingerprint_of(s).digest,
                                                                        fingerprint_of(s).sums)
    assert printer.for_step(4) == ""  # a later step's quorum does not carry it


def test_a_group_vouches_for_all_its_ranks_and_a_flip_on_any_rank_changes_its_fingerprint():
    rank0, rank1 = state(), state()
    rank1["model"]["layer.weight"] += 1.0  # ranks of a group may hold different state
    clean = group_fingerprint(4, [rank_fingerprint(4, rank0), rank_fingerprint(4, rank1)])
    assert len(clean["ranks"]) == 2
    flip_bit(rank1["optim"]["state"][0]["exp_avg"], index=2)
    flipped = group_fingerprint(4, [rank_fingerprint(4, rank0), rank_fingerprint(4, rank1)])
    a = parse_fingerprint('{"fingerprint": %s}' % json.dumps(clean))
    b = parse_fingerprint('{"fingerprint": %s}' % json.dumps(flipped))
    assert a.digest != b.digest and differing_ranks(a, b) == [1]
    assert fingerprint_of(rank0).runs[first_difference(a.sums, b.sums)][0] == "optim.state.0.exp_avg"
    # A rank without a fingerprint of this step (or with garbage): the group does not vote.
    assert group_fingerprint(4, [rank_fingerprint(4, rank0), ""]) is None
    assert group_fingerprint(4, [rank_fingerprint(4, rank0), "{nope"]) is None
    assert group_fingerprint(5, [rank_fingerprint(4, rank0)]) is None


def test_fingerprint_settings_come_from_the_environment_and_bad_ones_are_named():
    assert HealthConfig.from_env({"TORCHFT_LITE_FINGERPRINT_EVERY": "0"}).fingerprint_every == 0
    assert HealthConfig.from_env({}).fingerprint_every == 100
    with pytest.raises(ConfigError, match="TORCHFT_LITE_FINGERPRINT_EVERY"):
        HealthConfig.from_env({"TORCHFT_LITE_FINGERPRINT_EVERY": "often"})
    with pytest.raises(ConfigError, match="fingerprint_every"):
        HealthConfig(fingerprint_every=-1)
    with pytest.raises(ConfigError, match="regular expression"):
        HealthConfig(fingerprint_exclude="(")


def test_a_flipped_bit_in_one_of_three_groups_is_healed_from_the_majority(replicas, caplog):
    lighthouse = InMemoryLighthouse(min_replicas=3)
    groups = {name: replicas(lighthouse, name, 1.0, min_replica_size=2, health=EVERY_2) for name in "abc"}
    assert train(groups, 2) == {name: [True, True] for name in "abc"}
    loads = {name: g.loads for name, g in groups.items()}
    flip_bit(groups["c"].weights)
    assert not torch.equal(groups["c"].weights, groups["a"].weights)
    with caplog.at_level(logging.WARNING, logger="torchft_lite.manager"):
        assert train(groups, 2) == {name: [True, True] for name in "abc"}
    assert {name: g.loads - loads[name] for name, g in groups.items()} == {"a": 0, "b": 0, "c": 1}
    assert all(torch.equal(groups[n].weights, groups["a"].weights) for n in "bc")
    assert {g.manager.current_step() for g in groups.values()} == {4}
    warnings = [r.getMessage() for r in caplog.records if "silent data corruption" in r.getMessage()]
    assert warnings and all("c" in w and "step 2" in w for w in warnings)
    assert any("first tensor that differs" in w and "default.w" in w and "group rank(s) 0 differ" in w
               for w in warnings), warnings


def test_two_groups_that_differ_commit_nothing_and_both_stop_with_the_diverged_code(replicas):
    lighthouse = InMemoryLighthouse(min_replicas=2)
    groups = {name: replicas(lighthouse, name, 1.0, min_replica_size=2, health=EVERY_2) for name in "ab"}
    assert train(groups, 2) == {name: [True, True] for name in "ab"}
    flip_bit(groups["b"].weights)
    before = {name: g.weights.clone() for name, g in groups.items()}
    _, raised = in_threads(groups, lambda name: groups[name].step(), hung=None)
    assert set(raised) == {"a", "b"}
    assert all(isinstance(exc, StateDivergedError) for exc in raised.values()), raised
    assert {exit_code_for(exc) for exc in raised.values()} == {EXIT_CODE_DIVERGED}
    assert all(torch.equal(g.weights, before[name]) and g.manager.current_step() == 2 for name, g in groups.items())


def test_local_sgd_turns_fingerprints_off_because_groups_differ_between_syncs(replicas):
    """At a sync's start_quorum every group holds its own locally trained model: not corruption."""
    from torchft_lite.local_sgd import LocalSGD

    lighthouse = InMemoryLighthouse(min_replicas=2)
    groups = {name: replicas(lighthouse, name, 1.0, min_replica_size=2, health=HealthConfig(fingerprint_every=1))
              for name in "ab"}
    models = {name: torch.nn.Linear(3, 1) for name in groups}
    for g in groups.values():
        g.manager.register_state_dict_fn("model", models[g.manager.replica_id[0]].load_state_dict,
                                         models[g.manager.replica_id[0]].state_dict)

    def train_locally(name: str) -> None:
        model = models[name]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(ord(name))  # each group its own data
        with LocalSGD(groups[name].manager, model, optimizer, sync_every=2):
            for _ in range(6):
                optimizer.zero_grad()
                model(torch.randn(4, 3)).sum().backward()
                optimizer.step()

    _, raised = in_threads(groups, train_locally, hung=None)
    assert not raised, raised
    assert all(g.manager._fingerprints.every == 0 and g.manager.current_step() >= 3 for g in groups.values())
    assert torch.equal(models["a"].weight, models["b"].weight)  # the last sync averaged them
