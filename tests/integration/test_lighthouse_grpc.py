"""The lighthouse over real gRPC on port 0."""

import asyncio
import socket

import grpc
import pytest

from lighthouse.config import LighthouseConfig
from lighthouse.server import LighthouseServer
from tests.conftest import WAIT, running_lighthouse, wait_until
from tests.integration.helpers import client_for
from torchft_lite.rpc.lighthouse_client import LighthouseClient, LighthouseError, LighthouseTimeout
from torchft_lite.rpc.protocol import torchft_pb2 as pb

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_concurrent_joins_form_one_sorted_quorum(engine):
    async def scenario():
        async with running_lighthouse(min_replicas=3, grpc_engine=engine) as server, client_for(server) as c:
            quorums = await asyncio.gather(
                *(c.quorum(rid, timeout=WAIT, step=i, address=f"http://{rid}:1") for i, rid in enumerate("cab"))
            )
            assert {q.quorum_id for q in quorums} == {quorums[0].quorum_id}
            assert [m.replica_id for m in quorums[0].participants] == ["a", "b", "c"]
            assert [m.step for m in quorums[0].participants] == [1, 2, 0]
            assert quorums[0].created.seconds > 0

    asyncio.run(scenario())


def test_member_dropping_out_gets_a_new_quorum_id_after_heartbeat_expiry():
    async def scenario():
        async with running_lighthouse(min_replicas=2, heartbeat_timeout=0.5, join_timeout=60.0) as server, \
                client_for(server) as c:
            alive = set("abc")

            async def heartbeat_loop():  # what each group's manager does from startup
                while True:
                    await asyncio.gather(*(c.heartbeat(rid, timeout=WAIT) for rid in sorted(alive)))
                    await asyncio.sleep(0.1)

            beats = asyncio.create_task(heartbeat_loop())
            try:
                await wait_until(lambda: server.statistics().heartbeating_replicas == 3, "three heartbeats")
                first = await asyncio.gather(*(c.quorum(rid, timeout=WAIT) for rid in "abc"))
                assert [m.replica_id for m in first[0].participants] == ["a", "b", "c"]
                # c dies. a and b rejoin and wait for c (a healthy straggler) until
                # its heartbeat expires; then a new quorum without it forms.
                alive.discard("c")
                second = await asyncio.gather(*(c.quorum(rid, timeout=WAIT) for rid in "ab"))
            finally:
                beats.cancel()
            assert [m.replica_id for m in second[0].participants] == ["a", "b"]
            assert second[0].quorum_id == first[0].quorum_id + 1
            assert server.statistics().expired_replicas >= 1

    asyncio.run(scenario())


def test_heartbeats_state_the_lease_and_a_member_that_committed_a_redone_step_is_given_the_step_to_heal():
    """g is declared gone at step 7 (its heartbeats lapsed), p redoes step 7 alone, then both come back at
    step 8: the quorum gives g step 7, so every manager heals it from p (the lineage fence)."""
    async def scenario():
        async with running_lighthouse(heartbeat_timeout=0.5, join_timeout=60.0) as server, \
                client_for(server) as c:
            assert await c.heartbeat("p", timeout=WAIT) == 0.5
            first = await asyncio.gather(c.quorum("g", timeout=WAIT, step=7), c.quorum("p", timeout=WAIT, step=7))
            assert [m.step for m in first[0].participants] == [7, 7]

            async def keep_p_alive():
                while True:
                    await c.heartbeat("p", timeout=WAIT)
                    await asyncio.sleep(0.1)

            beats = asyncio.create_task(keep_p_alive())
            try:
                await wait_until(lambda: server.statistics().expired_replicas >= 1, "g's heartbeat to expire")
                redo = await c.quorum("p", timeout=WAIT, step=7)
                assert [m.replica_id for m in redo.participants] == ["p"]
                back = await asyncio.gather(c.quorum("g", timeout=WAIT, step=8),
                                            c.quorum("p", timeout=WAIT, step=8))
            finally:
                beats.cancel()
            assert {m.replica_id: m.step for m in back[0].participants} == {"g": 7, "p": 8}

    asyncio.run(scenario())


