"""Manager metrics (torchft_lite.metrics.registry) on the in-memory fakes: every step's report becomes the values a scrape
reads, for committed, failed, healed and non-finite steps, fingerprints and the watchdog's sections."""

from __future__ import annotations

import math

import prometheus_client
import pytest
import torch
from prometheus_client import CollectorRegistry

from tests.unit.helpers import Replica, flip_bit, replicas, train  # noqa: F401  (the fixture)
from torchft_lite.core.report import StepReport
from torchft_lite.errors import ConfigError, QuorumTimeout
from torchft_lite.health.nonfinite import HealthConfig
from torchft_lite.health.watchdog import WatchdogConfig
from torchft_lite.metrics.registry import (
    GROUP_VOTE, PHASES, TOO_FEW_PARTICIPANTS, ManagerMetrics, MetricsSettings, failure_reason, metrics_from_env,
)
from torchft_lite.testing import InMemoryLighthouse

NAN = float("nan")


def value(registry: CollectorRegistry, name: str, replica: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"replica_id": replica, "group_rank": "0", **labels})


def watched(replicas, lighthouse: InMemoryLighthouse, registry: CollectorRegistry, *names: str,
            **kwargs) -> dict[str, Replica]:
    groups = {name: replicas(lighthouse, name, 1.0, **kwargs) for name in names}
    for group in groups.values():
        ManagerMetrics(group.manager, registry)
    return groups


def test_committed_steps_count_their_phases_quorum_and_the_heal_at_step_zero(replicas):
    registry = CollectorRegistry()
    groups = watched(replicas, InMemoryLighthouse(min_replicas=2), registry, "a", "b")
    assert train(groups, 2) == {"a": [True, True], "b": [True, True]}
    for name in "ab":
        assert value(registry, "torchft_lite_steps_committed_total", name) == 2
        assert value(registry, "torchft_lite_step", name) == 2
        assert value(registry, "torchft_lite_participants", name) == 2
        assert value(registry, "torchft_lite_participating", name) == 1
        assert value(registry, "torchft_lite_quorum_id", name) == groups[name].manager._step_quorum.quorum_id
        assert value(registry, "torchft_lite_step_seconds_count", name) == 2
        for phase in PHASES:
            assert value(registry, "torchft_lite_step_phase_seconds_count", name, phase=phase) == 2
        phases = sum(value(registry, "torchft_lite_step_phase_seconds_sum", name, phase=p) for p in PHASES)
        assert math.isclose(phases, value(registry, "torchft_lite_step_seconds_sum", name), abs_tol=1e-6)
        for reason in (TOO_FEW_PARTICIPANTS, GROUP_VOTE):  # present at 0, so rate() sees the first failure
            assert value(registry, "torchft_lite_steps_failed_total", name, reason=reason) == 0
    # init_sync: b took a's state (three float32s) from replica rank 0 at step 0; a healed nobody.
    assert value(registry, "torchft_lite_heals_total", "b", source="0") == 1
    assert value(registry, "torchft_lite_heal_bytes_total", "b") == 3 * 4
    assert value(registry, "torchft_lite_heal_seconds_count", "b") == 1
    assert value(registry, "torchft_lite_heal_bytes_total", "a") == 0
    assert value(registry, "torchft_lite_heal_seconds_count", "a") is None


def test_the_replica_id_label_is_the_users_id_without_the_incarnation_suffix(replicas):
    registry = CollectorRegistry()
    (solo,) = watched(replicas, InMemoryLighthouse(), registry, "solo").values()
    assert solo.manager.replica_id != "solo" and solo.manager.replica_id.startswith("solo:")
    assert solo.step()[0]
    assert value(registry, "torchft_lite_steps_committed_total", "solo") == 1
    assert not any(
        s.labels.get("replica_id") == solo.manager.replica_id for m in registry.collect() for s in m.samples)


