"""When a lighthouse that belongs to one job may end: the job has been idle long enough.

A scheduler that runs the lighthouse as one role of the job (torchx, a Slurm
step) counts the job finished only when every role has exited. A lighthouse
serves until it is stopped, so ``--exit-when-idle SECONDS`` ends it (exit code
0) once a quorum has been issued and, for ``SECONDS`` in a row, no replica
group has held a lease or sent a heartbeat the lighthouse still counts: every
group finished or is gone. Choose ``SECONDS`` longer than a group's restart
(the scheduler's delay plus the trainer's start-up), or a job whose only live
group is being restarted ends under it.

The rule is pure: :meth:`IdleExit.observe` takes the lighthouse's statistics
and the time, so tests pass literal numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lighthouse.view import LighthouseStatistics

__all__ = ["IdleExit"]


@dataclass
class IdleExit:
    """Says when a job's lighthouse has been idle for ``idle_for`` seconds after its first quorum."""

    idle_for: float
    """Seconds with no lease and no heartbeating replica, after the first quorum, before it may exit."""
    _idle_since: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.idle_for > 0:
            raise ValueError(f"--exit-when-idle must be > 0 seconds, got {self.idle_for}")

    def observe(self, stats: LighthouseStatistics, now: float) -> bool:
        """Record what the lighthouse sees at ``now``; True once it may exit."""
        busy = stats.quorums_issued == 0 or stats.leases_held > 0 or stats.heartbeating_replicas > 0
        if busy:
            self._idle_since = None
            return False
        if self._idle_since is None:
            self._idle_since = now
        return now - self._idle_since >= self.idle_for
