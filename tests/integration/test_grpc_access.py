"""The job token and protected mode on every gRPC server: the attacks of issue 16, refused, with nothing changed.

The lighthouse runs on both engines (``native``, ``grpcio``); the ManagerServer
always serves on the native one, so its tests run there. An attacker is any
caller without the job token (or with a wrong one); in protected mode (no
token) it is any caller that is not loopback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import sys

import aiohttp
import grpc
import pytest

from tests.conftest import WAIT, non_loopback_address, running_lighthouse, wait_until
from tests.integration.helpers import manager_server
from torchft_lite.errors import ManagerError, QuorumError
from torchft_lite.group_server.client import ManagerStub
from torchft_lite.group_server.server import EXIT_CODE_KILLED, ManagerServer, ManagerServerConfig
from torchft_lite.rpc.access import TOKEN_ENV, Access
from torchft_lite.rpc.lighthouse_client import LighthouseClient
from torchft_lite.rpc.protocol import torchft_pb2 as pb

pytestmark = pytest.mark.integration

TOKEN = secrets.token_urlsafe(24)
ENGINES = pytest.mark.parametrize("grpc_engine", ["native", "grpcio"])
LIGHTHOUSE = "/torchft.LighthouseService/"
MANAGER = "/torchft.ManagerService/"
WRONG = (("authorization", "Bearer not-the-job-token"),)
RIGHT = (("authorization", f"Bearer {TOKEN}"),)
HUGE_STEP = 2**63 - 1


def forged_quorum(replica_id: str = "forger") -> bytes:
    member = pb.QuorumMember(replica_id=replica_id, address="http://attacker:1", store_address="attacker:2",
                             step=HUGE_STEP, world_size=1)
    return pb.LighthouseQuorumRequest(requester=member).SerializeToString()


async def raw_call(port: int, path: str, request: bytes, metadata, *, host: str = "127.0.0.1",
                   stream: bool = False) -> tuple[grpc.StatusCode, str]:
    """One call as an attacker would make it (bytes in, any metadata); its status code and details."""
    async with grpc.aio.insecure_channel(f"{host}:{port}") as channel:
        try:
            if stream:
                call = channel.unary_stream(path)(request, metadata=metadata, timeout=WAIT)
                await call.read()
                call.cancel()
            else:
                await channel.unary_unary(path)(request, metadata=metadata, timeout=WAIT)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.fixture
def no_token_in_logs(caplog):
    """Every log line of the test, DEBUG included, is checked for the token afterwards."""
    caplog.set_level(logging.DEBUG)
    yield
    assert TOKEN not in caplog.text, "the job token was logged"


# ------------------------------------------------------------------ the lighthouse, with a token


@ENGINES
def test_forged_quorum_and_heartbeat_without_the_token_change_nothing(grpc_engine, no_token_in_logs):
    async def scenario():
        async with running_lighthouse(access=Access(TOKEN), grpc_engine=grpc_engine) as lighthouse:
            before = lighthouse.statistics()
            attacks = [("Quorum", forged_quorum(), False),
                       ("Heartbeat", pb.LighthouseHeartbeatRequest(replica_id="forger").SerializeToString(), False),
                       ("GetConfig", b"", False), ("SubscribeFailures", b"", True),
                       ("Lease", pb.LeaseRequest(replica_id="forger").SerializeToString(), True)]
            for metadata in (None, WRONG, (("authorization", TOKEN),)):  # none, wrong, not a Bearer one
                for method, request, stream in attacks:
                    code, details = await raw_call(lighthouse.grpc_port, LIGHTHOUSE + method, request, metadata,
                                                   stream=stream)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (method, metadata, details)
                    assert TOKEN_ENV in details
            after = lighthouse.statistics()
            assert (after.quorum_requests, after.heartbeats, after.participants, after.heartbeating_replicas,
                    after.leases_held, after.invalid_requests) == (0, 0, 0, 0, 0, 0)
            assert after.max_step == before.max_step and after.quorum_id == before.quorum_id
            assert "forger" not in json.dumps(lighthouse.snapshot())
            assert lighthouse.refusals.counts == {"unauthenticated": 15}

            # The job's own processes, with the token, are served as before.
            async with LighthouseClient(f"127.0.0.1:{lighthouse.grpc_port}", access=Access(TOKEN)) as member:
                await member.heartbeat("honest", timeout=WAIT)
                quorum = await member.quorum("honest", step=3, timeout=WAIT)
                assert [m.replica_id for m in quorum.participants] == ["honest"]
                assert (await member.get_config(timeout=WAIT))["implementation"] == "torchft_lite"
            assert lighthouse.statistics().quorum_requests == 1
            assert lighthouse.refusals.counts == {"unauthenticated": 15}

    asyncio.run(scenario())


@ENGINES
def test_a_lease_takeover_without_the_token_is_refused(grpc_engine, no_token_in_logs):
    async def scenario():
        async with running_lighthouse(access=Access(TOKEN), grpc_engine=grpc_engine, heartbeat_timeout=120.0) \
                as lighthouse:
            target = f"127.0.0.1:{lighthouse.grpc_port}"
            async with LighthouseClient(target, access=Access(TOKEN)) as holder:
                lease = holder.lease("a")
                granted = await asyncio.wait_for(lease.read(), WAIT)
                assert granted.kind == pb.LeaseEvent.GRANTED
                await holder.quorum("a", step=1, timeout=WAIT)  # a member of the quorum, whose loss is broadcast
                for thief_access in (Access(), Access("a-guessed-token")):
                    async with LighthouseClient(target, access=thief_access) as thief:
                        with pytest.raises(grpc.aio.AioRpcError) as caught:
                            await asyncio.wait_for(thief.lease("a").read(), WAIT)
                        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                stats = lighthouse.statistics()
                assert stats.leases_held == 1 and stats.leases_ended == 0
                assert lighthouse.refusals.counts == {"unauthenticated": 2}
                # the holder's lease is untouched: it still forms quorums as the same member
                again = await holder.quorum("a", step=2, timeout=WAIT)
                assert [m.replica_id for m in again.participants] == ["a"]
                lease.cancel()

    asyncio.run(scenario())


def test_refusals_are_in_the_lighthouse_metrics():
    async def scenario():
        async with running_lighthouse(access=Access(TOKEN)) as lighthouse:
            code, _ = await raw_call(lighthouse.grpc_port, LIGHTHOUSE + "Heartbeat", b"", WRONG)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            url = f"http://127.0.0.1:{lighthouse.http_port}/metrics"
            async with aiohttp.ClientSession(headers=Access(TOKEN).headers()) as session, session.get(url) as answer:
                assert answer.status == 200
                text = await answer.text()
            assert 'lighthouse_unauthorized_requests_total{interface="grpc",kind="unauthenticated"} 1.0' in text
            assert 'lighthouse_unauthorized_requests_total{interface="grpc",kind="forbidden"} 0.0' in text

    asyncio.run(scenario())


# ------------------------------------------------------------------ the ManagerServer, with a token


def test_kill_and_forged_calls_to_a_manager_server_without_the_token_are_refused(no_token_in_logs):
    async def scenario():
        async with running_lighthouse(access=Access(TOKEN)) as lighthouse, \
                manager_server(lighthouse.address(), Access(TOKEN)) as server:
            # Its own lighthouse calls carry the token: the lease is granted, nothing refused there.
            await wait_until(lambda: server.lease_held, "the ManagerServer's lease on the lighthouse")
            assert lighthouse.refusals.counts == {}
            for access in (Access(), Access("not-the-job-token")):
                attacker = ManagerStub(server.address(), access=access)
                try:
                    with pytest.raises(ManagerError, match="Kill failed: UNAUTHENTICATED"):
                        await attacker.kill("pwned", timeout=WAIT)
                    with pytest.raises(ManagerError, match="UNAUTHENTICATED"):
                        await attacker.should_commit(group_rank=0, step=7, should_commit=False, timeout=WAIT)
                    with pytest.raises(ManagerError, match="UNAUTHENTICATED"):
                        await attacker.checkpoint_metadata(0, timeout=WAIT)
                    with pytest.raises(QuorumError, match="UNAUTHENTICATED"):
                        await attacker.quorum(group_rank=0, step=HUGE_STEP, checkpoint_metadata="http://attacker/",
                                              shrink_only=False, init_sync=False, commit_failures=0, timeout=WAIT)
                finally:
                    await attacker.close()
            stats = server.statistics()
            assert stats.refused == {"unauthenticated": 8} and stats.quorums == 0

            member = ManagerStub(server.address(), access=Access(TOKEN))
            try:
                # No forged vote is waiting: the group's own vote, after its quorum, decides alone.
                await member.quorum(group_rank=0, step=7, checkpoint_metadata="", shrink_only=False,
                                    init_sync=False, commit_failures=0, timeout=WAIT)
                assert await member.should_commit(group_rank=0, step=7, should_commit=True, timeout=WAIT)
                await member.kill("by the job's operator", timeout=WAIT)
            finally:
                await member.close()
            # A refused Kill would have been scheduled before this one.
            await wait_until(lambda: server.kills, "the authorized Kill")
            assert server.kills == ["by the job's operator"]

    asyncio.run(scenario())


VICTIM = """
import asyncio, sys
from torchft_lite.rpc.access import Access
from torchft_lite.group_server.server import ManagerServer, ManagerServerConfig

