"""torchft's ManagerClient: how one rank reaches a replica group's ManagerServer (its own group's, or a peer's).

The Manager talks to its group's coordinator through this class only, with
torchft's methods and arguments: ``_quorum`` (this rank's part of the step's
quorum), ``should_commit`` (the group's vote) and ``_checkpoint_metadata`` (a
peer rank's, to heal from it). Because the names are torchft's, a test or a
user substitutes the class the way torchft's own tests do
(``patch("torchft.manager.ManagerClient")``).

Calls block the calling thread, never the control-plane loop: each runs on the
loop (:mod:`torchft_lite.rpc.loop`) and is waited for with its own timeout.
Code on the loop goes through :func:`quorum_in_thread` and
:func:`checkpoint_metadata_in_thread`, which make the blocking call from a
worker thread.

A ManagerServer serving in this process (group rank 0's, see
:func:`serve_in_process`) is called directly, without the network. Ours, on
top of torchft's: :meth:`ManagerClient.follow_events`,
:meth:`~ManagerClient.advertise`, :meth:`~ManagerClient.watch_quorums` and
:meth:`~ManagerClient.close`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from datetime import timedelta
from typing import Any, Callable, Coroutine, TypeVar

import grpc

from torchft_lite.errors import ConfigError, ManagerError, ManagerTimeout, QuorumError, QuorumTimeout
from torchft_lite.group_server.client import ManagerStub
from torchft_lite.group_server.quorum_compute import QuorumResult, result_of
from torchft_lite.rpc.loop import control_plane
from torchft_lite.rpc.protocol import torchft_pb2 as pb

__all__ = ["EventListener", "ManagerClient", "checkpoint_metadata_in_thread", "quorum_in_thread", "seconds_of",
           "serve_in_process", "withdraw_from_process"]

T = TypeVar("T")
EventListener = Callable[[pb.LeaseEvent], None]
logger = logging.getLogger(__name__)

# The control-plane wait outlasts a call's own deadline by this much, so the call's
# timeout (which names the call) is the one that fires.
HANDOFF = 5.0

_served_lock = threading.Lock()
_served: dict[str, Any] = {}  # address -> the (async) ManagerServer serving it in this process


def serve_in_process(server: Any) -> None:
    """Let clients in this process reach ``server`` (a started ``group_server.server.ManagerServer``) directly."""
    with _served_lock:
        _served[server.address()] = server


def withdraw_from_process(server: Any) -> None:
    """Undo :func:`serve_in_process` (before the server stops)."""
    with _served_lock:
        for address in [a for a, s in _served.items() if s is server]:
            del _served[address]


def seconds_of(value: timedelta | float, name: str) -> float:
    """A duration given as a ``timedelta`` (torchft's form) or as seconds -> seconds >= 0."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ConfigError(f"{name} must be a timedelta or a number of seconds, got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{name} must be a finite duration >= 0, got {value!r}")
    return seconds


class ManagerClient:
    """A connection to one replica group's ManagerServer (torchft's ``ManagerClient``), usable from any thread
    but the control plane's.

    The constructor does not wait for the server: a call made before it serves waits for it, up to the call's
    own timeout.

    Args:
        addr: the ManagerServer's address, as ``ManagerServer.address()`` gives it (group rank 0 publishes it in
            the group's TCPStore). Required: the default only lets ``create_autospec(ManagerClient)()`` make an
            instance mock the way torchft's tests do with torchft's class, whose signature Python can't see.
        connect_timeout: how long to wait for a connection (a ``timedelta``, or seconds); a call waits at most
            its own timeout in any case.

    Errors: ``_quorum`` raises :class:`~torchft_lite.errors.QuorumError` (``QuorumTimeout``, a ``TimeoutError``,
    when no answer came in time); the other calls raise :class:`~torchft_lite.errors.ManagerError`
    (``ManagerTimeout``); bad arguments raise :class:`~torchft_lite.errors.ConfigError` (a ``ValueError``).
    """

    def __init__(self, addr: str = "", connect_timeout: timedelta | float = timedelta(seconds=60)) -> None:
        if not isinstance(addr, str) or not addr:
            raise ConfigError(f"ManagerClient: addr must be a non-empty address, got {addr!r}")
        self.address = addr
        """The ManagerServer's address (ours; peers heal from it)."""
        self.connect_timeout = timedelta(seconds=seconds_of(connect_timeout, "connect_timeout"))
        self._control = control_plane()
        with _served_lock:
            self._server = _served.get(addr)
        self._stub = ManagerStub(addr)
        self._events: asyncio.Task | None = None
        self._closed = False

    # ------------------------------------------------------------ torchft's calls

    def _quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: timedelta,
        commit_failures: int,
        reconfigure_handle: str,
        init_sync: bool = True,
        *,
        state_fingerprint: str = "",
    ) -> QuorumResult:
        """This rank's part of the step's quorum; returns when the group has one (every rank asked).

        Args:
            group_rank: this rank within its replica group.
            step: the step this rank has committed.
            checkpoint_metadata: where peers fetch this rank's state from (its checkpoint transport's metadata).
            shrink_only: admit no new members to the quorum.
            timeout: how long to wait for the quorum.
            commit_failures: this rank's consecutive failed commits (a new quorum id follows any).
            reconfigure_handle: this rank's process-group handle (``ProcessGroup.get_reconfigure_handle``).
            init_sync: at step 0, every replica heals from the primary so all start from the same weights.
            state_fingerprint: (ours) this rank's state fingerprint at ``step``, or "".
        """
        seconds = seconds_of(timeout, "timeout")
        request = pb.ManagerQuorumRequest(
            group_rank=group_rank, step=step, checkpoint_metadata=checkpoint_metadata, shrink_only=shrink_only,
            init_sync=init_sync, commit_failures=commit_failures, reconfigure_handle=reconfigure_handle,
            state_fingerprint=state_fingerprint,
        )
        server = self._server
        if server is not None:
            call = server.local_quorum(request, seconds)
        else:
            call = self._stub.quorum(
                group_rank=group_rank, step=step, checkpoint_metadata=checkpoint_metadata, shrink_only=shrink_only,
                init_sync=init_sync, commit_failures=commit_failures, timeout=seconds,
                state_fingerprint=state_fingerprint, reconfigure_handle=reconfigure_handle,
            )
        what = f"the quorum for group rank {group_rank} at step {step} from ManagerServer {self.address}"
        return result_of(self._run(call, seconds, what, QuorumTimeout))

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        """What group rank ``rank`` of this server's group advertised as its checkpoint metadata.

        Args:
            rank: a group rank of the server's replica group.
            timeout: how long to wait for the answer.
        """
        seconds = seconds_of(timeout, "timeout")
        server = self._server
        if server is not None:
            metadata = server.checkpoint_metadata(rank)
            if metadata is None:
                raise ManagerError(f"ManagerServer {self.address} (in-process): group rank {rank} has not joined a "
                                   f"quorum")
            return metadata
        return self._run(self._stub.checkpoint_metadata(rank, timeout=seconds), seconds,
                         f"the checkpoint metadata of group rank {rank} from ManagerServer {self.address}")

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        """Vote on committing ``step``; returns the group's decision (True only when every rank voted yes).

        Args:
            group_rank: this rank within its replica group.
            step: the step voted on.
            should_commit: this rank's vote.
            timeout: how long to wait for the other ranks' votes.
        """
        seconds = seconds_of(timeout, "timeout")
        server = self._server
        if server is not None and server.config.world_size == 1:
            call = self._decide_alone(server, group_rank, step, should_commit)  # no round to gather
        else:
            call = self._stub.should_commit(group_rank=group_rank, step=step, should_commit=should_commit,
                                            timeout=seconds)
        return self._run(call, seconds, f"the commit vote of group rank {group_rank} at step {step} from "
                                        f"ManagerServer {self.address}")

    @staticmethod
    async def _decide_alone(server: Any, group_rank: int, step: int, vote: bool) -> bool:
        return server.decide(step, {group_rank: vote})  # on the loop, where the server's lease state lives

    def _run(self, call: Coroutine[Any, Any, T], seconds: float, what: str,
             timeout_error: type[TimeoutError] = ManagerTimeout) -> T:
        try:
            return self._control.run(call, seconds + HANDOFF, what)
        except (QuorumError, ManagerError):
            raise
        except TimeoutError as exc:  # the control plane's own wait: the call's deadline did not fire
            raise timeout_error(str(exc)) from exc

    # ------------------------------------------------------------ ours

    def follow_events(self, listener: EventListener) -> None:
        """From now until :meth:`close`, call ``listener`` (on the control-plane loop) with every lighthouse event
        the group's ManagerServer relays (a torchft ManagerServer relays none)."""
        self._control.run(self._start_following(listener), self.connect_timeout.total_seconds() + HANDOFF,
                          "the lighthouse event stream to start")

    async def _start_following(self, listener: EventListener) -> None:
        if self._server is not None:
            self._server.add_event_listener(listener)
            return
        if self._events is None:
            # Owned here and cancelled in close(); a failure of the stream is retried, never silent.
            self._events = asyncio.get_running_loop().create_task(self._follow(listener))
            self._events.add_done_callback(self._followed)

    async def _follow(self, listener: EventListener) -> None:
        """The lighthouse's events, relayed by the ManagerServer.

        Ends only for a server without the ``Events`` RPC: a broken stream or anything unexpected is logged
        (once per streak of failures) and retried with backoff; a listener's bug is logged per event.
        """
        backoff, failing = 0.1, False
        while True:
            call = None
            try:
                call = self._stub.events(0)
                async for event in call:
                    backoff, failing = 0.1, False
                    try:
                        listener(event)
                    except Exception:  # a bug in the listener must not cost the events after it
                        logger.exception("handling a lighthouse event from %s failed", self.address)
                if not failing:
                    logger.warning("the event stream from %s ended; following it again", self.address)
                failing = True
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("%s relays no lighthouse events (torchft's?)", self.address)
                    return
                if not failing:
                    logger.warning("the event stream from %s failed (%s: %s); retrying", self.address,
                                   exc.code().name, exc.details())
                failing = True
            except Exception:  # anything unexpected: logged with its traceback, then retried
                logger.exception("following the lighthouse's events from %s failed; retrying", self.address)
                failing = True
            finally:
                if call is not None:
                    call.cancel()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _followed(self, task: asyncio.Task) -> None:
        """Say so if following events ever ends with an error (the loop above should make that impossible)."""
        if not task.cancelled() and task.exception() is not None:
            logger.error("stopped following the lighthouse's events from %s", self.address, exc_info=task.exception())

    def advertise(self, key: str, value: Any) -> None:
        """Add ``key`` to the JSON the group sends as ``QuorumMember.data`` (None removes it); see
        ``ManagerServer.advertise``. Only the rank whose process runs the server speaks for the group: on the
        other ranks this does nothing."""
        if self._server is not None:
            self._server.advertise(key, value)

    def watch_quorums(self, watch: Callable[[list[tuple[str, int, str]]], None]) -> None:
        """Call ``watch`` with each issued quorum's ``(replica id, step, data)`` members (on the loop). Only where
        the server runs in this process; elsewhere it does nothing."""
        if self._server is not None:
            self._server.add_quorum_watcher(watch)

    def close(self, timeout: float = 10.0) -> None:
        """Stop following events and close the connection (not the server). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._control.run(self._close(), timeout, f"the connection to ManagerServer {self.address} to close")

    async def _close(self) -> None:
        if self._events is not None:
            self._events.cancel()
            await asyncio.gather(self._events, return_exceptions=True)
        await self._stub.close()


async def quorum_in_thread(client: ManagerClient, reconfigure_handle: Callable[[], str], **kwargs: Any) -> QuorumResult:
    """``client._quorum(reconfigure_handle=reconfigure_handle(), **kwargs)`` from a worker thread, for code on the
    control-plane loop (a process group's first handle starts the store it names: never on the loop)."""
    return await asyncio.to_thread(lambda: client._quorum(reconfigure_handle=reconfigure_handle(), **kwargs))


async def checkpoint_metadata_in_thread(connect: Callable[[str], ManagerClient], address: str, rank: int,
                                        timeout: float) -> str:
    """A peer's checkpoint metadata: ``connect(address)._checkpoint_metadata(rank)`` from a worker thread, on a
    connection of its own that is closed after."""
    def ask() -> str:
        peer = connect(address)
        try:
            return peer._checkpoint_metadata(rank, timeout=timedelta(seconds=timeout))
        finally:
            peer.close()

    return await asyncio.to_thread(ask)
