"""Connection leases: the fast path of failure detection (a torchft_lite extension).

A ManagerServer holds one long-lived ``Lease`` stream to the lighthouse; when it
ends (the process died, the socket closed, or the replica left on purpose) the
lighthouse treats the replica as gone at once instead of waiting
``heartbeat_timeout`` for its heartbeats to lapse. A stream that merely goes quiet
(a hung process, a partition) stays open, so those still fall back to the
heartbeat timeout. **A lease belongs to the connection that opened it**: the
rules for a second claim are :meth:`LeaseTable.open`'s.
"""

from __future__ import annotations

import asyncio

from torchft_lite.rpc.broadcast import push_dropping_oldest

__all__ = ["Lease", "LeaseHeld", "LeaseTable"]

MAX_EVENT_BACKLOG = 1024


class LeaseHeld(Exception):
    """A ``Lease`` for a replica id that a live connection holds; the message says why and what to do."""


class Lease:
    """One open lease stream, the connection it came on, and the events queued for it."""

    __slots__ = ("replica_id", "peer", "seen_at", "events", "ended")

    def __init__(self, replica_id: str, peer: str, now: float) -> None:
        self.replica_id = replica_id
        self.peer = peer
        self.seen_at = now
        """When the holder's connection last opened the lease or called for this replica (monotonic)."""
        self.events: asyncio.Queue[bytes] = asyncio.Queue(MAX_EVENT_BACKLOG)
        self.ended = False
        """Whether its stream ended (as the holder or after being replaced)."""

    def push(self, event: bytes) -> None:
        push_dropping_oldest(self.events, event)


class LeaseTable:
    """Who holds a lease right now, and on which connection."""

    def __init__(self, heartbeat_timeout: float) -> None:
        self._heartbeat_timeout = heartbeat_timeout
        self._holders: dict[str, Lease] = {}
        self.broken = 0
        self.taken_over = 0

    def open(self, replica_id: str, peer: str, now: float) -> Lease:
        """A new lease for ``replica_id`` on the connection ``peer``; raises :class:`LeaseHeld` while another
        live connection holds it.

        Ending a lease declares its replica gone and tells every other member, so no other connection may take
        it over: a lease for a replica id already leased on another connection is refused (ALREADY_EXISTS),
        and the refused stream ending declares nothing. Replica ids name one process incarnation (a group name
        and a uuid), so a restarted group never asks for its predecessor's lease. The one legitimate second
        claim is the same process reconnecting on a new connection; it gets the lease

        * once the old connection is seen to close (which ends the old lease: the replica is gone for a moment
          and rejoins, as after any broken connection), or
        * once the holder's connection has carried no Heartbeat or Quorum call for that replica for
          ``heartbeat_timeout`` (a connection that died without a close, which the lighthouse may not notice
          for a long time): the new connection takes the lease over, and the old stream ending later declares
          nothing.

        A connection is told apart by its gRPC peer (address and port), the same for every call on one HTTP/2
        connection; the manager's heartbeats and Quorum calls share its lease's channel. Heartbeats for the
        replica from other connections (a torchft manager's, or a forger's) keep it healthy in the quorum
        rules but never keep a lease's connection alive (:meth:`saw`): a holder can't be kept by someone else.
        """
        held = self._holders.get(replica_id)
        if held is not None and held.peer != peer:
            silent = now - held.seen_at
            if silent < self._heartbeat_timeout:
                raise LeaseHeld(
                    f"replica {replica_id!r} already holds a lease on another connection (last heard from "
                    f"{silent:.1f}s ago): a replica id names one process. A process reconnecting gets the lease "
                    f"once its old connection closes or stays silent for {self._heartbeat_timeout:.1f}s "
                    f"(heartbeat_timeout); a new process needs a new replica id")
            self.taken_over += 1
        lease = Lease(replica_id, peer, now)
        self._holders[replica_id] = lease
        return lease

    def saw(self, replica_id: str, peer: str, now: float) -> None:
        """A Heartbeat or Quorum call for ``replica_id`` came on ``peer``: the holder's connection is alive."""
        lease = self._holders.get(replica_id)
        if lease is not None and lease.peer == peer:
            lease.seen_at = now

    def close(self, lease: Lease) -> bool:
        """The stream of ``lease`` ended; True when it was the current holder (the replica is gone)."""
        lease.ended = True
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
