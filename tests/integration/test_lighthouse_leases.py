"""Connection leases: a replica whose lease stream breaks is gone at once, and the others hear of it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from lighthouse.client import LighthouseClient
from lighthouse.protocol import torchft_pb2 as pb
from tests.conftest import running_lighthouse, wait_until

pytestmark = pytest.mark.integration

# Long enough that passing can't be explained by heartbeat expiry or the join timeout.
SLOW = dict(heartbeat_timeout=120.0, join_timeout=120.0)


async def first_event(call) -> pb.LeaseEvent:
    return await asyncio.wait_for(call.read(), 30)


@contextlib.asynccontextmanager
async def clients(server, count: int = 2):
    """``count`` clients, each with its own connection (a replica process each)."""
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


def test_a_replaced_lease_ending_declares_nothing():
    """Only the current holder's stream counts: a reconnect's old stream can't kill the replica."""
    async def scenario():
        async with running_lighthouse(min_replicas=1, **SLOW) as server, clients(server) as (old, new):
            await first_event(old.lease("a"))
            await first_event(new.lease("a"))
            await old.close()
            await asyncio.sleep(0.5)
            assert server._state.is_heartbeating("a")
            assert server.statistics().leases_held == 1 and server.statistics().leases_ended == 0

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