async def main():
    server = ManagerServer(ManagerServerConfig(replica_id="victim", lighthouse_addr=sys.argv[1], hostname="127.0.0.1",
                                               store_address="store:1", world_size=1, bind="127.0.0.1:0"))
    await server.start()
    print(server.access.mode, server.address(), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_manager_process_lives_on_after_unauthenticated_kills(no_token_in_logs):
    """The real process, token from its environment, default Kill handler (``os._exit``)."""
    async def scenario():
        async with running_lighthouse(access=Access(TOKEN)) as lighthouse:
            env = {**os.environ, TOKEN_ENV: TOKEN}
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", VICTIM, lighthouse.address(), env=env,
                                                        stdout=asyncio.subprocess.PIPE)
            try:
                line = (await asyncio.wait_for(proc.stdout.readline(), WAIT)).decode().split()
                assert line and line[0] == "token", f"the ManagerServer did not start: {line}"
                address = line[1]
                for access in (Access(), Access("not-the-job-token")):
                    attacker = ManagerStub(address, access=access)
                    try:
                        with pytest.raises(ManagerError, match="UNAUTHENTICATED"):
                            await attacker.kill("pwned", timeout=WAIT)
                    finally:
                        await attacker.close()
                member = ManagerStub(address, access=Access(TOKEN))
                try:
                    # Still serving after the refused Kills (it answers the job's own calls) ...
                    with pytest.raises(ManagerError, match="NOT_FOUND"):
                        await member.checkpoint_metadata(0, timeout=WAIT)
                    assert proc.returncode is None
                    # ... until the job's own Kill.
                    await member.kill("by the job's operator", timeout=WAIT)
                finally:
                    await member.close()
                assert await asyncio.wait_for(proc.wait(), WAIT) == EXIT_CODE_KILLED
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    asyncio.run(scenario())


