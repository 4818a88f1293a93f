"""Fuzzing every network endpoint: bad input gets a clear error, never a crash, a hang or an allocation.

The servers under test run in-process on an event loop of their own (a
background thread); the test thread is the client, so every call here is a
plain blocking one with a timeout. Covered:

* the lighthouse's ``LighthouseService`` (both gRPC engines) and the
  ManagerServer's ``ManagerService``: random bytes, mutated valid messages and
  valid messages with absurd fields (int64 extremes, empty and enormous ids,
  megabytes of data) sent to every RPC as raw unary or server-streaming calls;
* the h2c server itself: garbage on the TCP port, random HTTP/2 frames after
  the preface, and requests whose gRPC framing lies about its length;
* the lighthouse's HTTP side (dashboard, /api/status, /metrics, the kill
  action) and the checkpoint server of ``HTTPTransport``: random methods,
  paths, queries, headers, tokens and bodies over raw sockets.

After each batch the server must still answer a valid request correctly, and
the process's resident memory must not have grown by more than a generous
bound. Statuses allowed everywhere: the ones the code documents (see
``ALLOWED`` and the HTTP checks); never gRPC ``UNKNOWN`` (a handler raised) or
HTTP 500 (aiohttp's answer to an unhandled exception), except the one aiohttp
itself gives to an ``Expect`` header that is not UTF-8 (``aiohttp_expect_bug``).

The tests of the bugs these fuzzers found keep them as explicit examples or
as tests of their own (each names what it found).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import resource
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Iterator

import grpc
import hpack
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

from lighthouse.server import MAX_REPLICA_ID_LEN, LighthouseServer
from lighthouse.validation import STEP_LIMIT, member_problem, replica_id_problem
from tests.conftest import WAIT, FakeManager, running_lighthouse
from tests.integration.helpers import fetch, manager_server
from torchft_lite.group_server.server import ManagerServer
from torchft_lite.rpc.h2grpc import wire
from torchft_lite.rpc.loop import new_event_loop
from torchft_lite.rpc.protocol import torchft_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Calls that may legitimately wait (a Quorum, a vote, a stream) get this deadline;
# the others get WAIT, so a hang shows up as a failed DEADLINE_EXCEEDED.
SHORT = 0.2
MEMORY_BOUND = 200 * 1024 * 1024
FUZZ = settings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None,
                phases=[Phase.explicit, Phase.generate, Phase.shrink])


def rss_bytes() -> int:
    """Resident memory of this process, where the servers under test run."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


class ServerLoop:
    """An event loop in a daemon thread, for the servers under test."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-servers", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = WAIT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @contextlib.contextmanager
    def entered(self, manager: contextlib.AbstractAsyncContextManager) -> Iterator:
        """The async context manager ``manager`` (a server's), entered and exited on this loop."""
        value = self.run(manager.__aenter__())
        try:
            yield value
        finally:
            self.run(manager.__aexit__(None, None, None))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT)
        if not self.loop.is_running():
            self.loop.close()


@contextlib.contextmanager
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    try:
        yield loop
    finally:
        loop.close()


def lighthouse_on(loop: ServerLoop, **overrides) -> contextlib.AbstractContextManager[LighthouseServer]:
    # holder_timeout: the fuzz pushes the highest step anywhere up to int64 max and its holders never come back;
    # a new epoch mid-run would then refuse later requests above the epoch's step (FAILED_PRECONDITION) and the
    # final check's call at int64 max, which the expectations here do not model (tests/unit/lighthouse covers it).
    settings_ = dict(heartbeat_timeout=1.0, join_timeout=0.5, kill_timeout=1.0, holder_timeout=3600.0)
    settings_.update(overrides)
    return loop.entered(running_lighthouse(**settings_))


def manager_on(loop: ServerLoop, lighthouse: LighthouseServer) -> contextlib.AbstractContextManager[ManagerServer]:
    return loop.entered(manager_server(lighthouse.address(), replica_id="fuzz-manager", store_address="store:1",
                                       world_size=2))


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@contextlib.contextmanager
def channel_to(port: int) -> Iterator[grpc.Channel]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        channel.close()


# ---------------------------------------------------------------------------------------------- gRPC

LIGHTHOUSE = "/torchft.LighthouseService/"
MANAGER = "/torchft.ManagerService/"
# RPC -> (server streaming, may wait: a valid request can legitimately get no answer within SHORT)
LIGHTHOUSE_RPCS = {"Quorum": (False, True), "Heartbeat": (False, False), "GetConfig": (False, False),
                   "SubscribeFailures": (True, True), "Lease": (True, True)}
MANAGER_RPCS = {"Quorum": (False, True), "CheckpointMetadata": (False, False), "ShouldCommit": (False, True),
                "Kill": (False, False), "Events": (True, True)}
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION}


