"""Prometheus metrics of one lighthouse, each server with its own registry."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lighthouse.straggler_view import StragglerCollector
from lighthouse.validation import REASONS
from lighthouse.view import LighthouseView


class _StatisticsCollector(Collector):
    """Reads ``server.statistics()`` at scrape time."""

    def __init__(self, server: LighthouseView) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        s = self._server.statistics()
        gauges = [
            ("lighthouse_quorum_id", "Id of the last issued quorum.", s.quorum_id),
            ("lighthouse_quorum_members", "Replica groups in the last issued quorum.", s.quorum_members),
            ("lighthouse_quorum_age_seconds", "Seconds since the last quorum was issued.", s.quorum_age or 0.0),
            ("lighthouse_participants", "Replica groups waiting in a Quorum call.", s.participants),
            ("lighthouse_healthy_participants", "Waiting replica groups with a live heartbeat.",
             s.healthy_participants),
            ("lighthouse_heartbeating_replicas", "Replica groups with a live heartbeat.", s.heartbeating_replicas),
            ("lighthouse_uptime_seconds", "Seconds since the lighthouse started.", s.uptime),
            ("lighthouse_leases", "Replica groups holding a connection lease (torchft_lite managers).", s.leases_held),
            ("lighthouse_max_step", "The highest step a quorum reached (the stale-quorum guard's).", s.max_step),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("lighthouse_quorums_issued", "Quorums issued (including re-issues with the same id).", s.quorums_issued),
            ("lighthouse_quorum_id_changes", "Times the quorum id increased (membership change or commit failures).",
             s.quorum_id_changes),
            ("lighthouse_quorum_requests", "Quorum RPCs received.", s.quorum_requests),
            ("lighthouse_heartbeats", "Heartbeat RPCs received.", s.heartbeats),
            ("lighthouse_expired_replicas", "Replicas forgotten after their heartbeat timed out.", s.expired_replicas),
            ("lighthouse_leases_ended", "Lease streams that ended (their replica treated as gone at once).",
             s.leases_ended),
            ("lighthouse_epochs", "New epochs of the job started (the stale-quorum guard gave way).", s.epochs),
            ("lighthouse_fenced_requests", "Quorum calls refused with FAILED_PRECONDITION as from before the "
             "current epoch.", s.fenced_requests),
            ("lighthouse_lease_refusals", "Lease calls refused: another live connection holds that replica's lease.",
             s.lease_refusals),
            ("lighthouse_state_dir_write_failures", "Writes to --state-dir that failed (full disk?); served on "
             "without them.", s.state_write_failures),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        invalid = CounterMetricFamily("lighthouse_invalid_requests", "Requests refused with INVALID_ARGUMENT, by "
                                      "reason (the field out of range, or malformed bytes).", labels=["reason"])
        for reason in REASONS:
            invalid.add_metric([reason], s.invalid_reasons.get(reason, 0))
        yield invalid
        refused = CounterMetricFamily(
            "lighthouse_unauthorized_requests", "Calls refused by the access policy: kind 'unauthenticated' (no "
            "or a wrong job token), 'forbidden' (not loopback while no token is set).", labels=["interface", "kind"],
        )
        for kind in ("unauthenticated", "forbidden"):
            refused.add_metric(["grpc", kind], self._server.refusals.counts.get(kind, 0))
        yield refused
        status = GaugeMetricFamily(
            "lighthouse_quorum_status", "1 for the current quorum status category.", labels=["status"]
        )
        status.add_metric([s.status], 1)
        yield status


def build_registry(server: LighthouseView) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_StatisticsCollector(server))
    registry.register(StragglerCollector(server))
    formation = Histogram(
        "lighthouse_quorum_formation_seconds",
        "Time from the first participant's join to the quorum being issued.",
        buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        registry=registry,
    )
    server.add_formation_observer(formation.observe)
    return registry
