"""How a Manager reaches its replica group's ManagerServer, and peers' servers.

The Manager needs four things from the group's coordinator: a quorum per
step, the group's commit vote, a peer rank's checkpoint metadata (to heal from
it) and the lighthouse's member-gone events. :class:`GroupChannel` declares
them; :class:`ServerChannel` serves group rank 0 from the ManagerServer in its
own process, :class:`ClientChannel` serves the other ranks over gRPC, and
``torchft_lite.testing`` has an in-memory one for tests without sockets.
All methods run on the control-plane loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Protocol

import grpc  # noqa: E402  (after the line above)

from torchft_lite.group_server.client import ManagerClient  # sets GRPC_ENABLE_FORK_SUPPORT before grpc loads
from torchft_lite.rpc.protocol import torchft_pb2 as pb  # noqa: E402

__all__ = ["ClientChannel", "EventListener", "GroupChannel", "ServerChannel", "peer_metadata"]

EventListener = Callable[[pb.LeaseEvent], None]
logger = logging.getLogger(__name__)


class GroupChannel(Protocol):
    """The replica group's coordinator, as one rank's Manager sees it."""

    address: str
    """The ManagerServer's address (peers heal from it)."""

    async def quorum(self, request: pb.ManagerQuorumRequest, timeout: float) -> pb.ManagerQuorumResponse:
        """This rank's part of the step's quorum; raises ``QuorumError``/``QuorumTimeout``."""

    async def should_commit(self, group_rank: int, step: int, vote: bool, timeout: float) -> bool:
        """The AND of every group rank's vote; raises ``ManagerError``/``ManagerTimeout``."""

    async def peer_metadata(self, address: str, group_rank: int, timeout: float) -> str:
        """The checkpoint metadata of ``group_rank`` in the group whose ManagerServer is at ``address``."""

    async def follow_events(self, listener: EventListener) -> None:
        """From now until :meth:`close`, call ``listener`` (on the loop) with every lighthouse event."""

    async def close(self) -> None:
        """Stop following events and release connections (and the server, where this rank runs it)."""


async def peer_metadata(address: str, group_rank: int, timeout: float) -> str:
    """A peer's checkpoint metadata over gRPC, on a channel of its own."""
    peer = ManagerClient(address)
    try:
        return await peer.checkpoint_metadata(group_rank, timeout=timeout)
    finally:
        await peer.close()


class ClientChannel:
    """Group ranks > 0: the group's ManagerServer over gRPC (one rank votes alone without a round trip)."""

    def __init__(self, address: str, group_rank: int, group_world_size: int) -> None:
        self.address = address
        self._client = ManagerClient(address)
        self._group_rank = group_rank
        self._group_world_size = group_world_size
        self._events: asyncio.Task | None = None

    async def quorum(self, request: pb.ManagerQuorumRequest, timeout: float) -> pb.ManagerQuorumResponse:
        return await self._client.quorum(
            group_rank=request.group_rank, step=request.step, checkpoint_metadata=request.checkpoint_metadata,
            shrink_only=request.shrink_only, init_sync=request.init_sync, commit_failures=request.commit_failures,
            state_fingerprint=request.state_fingerprint, timeout=timeout,
        )

    async def should_commit(self, group_rank: int, step: int, vote: bool, timeout: float) -> bool:
        if self._group_world_size == 1:
            return vote
        return await self._client.should_commit(group_rank=group_rank, step=step, should_commit=vote, timeout=timeout)

    async def peer_metadata(self, address: str, group_rank: int, timeout: float) -> str:
        return await peer_metadata(address, group_rank, timeout)

    async def follow_events(self, listener: EventListener) -> None:
        # Owned here and cancelled in close(); a failure of the stream is retried, never silent.
        self._events = asyncio.get_running_loop().create_task(self._follow(listener))
        self._events.add_done_callback(self._followed)

    async def _follow(self, listener: EventListener) -> None:
        """The lighthouse's events, relayed by the group's ManagerServer (a torchft one has none).

        Ends only for a server without the ``Events`` RPC: a broken stream or anything unexpected is logged
        (once per streak of failures) and retried with backoff; a listener's bug is logged per event.
        """
        backoff, failing, rank = 0.1, False, self._group_rank
        while True:
            call = None
            try:
                call = self._client.events(rank)
                async for event in call:
                    backoff, failing = 0.1, False
                    try:
                        listener(event)
                    except Exception:  # a bug in the listener must not cost the events after it
                        logger.exception("group rank %d: handling a lighthouse event failed", rank)
                if not failing:
                    logger.warning("group rank %d: the event stream from %s ended; following it again", rank,
                                   self.address)
                failing = True
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("group rank %d: %s relays no lighthouse events (torchft's?)", rank, self.address)
                    return
                if not failing:
                    logger.warning("group rank %d: the event stream from %s failed (%s: %s); retrying", rank,
                                   self.address, exc.code().name, exc.details())
                failing = True
            except Exception:  # anything unexpected: logged with its traceback, then retried
                logger.exception("group rank %d: following the lighthouse's events failed; retrying", rank)
                failing = True
            finally:
                if call is not None:
                    call.cancel()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _followed(self, task: asyncio.Task) -> None:
        """Say so if following events ever ends with an error (the loop above should make that impossible)."""
        if not task.cancelled() and task.exception() is not None:
            logger.error("group rank %d: stopped following the lighthouse's events", self._group_rank,
                         exc_info=task.exception())

    async def close(self) -> None:
        if self._events is not None:
            self._events.cancel()
            await asyncio.gather(self._events, return_exceptions=True)
        await self._client.close()


class ServerChannel(ClientChannel):
    """Group rank 0: the ManagerServer runs in this process; its quorum and events need no network."""

    def __init__(self, server: Any, group_world_size: int) -> None:
        super().__init__(server.address(), 0, group_world_size)
        self.server = server

    async def quorum(self, request: pb.ManagerQuorumRequest, timeout: float) -> pb.ManagerQuorumResponse:
        return await self.server.local_quorum(request, timeout)

    def advertise(self, key: str, value: Any) -> None:
        """Add ``key`` to the group's ``QuorumMember.data`` (see ``ManagerServer.advertise``)."""
        self.server.advertise(key, value)

    def watch_quorums(self, watch: Any) -> None:
        """Call ``watch`` with each issued quorum's members (see ``ManagerServer.add_quorum_watcher``)."""
        self.server.add_quorum_watcher(watch)

    async def should_commit(self, group_rank: int, step: int, vote: bool, timeout: float) -> bool:
        if self._group_world_size == 1:  # no round to gather, but the server still decides
            return self.server.decide(step, {group_rank: vote})
        return await super().should_commit(group_rank, step, vote, timeout)

    async def follow_events(self, listener: EventListener) -> None:
        self.server.add_event_listener(listener)

    async def close(self) -> None:
        await super().close()
        await self.server.stop()