def call(channel: grpc.Channel, path: str, payload: bytes, streaming: bool, timeout: float) -> tuple:
    """(status code, details) of one raw call; a stream is read up to its first message."""
    try:
        if streaming:
            responses = channel.unary_stream(path)(payload, timeout=timeout)
            try:
                next(responses, None)
            finally:
                responses.cancel()
        else:
            channel.unary_unary(path)(payload, timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def call_and_check(channel: grpc.Channel, service: str, rpcs: dict, rpc_data: tuple[str, bytes]) -> None:
    """Send fuzzed bytes to one RPC of ``service`` (``rpcs``: name -> (streaming, may wait)) and judge the answer."""
    rpc, data = rpc_data
    streaming, may_wait = rpcs[rpc]
    code, details = call(channel, service + rpc, data, streaming, SHORT if may_wait else WAIT)
    check_answer(service + rpc, code, details, may_wait)


def check_answer(path: str, code: grpc.StatusCode, details: str, may_wait: bool) -> None:
    if code in ALLOWED:
        return
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and may_wait:
        return
    if code is grpc.StatusCode.UNAVAILABLE and path == MANAGER + "Quorum" and "lighthouse quorum" in details:
        return  # the ManagerServer's own lighthouse call failed (e.g. behind the highest step): its documented answer
    pytest.fail(f"{path} answered {code.name}: {details!r}")


int64s = st.one_of(st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**31, -(2**31)]), st.integers(-(2**63), 2**63 - 1))
uint64s = st.one_of(st.sampled_from([0, 1, 2**64 - 1, 2**63]), st.integers(0, 2**64 - 1))
ranks = st.one_of(st.sampled_from([0, 1]), int64s)
replica_ids = st.one_of(
    st.sampled_from(["", "a", "x" * MAX_REPLICA_ID_LEN, "x" * (MAX_REPLICA_ID_LEN + 1), "\x00", "\u00e9" * 600,
                     "\U0001f600" * 1025]),
    st.text(max_size=12),
    st.integers(1, 200_000).map(lambda n: "r" * n),
)
texts = st.one_of(st.text(max_size=30), st.sampled_from([100_000, 1_500_000]).map(lambda n: "d" * n))
addresses = st.one_of(
    st.sampled_from(["", "http://127.0.0.1:1", "http://[::1", "grpc://", "unix:/nonexistent", "dns:///%%%",
                     "http://" + "h" * 300 + ":1", "127.0.0.1:99999", "\x00"]),
    st.text(max_size=30),
)
members = st.builds(
    pb.QuorumMember, replica_id=replica_ids, address=addresses, store_address=texts, step=int64s,
    world_size=uint64s, shrink_only=st.booleans(), data=texts, commit_failures=int64s,
    reconfigure_handles=st.lists(st.text(max_size=10), max_size=3),
)
lighthouse_messages = st.one_of(
    st.tuples(st.just("Quorum"), st.builds(pb.LighthouseQuorumRequest, requester=members)),
    st.tuples(st.just("Quorum"), st.just(pb.LighthouseQuorumRequest())),
    st.tuples(st.just("Heartbeat"), st.builds(pb.LighthouseHeartbeatRequest, replica_id=replica_ids)),
    st.tuples(st.just("Lease"), st.builds(pb.LeaseRequest, replica_id=replica_ids)),
    st.tuples(st.just("GetConfig"), st.just(pb.LighthouseConfigRequest())),
    st.tuples(st.just("SubscribeFailures"), st.just(pb.SubscribeFailuresRequest())),
)
manager_messages = st.one_of(
    st.tuples(st.just("Quorum"), st.builds(
        pb.ManagerQuorumRequest, group_rank=ranks, step=int64s, checkpoint_metadata=texts, shrink_only=st.booleans(),
        init_sync=st.booleans(), commit_failures=int64s, reconfigure_handle=st.text(max_size=10))),
    st.tuples(st.just("CheckpointMetadata"), st.builds(pb.CheckpointMetadataRequest, rank=ranks)),
    st.tuples(st.just("ShouldCommit"), st.builds(pb.ShouldCommitRequest, should_commit=st.booleans(),
                                                  group_rank=ranks, step=int64s)),
    st.tuples(st.just("Kill"), st.builds(pb.KillRequest, msg=texts)),
    st.tuples(st.just("Events"), st.builds(pb.ManagerEventsRequest, group_rank=ranks)),
)


@st.composite
def mangled(draw, messages) -> tuple[str, bytes]:
    """A valid message's bytes, truncated, bit-flipped, extended or replaced by random bytes."""
    rpc, message = draw(messages)
    data = message.SerializeToString()
    how = draw(st.sampled_from(["random", "truncate", "flip", "append", "valid"]))
    if how == "random":
        data = draw(st.binary(max_size=300))
    elif how == "truncate" and data:
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif how == "flip" and data:
        position = draw(st.integers(0, len(data) - 1))
        data = data[:position] + bytes([data[position] ^ draw(st.integers(1, 255))]) + data[position + 1:]
    elif how == "append":
        data += draw(st.binary(min_size=1, max_size=50))
    return rpc, data


def expected_lighthouse_code(rpc: str, message, max_request_bytes: int) -> set[grpc.StatusCode]:
    """What the lighthouse must answer a well-formed message with."""
    if message.ByteSize() > max_request_bytes:
        return {grpc.StatusCode.RESOURCE_EXHAUSTED}
    if rpc in ("Heartbeat", "Lease", "Quorum"):
        if rpc == "Quorum" and not message.HasField("requester"):
            return {grpc.StatusCode.INVALID_ARGUMENT}
        problem = member_problem(message.requester) if rpc == "Quorum" else replica_id_problem(message.replica_id)
        if problem is not None:  # a field out of range (lighthouse.validation)
            return {grpc.StatusCode.INVALID_ARGUMENT}
    if rpc in ("Heartbeat", "GetConfig", "Lease"):
        return {grpc.StatusCode.OK}
    return {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}  # Quorum waits, SubscribeFailures streams


def lighthouse_still_serves(loop: ServerLoop, lighthouse: LighthouseServer, channel: grpc.Channel,
                            quorum: bool = True) -> None:
    config = pb.LighthouseConfigResponse.FromString(
        channel.unary_unary(LIGHTHOUSE + "GetConfig")(pb.LighthouseConfigRequest().SerializeToString(), timeout=WAIT))
    assert config.config_data["implementation"] == "torchft_lite"
    channel.unary_unary(LIGHTHOUSE + "Heartbeat")(
        pb.LighthouseHeartbeatRequest(replica_id="alive").SerializeToString(), timeout=WAIT)
    if quorum:
        # The fuzz may have pushed the highest committed step anywhere below STEP_LIMIT; a request at the
        # largest step in range is never behind. It waits out the fuzzed replicas' heartbeats (split-brain
        # guard) if it must, heartbeating meanwhile as a manager does, or its own would expire first.
        request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="alive", step=STEP_LIMIT - 1))
        answer = channel.unary_unary(LIGHTHOUSE + "Quorum").future(request.SerializeToString(), timeout=WAIT)
        heartbeat = pb.LighthouseHeartbeatRequest(replica_id="alive").SerializeToString()
        while not answer.done():
            channel.unary_unary(LIGHTHOUSE + "Heartbeat")(heartbeat, timeout=WAIT)
            time.sleep(0.1)
        response = pb.LighthouseQuorumResponse.FromString(answer.result())
        assert "alive" in [m.replica_id for m in response.quorum.participants]
    status = loop.run(_snapshot(lighthouse))
    json.dumps(status, allow_nan=False)


async def _snapshot(lighthouse: LighthouseServer) -> dict:
    return lighthouse.snapshot()


