"""The Manager's step listeners (``Manager.add_step_listener``): who is told where a step stands.

A listener (``core.capabilities.StepListener``; ``DurableCheckpointer`` is one)
is called on the training thread at four points of a step. Its failure is
logged and never fails the step: a durable save must not stop training.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from torchft_lite.core.capabilities import StepListener

__all__ = ["StepListeners", "metrics_from_env"]


class StepListeners:
    def __init__(self, log: Callable[..., None]) -> None:
        self._listeners: list[StepListener] = []
        self._log = log

    def add(self, listener: StepListener) -> None:
        self._listeners.append(listener)

    def remove(self, listener: StepListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def notify(self, event: str, *args: Any) -> None:
        """Call ``event`` (a ``StepListener`` method name) on every listener."""
        for listener in list(self._listeners):
            try:
                method = getattr(listener, event, None)
                if method is not None:  # an event newer than the listener (``step_finished``) is optional
                    method(*args)
            except Exception as exc:  # logged with its traceback; the step goes on
                self._log(logging.ERROR, "step listener %s.%s failed: %s: %s", type(listener).__name__, event,
                          type(exc).__name__, exc, exc_info=(type(exc), exc, exc.__traceback__))


def metrics_from_env(manager: Any) -> Any:
    """``torchft_lite.metrics.registry.metrics_from_env``, imported only when ``TORCHFT_LITE_METRICS_PORT`` is set:
    prometheus_client and an HTTP server are imports a restarting trainer that exports nothing never needs."""
    if not os.environ.get("TORCHFT_LITE_METRICS_PORT", "").strip():
        return None
    from torchft_lite.metrics.registry import metrics_from_env as attach

    return attach(manager)
