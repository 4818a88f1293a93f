"""Connection leases: a replica whose lease stream breaks is gone at once, and the others hear of it."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from lighthouse.server import LighthouseServer
from tests.conftest import FrozenClock, lighthouse_config, running_lighthouse, wait_until
from torchft_lite.rpc.lighthouse_client import LighthouseClient
from torchft_lite.rpc.protocol import torchft_pb2 as pb

pytestmark = pytest.mark.integration

# Long enough that passing can't be explained by heartbeat expiry or the join timeout.
SLOW = dict(heartbeat_timeout=120.0, join_timeout=120.0)


class Connection:
    """A client on a TCP connection of its own, as another process has: gRPC shares one connection between
    the channels of a process (``clients`` below) unless told not to."""

    def __init__(self, server: LighthouseServer) -> None:
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                                  options=[("grpc.use_local_subchannel_pool", 1)])

    def lease(self, replica_id: str):
        call = self._channel.unary_stream("/torchft.LighthouseService/Lease",
                                          request_serializer=pb.LeaseRequest.SerializeToString,
                                          response_deserializer=pb.LeaseEvent.FromString)
        return call(pb.LeaseRequest(replica_id=replica_id), timeout=60)

    async def heartbeat(self, replica_id: str) -> None:
        call = self._channel.unary_unary("/torchft.LighthouseService/Heartbeat",
                                         request_serializer=pb.LighthouseHeartbeatRequest.SerializeToString,
                                         response_deserializer=pb.LighthouseHeartbeatResponse.FromString)
        await call(pb.LighthouseHeartbeatRequest(replica_id=replica_id), timeout=30)

    async def quorum(self, replica_id: str) -> pb.Quorum:
        call = self._channel.unary_unary("/torchft.LighthouseService/Quorum",
                                         request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
                                         response_deserializer=pb.LighthouseQuorumResponse.FromString)
        request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id=replica_id))
        return (await call(request, timeout=60)).quorum

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "Connection":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


async def first_event(call) -> pb.LeaseEvent:
    return await asyncio.wait_for(call.read(), 30)


@contextlib.asynccontextmanager
async def clients(server, count: int = 2):
    """``count`` clients, each with its own channel (one process's channels may share a connection: see
    :class:`Connection`)."""
    opened = [LighthouseClient(f"127.0.0.1:{server.grpc_port}") for _ in range(count)]
    try:
        yield opened
    finally:
        for client in opened:
            await client.close()


@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_a_broken_lease_drops_the_member_at_once_and_tells_the_others(engine):
    async def scenario():
        async with running_lighthouse(min_replicas=1, grpc_engine=engine, **SLOW) as server, \
                clients(server) as (a, b):
            lease_a, lease_b = a.lease("a"), b.lease("b")
            assert (await first_event(lease_a)).kind == pb.LeaseEvent.GRANTED
            assert (await first_event(lease_b)).kind == pb.LeaseEvent.GRANTED
            first = await asyncio.gather(a.quorum("a", timeout=30), b.quorum("b", timeout=30))
            assert [m.replica_id for m in first[0].participants] == ["a", "b"]

            await a.close()  # a's process "dies": its connection, and with it its lease, goes away
            event = await first_event(lease_b)
            assert event.kind == pb.LeaseEvent.MEMBER_GONE and event.replica_id == "a"
            assert event.quorum_id == first[0].quorum_id and "lease ended" in event.reason
            # b alone forms the next quorum now, though a's heartbeat would be fresh for 2 more minutes
            second = await b.quorum("b", timeout=30)
            assert [m.replica_id for m in second.participants] == ["b"]
            assert second.quorum_id > first[0].quorum_id
            stats = server.statistics()
            assert stats.leases_held == 1 and stats.leases_ended == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_another_connection_can_neither_take_over_a_held_lease_nor_declare_its_replica_gone(engine):
    """A lease belongs to the connection that opened it (issue 16): a thief claiming the replica id is refused,
    and its stream ending declares nothing."""
    async def scenario():
        async with running_lighthouse(min_replicas=1, grpc_engine=engine, **SLOW) as server, \
                clients(server) as (a, b), Connection(server) as thief:
            lease_a, lease_b = a.lease("a"), b.lease("b")
            assert (await first_event(lease_a)).kind == pb.LeaseEvent.GRANTED
            assert (await first_event(lease_b)).kind == pb.LeaseEvent.GRANTED
            await asyncio.gather(a.quorum("a", timeout=30), b.quorum("b", timeout=30))  # a's going would be news

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await first_event(thief.lease("a"))
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "already holds a lease on another connection" in info.value.details()
            await thief.close()
            stats = server.statistics()
            assert (stats.leases_held, stats.leases_ended, stats.lease_refusals) == (2, 0, 1)
            assert server._state.is_heartbeating("a") and server._leases._holders["b"].events.empty()

            await a.close()  # a's own connection is the one that ends its lease
            event = await first_event(lease_b)
            assert event.kind == pb.LeaseEvent.MEMBER_GONE and event.replica_id == "a"
            assert server.statistics().leases_ended == 1

    asyncio.run(scenario())


def test_a_reconnecting_process_gets_its_lease_once_the_old_connection_closed():
    async def scenario():
        async with running_lighthouse(min_replicas=1, **SLOW) as server, Connection(server) as old, \
                Connection(server) as new:
            await first_event(old.lease("a"))
            await old.close()
            await wait_until(lambda: server.statistics().leases_ended == 1, "the old connection's lease to end")
            assert (await first_event(new.lease("a"))).kind == pb.LeaseEvent.GRANTED
            assert server.statistics().leases_held == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_a_quorum_call_on_a_new_connection_outlives_the_end_of_the_old_connections_lease(engine):
    """After a partition, a process's Quorum call on its new connection can reach the lighthouse before its old
    connection's close ends its lease. The end tells the others it left, but the waiting call joins again: a
    chaos run's group, forgotten so, sat out its whole 16 s call in no quorum."""
    async def scenario():
        async with running_lighthouse(min_replicas=2, grpc_engine=engine, **SLOW) as server, \
                Connection(server) as old, Connection(server) as new, clients(server, 1) as (b,):
            lease_a, lease_b = old.lease("a"), b.lease("b")
            assert (await first_event(lease_a)).kind == pb.LeaseEvent.GRANTED
            assert (await first_event(lease_b)).kind == pb.LeaseEvent.GRANTED
            first = await asyncio.gather(old.quorum("a"), b.quorum("b", timeout=30))
            assert [m.replica_id for m in first[0].participants] == ["a", "b"]

            waiting = asyncio.ensure_future(new.quorum("a"))  # a reconnected: its next call, on the new connection
            await wait_until(lambda: server.statistics().participants == 1, "a's call to arrive")
            await old.close()  # ... and then the old connection's close ends its lease
            event = await first_event(lease_b)
            assert event.kind == pb.LeaseEvent.MEMBER_GONE and event.replica_id == "a"
            second = await asyncio.wait_for(asyncio.gather(waiting, b.quorum("b", timeout=30)), 20)
            assert [m.replica_id for m in second[0].participants] == ["a", "b"]
            assert second[0].quorum_id == second[1].quorum_id

    asyncio.run(scenario())