def test_a_failed_step_counts_under_its_errors_type_name(replicas):
    registry = CollectorRegistry()
    (solo,) = watched(replicas, InMemoryLighthouse(), registry, "solo").values()
    solo.manager.start_quorum()
    solo.manager.report_error(RuntimeError("the loss was garbage: 1e30"))
    assert not solo.manager.should_commit()
    solo.manager.start_quorum()
    solo.manager.report_error(QuorumTimeout("no quorum within 1s"))
    assert not solo.manager.should_commit()
    solo.pg.fail_next = True
    assert not solo.step()[0]
    assert solo.step()[0]
    # torch wraps an error raised in a future's callback in a RuntimeError: that is the type recorded.
    assert value(registry, "torchft_lite_steps_failed_total", "solo", reason="RuntimeError") == 2
    assert value(registry, "torchft_lite_steps_failed_total", "solo", reason="QuorumTimeout") == 1
    assert value(registry, "torchft_lite_steps_committed_total", "solo") == 1
    assert value(registry, "torchft_lite_step", "solo") == 1


def test_a_step_with_too_few_participants_says_so(replicas):
    registry = CollectorRegistry()
    (solo,) = watched(replicas, InMemoryLighthouse(), registry, "solo", min_replica_size=2).values()
    assert not solo.step()[0]
    assert value(registry, "torchft_lite_steps_failed_total", "solo", reason=TOO_FEW_PARTICIPANTS) == 1
    assert value(registry, "torchft_lite_participants", "solo") == 1
    assert value(registry, "torchft_lite_step", "solo") == 0


def report(**changes) -> StepReport:
    fields = dict(step=3, committed=False, error=None, quorum_id=1, participants=2, participating=True,
                  healed_bytes=0, healed_seconds=0.0, healed_from=(), nonfinite=False, quorum_s=0.0,
                  compute_s=0.0, allreduce_s=0.0, commit_s=0.0, total_s=0.0)
    fields.update(changes)
    return StepReport(**fields)


def test_the_reason_label_stays_bounded():
    assert failure_reason(report(), 2) == GROUP_VOTE  # no error here: another rank of the group voted no
    assert failure_reason(report(participants=1), 2) == TOO_FEW_PARTICIPANTS
    assert failure_reason(report(error="QuorumTimeout: no quorum within 60s"), 1) == "QuorumTimeout"
    # Only the type name, and only name characters of it, however odd the error's text.
    assert failure_reason(report(error="Weird Error{x=\"1\"}: text"), 1) == "Weird_Error_x__1__"
    assert failure_reason(report(error=": nameless"), 1) == "unknown"
    assert len(failure_reason(report(error="E" * 500 + ": long"), 1)) == 80


def test_a_group_with_non_finite_gradients_counts_the_step(replicas):
    registry = CollectorRegistry()
    groups = watched(replicas, InMemoryLighthouse(min_replicas=2), registry, "a", "b", min_replica_size=2)
    assert train(groups, 1) == {"a": [True], "b": [True]}
    assert train(groups, 2, grads={"a": NAN, "b": 1.0}) == {"a": [True, True], "b": [True, True]}
    assert value(registry, "torchft_lite_nonfinite_steps_total", "a") == 2
    assert value(registry, "torchft_lite_nonfinite_steps_total", "b") == 0
    assert value(registry, "torchft_lite_steps_committed_total", "a") == 3


def test_fingerprints_and_a_corruption_found_are_counted_and_the_corrupt_group_heals(replicas):
    registry = CollectorRegistry()
    groups = watched(replicas, InMemoryLighthouse(min_replicas=3), registry, "a", "b", "c", min_replica_size=2,
                     health=HealthConfig(fingerprint_every=2))
    assert train(groups, 2) == {name: [True, True] for name in "abc"}
    for name in "abc":
        assert value(registry, "torchft_lite_fingerprints_total", name) == 0
    flip_bit(groups["c"].weights)
    assert train(groups, 2) == {name: [True, True] for name in "abc"}  # step 2 is fingerprinted
    for name in "abc":
        assert value(registry, "torchft_lite_fingerprints_total", name) == 1
        assert value(registry, "torchft_lite_fingerprint_corruptions_total", name) >= 1
        assert value(registry, "torchft_lite_fingerprint_seconds", name) >= 0
    heals = {s.labels["source"]: s.value for m in registry.collect() if m.name == "torchft_lite_heals"
             for s in m.samples if s.name.endswith("_total") and s.labels["replica_id"] == "c"}
    # c healed at step 0 (init_sync) and again at step 2, each time from a replica rank of the majority.
    assert sum(heals.values()) == 2 and set(heals) <= {"0", "1"}, heals
    assert torch.equal(groups["c"].weights, groups["a"].weights)


