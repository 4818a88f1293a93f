"""ManagerServer against a real lighthouse: gathering ranks, votes, metadata, failures."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.conftest import running_lighthouse, wait_until
from tests.integration.helpers import manager_server
from torchft_lite.errors import ManagerError, QuorumError
from torchft_lite.group_server.client import ManagerStub
from torchft_lite.rpc.lighthouse_client import LighthouseClient, LighthouseTimeout

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def server_and_client(lighthouse_addr: str, replica_id: str, world_size: int = 1, lighthouse=None, **settings):
    """``manager_server`` as ``replica_id`` (store "store-<replica_id>:1234", a 30 s quorum timeout), and a
    ManagerStub of it."""
    async with manager_server(lighthouse_addr, replica_id=replica_id, store_address=f"store-{replica_id}:1234",
                              world_size=world_size, quorum_timeout=30.0, lighthouse=lighthouse, **settings) as server:
        client = ManagerStub(server.address())
        try:
            yield server, client
        finally:
            await client.close()


async def quorum(client: ManagerStub, rank: int, step: int, timeout: float = 30.0, **kw):
    return await client.quorum(group_rank=rank, step=step, checkpoint_metadata=f"meta-{rank}", shrink_only=False,
                               init_sync=kw.pop("init_sync", True), commit_failures=kw.pop("commit_failures", 0),
                               timeout=timeout)


def test_group_of_two_ranks_gets_one_quorum_and_per_rank_results():
    async def scenario():
        async with running_lighthouse(min_replicas=2) as lh:
            async with server_and_client(lh.address(), "a", world_size=2) as (a, ca), \
                       server_and_client(lh.address(), "b", world_size=2) as (b, cb):
                results = await asyncio.gather(
                    quorum(ca, 0, step=4), quorum(ca, 1, step=4), quorum(cb, 0, step=2), quorum(cb, 1, step=2)
                )
                a0, a1, b0, b1 = results
                assert len({r.quorum_id for r in results}) == 1
                assert [r.replica_rank for r in results] == [0, 0, 1, 1]
                assert a0.max_step == 4 and not a0.heal and list(a0.recover_dst_replica_ranks) == [1]
                assert b0.heal and b0.recover_src_replica_rank == 0 and b1.heal
                assert b0.recover_src_manager_address == a.address()
                assert a0.store_address == "store-a:1234" and b1.store_address == "store-a:1234"
                assert list(a1.replica_ids) == ["a", "b"]
                assert a.statistics().quorums == 1  # one lighthouse call for the two ranks
                # a healing peer asks the source for its metadata, per group rank
                assert await cb.checkpoint_metadata(1, timeout=10) == "meta-1"
                assert await ca.checkpoint_metadata(1, timeout=10) == "meta-1"

    asyncio.run(scenario())


def test_ranks_reporting_different_steps_get_an_error_naming_them():
    async def scenario():
        async with running_lighthouse() as lh, server_and_client(lh.address(), "a", world_size=2) as (_, client):
            results = await asyncio.gather(quorum(client, 0, 3), quorum(client, 1, 5), return_exceptions=True)
            for result in results:
                assert isinstance(result, QuorumError)
                assert "rank 0 at step 3, rank 1 at step 5" in str(result)

    asyncio.run(scenario())


def test_should_commit_is_the_and_of_the_group_votes():
    async def scenario():
        async with running_lighthouse() as lh, server_and_client(lh.address(), "a", world_size=2) as (_, client):
            await asyncio.gather(quorum(client, 0, 1), quorum(client, 1, 1))
            votes = await asyncio.gather(client.should_commit(group_rank=0, step=1, should_commit=True, timeout=10),
                                         client.should_commit(group_rank=1, step=1, should_commit=True, timeout=10))
            assert votes == [True, True]
            votes = await asyncio.gather(client.should_commit(group_rank=0, step=2, should_commit=True, timeout=10),
                                         client.should_commit(group_rank=1, step=2, should_commit=False, timeout=10))
            assert votes == [False, False]

    asyncio.run(scenario())


def test_votes_for_different_steps_fail_both_ranks():
    async def scenario():
        async with running_lighthouse() as lh, server_and_client(lh.address(), "a", world_size=2) as (_, client):
            first = asyncio.ensure_future(client.should_commit(group_rank=0, step=1, should_commit=True, timeout=10))
            await asyncio.sleep(0.2)
            with pytest.raises(ManagerError, match="voted for step 2 while rank 0 voted for step 1"):
                await client.should_commit(group_rank=1, step=2, should_commit=True, timeout=10)
            with pytest.raises(ManagerError, match="FAILED_PRECONDITION"):
                await first

    asyncio.run(scenario())


def test_bad_input_is_rejected_with_a_clear_status():
    async def scenario():
        async with running_lighthouse() as lh, server_and_client(lh.address(), "a", world_size=2) as (_, client):
            with pytest.raises(QuorumError, match="INVALID_ARGUMENT.*group_rank=5 is outside"):
                await quorum(client, 5, 0, timeout=5)
            with pytest.raises(ManagerError, match="NOT_FOUND: rank not found"):
                await client.checkpoint_metadata(0, timeout=5)

    asyncio.run(scenario())


def test_unreachable_lighthouse_fails_every_waiting_rank_after_retries():
    async def scenario():
        # Nothing listens on this lighthouse address (port 1 on loopback is never ours).
        async with server_and_client("http://127.0.0.1:1", "a", world_size=2, quorum_retries=2) as (server, client):
            results = await asyncio.gather(quorum(client, 0, 0, timeout=3), quorum(client, 1, 0, timeout=3),
                                           return_exceptions=True)
            for result in results:
                assert isinstance(result, QuorumError), result
            assert server.statistics().quorum_failures == 1

    asyncio.run(scenario())


def test_lighthouse_restart_is_survived_with_quorum_retries():
    async def scenario():
        async with running_lighthouse() as lh:
            port = lh.grpc_port
            address = lh.address()
        # The lighthouse is gone now; the quorum call waits for it (retries) until one comes back.
        async with server_and_client(address, "a", world_size=1, quorum_retries=3) as (_, client):
            pending = asyncio.ensure_future(quorum(client, 0, 7, timeout=30))
            await asyncio.sleep(0.5)
            async with running_lighthouse(bind=f"127.0.0.1:{port}"):
                result = await pending
                assert result.max_step == 7 and result.replica_world_size == 1

    asyncio.run(scenario())


def test_heartbeats_reach_the_lighthouse_and_kill_calls_the_hook():
    async def scenario():
        async with running_lighthouse() as lh, server_and_client(lh.address(), "a") as (server, client):
            await wait_until(lambda: any(r["replica_id"] == "a" for r in lh.snapshot()["replicas"]), "the heartbeat")
            await client.kill("operator asked", timeout=5)
            await wait_until(lambda: server.kills == ["operator asked"], "the kill hook")

    asyncio.run(scenario())


class UnreliableLighthouseClient(LighthouseClient):
    """Heartbeats as a group cut off from the lighthouse sees them: while ``deaf``, each fails at once; while
    ``stall`` > 0, the next one reaches the lighthouse only after ``stall`` seconds and succeeds (what a group
    sees after it was hung, SIGSTOP, or silently cut off: no heartbeat fails)."""

    deaf = False
    stall = 0.0

    async def heartbeat(self, replica_id: str, *, timeout: float) -> float | None:
        if self.deaf:
            raise LighthouseTimeout(f"injected: Heartbeat for {replica_id} got no answer")
        stall, self.stall = self.stall, 0.0
        await asyncio.sleep(stall)
        return await super().heartbeat(replica_id, timeout=timeout)


async def voted(client: ManagerStub, number: int, between=None) -> list[bool]:
    """Both ranks of a two-rank group join step ``number``'s quorum, ``await between()`` runs, both vote yes:
    the group's decision, as each rank hears it."""
    await asyncio.gather(quorum(client, 0, number), quorum(client, 1, number))
    if between is not None:
        await between()
    return list(await asyncio.gather(
        *(client.should_commit(group_rank=r, step=number, should_commit=True, timeout=10) for r in (0, 1))))


