"""Prometheus metrics of one trainer process: :mod:`.registry` what is measured, :mod:`.server` its ``/metrics``."""

from torchft_lite.metrics.registry import (
    METRICS_HOST_ENV, METRICS_PORT_ENV, ManagerMetrics, MetricsSettings, failure_reason, metrics_from_env,
)

__all__ = ["METRICS_HOST_ENV", "METRICS_PORT_ENV", "ManagerMetrics", "MetricsSettings", "failure_reason",
           "metrics_from_env"]
