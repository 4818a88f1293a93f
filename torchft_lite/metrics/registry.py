"""Prometheus metrics of one trainer process: where each step's time went, what it did, what the checks saw.

:class:`ManagerMetrics` is a step listener (``Manager.add_step_listener``): every
``StepReport`` (:mod:`torchft_lite.core.report`) becomes histogram observations and
counter increments, and what other parts keep (the fingerprinter's counts, the
watchdog's sections) is read when a scrape comes. Register it on your own registry,
or let :func:`metrics_from_env` serve a private one on ``TORCHFT_LITE_METRICS_PORT``
(:mod:`torchft_lite.metrics.server`). The metrics and both ways in: docs/health.md ("Metrics").
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from torchft_lite.core.report import StepReport
from torchft_lite.errors import ConfigError
from torchft_lite.health.fingerprint import Fingerprinter
from torchft_lite.metrics.server import MetricsServer
from torchft_lite.rpc.access import Access
from torchft_lite.rpc.tls import TlsSettings

__all__ = ["METRICS_HOST_ENV", "METRICS_PORT_ENV", "ManagerMetrics", "MetricsSettings", "failure_reason",
           "metrics_from_env"]

logger = logging.getLogger(__name__)

METRICS_PORT_ENV = "TORCHFT_LITE_METRICS_PORT"
METRICS_HOST_ENV = "TORCHFT_LITE_METRICS_HOST"
LABELS = ("replica_id", "group_rank")
PHASES = ("quorum", "compute", "allreduce", "commit")
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
"""1 ms (a quorum answered at once, an allreduce of a small model) to 10 min (a watchdog's default scale)."""
TOO_FEW_PARTICIPANTS = "too_few_participants"
GROUP_VOTE = "group_vote"
_REASON_CHARS = re.compile(r"[^A-Za-z0-9_.]")


@dataclass(frozen=True)
class MetricsSettings:
    """Where a Manager serves its metrics, from the environment."""

    port: int | None = None
    """``TORCHFT_LITE_METRICS_PORT``: None (unset or empty) serves nothing; 0 takes any free port."""
    host: str = "127.0.0.1"
    """``TORCHFT_LITE_METRICS_HOST``: the address to listen on (``0.0.0.0`` for every interface; a scraper on
    another host then needs the job token, or ``TORCHFT_LITE_INSECURE=1``)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "MetricsSettings":
        environ = os.environ if environ is None else environ
        raw = environ.get(METRICS_PORT_ENV, "").strip()
        host = environ.get(METRICS_HOST_ENV, "").strip() or cls.host
        if not raw:
            return cls(None, host)
        try:
            port = int(raw)
        except ValueError:
            raise ConfigError(f"{METRICS_PORT_ENV} must be a port number in 0..65535 (0: any free port; unset: "
                              f"no metrics server), got {raw!r}") from None
        if not 0 <= port <= 65535:
            raise ConfigError(f"{METRICS_PORT_ENV} must be a port number in 0..65535 (0: any free port), got {port}")
        return cls(port, host)


def failure_reason(report: StepReport, min_replica_size: int) -> str:
    """The ``reason`` label of a step that did not commit: its first error's type name, else why it was
    refused (too few participants, or another rank of the group voted no)."""
    if report.error:
        name = _REASON_CHARS.sub("_", report.error.split(":", 1)[0].strip())[:80]
        return name or "unknown"
    return TOO_FEW_PARTICIPANTS if report.participants < min_replica_size else GROUP_VOTE


class _Families:
    """The metrics of one registry, shared by every :class:`ManagerMetrics` on it (told apart by labels)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, (*LABELS, *extra), buckets=SECONDS_BUCKETS, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*LABELS, *extra), registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=registry)

        self.phase = histogram("torchft_lite_step_phase_seconds", "Where a step's time went: phase 'quorum' (blocked "
                               "on the quorum), 'compute' (forward and backward up to the first allreduce), "
                               "'allreduce' (the rest), 'commit' (should_commit: heal applied, group vote).",
                               ("phase",))
        self.total = histogram("torchft_lite_step_seconds", "A step from start_quorum to the end of should_commit.")
        self.committed = counter("torchft_lite_steps_committed", "Steps this group committed.")
        self.failed = counter("torchft_lite_steps_failed", "Steps that did not commit, by reason: the first error's "
                              f"type name, '{TOO_FEW_PARTICIPANTS}' or '{GROUP_VOTE}' (another rank failed).",
                              ("reason",))
        self.step = gauge("torchft_lite_step", "The step the Manager is at (committed steps).")
        self.quorum_id = gauge("torchft_lite_quorum_id", "Id of the quorum of the last step.")
        self.participants = gauge("torchft_lite_participants", "Replica groups the last step averaged over.")
        self.participating = gauge("torchft_lite_participating", "1 when this group contributed to the last step "
                                   "(0: a spare, or healing).")
        self.heals = counter("torchft_lite_heals", "Heals applied, by source replica rank (a striped heal counts "
                             "once per source).", ("source",))
        self.heal_bytes = counter("torchft_lite_heal_bytes", "Bytes of state received and applied by heals.")
        self.heal_seconds = histogram("torchft_lite_heal_seconds", "Time a heal took to receive its state.")
        self.nonfinite = counter("torchft_lite_nonfinite_steps", "Steps whose local gradients were non-finite "
                                 "(NaN/Inf) and left out of the average.")
        self._live: dict[tuple[str, str], ManagerMetrics] = {}
        self._lock = threading.Lock()
        registry.register(_ScrapeTimeCollector(self))

    def join(self, member: "ManagerMetrics") -> None:
        with self._lock:
            if member.labels in self._live:
                raise ValueError(f"this registry already has the metrics of replica_id={member.labels[0]!r} "
                                 f"group_rank={member.labels[1]}: close() those first, or give another replica_id")
            self._live[member.labels] = member

    def leave(self, member: "ManagerMetrics") -> None:
        with self._lock:
            if self._live.get(member.labels) is member:
                del self._live[member.labels]

    def live(self) -> list["ManagerMetrics"]:
        with self._lock:
            return list(self._live.values())