def test_the_dashboard_kill_carries_the_job_token():
    async def scenario():
        # The admin token is the job token here, so one header passes the HTTP side's checks too.
        async with running_lighthouse(access=Access(TOKEN), admin_token=TOKEN) as lighthouse, \
                manager_server(lighthouse.address(), Access(TOKEN)) as server:
            member = ManagerStub(server.address(), access=Access(TOKEN))
            try:  # a quorum makes the lighthouse know the ManagerServer's address
                await member.quorum(group_rank=0, step=1, checkpoint_metadata="", shrink_only=False,
                                    init_sync=False, commit_failures=0, timeout=WAIT)
            finally:
                await member.close()
            url = f"http://127.0.0.1:{lighthouse.http_port}/api/replicas/victim/kill"
            async with aiohttp.ClientSession(headers=Access(TOKEN).headers()) as session, \
                    session.post(url, json={"msg": "from the dashboard"}) as answer:
                assert answer.status == 200, await answer.text()
            await wait_until(lambda: server.kills, "the dashboard's Kill")
            assert server.kills == ["from the dashboard"] and server.statistics().refused == {}

    asyncio.run(scenario())


# ------------------------------------------------------------------ no token: protected mode


@ENGINES
def test_without_a_token_a_peer_that_is_not_loopback_is_forbidden(grpc_engine):
    host = non_loopback_address()

    async def scenario():
        async with running_lighthouse(bind="0.0.0.0:0", grpc_engine=grpc_engine) as lighthouse:
            port = lighthouse.grpc_port
            code, details = await raw_call(port, LIGHTHOUSE + "Quorum", forged_quorum(), None, host=host)
            assert code == grpc.StatusCode.PERMISSION_DENIED and TOKEN_ENV in details and host in details
            code, _ = await raw_call(port, LIGHTHOUSE + "Lease", pb.LeaseRequest(replica_id="x").SerializeToString(),
                                     RIGHT, host=host, stream=True)  # a token the lighthouse has not got: no help
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert lighthouse.statistics().quorum_requests == 0
            assert lighthouse.refusals.counts == {"forbidden": 2}
            code, _ = await raw_call(port, LIGHTHOUSE + "GetConfig", b"", None)  # loopback is served
            assert code == grpc.StatusCode.OK

    asyncio.run(scenario())