def test_a_group_cut_off_from_the_lighthouse_past_its_lease_votes_the_step_down_a_blip_does_not():
    """Heartbeats unanswered between a step's quorum and its vote for longer than the lease (less its margin):
    the lighthouse may have declared the group gone and its peers redone the step, yet the group's collectives
    may still complete with their data. Every rank's vote for that step is no (behind, the group heals); the
    next step, in contact, commits. One unanswered heartbeat inside the lease is no reason: the lighthouse
    still counts the group, its peers commit the step with it, and so does it."""
    async def scenario():
        async with running_lighthouse(heartbeat_timeout=3.0) as lh:
            link = UnreliableLighthouseClient(lh.address(), connect_timeout=10)
            async with server_and_client(lh.address(), "a", world_size=2, lighthouse=link) as (server, client):
                def deaf_for(seconds: float):
                    async def cut_off() -> None:
                        failures = server.statistics().heartbeat_failures
                        link.deaf = True
                        await wait_until(lambda: server.statistics().heartbeat_failures > failures,
                                         "a heartbeat to go unanswered")
                        await asyncio.sleep(seconds)
                        link.deaf = False
                    return cut_off

                assert await voted(client, 1) == [True, True]
                assert await voted(client, 2, deaf_for(3.5)) == [False, False]
                assert await voted(client, 2) == [True, True]
                assert await voted(client, 3, deaf_for(0.01)) == [True, True]  # a blip: the lease still held

    asyncio.run(scenario())