class _ScrapeTimeCollector(Collector):
    """What is read when a scrape comes: the fingerprinter's counts and the watchdog's sections."""

    def __init__(self, families: _Families) -> None:
        self._families = families

    def _empty(self) -> list[Metric]:
        return [
            CounterMetricFamily("torchft_lite_fingerprints", "Fingerprints of this process's state computed.",
                                labels=LABELS),
            CounterMetricFamily("torchft_lite_fingerprint_corruptions", "Quorums whose fingerprint vote found groups "
                                "holding a state the others don't (silent data corruption; group rank 0 only).",
                                labels=LABELS),
            GaugeMetricFamily("torchft_lite_fingerprint_seconds", "How long the last fingerprint took.",
                              labels=LABELS),
            GaugeMetricFamily("torchft_lite_watchdog_timeout_seconds", "The timeout the section's next occurrence "
                              "gets (configured or calibrated); absent: unwatched.", labels=(*LABELS, "section")),
            GaugeMetricFamily("torchft_lite_watchdog_section_seconds", "How long the section under way has run "
                              "(less heals for 'step'); absent: not under way.", labels=(*LABELS, "section")),
        ]

    def describe(self) -> Iterator[Metric]:
        return iter(self._empty())

    def collect(self) -> Iterator[Metric]:
        fingerprints, corruptions, fingerprint_seconds, timeouts, running = families = self._empty()
        for member in self._families.live():
            labels = list(member.labels)
            fingerprinter = member.fingerprinter
            if fingerprinter is not None:
                fingerprints.add_metric(labels, getattr(fingerprinter, "fingerprints", 0))
                corruptions.add_metric(labels, getattr(fingerprinter, "corruptions", 0))
                fingerprint_seconds.add_metric(labels, fingerprinter.seconds)
            for section, stats in member.watchdog.statistics().sections.items():
                if stats.timeout is not None:
                    timeouts.add_metric([*labels, section], stats.timeout)
                if stats.running_for is not None:
                    running.add_metric([*labels, section], stats.running_for)
        return iter(families)


_REGISTRIES: "weakref.WeakKeyDictionary[CollectorRegistry, _Families]" = weakref.WeakKeyDictionary()
_REGISTRIES_LOCK = threading.Lock()


def _families_of(registry: CollectorRegistry) -> _Families:
    with _REGISTRIES_LOCK:
        families = _REGISTRIES.get(registry)
        if families is None:
            families = _REGISTRIES[registry] = _Families(registry)
        return families