def test_the_watchdog_sections_show_their_timeouts_and_the_time_in_the_one_under_way(replicas):
    registry = CollectorRegistry()
    config = WatchdogConfig(quorum=100.0, heal=200.0, step=300.0)
    (solo,) = watched(replicas, InMemoryLighthouse(), registry, "solo", watchdog=config).values()
    for section, seconds in (("quorum", 100.0), ("heal", 200.0), ("step", 300.0)):
        assert value(registry, "torchft_lite_watchdog_timeout_seconds", "solo", section=section) == seconds
    assert value(registry, "torchft_lite_watchdog_timeout_seconds", "solo", section="checkpoint") is None
    assert value(registry, "torchft_lite_watchdog_section_seconds", "solo", section="step") is None
    solo.manager.start_quorum()
    assert value(registry, "torchft_lite_watchdog_section_seconds", "solo", section="step") >= 0
    solo.manager.allreduce(torch.ones(3)).wait()
    assert solo.manager.should_commit()
    assert value(registry, "torchft_lite_watchdog_section_seconds", "solo", section="step") is None


def test_managers_share_a_registry_by_label_and_never_touch_the_global_one(replicas):
    shared = CollectorRegistry()
    groups = watched(replicas, InMemoryLighthouse(), shared, "a", "b")
    with pytest.raises(ValueError, match="replica_id='a' group_rank=0"):
        ManagerMetrics(groups["a"].manager, shared)
    private = ManagerMetrics(groups["a"].manager)  # its own registry: no clash
    assert private.registry is not prometheus_client.REGISTRY and private.registry is not shared
    assert train(groups, 1) == {"a": [True], "b": [True]}
    assert value(private.registry, "torchft_lite_steps_committed_total", "a") == 1
    assert value(shared, "torchft_lite_steps_committed_total", "a") == 1
    assert value(shared, "torchft_lite_steps_committed_total", "b") == 1
    assert prometheus_client.REGISTRY.get_sample_value("torchft_lite_steps_committed_total",
                                                       {"replica_id": "a", "group_rank": "0"}) is None
    private.close()
    assert train(groups, 1) == {"a": [True], "b": [True]}
    assert value(private.registry, "torchft_lite_steps_committed_total", "a") == 1  # detached: no more counting
    assert value(private.registry, "torchft_lite_watchdog_timeout_seconds", "a", section="step") is None
    assert value(shared, "torchft_lite_steps_committed_total", "a") == 2
    ManagerMetrics(groups["a"].manager, private.registry)  # its labels are free again after close()


@pytest.mark.parametrize("raw", ["abc", "-1", "70000", "1.5"])
def test_a_bad_port_is_named(raw):
    with pytest.raises(ConfigError, match="TORCHFT_LITE_METRICS_PORT"):
        MetricsSettings.from_env({"TORCHFT_LITE_METRICS_PORT": raw})


def test_the_settings_default_to_off_and_loopback():
    assert MetricsSettings.from_env({}) == MetricsSettings(None, "127.0.0.1")
    assert MetricsSettings.from_env({"TORCHFT_LITE_METRICS_PORT": " "}).port is None
    assert MetricsSettings.from_env({"TORCHFT_LITE_METRICS_PORT": "0", "TORCHFT_LITE_METRICS_HOST": "::1"}) \
        == MetricsSettings(0, "::1")


def test_unset_attaches_nothing_and_a_bad_port_shuts_the_manager_down(replicas, monkeypatch):
    monkeypatch.delenv("TORCHFT_LITE_METRICS_PORT", raising=False)
    (solo,) = watched(replicas, InMemoryLighthouse(), CollectorRegistry(), "solo").values()
    assert solo.manager.metrics is None  # the Manager's own call, with the variable unset here
    assert metrics_from_env(solo.manager, {}) is None
    with pytest.raises(ConfigError, match="TORCHFT_LITE_METRICS_PORT"):
        metrics_from_env(solo.manager, {"TORCHFT_LITE_METRICS_PORT": "abc"})
    assert solo.manager._closed  # nothing left running behind the error
