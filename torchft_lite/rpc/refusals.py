"""Calls a gRPC server refused under its :class:`~torchft_lite.rpc.access.Access` policy: counted, and logged sparingly.

A refused call deserves a WARNING: it is a process of the job started without
its token, or someone probing the port. But whoever probes may send thousands
a second, and a log that grows with them is a second way to hurt the job; so
at most one line per ``interval`` seconds, and that line says how many
refusals went unlogged since the last one. The counts, by kind, are what the
lighthouse's ``/metrics`` reads. Lines name the peer, the method and the
refusal's message, which by construction never holds the token.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import grpc

from torchft_lite.rpc.access import Refusal

__all__ = ["RefusalLog", "status_of"]

logger = logging.getLogger(__name__)

_STATUS = {"unauthenticated": grpc.StatusCode.UNAUTHENTICATED, "forbidden": grpc.StatusCode.PERMISSION_DENIED}
MAX_METHOD_CHARS = 200  # the method is the caller's text; a refused caller gets no say over long lines


def status_of(refusal: Refusal) -> grpc.StatusCode:
    """UNAUTHENTICATED for a missing or wrong token, PERMISSION_DENIED for a peer protected mode does not serve."""
    return _STATUS[refusal.kind]


class CountedLog:
    """Counts by key, and says when a WARNING line may be logged: at most one per ``interval`` seconds
    (a flood must not become a flood of log lines), with how many went unlogged since the previous one.
    Used on the server's event loop only (both engines answer there), so it needs no lock."""

    def __init__(self, server: str, *, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not interval >= 0:
            raise ValueError(f"interval must be >= 0 seconds, got {interval!r}")
        self.server = server
        self.interval = interval
        self.counts: dict[str, int] = {}
        self._clock = clock
        self._next_line = -math.inf
        self._unlogged = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _count(self, key: str) -> int | None:
        """Count one under ``key``; the number left unlogged since the last line if one may be logged now,
        else None."""
        self.counts[key] = self.counts.get(key, 0) + 1
        now = self._clock()
        if now < self._next_line:
            self._unlogged += 1
            return None
        self._next_line = now + self.interval
        unlogged, self._unlogged = self._unlogged, 0
        return unlogged


class RefusalLog(CountedLog):
    """Refused calls of one server: ``counts`` by kind, and a rate-limited WARNING per refusal."""

    def note(self, peer: str, method: str, refusal: Refusal) -> None:
        """Count a call to ``method`` from ``peer`` refused with ``refusal``; log it unless a line was logged
        less than ``interval`` seconds ago."""
        unlogged = self._count(refusal.kind)
        if unlogged is None:
            return
        logger.warning(
            "%s refused %r from %s (%s): %s%s", self.server, method[:MAX_METHOD_CHARS], peer, refusal.kind,
            refusal.message,
            f" [{unlogged} more refused call(s) since the last such line were not logged]" if unlogged else "",
        )
