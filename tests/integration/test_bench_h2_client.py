"""The benchmark's lean h2c client (benchmarks/_h2_client.py) against our gRPC server and lighthouse.

The benchmark's figures are only as good as its load generator: these check
that it follows HTTP/2 flow control, framing and gRPC statuses, so a stall or
an error in a benchmark run points at the server.
"""

import asyncio

import grpc
import pytest

from benchmarks._h2_client import H2CallError, H2CallTimeout, H2Channel
from benchmarks._h2_wire import DEFAULT_WINDOW
from tests.conftest import WAIT, running_lighthouse
from tests.integration.helpers import probe_server
from torchft_lite.rpc.h2grpc.connection import H2Connection
from torchft_lite.rpc.protocol import torchft_pb2 as pb

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("recv_window, max_frame_size", [(DEFAULT_WINDOW, 16_384), (4 * 1024 * 1024, 1 << 20)])
def test_large_and_concurrent_answers_within_the_advertised_windows(recv_window, max_frame_size):
    """With the default 65535-byte windows a 1 MB answer needs many WINDOW_UPDATEs for the
    connection and the stream; concurrent calls interleave their DATA frames."""
    async def scenario():
        async with probe_server() as (server, _, port):
            channel = H2Channel("127.0.0.1", port, recv_window=recv_window, max_frame_size=max_frame_size)
            try:
                for size in (1_000_000, 300_000, 70_000, 16_384, 256):
                    assert len(await channel.unary("/t.S/Echo", b"big:%d" % size, WAIT)) == size // 256 * 256
                sizes = [25_600 * (i % 4) + 256 for i in range(200)]
                answers = await asyncio.gather(*(channel.unary("/t.S/Echo", b"big:%d" % s, WAIT) for s in sizes))
                assert [len(a) for a in answers] == sizes
                assert server.protocol_errors == 0
            finally:
                await channel.close()

    asyncio.run(scenario())


def test_grpc_errors_timeouts_and_a_lost_connection_raise_clearly():
    async def scenario():
        async with probe_server() as (server, handlers, port):
            channel = H2Channel("127.0.0.1", port)
            try:
                with pytest.raises(H2CallError, match="grpc-status 9: not now: caf\u00e9 100%") as info:
                    await channel.unary("/t.S/Echo", b"abort", WAIT)
                assert info.value.grpc_status == grpc.StatusCode.FAILED_PRECONDITION.value[0]
                with pytest.raises(H2CallError, match="grpc-status 12"):
                    await channel.unary("/t.S/Missing", b"x", WAIT)
                with pytest.raises(H2CallTimeout, match="no answer within 0.2s"):
                    await channel.unary("/t.S/Echo", b"wait", 0.2)
                assert await channel.unary("/t.S/Echo", b"still usable", WAIT) == b"still usable"
                assert handlers.cancelled == 1  # the timeout reached the server (RST_STREAM or grpc-timeout)
                pending = asyncio.ensure_future(channel.unary("/t.S/Echo", b"wait", WAIT))
                await asyncio.sleep(0.1)
                await server.stop(0.1)
                with pytest.raises(H2CallError):
                    await asyncio.wait_for(pending, WAIT)
            finally:
                await channel.close()

    asyncio.run(scenario())


def test_connections_that_fail_before_the_servers_settings_are_retried():
    """As grpc's wait_for_ready: a listener that overflows its backlog resets connections the
    client already counted as open (torchft's at N=1000); no call was sent on them."""
    class Reset(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            transport.abort()

    async def scenario():
        async with probe_server() as (server, _, _):
            accepted = 0

            def factory():
                nonlocal accepted
                accepted += 1
                return Reset() if accepted <= 2 else H2Connection(server)

            listener = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
            channel = H2Channel("127.0.0.1", listener.sockets[0].getsockname()[1])
            try:
                assert await channel.unary("/t.S/Echo", b"third time", WAIT) == b"third time"
                assert channel.connect_attempts == 3
            finally:
                await channel.close()
                listener.close()

    asyncio.run(scenario())


def test_replica_groups_heartbeat_and_get_one_quorum_over_shared_connections():
    """The benchmark's traffic: heartbeats and Quorum calls on each group's one connection."""
    async def scenario():
        async with running_lighthouse(min_replicas=20, http_bind=None) as lighthouse:
            channels = [H2Channel("127.0.0.1", lighthouse.grpc_port) for _ in range(20)]
            try:
                for step in range(3):
                    heartbeats = [
                        c.unary("/torchft.LighthouseService/Heartbeat",
                                pb.LighthouseHeartbeatRequest(replica_id=f"r{i}").SerializeToString(), WAIT)
                        for i, c in enumerate(channels)
                    ]
                    quorums = [
                        c.unary("/torchft.LighthouseService/Quorum", pb.LighthouseQuorumRequest(
                            requester=pb.QuorumMember(replica_id=f"r{i}", step=step)).SerializeToString(), WAIT)
                        for i, c in enumerate(channels)
                    ]
                    answers = await asyncio.gather(*heartbeats, *quorums)
                    quorum = pb.LighthouseQuorumResponse.FromString(answers[-1]).quorum
                    assert {m.replica_id for m in quorum.participants} == {f"r{i}" for i in range(20)}
                    assert len(set(answers[20:])) == 1
            finally:
                await asyncio.gather(*(c.close() for c in channels))

    asyncio.run(scenario())
