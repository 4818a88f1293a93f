"""The lighthouse's own gRPC server against real grpc C-core clients and raw sockets."""

import asyncio
import struct

import grpc
import pytest

from tests.conftest import WAIT, wait_until
from tests.integration.helpers import probe_server
from torchft_lite.rpc.h2grpc import GrpcServer, wire

pytestmark = pytest.mark.integration

SMALL_WINDOWS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024),
                 ("grpc.http2.max_frame_size", 16384)]
SERVER = dict(echo_peer=True, max_request_bytes=64 * 1024)  # probe_server's: echoes name their peer


def echo_call(channel):
    return channel.unary_unary("/t.S/Echo")


def test_unary_streaming_and_peer():
    async def scenario():
        async with probe_server(**SERVER) as (server, probe, port), \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            answer = await echo_call(channel)(b"hi", timeout=WAIT)
            assert answer.startswith(b"hi|ipv4:127.0.0.1:")
            stream = channel.unary_stream("/t.S/Count")(b"5", timeout=WAIT)
            assert [m async for m in stream] == [b"0", b"1", b"2", b"3", b"4"]

    asyncio.run(scenario())


def test_large_responses_respect_small_flow_control_windows():
    async def scenario():
        async with probe_server(**SERVER) as (server, probe, port):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=SMALL_WINDOWS) as channel:
                call = echo_call(channel)
                sizes = [300_000, 70_000, 16_384, 1]
                answers = await asyncio.gather(*(call(f"big:{n}".encode(), timeout=WAIT) for n in sizes * 5))
                for size, answer in zip(sizes * 5, answers):
                    assert answer == bytes(range(256)) * (size // 256)

    asyncio.run(scenario())


def test_errors_map_to_grpc_statuses():
    async def scenario():
        async with probe_server(**SERVER) as (server, probe, port), \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = echo_call(channel)
            cases = [
                (b"abort", grpc.StatusCode.FAILED_PRECONDITION, "not now: caf\u00e9 100%"),
                (b"raise", grpc.StatusCode.UNKNOWN, "RuntimeError('boom')"),
                (b"x" * 70_000, grpc.StatusCode.RESOURCE_EXHAUSTED, "request larger than"),
            ]
            for request, code, message in cases:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(request, timeout=WAIT)
                assert info.value.code() == code
                assert message in info.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/t.S/Nope")(b"", timeout=WAIT)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                # Compressible enough that the client really compresses it.
                await call(b"a" * 10_000, timeout=WAIT, compression=grpc.Compression.Gzip)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert await call(b"still fine", timeout=WAIT)

    asyncio.run(scenario())


def test_client_deadline_cancels_the_handler():
    async def scenario():
        async with probe_server(**SERVER) as (server, probe, port), \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await echo_call(channel)(b"wait", timeout=0.5)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_until(lambda: probe.cancelled == 1, "the handler to be cancelled")
            assert await echo_call(channel)(b"after", timeout=WAIT)

    asyncio.run(scenario())


def test_many_concurrent_calls_on_one_connection():
    async def scenario():
        async with probe_server(**SERVER) as (server, probe, port), \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = echo_call(channel)
            answers = await asyncio.gather(*(call(str(i).encode(), timeout=WAIT) for i in range(600)))
            assert [a.split(b"|")[0] for a in answers] == [str(i).encode() for i in range(600)]
            assert len(server.connections) == 1

    asyncio.run(scenario())


async def raw_exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    received = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), timeout=WAIT):
            received += chunk
    except ConnectionError:
        pass
    writer.close()
    return received


def goaway_code(received: bytes) -> int | None:
    offset = 0
    while offset + 9 <= len(received):
        length, kind, _, _ = wire.parse_frame_header(received, offset)
        if kind == wire.GOAWAY:
            return struct.unpack_from(">II", received, offset + 9)[1]
        offset += 9 + length
    return None