def test_heartbeat_expiry_is_visible_in_status():
    async def scenario():
        async with running_lighthouse(heartbeat_timeout=0.3) as server, client_for(server) as c:
            await c.heartbeat("lonely", timeout=WAIT)
            assert server.statistics().heartbeating_replicas == 1
            await wait_until(lambda: server.statistics().heartbeating_replicas == 0, "heartbeat to expire")
            assert server.snapshot()["replicas"] == []

    asyncio.run(scenario())


def test_cancelled_quorum_call_stops_being_a_participant_and_is_forgotten():
    async def scenario():
        async with running_lighthouse(min_replicas=2, heartbeat_timeout=0.2) as server, client_for(server) as c:
            # Its heartbeat (the join) expires while it waits; then the call times out.
            with pytest.raises(LighthouseTimeout, match="no answer within"):
                await c.quorum("impatient", timeout=0.8)
            await wait_until(lambda: server.statistics().participants == 0, "the timed-out caller to leave")
            await wait_until(lambda: server.known_member("impatient") is None, "its data to be pruned")
            assert server.snapshot()["replicas"] == []

    asyncio.run(scenario())


def test_quorum_ids_increase_across_restarts_without_state_dir():
    async def one_quorum(**overrides) -> int:
        async with running_lighthouse(**overrides) as server, client_for(server) as c:
            return (await c.quorum("a", timeout=WAIT)).quorum_id

    first = asyncio.run(one_quorum())
    second = asyncio.run(one_quorum())
    assert second > first


def test_state_dir_keeps_ids_increasing_when_the_clock_steps_back(tmp_path):
    async def one_quorum(wall: float) -> int:
        config = LighthouseConfig(min_replicas=1, bind="127.0.0.1:0", http_bind=None, state_dir=tmp_path, startup_grace=0.0)
        server = LighthouseServer(config, wall_clock=lambda: wall)
        await server.start()
        try:
            async with client_for(server) as c:
                return (await c.quorum("a", timeout=WAIT)).quorum_id
        finally:
            await server.stop()

    first = asyncio.run(one_quorum(wall=5000.0))
    second = asyncio.run(one_quorum(wall=1000.0))  # clock went back 4000 s
    assert second > first


@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_unknown_fields_survive_the_round_trip(engine):
    async def scenario():
        async with running_lighthouse(grpc_engine=engine) as server:
            member = pb.QuorumMember(replica_id="newer-manager", step=7)
            # Field 200 (length-delimited "future"), as a newer manager might send.
            raw_member = member.SerializeToString() + b"\xc2\x0c\x06future"
            request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember.FromString(raw_member))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                call = channel.unary_unary("/torchft.LighthouseService/Quorum",
                                           request_serializer=pb.LighthouseQuorumRequest.SerializeToString)
                raw = await call(request, timeout=WAIT)
            assert b"\xc2\x0c\x06future" in raw
            quorum = pb.LighthouseQuorumResponse.FromString(raw).quorum
            assert quorum.participants[0].step == 7

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "method, payload, message",
    [
        ("Quorum", pb.LighthouseQuorumRequest().SerializeToString(), "requester is required"),
        ("Quorum", pb.LighthouseQuorumRequest(requester=pb.QuorumMember()).SerializeToString(),
         "replica_id must be a non-empty string"),
        ("Quorum", b"\xff\xff\xff\xff garbage", "malformed LighthouseQuorumRequest"),
        ("Quorum", pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="x" * 5000)).SerializeToString(),
         "longer than"),
        ("Heartbeat", pb.LighthouseHeartbeatRequest().SerializeToString(), "replica_id must be a non-empty string"),
        ("Heartbeat", b"\x0a\xff", "malformed LighthouseHeartbeatRequest"),
    ],
)
@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_bad_input_gets_invalid_argument_and_server_survives(method, payload, message, engine):
    async def scenario():
        async with running_lighthouse(grpc_engine=engine) as server:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                call = channel.unary_unary(f"/torchft.LighthouseService/{method}")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(payload, timeout=WAIT)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert message in info.value.details()
                unknown = channel.unary_unary("/torchft.LighthouseService/NoSuchMethod")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await unknown(b"", timeout=WAIT)
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            async with client_for(server) as c:
                assert (await c.quorum("still-works", timeout=WAIT)).participants[0].replica_id == "still-works"
            assert server.statistics().invalid_requests == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_garbage_bytes_on_the_port_are_survived(engine):
    async def scenario():
        async with running_lighthouse(grpc_engine=engine) as server:
            for garbage in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00" * 64, bytes(range(256)) * 8):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.grpc_port)
                writer.write(garbage)
                await writer.drain()
                try:
                    await asyncio.wait_for(reader.read(1024), timeout=5)
                except (asyncio.TimeoutError, ConnectionError):
                    pass
                writer.close()
            async with client_for(server) as c:
                assert (await c.quorum("after-garbage", timeout=WAIT)).quorum_id > 0

    asyncio.run(scenario())


