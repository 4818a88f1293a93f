"""A replica group's presence at the lighthouse: heartbeats, a lease, and the lease's events.

The ManagerServer (group rank 0) runs one on the control-plane loop.
Heartbeats keep the group healthy in the quorum rules. The lease (a
torchft_lite extension: one long-lived ``Lease`` stream) lets the lighthouse
drop the group the moment this process dies or leaves, and carries its
member-gone events, which are relayed to listeners in this process and to the
group's ``Events`` streams. A torchft lighthouse has no leases; heartbeats
alone then tell it the group is alive.

It also keeps the group's :class:`~torchft_lite.group_server.lease_fence.LeaseFence`: the
proof, from the answers it got, that the lighthouse still counts the group,
which the group's commit vote needs (:meth:`LighthouseLink.commit_refusal`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from torchft_lite.group_server.lease_fence import LeaseFence, lease_clock
from torchft_lite.rpc.broadcast import Broadcast
from torchft_lite.rpc.lighthouse_client import LighthouseClient
from torchft_lite.rpc.protocol import torchft_pb2 as pb

__all__ = ["LighthouseLink"]

logger = logging.getLogger(__name__)


class LighthouseLink:
    """``start()`` ... ``await stop()``, on the loop of ``lighthouse``; never raises from its loops."""

    def __init__(self, lighthouse: LighthouseClient, replica_id: str, heartbeat_interval: float, *,
                 fence: LeaseFence | None = None, clock: Callable[[], float] = lease_clock) -> None:
        """``fence``: where the lease's proofs go (default: one assuming torchft's lease length until the
        lighthouse states its own); ``clock``: seconds, never going back, counting while suspended."""
        self._lighthouse = lighthouse
        self.fence = fence or LeaseFence()
        self._clock = clock
        self._replica_id = replica_id
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_task: asyncio.Task | None = None
        self._lease_task: asyncio.Task | None = None
        self._listeners: list[Callable[[pb.LeaseEvent], None]] = []
        self.events = Broadcast(256)
        """The lighthouse's events, serialized, for the group's ``Events`` streams."""
        self.lease_held = False
        self.heartbeat_failures = 0
        self.lease_losses = 0

    def quorum_answered(self, sent_at: float) -> None:
        """The lighthouse just answered this group's Quorum call, sent at ``sent_at`` (:attr:`clock`): it counted
        the group then."""
        self.fence.quorum_answered(sent_at, self._clock())

    def clock(self) -> float:
        """The time on the clock the lease is judged by."""
        return self._clock()

    def commit_refusal(self) -> str | None:
        """Why the group must not commit the step of its latest quorum now, or None: it may commit only while
        the lighthouse surely still counts it, since that quorum and now (see :mod:`torchft_lite.group_server.lease_fence`).

        An unanswered heartbeat alone is no reason: while the lease provably holds, the lighthouse has not
        declared the group gone, so its peers abort nothing on its account and commit the step with it; a
        group voting no then would fall a step behind peers that may form their next quorum without it and
        redo the step, two lineages at one step (a chaos run saw a one-second partition do exactly that)."""
        return self.fence.refusal(self._clock())

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._heartbeat_task = loop.create_task(self._heartbeat_loop())
        self._lease_task = loop.create_task(self._lease_loop())

    async def stop(self) -> None:
        """Leave: the lease closes first, so the lighthouse drops this group at once."""
        for task in (self._lease_task, self._heartbeat_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._lease_task = self._heartbeat_task = None

    def add_event_listener(self, listener: Callable[[pb.LeaseEvent], None]) -> None:
        """Call ``listener(event)`` on this loop for every lighthouse event."""
        self._listeners.append(listener)

    async def _heartbeat_loop(self) -> None:
        interval = self._heartbeat_interval
        failing = False
        while True:
            try:
                sent_at = self._clock()
                stated = await self._lighthouse.heartbeat(self._replica_id, timeout=max(interval * 10, 1.0))
                self.fence.answered(sent_at, self._clock(), stated)
                if failing:
                    logger.info("[%s] lighthouse heartbeats succeed again", self._replica_id)
                failing = False
            except Exception as exc:  # never let the heartbeat loop die: the group would look dead
                self.heartbeat_failures += 1
                if not failing:  # log the first failure of a streak, not every one
                    logger.warning("[%s] heartbeat failed: %s", self._replica_id, exc)
                failing = True
            await asyncio.sleep(interval)

    async def _lease_loop(self) -> None:
        """Hold a lease on the lighthouse, reconnecting when it breaks; relay its events.

        Ends only for a lighthouse without leases: anything else (a refusal, a broken stream, an unexpected
        error) is logged once per streak of failures and retried with backoff.
        """
        replica_id = self._replica_id
        backoff, failing = 0.1, False
        while True:
            call = None
            try:
                call = self._lighthouse.lease(replica_id)
                async for event in call:
                    if event.kind == pb.LeaseEvent.GRANTED:
                        if not self.lease_held:
                            logger.info("[%s] lease held on the lighthouse", replica_id)
                        self.lease_held, backoff, failing = True, 0.1, False
                        continue
                    logger.info("[%s] lighthouse: %s left quorum %d (%s)", replica_id, event.replica_id,
                                event.quorum_id, event.reason)
                    self._relay(event)
                logger.warning("[%s] lease stream ended by the lighthouse; reconnecting", replica_id)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("[%s] the lighthouse has no Lease RPC (torchft's?): failures are detected "
                                "by heartbeat expiry only", replica_id)
                    return
                if self.lease_held or not failing:
                    logger.warning("[%s] lease lost or refused (%s: %s); retrying", replica_id, exc.code().name,
                                   exc.details())
                failing = True
            except Exception:  # never let the lease loop die silently
                logger.exception("[%s] lease loop failed; reconnecting", replica_id)
                failing = True
            finally:
                if call is not None:
                    call.cancel()
            if self.lease_held:
                self.lease_losses += 1
                self.fence.lost(self._clock(), "the lease stream ended, so the lighthouse dropped this group")
            self.lease_held = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _relay(self, event: pb.LeaseEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # one listener's bug must not stop the others
                logger.exception("[%s] event listener failed", self._replica_id)
        self.events.publish(event.SerializeToString())
