"""Connection leases: the fast path of failure detection (a torchft_lite extension).

A ManagerServer holds one long-lived ``Lease`` stream to the lighthouse. While
the stream is open the replica is leased; when it ends (the process died, the
socket closed, or the replica left on purpose) the lighthouse treats the
replica as gone at once instead of waiting ``heartbeat_timeout`` for its
heartbeats to lapse. A stream that merely goes quiet (a hung process, a
partition) stays open, so those cases still fall back to the heartbeat timeout.

Only the current holder's stream counts: a replica that reconnects replaces
its lease, and the old stream ending later declares nothing.
"""

from __future__ import annotations

import asyncio

from lighthouse.rpc.broadcast import push_dropping_oldest

__all__ = ["Lease", "LeaseTable"]

MAX_EVENT_BACKLOG = 1024


class Lease:
    """One open lease stream and the events queued for it."""

    __slots__ = ("replica_id", "events")

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.events: asyncio.Queue[bytes] = asyncio.Queue(MAX_EVENT_BACKLOG)

    def push(self, event: bytes) -> None:
        push_dropping_oldest(self.events, event)


class LeaseTable:
    """Who holds a lease right now."""

    def __init__(self) -> None:
        self._holders: dict[str, Lease] = {}
        self.broken = 0

    def open(self, replica_id: str) -> Lease:
        """A new lease for ``replica_id``, replacing any older one."""
        lease = Lease(replica_id)
        self._holders[replica_id] = lease
        return lease

    def close(self, lease: Lease) -> bool:
        """The stream of ``lease`` ended; True when it was the current holder (the replica is gone)."""
        if self._holders.get(lease.replica_id) is not lease:
            return False
        del self._holders[lease.replica_id]
        self.broken += 1
        return True

    def holds(self, replica_id: str) -> bool:
        return replica_id in self._holders

    def broadcast(self, event: bytes, *, exclude: str | None = None) -> int:
        """Queue ``event`` for every holder but ``exclude``; returns how many got it."""
        count = 0
        for replica_id, lease in self._holders.items():
            if replica_id != exclude:
                lease.push(event)
                count += 1
        return count

    def __len__(self) -> int:
        return len(self._holders)
