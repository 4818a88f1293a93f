"""Prometheus metrics of one lighthouse, each server with its own registry."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lighthouse.history import STATES
from lighthouse.stragglers.view import StragglerCollector
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


class _TimelineCollector(Collector):
    """Reads ``server.timeline_statistics()`` at scrape time: what the job is doing, its stalls and heals."""

    def __init__(self, server: LighthouseView) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        t = self._server.timeline_statistics()
        yield GaugeMetricFamily("lighthouse_steps_per_second", "Steps the job committed per second, over the last "
                                "10 s or more (the highest step of the issued quorums).", value=t.steps_per_second)
        state = GaugeMetricFamily("lighthouse_job_state", "1 for what the job is doing now, as the dashboard's "
                                  "status line says it.", labels=["state"])
        for name in STATES:
            state.add_metric([name], 1 if name == t.state else 0)
        yield state
        counters = [
            ("lighthouse_stalls", "Gaps between two quorums of the job over max(1 s, 3x its median gap).", t.stalls),
            ("lighthouse_stall_seconds", "Seconds the job spent in those stalls (counted when each ended).",
             t.stall_seconds),
            ("lighthouse_heals", "Heals that finished: a member behind its quorum's highest step, at it in a later "
             "quorum.", t.heals),
            ("lighthouse_heal_seconds", "Seconds those heals took, quorum to quorum.", t.heal_seconds),
            ("lighthouse_heals_failed", "Heals whose group went, or was left out of the next quorum, first.",
             t.heals_failed),
            ("lighthouse_groups_gone", "Members of the last quorum gone (lease ended, heartbeat expired, refused).",
             t.groups_gone),
            ("lighthouse_groups_back", "Groups back in a quorum after they were gone or restarted.", t.groups_back),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


def build_registry(server: LighthouseView) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_StatisticsCollector(server))
    registry.register(_TimelineCollector(server))
    registry.register(StragglerCollector(server))
    formation = Histogram(
        "lighthouse_quorum_formation_seconds",
        "Time from the first participant's join to the quorum being issued.",
        buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        registry=registry,
    )
    server.add_formation_observer(formation.observe)
    return registry
