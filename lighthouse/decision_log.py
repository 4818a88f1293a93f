"""What the lighthouse is waiting for now, and which changes of it are worth a log line.

Every round passes through waiting states until the members rejoin, so a
change of decision is DEBUG; a wait with participants that lasts over a
second is logged once at INFO (that is when someone wants to know why). "No
participants" is the idle state between steps and stays DEBUG. An issued
quorum is INFO when its id or membership changed, DEBUG otherwise.
"""

from __future__ import annotations

import logging
from typing import Iterable

from lighthouse.quorum import Decision, IssuedQuorum, Status

logger = logging.getLogger(__name__)

__all__ = ["DecisionLog", "log_serving", "preview"]


def log_serving(config, grpc_port: int, http_port: int | None, state, restart_evidence: str | None) -> None:
    """The line a lighthouse logs once it serves: where, its settings, whether this is a restart, and who may
    call it (a WARNING when anyone may: no job token and --insecure)."""
    grace = state.config.startup_grace
    access = config.access
    logger.log(
        logging.WARNING if access.mode == "insecure" else logging.INFO,
        "lighthouse serving gRPC (%s engine) on %s (port %d)%s; min_replicas=%d join_timeout=%.1fs "
        "heartbeat_timeout=%.1fs holder_timeout=%.1fs; highest step reached %d; first quorum id will be > %d; %s; "
        "access: %s; %s",
        config.grpc_engine, config.bind, grpc_port,
        f", HTTP on port {http_port}" if http_port is not None else ", HTTP disabled",
        config.min_replicas, config.join_timeout, config.heartbeat_timeout, config.holder_timeout, state.max_step,
        state.quorum_id,
        "first start: no startup grace" if restart_evidence is None
        else f"restarted ({restart_evidence}): startup grace of {grace:.1f}s before the first quorum",
        access.describe(), config.tls.describe(),
    )


class DecisionLog:
    """The current decision (for the views) and since when it holds."""

    def __init__(self, now: float) -> None:
        self.current = Decision(Status.NO_PARTICIPANTS, "no participants yet")
        self._since = now
        self._logged = False

    def note(self, decision: Decision, now: float) -> None:
        """``decision`` is what the rules said at ``now``: keep it, and log it if it is worth it."""
        previous = self.current
        self.current = decision
        if decision.status != previous.status:
            self._since, self._logged = now, False
            logger.debug("quorum status: %s", decision.reason)
        elif (not decision.ready and decision.status is not Status.NO_PARTICIPANTS
              and not self._logged and now - self._since > 1.0):
            self._logged = True
            logger.info("quorum status: %s", decision.reason)
        elif decision.reason != previous.reason:
            logger.debug("quorum status: %s", decision.reason)

    def restart(self, decision: Decision, now: float) -> None:
        """A quorum was just served: show what the next round waits for (``decision``), counting from ``now``."""
        self.current = decision
        self._since, self._logged = now, False

    def issued(self, quorum: IssuedQuorum, previous: set[str], changed: bool, formation: float) -> None:
        """Log ``quorum`` (its id ``changed``; ``previous``: the members before) with the reason it was issued."""
        ids = set(quorum.replica_ids)
        if changed or ids != previous:
            joined, left = sorted(ids - previous), sorted(previous - ids)
            logger.info(
                "quorum %d issued with %d members (%s%s%s) after %.3fs: %s",
                quorum.quorum_id, len(ids), preview(quorum.replica_ids),
                f"; joined {preview(joined)}" if joined else "", f"; left {preview(left)}" if left else "",
                formation, self.current.reason,
            )
        else:
            logger.debug("quorum %d reissued with %d members after %.3fs", quorum.quorum_id, len(ids), formation)


def preview(ids: Iterable[str], limit: int = 8) -> str:
    """The first ``limit`` ids, comma-separated, and how many more."""
    ids = list(ids)
    shown = ", ".join(ids[:limit])
    return shown + (f", ... {len(ids) - limit} more" if len(ids) > limit else "")
