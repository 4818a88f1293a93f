"""Stragglers as /api/status and /metrics show them (the rules are in :mod:`lighthouse.stragglers.rules`).

:func:`straggler_rows` is the ``straggler`` field of every row of ``quorum.members``
and ``replicas`` in /api/status, :func:`straggler_summary` its top-level
``stragglers`` object, and :class:`StragglerCollector` the per-group gauges and
the counters of /metrics (listed in docs/health.md, "Stragglers").
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lighthouse.stragglers.rules import StragglerStatistics

__all__ = ["StragglerCollector", "straggler_rows", "straggler_summary"]


def straggler_rows(stats: StragglerStatistics) -> dict[str, dict]:
    """replica_id -> its ``straggler`` field, for the groups with a sample (the field is None for a group that
    advertised no compute time: a torchft manager, or before its first finished step)::

        {"compute_ms": 512.0, "compute_step": 41,      # its last sample
         "quorum_median_ms": 101.0,                    # the median of the last quorum it was scored in
         "own_median_ms": 498.0,                       # the median of its own recent samples
         "relative_score": 5.07, "individual_score": 1.03,   # smoothed ratios; null until known
         "slow_streak": 4, "flagged": true,            # quorums in a row above the threshold; the flag
         "evicted": true, "evicted_until": "readmitted after 2 more quorums",   # left out of quorums now
         "kept_in": null,                              # flagged but not evicted: why (the limits)
         "samples": 12}
    """
    rows = {}
    for g in stats.groups:
        rows[g.replica_id] = {
            "compute_ms": g.compute_ms,
            "compute_step": g.compute_step,
            "quorum_median_ms": g.quorum_median_ms,
            "own_median_ms": g.own_median_ms,
            "relative_score": g.relative,
            "individual_score": g.individual,
            "slow_streak": g.slow_streak,
            "flagged": g.flagged,
            "evicted": g.replica_id in stats.evicted,
            "evicted_until": stats.evicted.get(g.replica_id),
            "kept_in": stats.kept_in.get(g.replica_id),
            "samples": g.samples,
        }
    return rows


def straggler_summary(stats: StragglerStatistics) -> dict:
    """The top-level ``stragglers`` object of /api/status."""
    cfg = stats.config
    return {
        "threshold": cfg.threshold,
        "patience": cfg.patience,
        "evict": cfg.evict,
        "evictions": stats.evictions,
        "readmissions": stats.readmissions,
        "refused_samples": stats.refused_samples,
        "flagged": [g.replica_id for g in stats.groups if g.flagged],
        "evicted": sorted(stats.evicted),
    }


class StragglerCollector(Collector):
    """Reads ``server.stragglers()`` at scrape time. A group's series go when the lighthouse forgets it, so
    their number follows the live groups."""

    def __init__(self, server) -> None:  # a LighthouseView (which imports this module's source of data)
        self._server = server

    def collect(self) -> Iterator[Metric]:
        s = self._server.stragglers()
        label = ["replica_id"]
        relative = GaugeMetricFamily("lighthouse_straggler_relative_score", "A group's compute time over its "
                                     "quorum's median, smoothed (median of its last 3).", labels=label)
        individual = GaugeMetricFamily("lighthouse_straggler_individual_score", "A group's compute time over the "
                                       "median of its own recent ones, smoothed (shown, never flags).", labels=label)
        compute = GaugeMetricFamily("lighthouse_straggler_compute_seconds", "A group's last advertised compute "
                                    "time (start_quorum returned -> first allreduce).", labels=label)
        flagged = GaugeMetricFamily("lighthouse_straggler_flagged", "1 while a group's relative score has stayed "
                                    "above the threshold for the patience.", labels=label)
        evicted = GaugeMetricFamily("lighthouse_straggler_evicted", "1 while a flagged group is left out of "
                                    "quorums (--evict-stragglers).", labels=label)
        for g in s.groups:
            rid = [g.replica_id]
            if g.relative is not None:
                relative.add_metric(rid, g.relative)
            if g.individual is not None:
                individual.add_metric(rid, g.individual)
            compute.add_metric(rid, g.compute_ms / 1000)
            flagged.add_metric(rid, int(g.flagged))
            evicted.add_metric(rid, int(g.replica_id in s.evicted))
        yield from (relative, individual, compute, flagged, evicted)
        yield CounterMetricFamily("lighthouse_straggler_evictions", "Groups left out of quorums as stragglers.",
                                  value=s.evictions)
        yield CounterMetricFamily("lighthouse_straggler_readmissions", "Evicted groups let back in (cooldown, "
                                  "or the limits broke).", value=s.readmissions)
        yield CounterMetricFamily("lighthouse_straggler_refused_samples", "Quorum requests whose compute_ms or "
                                  "compute_step was garbage (ignored; the request was served).",
                                  value=s.refused_samples)