@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_lighthouse_rpcs_answer_absurd_messages_clearly(engine):
    with server_loop() as loop, lighthouse_on(loop, grpc_engine=engine) as lighthouse, \
            channel_to(lighthouse.grpc_port) as channel:
        before = rss_bytes()
        limit = 4 * 1024 * 1024  # ServerLimits.max_request_bytes, on both engines

        @settings(FUZZ, max_examples=100)
        @given(rpc_message=lighthouse_messages)
        def fuzz(rpc_message):
            rpc, message = rpc_message
            streaming, may_wait = LIGHTHOUSE_RPCS[rpc]
            expected = expected_lighthouse_code(rpc, message, limit)
            timeout = SHORT if may_wait and grpc.StatusCode.RESOURCE_EXHAUSTED not in expected else WAIT
            code, details = call(channel, LIGHTHOUSE + rpc, message.SerializeToString(), streaming, timeout)
            assert code in expected, (rpc, code, details)

        fuzz()
        lighthouse_still_serves(loop, lighthouse, channel)
        assert rss_bytes() - before < MEMORY_BOUND


def test_lighthouse_rpcs_answer_malformed_bytes_clearly():
    with server_loop() as loop, lighthouse_on(loop) as lighthouse, channel_to(lighthouse.grpc_port) as channel:
        before = rss_bytes()
        invalid_before = lighthouse.statistics().invalid_requests

        @settings(FUZZ, max_examples=200)
        @given(rpc_data=mangled(lighthouse_messages))
        @example(rpc_data=("Quorum", b"\xff\xff\xff\xff garbage"))
        @example(rpc_data=("Heartbeat", b"\x0a\xff"))  # a length running past the end
        @example(rpc_data=("Lease", b"\x0a\x02\xc3\x28"))  # invalid UTF-8 in a string field
        def fuzz(rpc_data):
            call_and_check(channel, LIGHTHOUSE, LIGHTHOUSE_RPCS, rpc_data)

        fuzz()
        assert lighthouse.statistics().invalid_requests > invalid_before
        code, _ = call(channel, LIGHTHOUSE + "NoSuchMethod", b"", False, WAIT)
        assert code is grpc.StatusCode.UNIMPLEMENTED
        lighthouse_still_serves(loop, lighthouse, channel)
        assert rss_bytes() - before < MEMORY_BOUND


def manager_still_serves(channel: grpc.Channel) -> None:
    """A whole group's round: both ranks ask for a quorum, then both vote."""
    quorum = channel.unary_unary(MANAGER + "Quorum")
    vote = channel.unary_unary(MANAGER + "ShouldCommit")
    step = STEP_LIMIT - 1  # never behind whatever step the fuzz made the lighthouse reach
    # A rank's request stays in the round after its caller gave up (torchft's server keeps it too): one the
    # fuzz left behind would complete this round at its own step. Rank 0 asking alone first, with a short
    # deadline, completes a round rank 1 left (FAILED_PRECONDITION or DEADLINE_EXCEEDED, no time left) or
    # replaces its own request; the round then holds nothing, or rank 0's, which the next request replaces.
    code, details = call(channel, MANAGER + "Quorum", pb.ManagerQuorumRequest(
        group_rank=0, step=step).SerializeToString(), False, SHORT)
    assert code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED), (code, details)
    # One channel, calls started in order: the server takes rank 0's request before rank 1's.
    answers = [quorum.future(pb.ManagerQuorumRequest(group_rank=rank, step=step, checkpoint_metadata=f"m{rank}")
                             .SerializeToString(), timeout=WAIT) for rank in (0, 1)]
    results = [pb.ManagerQuorumResponse.FromString(answer.result()) for answer in answers]
    assert [r.replica_rank for r in results] == [0, 0] and list(results[0].replica_ids) == ["fuzz-manager"]
    # Votes too: one the fuzz left behind ends at this vote (FAILED_PRECONDITION for another step, or the
    # round's decision for this one), or this vote opens the round that rank 0's next vote replaces.
    code, details = call(channel, MANAGER + "ShouldCommit", pb.ShouldCommitRequest(
        should_commit=True, group_rank=0, step=step).SerializeToString(), False, SHORT)
    assert code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.OK), (code, details)
    votes = [vote.future(pb.ShouldCommitRequest(should_commit=True, group_rank=rank, step=step).SerializeToString(),
                         timeout=WAIT) for rank in (0, 1)]
    assert all(pb.ShouldCommitResponse.FromString(v.result()).should_commit for v in votes)
    metadata = channel.unary_unary(MANAGER + "CheckpointMetadata")(
        pb.CheckpointMetadataRequest(rank=1).SerializeToString(), timeout=WAIT)
    assert pb.CheckpointMetadataResponse.FromString(metadata).checkpoint_metadata == "m1"


def test_manager_server_rpcs_answer_fuzzed_requests_clearly():
    with server_loop() as loop, lighthouse_on(loop) as lighthouse, manager_on(loop, lighthouse) as manager, \
            channel_to(port_of(manager.address())) as channel:
        before = rss_bytes()

        @settings(FUZZ, max_examples=150)
        @given(rpc_data=st.one_of(mangled(manager_messages),
                                  manager_messages.map(lambda m: (m[0], m[1].SerializeToString()))))
        def fuzz(rpc_data):
            call_and_check(channel, MANAGER, MANAGER_RPCS, rpc_data)

        fuzz()
        assert manager.kills, "no Kill request got through"
        manager_still_serves(channel)
        assert rss_bytes() - before < MEMORY_BOUND


def test_a_rank_that_timed_out_does_not_poison_the_next_round_with_its_deadline():
    """Found by the fuzz above: a rank's request whose deadline passed was replaced by its retry, but the
    round kept the old deadline, so the next complete round failed at once with 'no time left'."""
    with server_loop() as loop, lighthouse_on(loop) as lighthouse, manager_on(loop, lighthouse) as manager, \
            channel_to(port_of(manager.address())) as channel:
        alone = pb.ManagerQuorumRequest(group_rank=0, step=3).SerializeToString()
        code, _ = call(channel, MANAGER + "Quorum", alone, False, SHORT)
        assert code is grpc.StatusCode.DEADLINE_EXCEEDED  # rank 1 never came
        manager_still_serves(channel)


