"""The lighthouse server: gRPC ``LighthouseService`` plus HTTP, on one event loop.

The quorum rules live in :mod:`lighthouse.quorum`; this module converts wire
messages to plain data, keeps the state on the event loop (the only thread that
touches it, so no lock), re-evaluates on every Quorum call and every
``quorum_tick``, and hands each issued quorum to its waiting callers. A
replica from before a new epoch of the job (see :mod:`lighthouse.epochs`) gets
FAILED_PRECONDITION; the epoch's lower step is saved to the state directory.

A quorum's response is serialized once and the same bytes go to every member,
so issuing to n members costs one serialization, not n.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import AsyncIterator, Callable

import grpc
import hpack  # noqa: F401  (a lighthouse serves all day: load the HPACK tables at start, not on a first call)

from lighthouse.config import LighthouseConfig
from lighthouse.decision_log import DecisionLog, log_serving, preview
from lighthouse.epochs import StaleReplica, resumed_from_of, resumed_quorum_of
from lighthouse.fencing import QuorumIdStore
from lighthouse.leases import LeaseHeld, LeaseTable
from lighthouse.quorum import Epoch, IssuedQuorum, Member, Status
from lighthouse.stragglers.rules import StragglerQuorumState, StragglerStatistics
from lighthouse.timeline import Timeline, TimelineStatistics
from lighthouse.validation import MAX_REPLICA_ID_LEN, RequestChecks  # noqa: F401  (importable from here)
from lighthouse.view import LighthouseStatistics
from torchft_lite.rpc.addresses import split_host_port
from torchft_lite.rpc.broadcast import Broadcast
from torchft_lite.rpc.engines import RefusalLog, Server, Service, start_service
from torchft_lite.rpc.protocol import torchft_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE = "torchft.LighthouseService"
MAX_FAILURE_BACKLOG = 1024


class LighthouseServer:
    """Runs the lighthouse on the current event loop.

    ``await start()`` binds and returns once serving; ``await stop()`` shuts
    down; ``await serve()`` does both around waiting for :meth:`request_stop`.
    """

    def __init__(
        self,
        config: LighthouseConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._clock = clock
        self._wall_clock = wall_clock
        self._ids = QuorumIdStore(config.state_dir, wall_clock)
        seed = self._ids.initial()
        self._restart_evidence = self._ids.restart_evidence
        self._state = StragglerQuorumState(config.quorum_config(), config.straggler_config(), last_quorum_id=seed,
                                           started_at=clock(), max_step=self._ids.initial_max_step(),
                                           restart_evidence=self._restart_evidence)
        self._state.epochs.restore(self._ids.initial_holders())
        self._waiters: dict[str, list[asyncio.Future[bytes]]] = {}
        # Last Quorum request of each replica still worth showing (heartbeating,
        # participating or in the last quorum); pruned with them.
        self._known: dict[str, pb.QuorumMember] = {}
        # The newest waiting Quorum call of each replica: what it asked, and the connection it came on.
        self._calls: dict[str, tuple[Member, str]] = {}
        self._failure_subscribers = Broadcast(MAX_FAILURE_BACKLOG)
        self._leases = LeaseTable(config.heartbeat_timeout)
        # Every answered heartbeat states the lease length, for the Manager's commit fence.
        self._heartbeat_answer = pb.LighthouseHeartbeatResponse(
            heartbeat_timeout_ms=round(config.heartbeat_timeout * 1000)).SerializeToString()
        self._checks = RequestChecks()
        self._stopping = False
        self._decisions = DecisionLog(clock())
        self._timeline = Timeline(clock(), restart_evidence=self._restart_evidence)  # the dashboard's history
        self._eviction_counts = (0, 0)
        self._quorum_created_wall: float | None = None
        self._started_at = clock()
        self._counts = dict(quorum_requests=0, heartbeats=0, expired_replicas=0, id_changes=0,
                            fenced_requests=0)
        self._last_formation: float | None = None
        self._formation_observers: list[Callable[[float], None]] = []
        self._published_id: int | None = None
        self._previous_ids: set[str] = set()
        self._grpc: Server | None = None
        self.refusals = RefusalLog("lighthouse")  # gRPC calls refused by config.access; read by /metrics
        self._http = None  # aiohttp AppRunner, see lighthouse.http
        self._grpc_port: int | None = None
        self._http_port: int | None = None
        self._stop_requested: asyncio.Event | None = None
        self._serve_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ lifecycle

    async def serve(self, ready: Callable[[], None] | None = None) -> None:
        """Bind, serve until :meth:`request_stop`, then shut down cleanly."""
        self._stop_requested = asyncio.Event()
        await self._bind()
        try:
            async with asyncio.TaskGroup() as tasks:
                ticker = tasks.create_task(self._tick_loop(), name="lighthouse-tick")
                if ready is not None:
                    ready()
                await self._stop_requested.wait()
                ticker.cancel()
        finally:
            await self._shutdown()

    async def start(self) -> None:
        """Serve in a task owned by this object; returns once bound."""
        if self._serve_task is not None:
            raise RuntimeError("lighthouse already started")
        bound = asyncio.get_running_loop().create_future()
        self._serve_task = asyncio.create_task(self.serve(lambda: bound.set_result(None)), name="lighthouse-serve")
        done, _ = await asyncio.wait({bound, self._serve_task}, return_when=asyncio.FIRST_COMPLETED)
        if self._serve_task in done:
            self._serve_task.result()  # raises the bind error

    def request_stop(self) -> None:
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def stop(self) -> None:
        self.request_stop()
        if self._serve_task is not None:
            task, self._serve_task = self._serve_task, None
            await task

    async def _bind(self) -> None:
        try:
            self._grpc, self._grpc_port = await start_service(self._service(), self.config.bind, self.config.grpc_engine,
                                                              access=self.config.access, refusals=self.refusals,
                                                              tls=self.config.tls)
        except OSError as exc:
            raise OSError(f"lighthouse could not bind gRPC to {self.config.bind}: {exc}") from exc
        if self.config.http_bind is not None:
            from lighthouse.http import start_http  # aiohttp is only needed with HTTP on

            try:
                self._http, self._http_port = await start_http(self, self.config.http_bind)
            except BaseException:
                await self._stop_grpc()
                raise
        log_serving(self.config, self._grpc_port, self._http_port, self._state, self._restart_evidence)

    async def _shutdown(self) -> None:
        self._stopping = True  # lease streams ending now are our doing, not their replicas dying
        self._ids.keep_max_step(self._clock(), force=True)  # the step quorums agreed on (see fencing)
        for replica_id in list(self._waiters):
            self._fail_waiters(replica_id, _Shutdown())
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        await self._stop_grpc()
        logger.info("lighthouse stopped at quorum id %d", self._state.quorum_id)

    async def _stop_grpc(self) -> None:
        if self._grpc is not None:
            server, self._grpc = self._grpc, None
            await server.stop(0.5)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.quorum_tick)
            self._decide()

    # ------------------------------------------------------------ addresses

    @property
    def grpc_port(self) -> int:
        if self._grpc_port is None:
            raise RuntimeError("lighthouse not started")
        return self._grpc_port

    @property
    def http_port(self) -> int | None:
        return self._http_port

    def address(self) -> str:
        """Address for managers (``TORCHFT_LIGHTHOUSE``), torchft style: http://host:port."""
        host, _ = split_host_port(self.config.bind)
        if host in ("", "::", "0.0.0.0", "[::]"):
            host = socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        return f"{self.config.tls.scheme}://{host}:{self.grpc_port}"

    # ------------------------------------------------------------ gRPC

    def _service(self) -> Service:
        """The handlers, for either engine (requests and responses stay bytes)."""
        return Service(
            SERVICE,
            unary={"Quorum": self._rpc_quorum, "Heartbeat": self._rpc_heartbeat, "GetConfig": self._rpc_get_config},
            server_streams={"SubscribeFailures": self._rpc_subscribe_failures, "Lease": self._rpc_lease},
        )

    async def _rpc_quorum(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await self._checks.parse(pb.LighthouseQuorumRequest, data, context)
        requester = await self._checks.member(request, context)  # every field in range
        replica_id = requester.replica_id
        self._leases.saw(replica_id, context.peer(), self._clock())
        self._counts["quorum_requests"] += 1
        member = Member(replica_id, requester.shrink_only, requester.commit_failures, payload=requester,
                        step=requester.step, resumed_from=resumed_from_of(requester.data),
                        resumed_quorum=resumed_quorum_of(requester.data),
                        compute=self._state.sample_of(replica_id, requester.data))
        try:
            self._state.join(member, self._clock())
        except StaleReplica as exc:
            self._refuse_stale(exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self._known[replica_id] = requester
        self._calls[replica_id] = (member, context.peer())
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(replica_id, []).append(future)
        self._decide()
        try:
            return await future
        except _Shutdown:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "lighthouse is shutting down")
        except StaleReplica as exc:  # dropped as from before an epoch while it waited
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except asyncio.CancelledError:
            logger.debug("Quorum call of %s cancelled (client gone or deadline passed)", replica_id)
            raise
        finally:
            self._forget_waiter(replica_id, future)

    def _fail_waiters(self, replica_id: str, error: Exception) -> None:
        for future in self._waiters.get(replica_id, ()):
            if not future.done():
                future.set_exception(error)

    def _forget_waiter(self, replica_id: str, future: asyncio.Future[bytes]) -> None:
        waiting = self._waiters.get(replica_id)
        if waiting is None:
            return
        if future in waiting:
            waiting.remove(future)
        if not waiting:
            del self._waiters[replica_id]
            self._calls.pop(replica_id, None)
            # Nobody is waiting for this replica any more (cancelled or timed out).
            self._state.leave(replica_id)
            # Its heartbeat may have expired while it waited: nothing else would prune it.
            self._prune_known(replica_id)

    async def _rpc_heartbeat(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await self._checks.parse(pb.LighthouseHeartbeatRequest, data, context)
        await self._checks.replica_id(request.replica_id, "replica_id", context)
        self._leases.saw(request.replica_id, context.peer(), self._clock())
        self._counts["heartbeats"] += 1
        self._state.heartbeat(request.replica_id, self._clock())
        return self._heartbeat_answer

    async def _rpc_get_config(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await self._checks.parse(pb.LighthouseConfigRequest, data, context)
        return pb.LighthouseConfigResponse(config_data=self.config.advertised()).SerializeToString()

    async def _rpc_subscribe_failures(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        await self._checks.parse(pb.SubscribeFailuresRequest, data, context)
        async for note in self._failure_subscribers.subscribe():
            yield note

    async def _rpc_lease(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        request = await self._checks.parse(pb.LeaseRequest, data, context)
        replica_id = request.replica_id
        await self._checks.replica_id(replica_id, "replica_id", context)
        try:  # a lease belongs to its connection: see lighthouse.leases
            lease = self._leases.open(replica_id, context.peer(), self._clock())
        except LeaseHeld as exc:
            await self._checks.refuse(context, "lease_held", str(exc), grpc.StatusCode.ALREADY_EXISTS)
        self._state.heartbeat(replica_id, self._clock())
        logger.debug("lease granted to %s (%s)", replica_id, context.peer())
        try:
            yield pb.LeaseEvent(kind=pb.LeaseEvent.GRANTED, replica_id=replica_id,
                                quorum_id=self._state.quorum_id).SerializeToString()
            while True:
                yield await lease.events.get()
        finally:
            if self._leases.close(lease) and not self._stopping:
                self._on_lease_ended(replica_id, lease.peer)

    def _on_lease_ended(self, replica_id: str, peer: str | None = None) -> None:
        """The holder's stream (on connection ``peer``) ended: its process died or closed it. Gone now, not at
        heartbeat expiry."""
        if not self._state.forget(replica_id):
            return
        in_quorum = replica_id in self._previous_ids
        logger.info("lease of %s ended (connection closed)%s: treating it as gone now", replica_id,
                    f", a member of quorum {self._state.quorum_id}" if in_quorum else "")
        self._notify_gone(replica_id, "lease ended: its connection to the lighthouse closed")
        self._rejoin_from_another_connection(replica_id, peer)
        self._prune_known(replica_id)
        self._decide()

    def _rejoin_from_another_connection(self, replica_id: str, peer: str | None) -> None:
        """A Quorum call of ``replica_id`` still waits, and it came on another connection than the ended lease's:
        the same process reconnected, and its call got here before the old connection's close. It joins again
        now, as the call would have had it come a moment later; forgotten, it would wait out its whole timeout
        in no quorum (a chaos run lost 16 s so, after a partition healed). A call on the lease's own connection
        ends with it (a dead process) and rejoins nothing."""
        call = self._calls.get(replica_id)
        waiting = [future for future in self._waiters.get(replica_id, ()) if not future.done()]
        if call is None or peer is None or call[1] == peer or not waiting:
            return  # (a call already answered must not leave a member no call waits for)
        logger.info("%s has a Quorum call waiting on another connection (it reconnected): it joins again",
                    replica_id)
        try:
            self._state.join(call[0], self._clock())
        except StaleReplica as exc:
            self._refuse_stale(exc)

    def _notify_gone(self, replica_id: str, reason: str) -> None:
        """Tell every other lease holder (and SubscribeFailures) that a quorum member is gone."""
        self._timeline.gone(replica_id, reason, self._clock())
        if replica_id not in self._previous_ids:
            return
        self._leases.broadcast(pb.LeaseEvent(
            kind=pb.LeaseEvent.MEMBER_GONE, replica_id=replica_id, quorum_id=self._state.quorum_id, reason=reason,
        ).SerializeToString(), exclude=replica_id)
        if self._failure_subscribers:
            self._failure_subscribers.publish(
                pb.FailureNotification(replica_id=replica_id, error_message=reason).SerializeToString())

    # ------------------------------------------------------------ decisions

    def _decide(self) -> None:
        now = self._clock()
        first_joined = self._state.first_joined
        decision, expired = self._state.decide(now)
        if expired:
            self._on_expired(expired)
        if decision.epoch is not None:
            self._on_epoch(decision.epoch, decision.fenced, now)
        self._decisions.note(decision, now)
        if decision.quorum is not None:
            self._publish(decision.quorum, now - first_joined if first_joined is not None else 0.0)
            self._timeline.quorum_issued(decision.quorum, now)
            self._decisions.restart(self._state.evaluate(now), now)
        self._feed_timeline(now)

    def _feed_timeline(self, now: float) -> None:
        """What the rules decided, and who is left out as a straggler when that changed (O(1) otherwise)."""
        state, current = self._state, self._decisions.current
        self._timeline.observe(now, current.status, current.reason, state.num_heartbeating, state.num_participants)
        if (state.evictions, state.readmissions) != self._eviction_counts:
            self._eviction_counts = (state.evictions, state.readmissions)
            self._timeline.left_out(self.stragglers().evicted, now)

    def _publish(self, quorum: IssuedQuorum, formation: float) -> None:
        previous = self._previous_ids
        changed = quorum.quorum_id != self._published_id
        if changed:
            self._ids.save(quorum.quorum_id)  # before anyone can act on the new id
            self._counts["id_changes"] += 1
        self._published_id = quorum.quorum_id
        created = self._wall_clock()
        self._quorum_created_wall = created
        self._last_formation = formation
        for observe in self._formation_observers:
            observe(formation)
        message = pb.Quorum(quorum_id=quorum.quorum_id)
        for member in quorum.members:
            participant = message.participants.add()
            participant.CopyFrom(member.payload)
            participant.step = member.step  # the lineage fence may give a member a lower step, so it heals
        for replica_id, reported, given in quorum.redone_by_others:
            logger.warning("quorum %d: %s reports step %d, but it was declared gone at step %d and the others redid "
                           "that step without it: it is given step %d and heals from them (its step %d is from a "
                           "lineage the job did not keep)", quorum.quorum_id, replica_id, reported, given, given,
                           reported)
        message.created.FromNanoseconds(int(created * 1e9))
        response = pb.LighthouseQuorumResponse(quorum=message).SerializeToString()
        for replica_id in quorum.replica_ids:
            for future in self._waiters.get(replica_id, ()):
                if not future.done():
                    future.set_result(response)
        ids = self._previous_ids = set(quorum.replica_ids)
        self._decisions.issued(quorum, previous, changed, formation)
        for replica_id in previous - ids:
            self._prune_known(replica_id)
        self._ids.quorum_reached([m.step for m in quorum.members], self._clock(), quorum.replica_ids)

    def _on_epoch(self, epoch: Epoch, fenced: tuple[Member, ...], now: float) -> None:
        self._timeline.epoch_started(epoch)
        # A restart must not wait for the old step's holders again.
        self._ids.reset_max_step(epoch.to_step, now, self._state.epochs.holders)
        logger.warning(
            "a new epoch of the job starts (number %d since this lighthouse started): the highest step a quorum "
            "reached goes from %d down to %d because %s; "
            "the next quorum gets a new id, and replicas above step %d that were in no quorum since are refused",
            epoch.number, epoch.from_step, epoch.to_step, epoch.reason, epoch.to_step,
        )
        for member in fenced:
            self._refuse_stale(StaleReplica(member.replica_id, member.step, epoch.to_step, epoch))

    def _refuse_stale(self, error: StaleReplica) -> None:
        """Count and log a replica from before the epoch; its waiting Quorum calls fail with ``error``."""
        self._counts["fenced_requests"] += 1
        logger.warning("refused replica %s at step %d: %s", error.replica_id, error.step, error)
        self._timeline.gone(error.replica_id, "refused as from before the current epoch", self._clock())
        self._fail_waiters(error.replica_id, error)
        self._prune_known(error.replica_id)

    def request_epoch(self, requested_by: str) -> Epoch | None:
        """An operator's action: start a new epoch now if the stale-quorum guard holds participants back.

        Returns the epoch started, or None when nothing was blocked (then nothing is kept for later).
        """
        self._decide()
        if self._decisions.current.status is not Status.BEHIND_COMMITTED:
            return None
        before = self._state.epoch
        self._state.request_epoch(f"an operator asked for it ({requested_by})")
        self._decide()
        return None if self._state.epoch is before else self._state.epoch

    def _on_expired(self, expired: list[str]) -> None:
        self._counts["expired_replicas"] += len(expired)
        in_quorum = [rid for rid in expired if rid in self._previous_ids]
        if in_quorum:
            logger.info(
                "heartbeat expired for %d replicas of quorum %d: %s",
                len(in_quorum), self._state.quorum_id, preview(in_quorum),
            )
        for replica_id in expired:
            self._notify_gone(replica_id, f"no heartbeat for {self.config.heartbeat_timeout:.1f}s")
            self._prune_known(replica_id)

    def _prune_known(self, replica_id: str) -> None:
        if (
            replica_id not in self._previous_ids
            and replica_id not in self._waiters
            and not self._state.is_heartbeating(replica_id)
        ):
            self._known.pop(replica_id, None)

    # ------------------------------------------------------------ views

    def statistics(self) -> LighthouseStatistics:
        now = self._clock()
        prev = self._state.previous_quorum
        decision = self._decisions.current
        return LighthouseStatistics(
            quorum_id=self._state.quorum_id,
            quorum_members=len(prev.members) if prev else 0,
            quorum_age=now - prev.issued_at if prev else None,
            participants=self._state.num_participants,
            healthy_participants=self._state.num_healthy_participants,
            heartbeating_replicas=self._state.num_heartbeating,
            status=decision.status.value,
            reason=decision.reason,
            quorums_issued=self._state.quorums_issued,
            quorum_id_changes=self._counts["id_changes"],
            quorum_requests=self._counts["quorum_requests"],
            heartbeats=self._counts["heartbeats"],
            invalid_requests=self._checks.invalid,
            invalid_reasons=dict(self._checks.refused),
            lease_refusals=self._checks.refused["lease_held"],
            state_write_failures=self._ids.write_failures,
            expired_replicas=self._counts["expired_replicas"],
            leases_held=len(self._leases),
            leases_ended=self._leases.broken,
            last_formation_seconds=self._last_formation,
            uptime=now - self._started_at,
            max_step=self._state.max_step,
            epochs=0 if self._state.epoch is None else self._state.epoch.number,
            fenced_requests=self._counts["fenced_requests"],
        )

    def stragglers(self) -> StragglerStatistics:
        """Every group's compute-time scores, flags and evictions (read by /api/status and /metrics)."""
        return self._state.straggler_statistics()

    def add_formation_observer(self, observe: Callable[[float], None]) -> None:
        """Call ``observe(seconds)`` with the formation time of each issued quorum."""
        self._formation_observers.append(observe)

    def snapshot(self) -> dict:
        """Everything the dashboard shows, as plain JSON-able data."""
        from lighthouse.status import build_status  # keeps the JSON shape in one place

        return build_status(self, self._state, self._known, self._clock(), self._quorum_created_wall, self._timeline)

    def history(self, samples_after: int = -1, markers_after: int = -1, seconds: float | None = None) -> dict:
        """The job's history (lighthouse.history) newer than the cursors, within ``seconds`` if given."""
        return self._timeline.history.to_json(self._clock(), self._wall_clock(), samples_after=samples_after,
                                              markers_after=markers_after, seconds=seconds)

    def timeline_statistics(self) -> TimelineStatistics:
        """Stalls, heals, groups gone and back, and what the job is doing now (read by /metrics)."""
        return self._timeline.statistics(self._clock())

    def known_member(self, replica_id: str) -> pb.QuorumMember | None:
        return self._known.get(replica_id)


class _Shutdown(Exception):
    """Resolves waiting Quorum calls when the server stops."""