@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_get_config_and_failure_notifications(engine):
    async def scenario():
        async with running_lighthouse(min_replicas=2, heartbeat_timeout=0.4, grpc_engine=engine) as server, client_for(server) as c:
            config = await c.get_config(timeout=WAIT)
            assert config["min_replicas"] == "2" and config["heartbeat_timeout_ms"] == "400"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                subscribe = channel.unary_stream(
                    "/torchft.LighthouseService/SubscribeFailures",
                    request_serializer=pb.SubscribeFailuresRequest.SerializeToString,
                    response_deserializer=pb.FailureNotification.FromString,
                )
                stream = subscribe(pb.SubscribeFailuresRequest(), timeout=WAIT)
                await wait_until(lambda: len(server._failure_subscribers) == 1, "the subscription to register")
                await asyncio.gather(c.quorum("x", timeout=WAIT), c.quorum("y", timeout=WAIT))
                # Neither heartbeats again: both expire and are reported.
                notes = [await stream.read(), await stream.read()]
                stream.cancel()
            assert sorted(n.replica_id for n in notes) == ["x", "y"]
            assert "no heartbeat" in notes[0].error_message

    asyncio.run(scenario())


def test_bind_conflict_is_a_clear_error():
    async def scenario():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            server = LighthouseServer(LighthouseConfig(min_replicas=1, bind=f"127.0.0.1:{port}", http_bind=None, startup_grace=0.0))
            with pytest.raises(OSError, match="could not bind gRPC"):
                await server.start()

    asyncio.run(scenario())


def test_client_errors_name_the_call():
    async def scenario():
        async with running_lighthouse() as server:
            channel_target = f"127.0.0.1:{server.grpc_port}"
            async with LighthouseClient(channel_target) as c:
                with pytest.raises(LighthouseError, match="Heartbeat for .* INVALID_ARGUMENT"):
                    await c.heartbeat("", timeout=WAIT)

    asyncio.run(scenario())


def test_background_lighthouse_reports_a_failure_after_start(caplog):
    from lighthouse.thread import BackgroundLighthouse
    from tests.conftest import lighthouse_config, wait_until_sync

    lighthouse = BackgroundLighthouse(lighthouse_config()).start()

    def broken() -> None:
        raise RuntimeError("tick broke")

    lighthouse.server._decide = broken  # the tick loop calls it next
    wait_until_sync(lambda: not lighthouse._thread.is_alive(), "the lighthouse thread to end")
    with pytest.raises(RuntimeError, match="failed while running") as info:
        lighthouse.stop()
    assert "tick broke" in repr(info.value.__cause__)
    assert "lighthouse thread failed" in caplog.text


def test_a_restarted_lighthouse_remembers_the_highest_step_with_a_state_dir(tmp_path):
    """Otherwise replicas at step 0 could redo committed history while the holders are away."""
    async def scenario():
        config = LighthouseConfig(min_replicas=1, bind="127.0.0.1:0", http_bind=None, state_dir=tmp_path,
                                  startup_grace=0.0, join_timeout=0.5)
        first = LighthouseServer(config)
        await first.start()
        try:
            async with client_for(first) as c:
                await c.quorum("veteran", timeout=WAIT, step=40)
        finally:
            await first.stop()
        second = LighthouseServer(config)
        await second.start()
        try:
            async with client_for(second) as c:
                fresh = asyncio.ensure_future(c.quorum("fresh", timeout=WAIT, step=0))
                await wait_until(lambda: second.statistics().status == "behind_committed", "the guard to hold")
                assert "no participant holds step 40" in second.statistics().reason and not fresh.done()
                veteran = await c.quorum("veteran", timeout=WAIT, step=40)
                assert [m.replica_id for m in veteran.participants] == ["fresh", "veteran"]
                await fresh
        finally:
            await second.stop()

    asyncio.run(scenario())
