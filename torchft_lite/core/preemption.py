"""Graceful leave on a preemption signal (SIGTERM by default).

The handler only notes the signal (and cancels the quorum in flight, which is
abandoned); the training thread leaves at the next safe point,
between steps, where :meth:`PreemptionSignals.pending` tells it to.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Callable, Sequence

from torchft_lite.health.watchdog import EXIT_CODE_PREEMPTED

__all__ = ["PreemptionSignals"]

logger = logging.getLogger(__name__)


class PreemptionSignals:
    """Installs handlers for ``signals`` on the main thread; :meth:`restore` puts the previous ones back."""

    def __init__(self, signals: Sequence[int], quorum_in_flight: Callable[[], Any]) -> None:
        """On a signal, only note it (the training thread leaves at the next safe point) and cancel the
        future ``quorum_in_flight()`` returns, if any: the quorum under way is abandoned."""
        self.received: int | None = None
        self._quorum_in_flight = quorum_in_flight
        self._previous: dict[int, Any] = {}
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not on the main thread: preemption signals %s are not handled",
                           [signal.Signals(sig).name for sig in signals])
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            logger.warning("received %s: leaving after this step", signal.Signals(signum).name)
            quorum = self._quorum_in_flight()
            if quorum is not None:
                quorum.cancel()

    @property
    def pending(self) -> str | None:
        """The name of the signal received, if one was."""
        return signal.Signals(self.received).name if self.received is not None else None

    def leave(self, on_preemption: Callable[[], None] | None, watchdog: Any, shutdown: Callable[[], None]) -> None:
        """Run the user's ``on_preemption`` checkpoint (under the watchdog), shut down, exit with 143."""
        if on_preemption is not None:
            try:
                with watchdog.section("checkpoint", "the on_preemption checkpoint callback"):
                    on_preemption()
            except Exception:  # still leave: the survivors must not wait for us
                logger.exception("on_preemption callback failed")
        shutdown()
        raise SystemExit(EXIT_CODE_PREEMPTED)

    def restore(self) -> None:
        """The process's own handling again (only possible from the main thread)."""
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()
