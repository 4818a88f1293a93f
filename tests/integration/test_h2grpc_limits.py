"""Each flood limit of the native engine, one at a time, on a small GrpcServer with tight limits.

Every test ends with a real grpc client call that still works: a peer that hits
a limit is cut off, the server is not. (The attack suite, test_grpc_floods.py,
runs the same attacks at full size against a real lighthouse on both engines.)
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.conftest import WAIT, wait_until
from tests.integration.h2_raw import RawH2, call_frames, request_headers
from tests.integration.helpers import probe_server
from torchft_lite.rpc.h2grpc import wire
from torchft_lite.rpc.limits import ServerLimits

pytestmark = pytest.mark.integration

PATH = b"/t.S/Echo"


async def still_serves(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert await channel.unary_unary(PATH.decode())(b"still here", timeout=WAIT) == b"still here"


def is_goaway(frame) -> bool:
    return frame.kind == wire.GOAWAY


def run(scenario) -> None:
    asyncio.run(scenario())


def test_streams_beyond_max_concurrent_streams_are_refused_and_counted():
    async def scenario():
        async with probe_server(limits=ServerLimits(max_concurrent_streams=2)) as (server, handlers, port):
            raw = await RawH2.open(port)
            raw.send(b"".join(call_frames(i, b"hold", PATH) for i in (1, 3, 5)))
            frame = await raw.wait_for(lambda f: f.kind == wire.RST_STREAM, "RST_STREAM of the third stream")
            assert frame.stream_id == 5 and int.from_bytes(frame.payload, "big") == wire.REFUSED_STREAM
            assert server.limits_hit == {"max_concurrent_streams": 1}
            handlers.release.set()
            await raw.wait_for(lambda f: f.stream_id == 3 and f.flags & wire.END_STREAM, "the answer to stream 3")
            raw.close()
            await still_serves(port)

    run(scenario)


def test_rapid_reset_gets_goaway_enhance_your_calm():
    async def scenario():
        async with probe_server(limits=ServerLimits(max_resets=50)) as (server, handlers, port):
            raw = await RawH2.open(port)
            attack = b"".join(call_frames(i, b"hold", PATH) + wire.rst_stream(i, wire.CANCEL)
                              for i in range(1, 2 * 500, 2))
            raw.send(attack)
            assert await raw.closed(), "the server kept a rapid-reset connection open"
            assert raw.goaway()[0] == wire.ENHANCE_YOUR_CALM
            assert server.limits_hit == {"rapid_reset": 1}
            await still_serves(port)

    run(scenario)


@pytest.mark.parametrize("flood, limit", [
    (wire.frame(wire.PING, 0, 0, b"12345678"), "ping_flood"),
    (wire.settings_frame({wire.SETTINGS_INITIAL_WINDOW_SIZE: 70_000}), "settings_flood"),
])
def test_ping_and_settings_floods_get_goaway_enhance_your_calm(flood, limit):
    async def scenario():
        async with probe_server(limits=ServerLimits(max_pings=20, max_settings=20)) as (server, handlers, port):
            raw = await RawH2.open(port)
            raw.send(flood * 100)
            assert await raw.closed()
            code, debug = raw.goaway()
            assert code == wire.ENHANCE_YOUR_CALM and b"more than 20 " in debug
            assert server.limits_hit == {limit: 1}
            await still_serves(port)

    run(scenario)


def test_pings_while_the_server_answers_calls_are_not_a_flood():
    """A client may probe a connection that is busy answering it (gRPC's BDP pings do)."""
    async def scenario():
        async with probe_server(limits=ServerLimits(max_pings=20)) as (server, handlers, port):
            raw = await RawH2.open(port)
            for round_ in range(6):
                stream_id = 2 * round_ + 1
                raw.send(wire.frame(wire.PING, 0, 0, b"12345678") * 15 + call_frames(stream_id, b"x", PATH))
                await raw.wait_for(lambda f, s=stream_id: f.stream_id == s and f.flags & wire.END_STREAM,
                                   f"the answer to stream {stream_id}")
            assert raw.goaway() is None and server.limits_hit == {}
            raw.close()

    run(scenario)


def test_connections_beyond_the_caps_are_closed_at_once_with_a_reason():
    async def scenario():
        limits = ServerLimits(max_connections=3, max_connections_per_host=2)
        async with probe_server(limits=limits) as (server, handlers, port):
            held = [await RawH2.open(port) for _ in range(2)]
            for connection in held:  # admitted: the server's SETTINGS arrive
                await connection.wait_for(lambda f: f.kind == wire.SETTINGS, "the server's SETTINGS")
            third = await RawH2.open(port)
            assert await third.closed()
            code, debug = third.goaway()
            assert code == wire.ENHANCE_YOUR_CALM and b"maximum of 2 connections from 127.0.0.1" in debug
            assert server.limits_hit == {"max_connections_per_host": 1}
            server.limits = ServerLimits(max_connections=2)  # per host: no cap, for connections made now
            fourth = await RawH2.open(port)
            assert await fourth.closed() and b"maximum of 2 connections" in fourth.goaway()[1]
            assert server.limits_hit["max_connections"] == 1
            held[0].close()
            await wait_until(lambda: len(server.connections) == 1, "the server to let go of a closed connection")
            await still_serves(port)
            for connection in held[1:]:
                connection.close()

    run(scenario)


def test_idle_connections_get_goaway_but_one_holding_a_stream_is_never_idle():
    async def scenario():
        async with probe_server(limits=ServerLimits(idle_timeout=0.5)) as (server, handlers, port):
            streaming = await RawH2.open(port)
            streaming.send(call_frames(1, b"", b"/t.S/Watch"))
            await streaming.wait_for(lambda f: f.kind == wire.DATA, "the stream's first message")
            idle = await RawH2.open(port)
            assert await idle.closed(), "an idle connection was never closed"
            assert idle.goaway()[0] == wire.NO_ERROR
            # Closed an idle connection at least twice its timeout after the stream opened:
            second = await RawH2.open(port)
            assert await second.closed()
            assert streaming.goaway() is None and not streaming.eof
            assert server.limits_hit == {"idle_timeout": 2}
            handlers.release.set()
            await streaming.wait_for(lambda f: f.stream_id == 1 and f.flags & wire.END_STREAM, "the stream's end")
            assert await streaming.closed(), "a connection idle after its stream ended was not closed"

    run(scenario)


def test_an_oversized_header_list_gets_goaway_and_is_counted():
    async def scenario():
        async with probe_server(limits=ServerLimits(max_header_list_bytes=4096)) as (server, handlers, port):
            raw = await RawH2.open(port)
            block = request_headers(PATH, [(b"x-pad", b"p" * 5000)])
            raw.send(wire.frame(wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, 1, block))
            assert await raw.closed()
            assert raw.goaway()[0] == wire.ENHANCE_YOUR_CALM
            assert server.limits_hit == {"header_list_size": 1}
            await still_serves(port)

    run(scenario)


def test_an_oversized_message_is_refused_and_counted():
    async def scenario():
        async with probe_server(limits=ServerLimits(max_request_bytes=1000)) as (server, handlers, port):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_unary(PATH.decode())(b"x" * 2000, timeout=WAIT)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert server.limits_hit == {"request_size": 1}
            await still_serves(port)

    run(scenario)


def test_slowloris_requests_and_header_blocks_are_cut_after_request_timeout():
    async def scenario():
        async with probe_server(limits=ServerLimits(request_timeout=0.5)) as (server, handlers, port):
            body = await RawH2.open(port)
            message = wire.grpc_message(b"x" * 100)
            body.send(wire.frame(wire.HEADERS, wire.END_HEADERS, 1, request_headers(PATH))
                      + wire.frame(wire.DATA, 0, 1, message[:10]))  # ...and the other 95 bytes never come
            await body.wait_for(lambda f: f.stream_id == 1 and f.flags & wire.END_STREAM, "the stream's end")
            assert body.grpc_status(1) == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            block = request_headers(PATH)
            headers = await RawH2.open(port)
            # RawH2 acknowledges the server's SETTINGS: not from inside the header block, please.
            await headers.wait_for(lambda f: f.kind == wire.SETTINGS and not f.flags & wire.ACK, "SETTINGS")
            headers.send(wire.frame(wire.HEADERS, 0, 1, block[:20]))  # no END_HEADERS, no CONTINUATION
            assert await headers.closed()
            assert headers.goaway()[0] == wire.ENHANCE_YOUR_CALM
            assert server.limits_hit == {"slow_request": 2}
            body.close()
            await still_serves(port)

    run(scenario)