@ENGINES
def test_insecure_serves_a_peer_that_is_not_loopback(grpc_engine):
    host = non_loopback_address()

    async def scenario():
        async with running_lighthouse(bind="0.0.0.0:0", grpc_engine=grpc_engine,
                                      access=Access(insecure=True)) as lighthouse:
            code, details = await raw_call(lighthouse.grpc_port, LIGHTHOUSE + "GetConfig", b"", None, host=host)
            assert code == grpc.StatusCode.OK, details
            assert lighthouse.refusals.counts == {}

    asyncio.run(scenario())


def test_without_a_token_a_manager_server_refuses_a_kill_from_a_peer_that_is_not_loopback():
    host = non_loopback_address()

    async def scenario():
        async with running_lighthouse() as lighthouse, \
                manager_server(lighthouse.address(), Access(), bind="0.0.0.0:0", hostname=host) as server:
            attacker = ManagerStub(server.address(), access=Access())
            try:
                with pytest.raises(ManagerError, match=f"PERMISSION_DENIED: refused {host}.*{TOKEN_ENV}"):
                    await attacker.kill("pwned", timeout=WAIT)
            finally:
                await attacker.close()
            assert server.statistics().refused == {"forbidden": 1}
            local = ManagerStub(server.address().replace(host, "127.0.0.1"), access=Access())
            try:
                await local.kill("from this host", timeout=WAIT)
            finally:
                await local.close()
            await wait_until(lambda: server.kills, "the loopback Kill")
            assert server.kills == ["from this host"]

    asyncio.run(scenario())


def test_a_bad_token_variable_is_a_clear_error_at_construction(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "two words")
    config = ManagerServerConfig(replica_id="x", lighthouse_addr="http://127.0.0.1:1", hostname="127.0.0.1",
                                 store_address="s:1", world_size=1)
    with pytest.raises(ValueError, match="without whitespace"):
        ManagerServer(config)
    with pytest.raises(ValueError, match="without whitespace"):
        ManagerStub("127.0.0.1:1")


# ------------------------------------------------------------------ training end to end


@pytest.mark.slow
def test_training_with_a_job_token_commits_steps_and_heals(tmp_path, monkeypatch):
    """Real groups (examples/train_ddp.py) and a real lighthouse, all given the token by the environment."""
    from tests.integration.helpers import assert_identical_per_step, cluster, read_reports, steps_of, wait_for

    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # cluster.local passes it on as it is, instead of making one
    with cluster(tmp_path, min_replicas=1, join_timeout=1.0, heartbeat_timeout=1.0) as (_, add, report):
        survivor = add(0, 2, steps=400, sleep=0.05)
        victim = add(1, 2, steps=400, sleep=0.05)
        wait_for(lambda: min(len(steps_of(read_reports(report), g)) for g in (0, 1)) >= 3,
                 "both groups' 3rd committed step", groups=[survivor, victim])
        victim.kill(signal.SIGKILL)
        victim.start()
        restarted_before = len(steps_of(read_reports(report), 1))
        wait_for(lambda: len(steps_of(read_reports(report), 1)) >= restarted_before + 3,
                 "the restarted group to heal and commit 3 steps", groups=[survivor, victim])
        rows = read_reports(report)
        assert steps_of(rows, 1)[restarted_before] > 1, "the restarted group started over instead of healing"
        assert assert_identical_per_step(rows) >= 3
    lighthouse_log = (tmp_path / "lighthouse.log").read_text()
    assert "access: job token required on every call" in lighthouse_log
    for log in tmp_path.glob("*.log"):
        assert TOKEN not in log.read_text(errors="replace"), f"{log.name} holds the job token"