class ManagerMetrics:
    """The ``torchft_lite_*`` metrics of one Manager; attaches itself to it.

    Every metric carries ``replica_id`` (the id the user gave the Manager, without the suffix each incarnation
    adds, so a restarted group continues the same series) and ``group_rank``. Label values are bounded: a failed
    step's ``reason`` is an exception's type name (:func:`failure_reason`), a heal's ``source`` a replica rank.
    Several Managers may share one registry (their labels tell them apart); the global
    ``prometheus_client.REGISTRY`` is used only when passed explicitly.
    """

    def __init__(self, manager: Any, registry: CollectorRegistry | None = None, *,
                 replica_id: str | None = None) -> None:
        """``registry``: where to register (default: a new private one, :attr:`registry`);
        ``replica_id``: the label's value (default: the Manager's ``replica_id`` argument, else
        ``$REPLICA_GROUP_ID``, without the per-incarnation suffix)."""
        context = manager.context
        settings = context.settings
        if replica_id is None:
            replica_id = settings.replica_id or os.environ.get("REPLICA_GROUP_ID", "")
        self.labels = (replica_id, str(settings.group_rank))
        self.registry = CollectorRegistry() if registry is None else registry
        self.watchdog = manager.watchdog
        self.server: MetricsServer | None = None
        self._min_replica_size = settings.min_replica_size
        self._manager = weakref.ref(manager)  # a server thread must not keep a dropped Manager alive
        found = context.fingerprinter  # every rank's (its counts: group rank 0's verdicts)
        self._fingerprinter = weakref.ref(found) if isinstance(found, Fingerprinter) else None
        self._families = _families_of(self.registry)
        self._families.join(self)
        f, labels = self._families, self.labels
        for series in (f.committed, f.nonfinite, f.heal_bytes):  # present (at 0) from the start, for rate()
            series.labels(*labels)
        for reason in (TOO_FEW_PARTICIPANTS, GROUP_VOTE):
            f.failed.labels(*labels, reason)
        manager.add_step_listener(self)

    @property
    def fingerprinter(self) -> Fingerprinter | None:
        return self._fingerprinter() if self._fingerprinter is not None else None

    def step_finished(self, report: StepReport) -> None:
        f, labels = self._families, self.labels
        for phase in PHASES:
            f.phase.labels(*labels, phase).observe(getattr(report, f"{phase}_s"))
        f.total.labels(*labels).observe(report.total_s)
        if report.committed:
            f.committed.labels(*labels).inc()
        else:
            f.failed.labels(*labels, failure_reason(report, self._min_replica_size)).inc()
        f.step.labels(*labels).set(report.step + (1 if report.committed else 0))
        f.quorum_id.labels(*labels).set(report.quorum_id)
        f.participants.labels(*labels).set(report.participants)
        f.participating.labels(*labels).set(1 if report.participating else 0)
        if report.healed_from:
            f.heal_bytes.labels(*labels).inc(report.healed_bytes)
            f.heal_seconds.labels(*labels).observe(report.healed_seconds)
            for source in report.healed_from:
                f.heals.labels(*labels, str(source)).inc()
        if report.nonfinite:
            f.nonfinite.labels(*labels).inc()

    def serve(self, host: str = "127.0.0.1", port: int = 0, *, access: Access | None = None,
              tls: ssl.SSLContext | None = None) -> MetricsServer:
        """Serve :attr:`registry` on ``host:port`` (0: any free port) until :meth:`close` or the Manager's
        shutdown. ``access``: who may scrape (default: from the environment, as every server of the job);
        ``tls``: an HTTPS server context (default: ``TORCHFT_LITE_TLS_CERT``/``_KEY`` when set)."""
        if self.server is not None:
            raise RuntimeError(f"already serving on {self.server.url}")
        access = Access.from_env() if access is None else access
        if tls is None:
            settings = TlsSettings.from_env()
            tls = settings.server_context() if settings.serving else None
        manager = self._manager

        def manager_gone() -> bool:
            alive = manager()
            return alive is None or bool(getattr(alive, "_closed", False))

        self.server = MetricsServer(self.registry, host, port, access=access, tls=tls, stop_when=manager_gone,
                                    name=f"[{self.labels[0]}/{self.labels[1]}] metrics server")
        return self.server

    def close(self) -> None:
        """Stop serving, drop the scrape-time series and detach from the Manager. Idempotent."""
        if self.server is not None:
            self.server.close()
        self._families.leave(self)
        manager = self._manager()
        if manager is not None:
            manager.remove_step_listener(self)


def metrics_from_env(manager: Any, environ: Mapping[str, str] | None = None) -> ManagerMetrics | None:
    """The Manager's metrics server when ``TORCHFT_LITE_METRICS_PORT`` is set, else None.

    Called at the end of ``Manager.__init__``: a bad setting (or a port that can't be bound) shuts the
    Manager down again and raises ``ConfigError`` naming the variable.
    """
    try:
        settings = MetricsSettings.from_env(environ)
        if settings.port is None:
            return None
        metrics = ManagerMetrics(manager)
        try:
            server = metrics.serve(settings.host, settings.port, access=Access.from_env(environ))
        except OSError as exc:
            metrics.close()
            raise ConfigError(f"{METRICS_PORT_ENV}={settings.port}: can't listen on {settings.host}:{settings.port} "
                              f"({exc}); give each process on a host its own port, or 0 for any free one") from exc
    except BaseException:
        manager.shutdown()
        raise
    logger.info("[%s/%s] serving Prometheus metrics on %s (%s)", *metrics.labels, server.url, server.access.describe())
    return metrics