# ------------------------------------------------------------------------------- raw TCP and HTTP/2


def exchange(port: int, data: bytes, done, timeout: float = WAIT) -> tuple[bytes, str]:
    """Send ``data``; read until ``done(received)``, the server closes ("closed"), resets ("reset") or
    ``timeout`` ("timeout").

    A server that closes while our bytes are still unread makes its kernel reset the connection, and a
    reset discards whatever it sent before (a GOAWAY included): "reset" is a refusal we can't read.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except ConnectionError:
            return b"", "reset"  # the server gave up on us mid-send: it read enough to refuse
        received = b""
        deadline = time.monotonic() + timeout
        while not done(received):
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return received, "timeout"
            except ConnectionError:
                return received, "reset"
            if not chunk:
                return received, "closed"
            received += chunk
        return received, "done"


def frames_of(received: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream id, payload) of every complete frame the server sent."""
    frames, offset = [], 0
    while offset + 9 <= len(received):
        length, kind, flags, stream_id = wire.parse_frame_header(received, offset)
        if offset + 9 + length > len(received):
            break
        frames.append((kind, flags, stream_id, received[offset + 9:offset + 9 + length]))
        offset += 9 + length
    return frames


def grpc_statuses(frames) -> list[tuple[int, int, str]]:
    """(stream id, grpc-status, grpc-message) of every answer, decoding the server's header blocks."""
    decoder = hpack.Decoder()
    statuses = []
    for kind, _, stream_id, payload in frames:
        if kind == wire.HEADERS:
            headers = dict(decoder.decode(payload, raw=True))
            if b"grpc-status" in headers:
                statuses.append((stream_id, int(headers[b"grpc-status"]),
                                 headers.get(b"grpc-message", b"").decode("ascii")))
    return statuses


def check_grpc_statuses(frames) -> None:
    for stream_id, status, message in grpc_statuses(frames):
        assert status != grpc.StatusCode.UNKNOWN.value[0], f"stream {stream_id}: a handler raised: {message}"
        if status == grpc.StatusCode.INTERNAL.value[0]:
            assert "malformed request framing" in message or "expected one request message" in message, message


def test_garbage_on_the_grpc_port_is_refused_and_the_server_survives():
    with server_loop() as loop, lighthouse_on(loop) as lighthouse, channel_to(lighthouse.grpc_port) as channel:
        before = rss_bytes()

        @settings(FUZZ, max_examples=150)
        @given(data=st.one_of(
            st.binary(min_size=1, max_size=200),
            st.sampled_from([b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
                             b"\x00" * 4096, b"PRI * HTTP/1.1\r\n\r\n"]),
        ))
        def fuzz(data):
            if wire.PREFACE.startswith(data):
                return  # a slow client's first bytes: the server rightly waits for the rest
            received, how = exchange(lighthouse.grpc_port, data, done=lambda r: False)
            assert how in ("closed", "reset"), f"the server kept a non-HTTP/2 connection open ({how})"
            frames = frames_of(received)
            goaway = [payload for kind, _, _, payload in frames if kind == wire.GOAWAY]
            assert goaway and struct.unpack_from(">II", goaway[0])[1] == wire.PROTOCOL_ERROR

        fuzz()
        lighthouse_still_serves(loop, lighthouse, channel)
        assert rss_bytes() - before < MEMORY_BOUND


def _request_block(path: bytes, extra: list[tuple[bytes, bytes]], method: bytes = b"POST",
                   content_type: bytes = b"application/grpc") -> bytes:
    return wire.encode_headers([(b":method", method), (b":scheme", b"http"), (b":path", path),
                                (b"content-type", content_type), (b"te", b"trailers"), *extra])


stream_ids = st.one_of(st.sampled_from([1, 1, 3, 5, 7]), st.sampled_from([0, 2, 2**31 - 1]), st.integers(0, 2**31 - 1))
flags = st.one_of(st.sampled_from([0, wire.END_STREAM, wire.END_HEADERS, wire.END_HEADERS | wire.END_STREAM]),
                  st.integers(0, 255))
paths = st.one_of(st.sampled_from([(LIGHTHOUSE + rpc).encode() for rpc in LIGHTHOUSE_RPCS]),
                  st.sampled_from([b"", b"/", b"*", b"/torchft.LighthouseService/", b"/x" * 1000]),
                  st.binary(max_size=20))
grpc_bodies = st.one_of(
    mangled(lighthouse_messages).map(lambda rpc_data: wire.grpc_message(rpc_data[1])),
    st.tuples(st.integers(0, 255), st.integers(0, 2**32 - 1), st.binary(max_size=40))
    .map(lambda t: struct.pack(">BI", t[0], t[1]) + t[2]),  # a header that lies about the length
    st.binary(max_size=12),
)
header_blocks = st.one_of(
    st.builds(_request_block, paths, st.lists(st.tuples(st.binary(max_size=12), st.binary(max_size=40)), max_size=3),
              st.sampled_from([b"POST", b"GET", b"", b"PRI"]),
              st.sampled_from([b"application/grpc", b"application/grpc+proto", b"text/plain", b""])),
    st.builds(lambda path, timeout: _request_block(path, [(b"grpc-timeout", timeout)]), paths,
              st.sampled_from([b"100m", b"1n", b"99999999H", b"0S", b"-1S", b"S", b"1x", b"123456789m"])),
    st.binary(max_size=60),  # not HPACK at all
)
frames = st.one_of(
    st.builds(lambda sid, fl, block: wire.frame(wire.HEADERS, fl, sid, block), stream_ids, flags, header_blocks),
    st.builds(lambda sid, fl, block: wire.frame(wire.CONTINUATION, fl, sid, block), stream_ids, flags, header_blocks),
    st.builds(lambda sid, fl, body: wire.frame(wire.DATA, fl, sid, body), stream_ids, flags, grpc_bodies),
    st.builds(lambda pairs: wire.frame(wire.SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in pairs)),
              st.lists(st.tuples(st.integers(0, 8), st.integers(0, 2**32 - 1)), max_size=4)),
    st.builds(lambda sid, inc: wire.frame(wire.WINDOW_UPDATE, 0, sid, struct.pack(">I", inc)),
              stream_ids, st.integers(0, 2**32 - 1)),
    st.builds(lambda fl, payload: wire.frame(wire.PING, fl, 0, payload), flags, st.binary(min_size=8, max_size=8)),
    st.builds(lambda sid, code: wire.rst_stream(sid, code), stream_ids, st.integers(0, 2**32 - 1)),
    st.builds(lambda last, code: wire.goaway(last, code), stream_ids, st.integers(0, 2**32 - 1)),
    st.builds(lambda kind, fl, sid, payload: wire.frame(kind, fl, sid, payload),
              st.sampled_from([wire.PRIORITY, wire.PUSH_PROMISE, 0x0A, 0x20, 0xFF]), flags, stream_ids,
              st.binary(max_size=20)),
)


