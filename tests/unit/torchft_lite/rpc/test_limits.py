"""The flood limits as plain data: their validation, the grpcio arguments, the frame budgets, the rate-limited
log, and the guard's deadline sweep over a fake connection at literal times (no sockets)."""

from __future__ import annotations

import logging

import pytest

from torchft_lite.rpc.h2grpc import wire
from torchft_lite.rpc.h2grpc.guard import ConnectionGuard, FloodMeter, LimitExceeded, SweepState, flood_meters
from torchft_lite.rpc.h2grpc.streams import Stream
from torchft_lite.rpc.limits import LimitLog, ServerLimits, grpcio_options

# ------------------------------------------------------------------ ServerLimits


@pytest.mark.parametrize("field, value", [
    ("max_connections", 0), ("max_concurrent_streams", -1), ("max_pings", 1.5), ("max_resets", 0),
    ("max_connections_per_host", 0), ("idle_timeout", 0), ("request_timeout", float("nan")),
    ("flood_window", -1.0), ("handshake_timeout", float("inf")),
])
def test_limits_refuse_values_that_disable_or_break_them(field, value):
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: value})


def test_the_sweep_runs_often_enough_for_the_shortest_deadline_and_at_most_once_a_second():
    assert ServerLimits().sweep_interval() == 1.0
    assert ServerLimits(idle_timeout=2.0).sweep_interval() == 0.5
    assert ServerLimits(request_timeout=0.01).sweep_interval() == 0.05


def test_grpcio_gets_the_limits_it_has_arguments_for():
    options = dict(grpcio_options(ServerLimits(max_connections=7, max_concurrent_streams=9, idle_timeout=1.5,
                                               max_header_list_bytes=1000, max_request_bytes=2000)))
    assert options["grpc.max_allowed_incoming_connections"] == 7
    assert options["grpc.max_concurrent_streams"] == 9
    assert options["grpc.max_connection_idle_ms"] == 1500
    assert options["grpc.max_metadata_size"] == options["grpc.absolute_max_metadata_size"] == 1000
    assert options["grpc.max_receive_message_length"] == 2000
    # The ping policy under the name grpc-core reads (a misspelt argument is silently ignored).
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 1000
    assert options["grpc.http2.max_ping_strikes"] == 2


# ------------------------------------------------------------------ FloodMeter


def test_a_meter_allows_its_limit_per_window_and_raises_past_it():
    meter = FloodMeter("ping_flood", "PING frames", limit=3, window=10.0)
    for now in (0.0, 1.0, 2.0):
        meter.spend(now)
    with pytest.raises(LimitExceeded) as info:
        meter.spend(3.0)
    assert info.value.limit == "ping_flood" and info.value.code == wire.ENHANCE_YOUR_CALM
    assert "more than 3 PING frames within 10s" in str(info.value)


def test_a_new_window_starts_after_the_old_one_ends_and_forgiveness_resets_it():
    meter = FloodMeter("settings_flood", "SETTINGS frames", limit=2, window=1.0)
    meter.spend(0.0)
    meter.spend(0.5)
    meter.spend(1.5)  # a new window: 1 of 2
    meter.spend(1.6)
    meter.count = 0  # what the connection does for PINGs when it sends data
    meter.spend(1.7)
    meter.spend(1.8)
    with pytest.raises(LimitExceeded):
        meter.spend(1.9)


def test_a_connection_gets_one_meter_per_flood_kind():
    pings, settings, resets = flood_meters(ServerLimits(max_pings=5, max_settings=6, max_resets=7, flood_window=2.0))
    assert [(m.name, m.limit, m.window) for m in (pings, settings, resets)] == [
        ("ping_flood", 5, 2.0), ("settings_flood", 6, 2.0), ("rapid_reset", 7, 2.0)]


# ------------------------------------------------------------------ LimitLog


def test_limit_hits_are_all_counted_but_logged_at_most_once_per_interval(caplog):
    now = [0.0]
    log = LimitLog("lighthouse gRPC", interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="torchft_lite.rpc.limits"):
        for _ in range(5):
            log.hit("ping_flood", "ipv4:10.0.0.9:4000", "more than 100 PING frames")
        now[0] = 10.0
        log.hit("rapid_reset", "ipv4:10.0.0.9:4001", "more than 200 streams reset")
    assert log.counts == {"ping_flood": 5, "rapid_reset": 1}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "ipv4:10.0.0.9:4000 hit a flood limit (ping_flood)" in lines[0]
    assert "[4 more limit hit(s)" in lines[1] and "(rapid_reset)" in lines[1]


# ------------------------------------------------------------------ the guard


