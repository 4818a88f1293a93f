"""The ManagerServer: one per replica group, in group rank 0's process, on the control-plane loop.

It serves torchft's ``ManagerService`` to the ranks of its own group: ``Quorum``
(one lighthouse Quorum call for the whole group, :meth:`ManagerServer.quorum`),
``ShouldCommit`` (the ranks' votes, fenced by the lease: :meth:`ManagerServer.decide`),
``CheckpointMetadata`` for healing peers, ``Kill`` for the lighthouse's admin and
``Events`` (ours: the lighthouse's membership events, relayed). It heartbeats the
lighthouse and holds a lease on it through a
:class:`~torchft_lite.group_server.lighthouse_link.LighthouseLink`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from torchft_lite.errors import QuorumError, QuorumTimeout, StateDivergedError
from torchft_lite.group_server.lease_fence import DEFAULT_LEASE_TIMEOUT, FenceStatistics, LeaseFence
from torchft_lite.group_server.lighthouse_link import LighthouseLink
from torchft_lite.group_server.quorum_compute import (
    QuorumMember, compute_quorum_result, heal_sources_of, member_data, response_of,
)
from torchft_lite.health.fingerprint_vote import FINGERPRINT_KEY, group_fingerprint, parse_fingerprint
from torchft_lite.rpc.access import Access
from torchft_lite.rpc.addresses import split_host_port
from torchft_lite.rpc.h2grpc import GrpcServer, RpcAbort
from torchft_lite.rpc.lighthouse_client import LighthouseClient
from torchft_lite.rpc.protocol import torchft_pb2 as pb
from torchft_lite.rpc.refusals import RefusalLog
from torchft_lite.rpc.tls import ALPN_GRPC, TlsSettings

__all__ = ["EXIT_CODE_KILLED", "ManagerServer", "ManagerServerConfig", "PendingQuorum", "PendingVote"]

logger = logging.getLogger(__name__)
SERVICE = "torchft.ManagerService"
EXIT_CODE_KILLED = 1  # torchft's manager exits with 1 when killed


@dataclass(frozen=True)
class ManagerServerConfig:
    replica_id: str
    """This incarnation's replica id (the user's id plus a unique suffix)."""
    lighthouse_addr: str
    """The lighthouse, ``http://host:port``."""
    hostname: str
    """Advertised host in this server's address (what peers and the lighthouse dial)."""
    store_address: str
    """``host:port`` of this group's TCPStore, advertised to the quorum."""
    world_size: int
    """Ranks in this replica group; a quorum request waits for all of them."""
    bind: str = "[::]:0"
    """Where to listen; port 0 picks a free port."""
    heartbeat_interval: float = 0.1
    """Seconds between lighthouse heartbeats."""
    connect_timeout: float = 60.0
    """Seconds to wait for the lighthouse's first answer on a heartbeat."""
    quorum_timeout: float = 60.0
    """Lighthouse Quorum timeout used when a rank's request carries no deadline."""
    quorum_retries: int = 0
    """Extra lighthouse Quorum attempts after a failure before giving up."""
    heal_sources: int = 1
    """Sources this group's ranks can heal from at once, advertised in ``QuorumMember.data``
    (see :mod:`torchft_lite.group_server.quorum_compute`); 1 advertises nothing, as torchft."""
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT
    """Seconds of lease the commit fence assumes until the lighthouse states its heartbeat timeout (a
    torchft lighthouse never does); see :mod:`torchft_lite.group_server.lease_fence`."""

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("replica_id must be non-empty")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be > 0, got {self.heartbeat_interval}")
        if self.quorum_retries < 0:
            raise ValueError(f"quorum_retries must be >= 0, got {self.quorum_retries}")
        if self.heal_sources < 1:
            raise ValueError(f"heal_sources must be >= 1, got {self.heal_sources}")
        if not self.lease_timeout > 0:
            raise ValueError(f"lease_timeout must be > 0, got {self.lease_timeout}")


@dataclass(frozen=True)
class ManagerServerStatistics:
    quorums: int
    quorum_failures: int
    heartbeat_failures: int
    last_quorum_id: int | None
    refused: dict[str, int] = field(default_factory=dict)
    """Calls refused by the access check, by kind ('unauthenticated', 'forbidden')."""
    fence: FenceStatistics | None = None
    """The commit fence: votes it turned down, lapses it saw possible, the lease length stated."""