def test_a_holder_silent_for_the_heartbeat_timeout_is_replaced_and_its_old_stream_then_declares_nothing():
    """A connection that died without a close (the lighthouse never saw it end) can't keep a reconnecting
    process out for longer than heartbeat_timeout; heartbeats from another connection don't keep it either."""
    async def scenario():
        clock = FrozenClock()
        server = LighthouseServer(lighthouse_config(min_replicas=1, heartbeat_timeout=5.0, join_timeout=120.0),
                                  clock=clock)
        await server.start()
        try:
            async with Connection(server) as old, Connection(server) as new:
                await first_event(old.lease("a"))
                held = server._leases._holders["a"]
                clock.now += 4.0
                await new.heartbeat("a")  # keeps "a" healthy, but not the old connection's lease
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await first_event(new.lease("a"))
                assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS

                clock.now += 1.5  # 5.5 s since the old connection last called for "a"
                await new.heartbeat("a")
                assert (await first_event(new.lease("a"))).kind == pb.LeaseEvent.GRANTED
                await old.close()
                await wait_until(lambda: held.ended, "the replaced stream to end")
                stats = server.statistics()
                assert (stats.leases_held, stats.leases_ended) == (1, 0)
                assert server._state.is_heartbeating("a")
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_a_dead_member_stops_a_waiting_quorum_from_waiting_for_it():
    async def scenario():
        async with running_lighthouse(min_replicas=1, **SLOW) as server, clients(server) as (a, b):
            await first_event(a.lease("a"))
            await first_event(b.lease("b"))
            await asyncio.gather(a.quorum("a", timeout=30), b.quorum("b", timeout=30))
            waiting = asyncio.ensure_future(b.quorum("b", timeout=60))
            await wait_until(lambda: server.statistics().participants == 1, "b waiting for a")
            await asyncio.sleep(0.3)
            assert not waiting.done()  # a is healthy: b waits for it (join timeout 2 minutes)
            await a.close()
            quorum = await asyncio.wait_for(waiting, 30)
            assert [m.replica_id for m in quorum.participants] == ["b"]

    asyncio.run(scenario())