class FakeConnection:
    """The state the guard's sweep reads, and a record of what it did."""

    def __init__(self, limits: ServerLimits, peer: str = "ipv4:127.0.0.1:5000") -> None:
        self.transport = object()
        self.peer = peer
        self.limits = limits
        self.sweep = SweepState()
        self.streams: dict[int, Stream] = {}
        self.continuation = None  # an unfinished header block
        self.buffer = bytearray()  # bytes of an unfinished frame
        self.last_stream_id = 0
        self.done: list[str] = []
        self._partial_frame = object()

    def open(self, stream_id: int, request_done: bool) -> Stream:
        stream = Stream(stream_id, 65535)
        stream.request_done = request_done
        self.streams[stream_id] = stream
        self.last_stream_id = stream_id
        return stream

    def open_streams(self):
        return list(self.streams.values())

    def stalled_input(self):
        if self.continuation is not None:
            return self.continuation
        return None if self.streams or not self.buffer else self._partial_frame

    def trailers_only(self, stream, block):
        self.done.append(f"trailers {stream.id} " + ("grpc-status 4" if b"grpc-status\x01\x34" in block else "?"))
        self.streams.pop(stream.id)

    def stop_receiving(self, stream):
        self.done.append(f"write {wire.RST_STREAM} {stream.id}")

    def fail(self, code, message, limit=None):
        self.done.append(f"fail {code} {limit}")

    def go_away(self):
        self.done.append("go_away")


class FakeServer:
    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.connections: set = set()


LIMITS = ServerLimits(idle_timeout=5.0, request_timeout=2.0, max_connections=2, max_connections_per_host=1)


def guard() -> ConnectionGuard:
    return ConnectionGuard(FakeServer(LIMITS), LimitLog("test", interval=0.0))


def test_an_idle_connection_gets_goaway_after_idle_timeout_of_sweeps_with_no_new_stream():
    g, conn = guard(), FakeConnection(LIMITS)
    g.check(conn, 0.0, LIMITS)
    g.check(conn, 4.9, LIMITS)
    assert conn.done == []
    g.check(conn, 5.0, LIMITS)
    assert conn.done == ["go_away"] and g.log.counts == {"idle_timeout": 1}


def test_a_call_between_two_sweeps_restarts_the_idle_clock_and_an_open_stream_is_never_idle():
    g, conn = guard(), FakeConnection(LIMITS)
    g.check(conn, 0.0, LIMITS)
    conn.last_stream_id = 1  # a call came and went between two sweeps
    g.check(conn, 4.0, LIMITS)
    g.check(conn, 8.0, LIMITS)
    assert conn.done == []
    conn.open(3, request_done=True)  # a lease: a long-lived stream whose request is complete
    for now in (9.0, 20.0, 100.0):
        g.check(conn, now, LIMITS)
    assert conn.done == []


def test_a_request_still_arriving_after_request_timeout_is_ended_deadline_exceeded():
    g, conn = guard(), FakeConnection(LIMITS)
    conn.open(1, request_done=False)
    fast = conn.open(3, request_done=False)
    g.check(conn, 0.0, LIMITS)  # both get their deadline here
    fast.request_done = True
    g.check(conn, 1.9, LIMITS)
    assert conn.done == []
    g.check(conn, 2.0, LIMITS)
    assert conn.done == ["trailers 1 grpc-status 4", f"write {wire.RST_STREAM} 1"]
    assert g.log.counts == {"slow_request": 1} and list(conn.streams) == [3]


def test_a_header_block_or_a_frame_still_arriving_after_request_timeout_gets_goaway():
    g, conn = guard(), FakeConnection(LIMITS)
    conn.continuation = (1, 0, bytearray(b"\x00"))
    g.check(conn, 0.0, LIMITS)
    g.check(conn, 1.0, LIMITS)
    conn.continuation = (3, 0, bytearray(b"\x00"))  # a new block: its own deadline
    g.check(conn, 2.5, LIMITS)
    assert conn.done == []
    g.check(conn, 4.5, LIMITS)
    assert conn.done == [f"fail {wire.ENHANCE_YOUR_CALM} slow_request"]
    other = FakeConnection(LIMITS)
    other.buffer += b"\x00\x00\x10"  # the first bytes of a frame header, and then nothing
    g.check(other, 10.0, LIMITS)
    g.check(other, 12.0, LIMITS)
    assert other.done == [f"fail {wire.ENHANCE_YOUR_CALM} slow_request"]


def test_the_connection_cap_in_all_and_per_host():
    server = FakeServer(LIMITS)
    g = ConnectionGuard(server, LimitLog("test", interval=0.0))
    assert g.admit("ipv4:10.0.0.1:1") is None
    server.connections.add("a")
    assert "maximum of 1 connections from 10.0.0.1" in g.admit("ipv4:10.0.0.1:2")
    assert g.admit("ipv4:10.0.0.2:1") is None
    server.connections.add("b")
    assert "maximum of 2 connections" in g.admit("ipv4:10.0.0.3:1")
    server.connections.discard("a")
    g.release("ipv4:10.0.0.1:1")
    assert g.admit("ipv4:10.0.0.1:3") is None
    assert g.log.counts == {"max_connections_per_host": 1, "max_connections": 1}