class ManagerServer:
    """``await server.start()`` ... ``await server.stop()``; on the control-plane loop.

    It heartbeats the lighthouse every ``heartbeat_interval`` and holds a lease on it (the link is closed first
    on stop, so the lighthouse drops the group at once when this process dies or leaves).

    Only the job's own processes may call it (a ``Kill`` ends the process, a forged ``Quorum`` or
    ``ShouldCommit`` steers the group): every call must carry the job token (``TORCHFT_LITE_TOKEN``/``_FILE``),
    else, with no token, come from loopback (see :mod:`torchft_lite.rpc.access`). Its lighthouse calls carry
    the same token. With ``TORCHFT_LITE_TLS_CERT``/``_KEY`` set it serves TLS only (and advertises an
    ``https://`` address); its lighthouse calls use TLS by the same settings (:mod:`torchft_lite.rpc.tls`).
    """

    def __init__(
        self,
        config: ManagerServerConfig,
        *,
        lighthouse: LighthouseClient | None = None,
        on_kill: Callable[[str], None] | None = None,
        access: Access | None = None,
        tls: TlsSettings | None = None,
    ) -> None:
        """``access``: who may call this server, and the token its lighthouse calls carry; None reads
        ``TORCHFT_LITE_TOKEN``/``_TOKEN_FILE``/``_INSECURE`` once, here (a bad value raises ``ValueError``).
        ``tls``: whether it serves TLS and its lighthouse calls use it; None reads
        ``TORCHFT_LITE_TLS_CERT``/``_KEY``/``_CA`` once, here (the same)."""
        self.config = config
        self.access = Access.from_env() if access is None else access
        self.tls = TlsSettings.from_env() if tls is None else tls
        self._lighthouse = lighthouse or LighthouseClient(config.lighthouse_addr, connect_timeout=config.connect_timeout,
                                                          access=self.access, tls=self.tls)
        self._on_kill = on_kill or _exit_process
        self._grpc = GrpcServer(access=self.access, refusals=RefusalLog(f"ManagerServer {config.replica_id}"))
        for name, handler in {
            "Quorum": self._rpc_quorum,
            "CheckpointMetadata": self._rpc_checkpoint_metadata,
            "ShouldCommit": self._rpc_should_commit,
            "Kill": self._rpc_kill,
        }.items():
            self._grpc.add_unary(f"/{SERVICE}/{name}", handler)
        self._grpc.add_server_stream(f"/{SERVICE}/Events", self._rpc_events)
        self._port: int | None = None
        self._pending_quorum: PendingQuorum | None = None
        self._pending_vote: PendingVote | None = None
        self._checkpoint_metadata: dict[int, str] = {}
        self._tasks: set[asyncio.Task] = set()
        self._link = LighthouseLink(self._lighthouse, config.replica_id, config.heartbeat_interval,
                                    fence=LeaseFence(config.lease_timeout))
        self._quorums = 0
        self._advertised: dict[str, object] = {}
        self._quorum_watchers: list[Callable[[list[tuple[str, int, str]]], None]] = []
        self._quorum_failures = 0
        self._last_quorum_id: int | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        host, port = split_host_port(self.config.bind)
        self._port = await self._grpc.start(host, port, self.tls.server_context(ALPN_GRPC) if self.tls.serving
                                            else None)
        self._link.start()
        logger.log(logging.WARNING if self.access.mode == "insecure" else logging.INFO,
                   "[%s] ManagerServer listening on %s for %d rank(s); %s; %s",
                   self.config.replica_id, self.address(), self.config.world_size, self.access.describe(),
                   self.tls.describe())

    def advertise(self, key: str, value: object) -> None:
        """Add ``key`` to the JSON object this group sends as ``QuorumMember.data`` from the next quorum on
        (``None`` removes it). Used for ``resumed_from`` (a durable checkpoint's step)."""
        if value is None:
            self._advertised.pop(key, None)
        else:
            self._advertised[key] = value

    def add_quorum_watcher(self, watch: Callable[[list[tuple[str, int, str]]], None]) -> None:
        """Call ``watch`` with each quorum's ``(replica id, step, data)`` members, on the server's loop."""
        self._quorum_watchers.append(watch)

    def _advertised_data(self, requests: list[pb.ManagerQuorumRequest]) -> str:
        """What is advertised, and the group's fingerprint when every rank sent one of this step."""
        fingerprint = group_fingerprint(requests[0].step, [r.state_fingerprint for r in
                                                           sorted(requests, key=lambda r: r.group_rank)])
        data = self._advertised if fingerprint is None else {**self._advertised, FINGERPRINT_KEY: fingerprint}
        return json.dumps(data, separators=(",", ":"), sort_keys=True) if data else ""

    def address(self) -> str:
        if self._port is None:
            raise RuntimeError("ManagerServer not started")
        host = self.config.hostname
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{self.tls.scheme}://{host}:{self._port}"

    async def stop(self) -> None:
        """Leave: the lease closes first, so the lighthouse drops this group at once."""
        await self._link.stop()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._grpc.stop(grace=1.0)
        await self._lighthouse.close()

    @property
    def lease_held(self) -> bool:
        """Whether the lighthouse holds this group's lease now."""
        return self._link.lease_held

    def statistics(self) -> ManagerServerStatistics:
        return ManagerServerStatistics(
            self._quorums, self._quorum_failures, self._link.heartbeat_failures, self._last_quorum_id,
            dict(self._grpc.refusals.counts), self._link.fence.statistics(),
        )

    # ------------------------------------------------------------ lighthouse events

    def add_event_listener(self, listener: Callable[[pb.LeaseEvent], None]) -> None:
        """Call ``listener(event)`` on this loop for every lighthouse event (group rank 0's Manager)."""
        self._link.add_event_listener(listener)

    async def _rpc_events(self, data: bytes, context):
        request = _parse(pb.ManagerEventsRequest, data)
        self._check_rank(request.group_rank, "ManagerEventsRequest.group_rank")
        async for event in self._link.events.subscribe():
            yield event

    # ------------------------------------------------------------ Quorum

    async def _rpc_quorum(self, data: bytes, context) -> bytes:
        request = _parse(pb.ManagerQuorumRequest, data)
        return (await self.quorum(request, context.timeout)).SerializeToString()

    async def quorum(self, request: pb.ManagerQuorumRequest, timeout: float | None) -> pb.ManagerQuorumResponse:
        """A rank's Quorum call; group rank 0 calls this in-process, the others over gRPC.

        It waits until every rank of the group asked for the same step, makes one lighthouse ``Quorum`` call for
        the group (retrying up to ``quorum_retries`` times when the lighthouse is briefly gone), then answers
        each rank with :func:`~torchft_lite.group_server.quorum_compute.compute_quorum_result` for its group rank.
        The ranks' process-group handles travel to the lighthouse with the group, and each rank gets every
        member's for its group rank (torchft's reconfigure handles). When the call finally fails, every waiting
        rank gets the error at once. The group's ``heal_sources`` (how
        many peers a healing rank can stripe over) travels in ``QuorumMember.data`` so every group computes the
        same assignment.

        Raises ``RpcAbort`` with the status the caller should see.
        """
        rank = request.group_rank
        self._check_rank(rank, "ManagerQuorumRequest.group_rank")
        self._checkpoint_metadata[rank] = request.checkpoint_metadata
        round_ = self._pending_quorum
        if round_ is None:
            round_ = self._pending_quorum = PendingQuorum()
        round_.requests[rank] = request  # a rank that retries replaces its request, and its deadline
        if timeout is not None:
            # Absolute: a rank that asked early also gives up early.
            round_.deadlines[rank] = asyncio.get_running_loop().time() + timeout
        else:
            round_.deadlines.pop(rank, None)
        if len(round_.requests) == self.config.world_size:
            self._pending_quorum = None  # later requests start the next round
            self._start_lighthouse_quorum(round_)
        try:
            quorum: pb.Quorum = await asyncio.shield(round_.result)
        except _RoundFailed as exc:
            raise RpcAbort(exc.code, str(exc)) from None
        members = [
            QuorumMember(p.replica_id, p.address, p.store_address, p.step, p.world_size, p.commit_failures,
                         heal_sources=heal_sources_of(p.data), fingerprint=parse_fingerprint(p.data),
                         reconfigure_handles=tuple(p.reconfigure_handles))
            for p in quorum.participants
        ]
        # Group rank r of every replica group forms one process group, so every
        # group needs the same number of ranks; otherwise rendezvous would hang.
        mismatched = [f"{m.replica_id} has {m.world_size}" for m in members
                      if m.world_size not in (0, self.config.world_size)]
        if mismatched:
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION,
                           f"replica groups must all have the same number of ranks: {self.config.replica_id} has "
                           f"{self.config.world_size}, " + ", ".join(mismatched))
        try:
            result = compute_quorum_result(
                quorum.quorum_id, members, self.config.replica_id, rank, init_sync=request.init_sync
            )
        except StateDivergedError as exc:
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        except ValueError as exc:
            raise RpcAbort(grpc.StatusCode.INTERNAL, str(exc)) from None
        return response_of(result)

    async def local_quorum(self, request: pb.ManagerQuorumRequest, timeout: float) -> pb.ManagerQuorumResponse:
        """:meth:`quorum` for a rank in this process, with the errors a gRPC caller would get."""
        what = f"Quorum for group rank {request.group_rank} at step {request.step}"
        try:
            async with asyncio.timeout(timeout):
                return await self.quorum(request, timeout)
        except RpcAbort as exc:
            if exc.details.startswith(StateDivergedError.MARK):
                raise StateDivergedError(exc.details) from exc
            raise QuorumError(f"ManagerServer {self.address()} (in-process): {what} failed: "
                              f"{exc.code.name}: {exc.details}") from exc
        except TimeoutError as exc:
            raise QuorumTimeout(f"ManagerServer {self.address()} (in-process): {what} got no answer "
                                f"within {timeout:.2f}s (status: Cancelled, message: Timeout expired)") from exc

    def _start_lighthouse_quorum(self, round_: PendingQuorum) -> None:
        steps = {rank: r.step for rank, r in sorted(round_.requests.items())}
        if len(set(steps.values())) > 1:
            detail = ", ".join(f"rank {rank} at step {step}" for rank, step in steps.items())
            self._quorum_failures += 1
            round_.result.set_exception(_RoundFailed(
                grpc.StatusCode.FAILED_PRECONDITION, f"ranks of replica group {self.config.replica_id} disagree on the step: {detail}"
            ))
            return
        task = asyncio.get_running_loop().create_task(self._lighthouse_quorum(round_))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _lighthouse_quorum(self, round_: PendingQuorum) -> None:
        requests = list(round_.requests.values())
        step = requests[0].step
        # The ranks' process-group handles, by group rank: every member's group rank r gets them all for r.
        handles = [round_.requests[rank].reconfigure_handle for rank in sorted(round_.requests)]
        handles = handles if any(handles) else []
        now = asyncio.get_running_loop().time()
        if round_.deadline is not None:
            # Finish before the ranks' own deadlines so they get our error, not a bare timeout.
            left = round_.deadline - now
            deadline = now + left - min(1.0, 0.1 * max(left, 0.0))
        else:
            deadline = now + self.config.quorum_timeout
        attempts = self.config.quorum_retries + 1
        last_error: Exception | None = None
        for attempt in range(attempts):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                sent_at = self._link.clock()
                quorum = await self._lighthouse.quorum(
                    self.config.replica_id,
                    timeout=remaining / (attempts - attempt),  # leave time for the retries
                    address=self.address(),
                    store_address=self.config.store_address,
                    step=step,
                    world_size=self.config.world_size,
                    shrink_only=any(r.shrink_only for r in requests),
                    data=member_data(self.config.heal_sources, self._advertised_data(requests)),
                    commit_failures=max(r.commit_failures for r in requests),
                    reconfigure_handles=handles,
                )
            except Exception as exc:  # LighthouseError, or anything unexpected: the ranks must hear of it
                last_error = exc
                logger.warning("[%s] lighthouse quorum attempt %d/%d at step %d failed: %s",
                               self.config.replica_id, attempt + 1, attempts, step, exc)
                if attempt + 1 < attempts:
                    await asyncio.sleep(min(0.1 * 2**attempt, 1.0))
                continue
            except asyncio.CancelledError:
                round_.result.cancel()
                raise
            self._quorums += 1
            if quorum.quorum_id != self._last_quorum_id:
                logger.info("[%s] quorum %d at step %d: %d member(s)", self.config.replica_id,
                            quorum.quorum_id, step, len(quorum.participants))
            self._last_quorum_id = quorum.quorum_id
            self._link.quorum_answered(sent_at)
            members = [(p.replica_id, p.step, p.data) for p in quorum.participants]
            for watch in self._quorum_watchers:  # the Fingerprinter names the groups a corruption hit
                try:
                    watch(members)
                except Exception:
                    logger.exception("[%s] quorum watcher failed", self.config.replica_id)
            round_.result.set_result(quorum)
            return
        self._quorum_failures += 1
        code = grpc.StatusCode.DEADLINE_EXCEEDED if last_error is None else grpc.StatusCode.UNAVAILABLE
        why = "no time left" if last_error is None else str(last_error)
        round_.result.set_exception(_RoundFailed(
            code, f"replica group {self.config.replica_id}: lighthouse quorum at step {step} failed "
                  f"after {attempts} attempt(s): {why}"
        ))

    # ------------------------------------------------------------ ShouldCommit

    async def _rpc_should_commit(self, data: bytes, context) -> bytes:
        request = _parse(pb.ShouldCommitRequest, data)
        rank = request.group_rank
        self._check_rank(rank, "ShouldCommitRequest.group_rank")
        round_ = self._pending_vote
        if round_ is not None and round_.step != request.step:
            others = ", ".join(f"rank {r}" for r in sorted(round_.votes))
            message = (f"replica group {self.config.replica_id}: rank {rank} voted for step {request.step} "
                       f"while {others} voted for step {round_.step}")
            round_.result.set_exception(_RoundFailed(grpc.StatusCode.FAILED_PRECONDITION, message))
            self._pending_vote = None
            raise RpcAbort(grpc.StatusCode.FAILED_PRECONDITION, message)
        if round_ is None:
            round_ = self._pending_vote = PendingVote(step=request.step)
        round_.votes[rank] = request.should_commit
        if len(round_.votes) == self.config.world_size:
            self._pending_vote = None
            round_.result.set_result(self.decide(round_.step, round_.votes))
        try:
            decision = await asyncio.shield(round_.result)
        except _RoundFailed as exc:
            raise RpcAbort(exc.code, str(exc)) from None
        return pb.ShouldCommitResponse(should_commit=decision).SerializeToString()

    def decide(self, step: int, votes: dict[int, bool]) -> bool:
        """The group's decision on ``step`` (a one-rank group's Manager asks in-process): no when a rank voted
        no, or when the group's lease at the lighthouse can't be shown to have held since the step's quorum and
        to hold now (:meth:`LighthouseLink.commit_refusal`). Then the lighthouse may have declared the group gone
        and its peers redone the step while this group's collectives completed: committing would fork the job's
        history. Not committing is always safe: behind, the group heals at the next quorum."""
        against = [r for r, v in sorted(votes.items()) if not v]
        if against:
            if len(votes) > 1:
                logger.info("[%s] step %d not committed: rank(s) %s voted no", self.config.replica_id, step,
                            against)
            return False
        refusal = self._link.commit_refusal()
        if refusal is not None:
            logger.warning("[%s] step %d not committed: %s", self.config.replica_id, step, refusal)
            return False
        return True

    # ------------------------------------------------------------ metadata, kill

    def checkpoint_metadata(self, rank: int) -> str | None:
        """What group rank ``rank`` sent as its checkpoint metadata with its last quorum request; None before."""
        return self._checkpoint_metadata.get(rank)

    async def _rpc_checkpoint_metadata(self, data: bytes, context) -> bytes:
        request = _parse(pb.CheckpointMetadataRequest, data)
        metadata = self.checkpoint_metadata(request.rank)
        if metadata is None:
            raise RpcAbort(grpc.StatusCode.NOT_FOUND,
                           f"rank not found: group rank {request.rank} of {self.config.replica_id} has not joined a quorum")
        return pb.CheckpointMetadataResponse(checkpoint_metadata=metadata).SerializeToString()

    async def _rpc_kill(self, data: bytes, context) -> bytes:
        """``Kill``: log the reason and exit the process (``EXIT_CODE_KILLED``)."""
        request = _parse(pb.KillRequest, data)
        logger.warning("[%s] killed on request from %s: %s", self.config.replica_id, context.peer(), request.msg)
        # Answer first, then exit: the caller learns the kill was accepted.
        asyncio.get_running_loop().call_later(0.05, self._on_kill, request.msg)
        return pb.KillResponse().SerializeToString()

    def _check_rank(self, rank: int, what: str) -> None:
        if not 0 <= rank < self.config.world_size:
            raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{what}={rank} is outside [0, {self.config.world_size})")


class _RoundFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _parse(cls, data: bytes):
    try:
        return cls.FromString(data)
    except DecodeError as exc:
        raise RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.__name__}: {exc}") from None


def _exit_process(msg: str) -> None:
    logging.shutdown()
    os._exit(EXIT_CODE_KILLED)


@dataclass
class PendingQuorum:
    """One group's Quorum calls for a step, gathered until every rank has asked, then answered together."""

    requests: dict[int, pb.ManagerQuorumRequest] = field(default_factory=dict)
    deadlines: dict[int, float] = field(default_factory=dict)  # loop time, per rank: of its latest request
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def deadline(self) -> float | None:
        """The earliest deadline among the ranks' current requests."""
        return min(self.deadlines.values(), default=None)


@dataclass
class PendingVote:
    """One group's ShouldCommit votes for a step, gathered until every rank has voted."""

    step: int
    votes: dict[int, bool] = field(default_factory=dict)
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