@st.composite
def frame_sequences(draw) -> list[bytes]:
    """Mostly well-formed requests (increasing stream ids, fuzzed headers and bodies) mixed with random frames."""
    out, stream_id = [], 1
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            out.append(draw(frames))
            continue
        block = draw(header_blocks)
        body = draw(grpc_bodies)
        if draw(st.booleans()):  # the usual shape: HEADERS, then the body with END_STREAM
            out += [wire.frame(wire.HEADERS, wire.END_HEADERS, stream_id, block),
                    wire.frame(wire.DATA, wire.END_STREAM, stream_id, body)]
        else:  # headers split over CONTINUATION, body padded
            cut = draw(st.integers(0, len(block)))
            pad = draw(st.integers(0, 255))
            out += [wire.frame(wire.HEADERS, 0, stream_id, block[:cut]),
                    wire.frame(wire.CONTINUATION, wire.END_HEADERS, stream_id, block[cut:]),
                    wire.frame(wire.DATA, wire.END_STREAM | wire.PADDED, stream_id, bytes([pad]) + body + b"\0" * pad)]
        stream_id += 2
    return out


def _answered(received: bytes, probe_id: int | None, nonce: bytes) -> bool:
    seen = frames_of(received)
    if any(kind == wire.GOAWAY for kind, *_ in seen):
        return True
    acked = any(kind == wire.PING and fl & wire.ACK and payload == nonce for kind, fl, _, payload in seen)
    probed = probe_id is None or any(sid == probe_id and kind in (wire.HEADERS, wire.RST_STREAM)
                                     for kind, _, sid, _ in seen)
    return acked and probed


def test_random_http2_frames_get_answers_or_goaway_and_the_server_survives():
    with server_loop() as loop, lighthouse_on(loop) as lighthouse, channel_to(lighthouse.grpc_port) as channel:
        before = rss_bytes()

        @settings(FUZZ, max_examples=150)
        @given(fuzz_frames=frame_sequences(), nonce=st.binary(min_size=8, max_size=8))
        @example(fuzz_frames=[wire.frame(wire.HEADERS, wire.END_HEADERS, 1, _request_block(
                     (LIGHTHOUSE + "Heartbeat").encode(), [])),
                     wire.frame(wire.DATA, wire.END_STREAM, 1, struct.pack(">BI", 0, 2**32 - 1) + b"tiny")],
                 nonce=b"declared")  # a 4 GiB message declared in a 9-byte body: refused, not allocated
        def fuzz(fuzz_frames, nonce):
            ids = [wire.parse_frame_header(f)[3] for f in fuzz_frames if wire.parse_frame_header(f)[1] == wire.HEADERS]
            probe_id = (max(ids, default=0) | 1) + 2
            probe = b""
            if probe_id <= 2**31 - 1:
                probe = (wire.frame(wire.HEADERS, wire.END_HEADERS, probe_id,
                                    _request_block((LIGHTHOUSE + "Heartbeat").encode(), []))
                         + wire.frame(wire.DATA, wire.END_STREAM, probe_id, wire.grpc_message(
                             pb.LighthouseHeartbeatRequest(replica_id="probe").SerializeToString())))
            else:
                probe_id = None
            data = (wire.PREFACE + wire.settings_frame({}) + b"".join(fuzz_frames) + probe
                    + wire.frame(wire.PING, 0, 0, nonce))
            received, how = exchange(lighthouse.grpc_port, data, lambda r: _answered(r, probe_id, nonce))
            assert how != "timeout", "neither an answer nor GOAWAY: the connection hangs"
            seen = frames_of(received)
            if how == "closed":  # an orderly close must have said why (after a reset, the GOAWAY may be lost)
                assert any(kind == wire.GOAWAY for kind, *_ in seen), "closed without GOAWAY"
            check_grpc_statuses(seen)
            goaway = any(kind == wire.GOAWAY for kind, *_ in seen)
            outcomes["reset" if how == "reset" else "goaway" if goaway else "alive"] += 1
            outcomes.update(f"status {status}" for _, status, _ in grpc_statuses(seen))

        outcomes: collections.Counter[str] = collections.Counter()
        fuzz()
        print(sorted(outcomes.items()))
        # Both paths were exercised: connections refused with GOAWAY, and fuzzed requests answered.
        assert outcomes["goaway"] and outcomes["alive"] and outcomes[f"status {grpc.StatusCode.INTERNAL.value[0]}"]
        assert lighthouse._grpc.protocol_errors > 0  # type: ignore[union-attr]
        lighthouse_still_serves(loop, lighthouse, channel)
        assert rss_bytes() - before < MEMORY_BOUND


# ------------------------------------------------------------------------------------ memory bounds