@pytest.mark.parametrize("frames, code", [
    (wire.frame(wire.DATA, 0, 0, b"x"), wire.PROTOCOL_ERROR),  # DATA on stream 0
    (wire.frame(wire.HEADERS, wire.END_HEADERS, 2, b""), wire.PROTOCOL_ERROR),  # even stream id
    (wire.frame(wire.PING, 0, 0, b"short"), wire.FRAME_SIZE_ERROR),
    (wire.frame(wire.SETTINGS, 0, 0, b"\x00\x04\x80\x00\x00\x00"), wire.FLOW_CONTROL_ERROR),
    (wire.frame(wire.HEADERS, wire.END_HEADERS, 1, b"\xff\xff\xff\xff"), wire.COMPRESSION_ERROR),
    (wire.frame(wire.WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x00"), wire.PROTOCOL_ERROR),
    (wire.frame(wire.HEADERS, 0, 1, b"") + wire.frame(wire.PING, 0, 0, b"12345678"), wire.PROTOCOL_ERROR),
    (struct.pack(">BHBBI", 0, 20000, wire.DATA, 0, 1) + b"x" * 20000, wire.FRAME_SIZE_ERROR),
])
def test_protocol_errors_get_goaway_and_the_server_survives(frames, code):
    async def scenario():
        async with probe_server(**SERVER) as (server, probe, port):
            received = await raw_exchange(port, wire.PREFACE + wire.settings_frame({}) + frames)
            assert goaway_code(received) == code
            assert server.protocol_errors == 1
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert await echo_call(channel)(b"ok", timeout=WAIT)

    asyncio.run(scenario())


def request_frames(stream_id: int, message: bytes, path: bytes = b"/t.S/Echo") -> bytes:
    block = wire.encode_headers([(b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
                                 (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    return (wire.frame(wire.HEADERS, wire.END_HEADERS, stream_id, block)
            + wire.frame(wire.DATA, wire.END_STREAM, stream_id, wire.grpc_message(message)))


def test_a_request_on_a_lower_stream_id_than_one_already_opened_gets_goaway():
    """Stream 3 after stream 5 can never be answered (5 implicitly closed it).

    The server used to ignore it silently: the caller then waited forever on an
    idle, established connection, which is how a benchmark round at N=300
    stalled with both processes idle and every socket queue empty.
    """
    async def scenario():
        async with probe_server(**SERVER) as (server, probe, port):
            received = await raw_exchange(
                port, wire.PREFACE + wire.settings_frame({}) + request_frames(5, b"five") + request_frames(3, b"three"))
            assert goaway_code(received) == wire.PROTOCOL_ERROR
            assert b"stream 3 opened after stream 5" in received
            assert server.protocol_errors == 1

    asyncio.run(scenario())


def test_trailers_for_a_stream_the_server_closed_are_ignored():
    """Only a new request on a used id is an error: late trailers of a finished stream are not."""
    async def scenario():
        async with probe_server(**SERVER) as (server, probe, port):
            trailers = wire.frame(wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, 1,
                                  wire.encode_headers([(b"x-late", b"1")]))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(wire.PREFACE + wire.settings_frame({}) + request_frames(1, b"one"))
            received = b""
            while b"grpc-status" not in received:
                chunk = await asyncio.wait_for(reader.read(65536), timeout=WAIT)
                assert chunk, "connection closed before stream 1 was answered"
                received += chunk
            writer.write(trailers + request_frames(3, b"three"))
            while received.count(b"grpc-status") < 2:
                chunk = await asyncio.wait_for(reader.read(65536), timeout=WAIT)
                assert chunk, "connection closed before stream 3 was answered"
                received += chunk
            writer.close()
            assert goaway_code(received) is None
            assert server.protocol_errors == 0

    asyncio.run(scenario())


def test_non_http2_clients_are_disconnected():
    async def scenario():
        async with probe_server(**SERVER) as (server, probe, port):
            received = await raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert goaway_code(received) == wire.PROTOCOL_ERROR
            # A real HTTP/2 peer gets its PING answered on a connection that stays open.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(wire.PREFACE + wire.settings_frame({}) + wire.frame(wire.PING, 0, 0, b"abcdefgh"))
            received = b""
            while wire.frame(wire.PING, wire.ACK, 0, b"abcdefgh") not in received:
                chunk = await asyncio.wait_for(reader.read(65536), timeout=WAIT)
                assert chunk, "connection closed before the PING was answered"
                received += chunk
            writer.close()

    asyncio.run(scenario())


def test_silent_connections_are_closed_after_the_handshake_timeout():
    async def scenario():
        server = GrpcServer(handshake_timeout=0.3)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(wire.PREFACE[:5])  # starts, then goes quiet
            await writer.drain()
            # The server's SETTINGS arrive first; then the connection must be closed (EOF).
            while await asyncio.wait_for(reader.read(65536), timeout=WAIT):
                pass
            writer.close()
            await wait_until(lambda: not server.connections, "the server to drop the connection")
        finally:
            await server.stop(1.0)

    asyncio.run(scenario())


def test_stop_lets_calls_in_flight_finish_within_grace():
    async def scenario():
        async with probe_server(**SERVER) as (server, probe, port), \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            pending = asyncio.ensure_future(echo_call(channel)(b"wait", timeout=WAIT))
            await asyncio.wait_for(probe.started.wait(), WAIT)
            await server.stop(0.2)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pending
            assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            assert probe.cancelled == 1

    asyncio.run(scenario())


def test_wildcard_bind_accepts_ipv4_and_ipv6_clients():
    """'[::]' (the lighthouse's default bind) must not refuse 127.0.0.1: asyncio alone makes it IPv6-only."""
    import socket

    from torchft_lite.rpc.h2grpc import GrpcServer

    async def scenario():
        server = GrpcServer()
        port = await server.start("::", 0)
        try:
            families = [(socket.AF_INET, "127.0.0.1")]
            if socket.has_ipv6:
                families.append((socket.AF_INET6, "::1"))
            for family, address in families:
                try:
                    _, writer = await asyncio.open_connection(address, port, family=family)
                except OSError as exc:
                    if family == socket.AF_INET6:
                        continue  # no IPv6 loopback in this sandbox
                    raise AssertionError(f"{address} refused on a wildcard bind: {exc}") from exc
                writer.close()
        finally:
            await server.stop(grace=1)

    asyncio.run(scenario())
