"""Lease fencing: a group commits a step only while its lease at the lighthouse provably holds.

A group that was hung, SIGSTOPped or cut off may wake with its gradients
exchanged while the lighthouse declared it gone and its peers redid the step
without it; committing then would fork the job. :class:`LeaseFence` proves on the
group's own clock, with no round trip per step, that the lighthouse cannot have
declared it gone (the reasoning is on the class; docs/training.md, "Failure
detection and fencing", states the rule for users). Pure: every method takes the
time; :class:`~torchft_lite.group_server.lighthouse_link.LighthouseLink` feeds it
from :func:`lease_clock`, which keeps counting while the machine is suspended.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

__all__ = ["CLOCK_RATE_BOUND", "DEFAULT_LEASE_TIMEOUT", "EVENT_ALLOWANCE", "LeaseFence", "lease_clock", "margin"]

CLOCK_RATE_BOUND = 0.01
"""How far apart the rates of this host's clock and the lighthouse's may be, as a fraction."""
EVENT_ALLOWANCE = 0.25
"""Seconds left for the group's last collective data to land at its peers before they could hear it is gone."""
DEFAULT_LEASE_TIMEOUT = 5.0
"""The lease length assumed when the lighthouse does not say (torchft's lighthouse: its default heartbeat timeout)."""


def margin(lease_timeout: float) -> float:
    """What is kept back from a lease of ``lease_timeout`` seconds: the clock-rate bound plus the event
    allowance, never more than half the lease (a lighthouse with a very short timeout still leaves a window)."""
    return min(CLOCK_RATE_BOUND * lease_timeout + EVENT_ALLOWANCE, lease_timeout / 2)


def lease_clock() -> float:
    """Seconds on a clock that never goes back and keeps counting while the machine is suspended (Linux's
    ``CLOCK_BOOTTIME``; elsewhere the monotonic clock): the lighthouse's clock does not stop either."""
    return time.clock_gettime(_CLOCK)


_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


@dataclass(frozen=True)
class FenceStatistics:
    refusals: int
    """Votes turned to no because the lease could not be shown to hold."""
    holes: int
    """Answers that came after the previous proof's bound had run out (a lapse was possible)."""
    lease_timeout: float | None
    """The lease length the lighthouse last stated, or None when it never did."""


class LeaseFence:
    """What this group can prove about its lease, from the lighthouse answers it received.

    The lighthouse declares a replica gone when it has heard nothing from it (no Heartbeat, no Quorum call)
    for its ``heartbeat_timeout`` T, measured from when it *received* the last call. So:

    * a call the lighthouse answered that was *sent* at ``s`` reached it no earlier than ``s``, so the
      lighthouse cannot declare the group gone before ``s + T`` on its clock. With both clocks' rates within
      ``CLOCK_RATE_BOUND`` of each other, and ``EVENT_ALLOWANCE`` left for the group's last collective data to
      reach the peers before they could hear it is gone, the lease provably holds until ``s + T - margin(T)``
      on this process's clock;
    * a lapse can only have happened where the proofs left a hole: an answer that arrived after the previous
      proof's bound had run out. Holes before the step's quorum don't matter (the lighthouse issued that
      quorum with the group as a member, so it had it as alive then); one after it might;
    * a lost lease stream means the lighthouse dropped the group: a certain lapse.

    The vote is yes only when no hole opened since the step's quorum was answered and the lease holds now.
    What remains assumed: the clocks' rates differ by less than ``CLOCK_RATE_BOUND`` (1%, far above what NTP
    lets a clock slew), and the group's last collective data reaches its peers within ``EVENT_ALLOWANCE`` of
    its vote.
    """

    def __init__(self, default_timeout: float = DEFAULT_LEASE_TIMEOUT) -> None:
        if not default_timeout > 0:
            raise ValueError(f"default_timeout must be > 0, got {default_timeout}")
        self._default_timeout = default_timeout
        self._stated_timeout: float | None = None
        self._valid_until = -math.inf
        self._proof_sent_at = -math.inf  # when the call that set the bound was sent
        self._hole_at: float | None = None  # the latest answer that came after the bound ran out, since the quorum
        self._hole_why = ""
        self._quorum_answered = False
        self._refusals = 0
        self._holes = 0

    @property
    def lease_timeout(self) -> float:
        return self._default_timeout if self._stated_timeout is None else self._stated_timeout

    def answered(self, sent_at: float, answered_at: float, stated_timeout: float | None = None) -> None:
        """The lighthouse answered a call (Heartbeat or Quorum) sent at ``sent_at``; ``stated_timeout``: the lease
        length it said it keeps (seconds), if it said."""
        if stated_timeout is not None and stated_timeout > 0:
            self._stated_timeout = stated_timeout
        if answered_at > self._valid_until:
            self._hole(answered_at, "no call answered before" if self._valid_until == -math.inf else
                       f"an answer came {answered_at - self._valid_until:.2f}s after the lease was last proven")
        timeout = self.lease_timeout
        bound = sent_at + timeout - margin(timeout)
        if bound > self._valid_until:
            self._valid_until, self._proof_sent_at = bound, sent_at

    def quorum_answered(self, sent_at: float, answered_at: float) -> None:
        """The lighthouse issued a quorum with this group in it: it counted the group as alive then, so holes
        before it no longer matter. (A Quorum call also counts as a heartbeat at the lighthouse.)"""
        self.answered(sent_at, answered_at)
        self._hole_at, self._hole_why = None, ""
        self._quorum_answered = True

    def lost(self, now: float, why: str) -> None:
        """The lighthouse dropped the group (its lease stream ended): a certain lapse."""
        self._hole(now, why)

    def refusal(self, now: float) -> str | None:
        """Why this group may not commit at ``now``, or None when its lease provably held since the step's
        quorum and holds now. Counts each refusal."""
        why = self._why_not(now)
        if why is not None:
            self._refusals += 1
        return why

    def statistics(self) -> FenceStatistics:
        return FenceStatistics(self._refusals, self._holes, self._stated_timeout)

    def _why_not(self, now: float) -> str | None:
        if not self._quorum_answered:
            return "no quorum was answered yet"
        if self._hole_at is not None:
            return (f"the lease may have lapsed since the step's quorum ({self._hole_why}), so the lighthouse may "
                    f"have declared this group gone and its peers redone the step")
        if now >= self._valid_until:
            timeout = self.lease_timeout
            return (f"the lease is not proven to hold: the last call the lighthouse answered was sent "
                    f"{now - self._proof_sent_at:.2f}s ago, more than the lease of {timeout:.2f}s less a margin of "
                    f"{margin(timeout):.2f}s")
        return None

    def _hole(self, at: float, why: str) -> None:
        self._holes += 1
        if self._hole_at is None or at >= self._hole_at:
            self._hole_at, self._hole_why = at, why