def test_a_group_silent_past_the_heartbeat_timeout_votes_the_step_down_though_no_heartbeat_failed():
    """The fork the lease fence closes: the lighthouse heard nothing from the group for longer than its heartbeat
    timeout after the step's quorum (so it declared the group gone and its peers redid the step), yet every
    heartbeat the group sent succeeded. The step's vote is no; the next quorum has the group again and commits."""
    async def scenario():
        async with running_lighthouse(heartbeat_timeout=1.0) as lh:
            link = UnreliableLighthouseClient(lh.address(), connect_timeout=10)
            async with server_and_client(lh.address(), "a", world_size=2, lighthouse=link) as (server, client):
                async def silent() -> None:
                    link.stall = 2.5
                    await wait_until(lambda: lh.statistics().expired_replicas > 0,
                                     "the lighthouse to declare the silent group gone")
                    await wait_until(lambda: link.stall == 0.0, "the stalled heartbeat to go out")

                assert await voted(client, 1) == [True, True]
                assert await voted(client, 2, silent) == [False, False]
                assert server.statistics().heartbeat_failures == 0
                assert await voted(client, 2) == [True, True]

    asyncio.run(scenario())


def test_groups_of_different_sizes_are_refused_clearly():
    async def scenario():
        async with running_lighthouse(min_replicas=2) as lh:
            async with server_and_client(lh.address(), "a", world_size=1) as (_, ca), \
                       server_and_client(lh.address(), "b", world_size=2) as (_, cb):
                results = await asyncio.gather(quorum(ca, 0, 0), quorum(cb, 0, 0), quorum(cb, 1, 0),
                                               return_exceptions=True)
                for result in results:
                    assert isinstance(result, QuorumError), result
                    assert "must all have the same number of ranks" in str(result)

    asyncio.run(scenario())


@pytest.mark.parametrize("late_heal_sources", [2, 1])
def test_heal_sources_travel_in_member_data_and_stripe_only_when_all_advertise(late_heal_sources):
    async def scenario():
        async with running_lighthouse(min_replicas=3) as lh:
            async with server_and_client(lh.address(), "a", heal_sources=2) as (a, ca), \
                       server_and_client(lh.address(), "b", heal_sources=2) as (b, cb), \
                       server_and_client(lh.address(), "c", heal_sources=late_heal_sources) as (_, cc):
                ra, rb, rc = await asyncio.gather(quorum(ca, 0, step=5), quorum(cb, 0, step=5), quorum(cc, 0, step=1))
                assert rc.heal and rc.recover_src_replica_rank == 0 and rc.recover_src_manager_address == a.address()
                if late_heal_sources == 2:
                    assert list(rc.recover_src_replica_ranks) == [0, 1]
                    assert list(rc.recover_src_manager_addresses) == [a.address(), b.address()]
                    assert list(ra.recover_dst_replica_ranks) == [2] and list(rb.recover_dst_replica_ranks) == [2]
                else:  # one member advertises nothing: torchft's single source for everyone
                    assert list(rc.recover_src_replica_ranks) == [0]
                    assert list(ra.recover_dst_replica_ranks) == [2] and list(rb.recover_dst_replica_ranks) == []
                assert list(ra.recover_src_replica_ranks) == [] and not ra.HasField("recover_src_replica_rank")

    asyncio.run(scenario())