class RawH2:
    """A bare HTTP/2 client that honours the server's connection window (no more)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        self.received = b""
        self.sent_data = 0
        self.sock.sendall(wire.PREFACE + wire.settings_frame({}))

    def window(self) -> int:
        updates = [struct.unpack(">I", payload)[0] & 0x7FFFFFFF
                   for kind, _, sid, payload in frames_of(self.received) if kind == wire.WINDOW_UPDATE and sid == 0]
        return wire.DEFAULT_WINDOW + sum(updates) - self.sent_data

    def read(self) -> None:
        chunk = self.sock.recv(1 << 20)
        assert chunk, "the server closed the connection"
        self.received += chunk

    def data(self, stream_id: int, payload: bytes) -> None:
        while self.window() < len(payload):
            self.read()
        self.sock.sendall(wire.frame(wire.DATA, 0, stream_id, payload))
        self.sent_data += len(payload)

    def close(self) -> None:
        self.sock.close()


def test_a_connection_cannot_make_the_server_hold_more_than_its_request_budget():
    """Found by this file: the connection window reopens as data arrives, so the per-request limit alone let
    one peer park max_concurrent_streams * 4 MiB (16 GiB) in unfinished requests. Requests beyond the
    connection's budget are now refused with RESOURCE_EXHAUSTED instead of buffered."""
    with server_loop() as loop, lighthouse_on(loop) as lighthouse, channel_to(lighthouse.grpc_port) as channel:
        before = rss_bytes()
        peer = RawH2(lighthouse.grpc_port)
        try:
            piece = b"\0" * wire.DEFAULT_MAX_FRAME
            per_stream = 4 * 1024 * 1024 - 4 * len(piece)  # just under the 4 MiB request limit
            for stream_id in range(1, 2 * 16, 2):  # 16 unfinished requests: 64 MiB
                peer.sock.sendall(wire.frame(wire.HEADERS, wire.END_HEADERS, stream_id,
                                             _request_block((LIGHTHOUSE + "Heartbeat").encode(), [])))
                for _ in range(per_stream // len(piece)):
                    peer.data(stream_id, piece)
            peer.sock.sendall(wire.frame(wire.PING, 0, 0, b"budget!!"))
            while wire.frame(wire.PING, wire.ACK, 0, b"budget!!") not in peer.received:
                peer.read()
            grown = rss_bytes() - before
            refused = [(sid, message) for sid, status, message in grpc_statuses(frames_of(peer.received))
                       if status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
        finally:
            peer.close()
        assert len(refused) >= 7, refused  # 32 MiB of budget holds 8 of the 16
        assert all("request bytes" in message for _, message in refused)
        assert grown < 48 * 1024 * 1024, f"RSS grew by {grown / 2**20:.0f} MiB for 64 MiB of unfinished requests"
        lighthouse_still_serves(loop, lighthouse, channel)


@pytest.mark.parametrize("engine, limit", [("native", 4 * 1024 * 1024), ("grpcio", 4 * 1024 * 1024)])
def test_requests_at_and_over_the_message_limit_get_answers(engine, limit):
    """Found by this file: on the native engine a request whose body (message and 5-byte prefix) did not fit
    the 4 MiB stream window, which is never reopened, stalled its caller until its deadline (forever without
    one) instead of getting RESOURCE_EXHAUSTED; a message of exactly the limit did too."""
    with server_loop() as loop, lighthouse_on(loop, grpc_engine=engine) as lighthouse, \
            channel_to(lighthouse.grpc_port) as channel:
        at_limit = pb.LighthouseHeartbeatRequest(replica_id="x" * (limit - 5)).SerializeToString()
        assert len(at_limit) == limit
        code, details = call(channel, LIGHTHOUSE + "Heartbeat", at_limit, False, WAIT)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "longer than" in details, (code, details)
        over = pb.LighthouseHeartbeatRequest(replica_id="x" * (limit - 4)).SerializeToString()
        code, details = call(channel, LIGHTHOUSE + "Heartbeat", over, False, WAIT)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
        assert lighthouse.statistics().heartbeats == 0
        lighthouse_still_serves(loop, lighthouse, channel)


# ---------------------------------------------------------------------------------------------- HTTP


def http_exchange(port: int, request: bytes, complete: bool = True, timeout: float = WAIT) -> int | None:
    """Send a raw request; the status of the answer, or None when the server closed without one.

    A request that is not ``complete`` (a body shorter than it declares) may rightly be waited on: after a
    moment the socket is half-closed, which ends it, and then any outcome is fine but a hang.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(request)
        except ConnectionError:
            pass
        received = b""
        deadline = time.monotonic() + timeout
        half_closed = False
        while b"\r\n" not in received:
            wait = deadline - time.monotonic() if complete or half_closed else 0.3
            sock.settimeout(max(0.01, wait))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                if complete or half_closed:
                    pytest.fail(f"no answer within {timeout:.0f}s to {request[:200]!r}")
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                half_closed = True
                continue
            except ConnectionError:
                break
            if not chunk:
                break
            received += chunk
    if not received:
        return None
    status_line = received.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/"), status_line
    return int(status_line.split()[1])


def aiohttp_expect_bug(request: bytes) -> bool:
    """Whether ``request`` carries an Expect header that is not UTF-8.

    aiohttp (3.14.5) answers those with 500 on every route: its default Expect handler puts the header in
    the text of its 417 and can't encode it (UnicodeEncodeError). An upstream bug, before our handlers
    run; see test_aiohttp_answers_an_expect_header_that_is_not_utf8_with_500.
    """
    for line in request.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"expect":
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return True
    return False


def raw_request(method: bytes, target: bytes, version: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    lines = [method + b" " + target + b" " + version] + [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


methods = st.one_of(st.sampled_from([b"GET", b"POST", b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS"]),
                    st.sampled_from([b"PATCH", b"TRACE", b"CONNECT", b"BREW", b"get", b"G\x00T", b""]))
versions = st.one_of(st.just(b"HTTP/1.1"), st.sampled_from([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9.9", b"", b"HTTP/1.1 x"]))
printable = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
clean_headers = st.lists(st.tuples(st.sampled_from([b"Accept", b"Content-Type", b"Connection", b"Cookie", b"X-Y"]),
                                   st.text(printable, max_size=30).map(str.encode)), max_size=3)
junk_headers = st.lists(st.tuples(
    st.one_of(st.sampled_from([b"Host", b"Authorization", b"Content-Length", b"Transfer-Encoding", b"Expect"]),
              st.binary(max_size=12)),
    st.one_of(st.binary(max_size=30), st.integers(0, 10000).map(lambda n: b"v" * n))), max_size=3)
json_bodies = st.one_of(
    st.sampled_from([b"", b"{}", b"null", b"[]", b'{"msg": 5}', b'{"msg": "stop"}', b"\xff\xfe{", b'"x"',
                     b'{"msg": "' + b"m" * 5000 + b'"}']),
    st.integers(1, 4000).map(lambda depth: b"[" * depth + b"]" * depth),  # nested past the recursion limit
    st.binary(max_size=100),
)
declared_lengths = st.sampled_from([b"0", b"-1", b"99999999999999999999", b"abc", b"1e3", b"4097", b"5, 5", b" 7 "])
chunked_bodies = st.sampled_from([(b"5\r\nhello\r\n0\r\n\r\n", True), (b"zz\r\n", True), (b"0\r\n\r\n", True),
                                  (b"ffffffffffffffff\r\nx", False), (b"3\r\nabc", False)])


@st.composite
def http_requests(draw, paths, tokens) -> tuple[bytes, bool]:
    """(request bytes, whether its body is as long as it says): mostly well-formed, some junk."""
    clean = draw(st.booleans())
    headers = [(b"Host", b"127.0.0.1")] if clean or draw(st.booleans()) else []
    token = draw(tokens)
    if token is not None:
        headers.append((b"Authorization", token))
    headers += draw(clean_headers if clean else junk_headers)
    body, complete = draw(json_bodies), True
    how = draw(st.sampled_from(["exact", "exact", "none", "declared", "chunked"])) if not clean else "exact"
    if how == "exact" and body:
        headers.append((b"Content-Length", str(len(body)).encode()))
    elif how == "declared":
        length = draw(declared_lengths)
        headers.append((b"Content-Length", length))
        complete = not length.strip().isdigit() or int(length) <= len(body)
    elif how == "chunked":
        headers.append((b"Transfer-Encoding", b"chunked"))
        body, complete = draw(chunked_bodies)
    method = draw(methods) if not clean else draw(st.sampled_from([b"GET", b"POST", b"HEAD"]))
    version = draw(versions) if not clean else b"HTTP/1.1"
    return raw_request(method, draw(paths), version, headers, body), complete


ADMIN_TOKEN = "fuzz-admin-token"
admin_tokens_list = [
    b"Bearer " + ADMIN_TOKEN.encode(), b"bearer " + ADMIN_TOKEN.encode() + b"  ", b"Bearer wrong", b"Bearer",
    b"Bearer ", b"Basic Zm9vOmJhcg==", b"Bearer " + ADMIN_TOKEN.encode() + b"\xff", b"Bearer \xc3\xa9\xff",
    b"Bearer " + b"t" * 10000, b"\x00",
]


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of ``choices`` drawn with the given integer weights (one_of draws them evenly)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(table.__getitem__)


dashboard_paths = weighted(
    (4, st.sampled_from([b"/", b"/api/status", b"/api/history", b"/api/history?seconds=1e400&samples_after=-1",
                         b"/metrics", b"/healthz", b"/api/replicas/known/kill",
                         b"/api/replicas/nobody/kill", b"/api/replicas/known/kill?x=%zz", b"/healthz?a=1&a=2"])),
    (1, st.sampled_from([b"/api/replicas//kill", b"/api/replicas/%00/kill", b"/api/replicas/%ff%fe/kill",
                         b"/api/replicas/..%2f..%2fetc/kill", b"*", b"//", b"/api/status?" + b"a=b&" * 500,
                         b"/" + b"x" * 9000, b"http://example.com/healthz"])),
    (1, st.text(st.characters(min_codepoint=0x21, max_codepoint=0x2FF), max_size=40).map(lambda s: b"/" + s.encode())),
    (1, st.binary(max_size=20)),
)
admin_tokens = weighted((2, st.none()), (4, st.sampled_from(admin_tokens_list)), (1, st.binary(max_size=30)))


def test_lighthouse_http_answers_random_requests_without_5xx():
    with server_loop() as loop, lighthouse_on(loop, admin_token=ADMIN_TOKEN, heartbeat_timeout=600.0) as lighthouse, \
            channel_to(lighthouse.grpc_port) as channel:
        fake = loop.run(FakeManager().start())
        try:
            request = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="known", address=fake.address))
            channel.unary_unary(LIGHTHOUSE + "Quorum")(request.SerializeToString(), timeout=WAIT)
            before = rss_bytes()
            statuses: collections.Counter[int | None] = collections.Counter()

            @settings(FUZZ, max_examples=250)
            @given(request=http_requests(dashboard_paths, admin_tokens))
            @example(request=(raw_request(b"POST", b"/api/replicas/nobody/kill", b"HTTP/1.1",
                                          [(b"Host", b"x"), (b"Authorization", b"Bearer " + ADMIN_TOKEN.encode()),
                                           (b"Content-Length", b"4000")], b"[" * 2000 + b"]" * 2000), True))
            @example(request=(raw_request(b"POST", b"/api/replicas/known/kill", b"HTTP/1.1",
                                          [(b"Host", b"x"), (b"Authorization", b"Bearer \xff" + ADMIN_TOKEN.encode())],
                                          b""), True))
            def fuzz(request):
                request, complete = request
                status = http_exchange(lighthouse.http_port, request, complete)
                statuses[status] += 1
                if status is not None:
                    kill = b"/kill" in request.split(b"\r\n", 1)[0]
                    allowed = status < 500 or (status == 502 and kill) or aiohttp_expect_bug(request)
                    assert allowed, (status, request[:300])

            fuzz()
            print(sorted(statuses.items(), key=str))
            assert rss_bytes() - before < MEMORY_BOUND
            assert fetch(f"http://127.0.0.1:{lighthouse.http_port}/healthz")[:2] == (200, b"ok")
            status, body, _ = fetch(f"http://127.0.0.1:{lighthouse.http_port}/api/status")
            assert status == 200 and "known" in {r["replica_id"] for r in json.loads(body)["replicas"]}
            assert fetch(f"http://127.0.0.1:{lighthouse.http_port}/metrics")[0] == 200
            kills = len(fake.kills)
            status = http_exchange(lighthouse.http_port, raw_request(
                b"POST", b"/api/replicas/known/kill", b"HTTP/1.1",
                [(b"Host", b"x"), (b"Authorization", b"Bearer " + ADMIN_TOKEN.encode()), (b"Content-Length", b"15")],
                b'{"msg": "bye"}\n'))
            assert status == 200 and fake.kills[kills:] == ["bye"]
            lighthouse_still_serves(loop, lighthouse, channel, quorum=False)  # "known" stays healthy for 600 s
        finally:
            loop.run(fake.stop())


CHECKPOINT_TOKEN = "ckpt-token"
checkpoint_tokens = weighted(
    (2, st.none()),
    (6, st.just(b"Bearer " + CHECKPOINT_TOKEN.encode())),
    (3, st.sampled_from([b"Bearer wrong", b"bearer " + CHECKPOINT_TOKEN.encode(), b"Bearer " + b"t" * 10000,
                         b"Bearer " + CHECKPOINT_TOKEN.encode() + b"\xff", b"Bearer \xc3\xa9", b""])),
    (1, st.binary(max_size=30)),
)
query_values = {
    "session": weighted((4, st.sampled_from(["s1", "s2", "s3", "fuzz_-9"])),
                        (1, st.sampled_from(["", "bad id!", "x" * 65, "%00", "s1&session=s2"]))),
    "timeout": st.sampled_from(["0", "0.05", "0.2", "-1", "nan", "inf", "-inf", "1e309", "abc", "", "1" * 400]),
    "start": st.one_of(st.integers(-5, 5000).map(str), st.sampled_from(["", "x", str(2**70), "1.5", "-0"])),
    "end": st.one_of(st.integers(-5, 5000).map(str), st.sampled_from(["", "x", str(2**70), "1e3"])),
    "ok": st.sampled_from(["0", "1", "yes", ""]),
}


@st.composite
def checkpoint_targets(draw) -> bytes:
    step = draw(weighted((10, st.just("5")), (1, st.just("6")),
                         (3, st.sampled_from(["4", "-1", "abc", "9" * 5000, "5.0", "+5", "\u0665", "0x5", "", "%35"]))))
    suffix = draw(weighted((6, st.sampled_from(["", "/header", "/data", "/checksums", "/done"])),
                           (1, st.sampled_from(["/data/", "/x", "/../5", "/done/x", "/checksums/x"]))))
    names = draw(st.lists(st.sampled_from(sorted(query_values)), max_size=4))
    if draw(st.integers(0, 5)):
        names.insert(0, "session")  # without one every route answers 400 before looking further
    query = "&".join(f"{name}={draw(query_values[name])}" for name in names)
    if draw(st.integers(0, 9)) == 0:
        query += draw(st.sampled_from(["&&&", "%zz", "&=", "a" * 3000]))
    target = f"/checkpoint/{step}{suffix}" + (f"?{query}" if query else "")
    return target.encode()


@st.composite
def checkpoint_requests(draw) -> tuple[bytes, bool]:
    request, complete = draw(http_requests(checkpoint_targets(), checkpoint_tokens))
    if draw(st.integers(0, 3)):  # mostly the methods the routes take, with a Host
        method = draw(st.sampled_from([b"GET", b"GET", b"POST", b"HEAD"]))
        request = method + b" " + request.split(b" ", 1)[1]
        if b"\r\nHost:" not in request.split(b"\r\n\r\n", 1)[0]:
            request = request.replace(b"\r\n", b"\r\nHost: x\r\n", 1)
    return request, complete


def test_checkpoint_server_answers_random_requests_and_still_serves():
    import torch

    from torchft_lite.checkpointing import HTTPTransport

    server = HTTPTransport(timedelta(seconds=1), hostname="127.0.0.1", bind_host="127.0.0.1", token=CHECKPOINT_TOKEN)
    client = HTTPTransport(timedelta(seconds=WAIT), hostname="127.0.0.1", bind_host="127.0.0.1",
                           token=CHECKPOINT_TOKEN)
    try:
        weights = {"model": {"w": torch.arange(50_000, dtype=torch.float32)}, "torchft": {"step": 5}}
        server.send_checkpoint([1], 5, weights, timedelta(seconds=5))
        before = rss_bytes()
        statuses: collections.Counter[int | None] = collections.Counter()

        @settings(FUZZ, max_examples=250)
        @given(request=checkpoint_requests())
        @example(request=(raw_request(b"GET", b"/checkpoint/5?session=s1", b"HTTP/1.1",
                                      [(b"Host", b"x"), (b"Authorization", b"Bearer \xff")], b""), True))
        @example(request=(raw_request(b"HEAD", b"/checkpoint/5/header?session=s9", b"HTTP/1.1",
                                      [(b"Host", b"x"), (b"Authorization", b"Bearer " + CHECKPOINT_TOKEN.encode())],
                                      b""), True))
        @example(request=(raw_request(b"GET", b"/checkpoint/5/checksums?session=s8&timeout=nan", b"HTTP/1.1",
                                      [(b"Host", b"x"), (b"Authorization", b"Bearer " + CHECKPOINT_TOKEN.encode())],
                                      b""), True))
        def fuzz(request):
            request, complete = request
            status = http_exchange(server.port, request, complete)
            statuses[status] += 1
            # 504 is documented: a step not published in time (held requests), or not encoded in time.
            allowed = status is None or status < 500 or status == 504 or aiohttp_expect_bug(request)
            assert allowed, (status, request[:300])

        fuzz()
        print(sorted(statuses.items(), key=str))
        assert rss_bytes() - before < MEMORY_BOUND
        server.disallow_checkpoint()  # the fuzz's sessions are cut off at step 5's send timeout
        weights["torchft"]["step"] = 6
        server.send_checkpoint([1], 6, weights, timedelta(seconds=WAIT))
        received = client.recv_checkpoint(0, server.metadata(), 6, timedelta(seconds=WAIT))
        assert torch.equal(received["model"]["w"], weights["model"]["w"]) and received["torchft"]["step"] == 6
        server.disallow_checkpoint()
        stats = server.statistics()
        assert stats.published_step is None and stats.held_requests == 0 and stats.active_streams == 0
    finally:
        client.shutdown()
        server.shutdown()


@pytest.mark.xfail(reason="aiohttp 3.14.5's default Expect handler can't encode a non-UTF-8 header into its 417",
                   strict=True)  # strict: the day aiohttp fixes it, this fails and says so
def test_aiohttp_answers_an_expect_header_that_is_not_utf8_with_500():
    with server_loop() as loop, lighthouse_on(loop) as lighthouse:
        request = raw_request(b"GET", b"/healthz", b"HTTP/1.1", [(b"Host", b"x"), (b"Expect", b"\x80")], b"")
        assert http_exchange(lighthouse.http_port, request) == 417
