"""The native engine's flood guard: it enforces :class:`~torchft_lite.rpc.limits.ServerLimits`.

Two halves, because the limits are of two kinds: **what a frame costs** is
checked as frames arrive, by a connection's :class:`FloodMeter` per kind of frame
(:func:`flood_meters`); **what a connection holds** is checked by one
:class:`ConnectionGuard` per server (the connection cap, and a sweep for idle and
slow connections). Every hit is counted by name in the server's
:class:`~torchft_lite.rpc.limits.LimitLog` (``GrpcServer.limits_hit``) and logged
at WARNING, rate-limited.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from torchft_lite.rpc.access import peer_host
from torchft_lite.rpc.h2grpc import wire
from torchft_lite.rpc.h2grpc.streams import Stream
from torchft_lite.rpc.h2grpc.wire import ProtocolError
from torchft_lite.rpc.limits import LimitLog, ServerLimits

__all__ = ["ConnectionGuard", "FloodMeter", "LimitExceeded", "SweepState", "flood_meters"]

# grpc-status 4 (DEADLINE_EXCEEDED), trailers-only: built here so this module needs no gRPC import.
_SLOW_REQUEST = [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-status", b"4")]


class LimitExceeded(ProtocolError):
    """A peer went over the flood limit ``limit``: the connection answers GOAWAY ENHANCE_YOUR_CALM and closes."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message, wire.ENHANCE_YOUR_CALM)
        self.limit = limit


class FloodMeter:
    """How many frames of one kind a peer sent in the current window (which starts at the first of them).

    ``spend()`` raises :class:`LimitExceeded` at the one past ``limit``; setting ``count`` to 0 forgives
    the window so far (the connection does so for PINGs whenever it sends data, as gRPC's ping policy does:
    a client may probe a connection that is busy answering it).
    """

    __slots__ = ("name", "what", "limit", "window", "count", "since")

    def __init__(self, name: str, what: str, limit: int, window: float) -> None:
        self.name = name
        self.what = what
        self.limit = limit
        self.window = window
        self.count = 0
        self.since = 0.0

    def spend(self, now: float | None = None) -> None:
        """Count one frame at ``now`` (``time.monotonic()`` when None)."""
        now = time.monotonic() if now is None else now
        if self.count == 0 or now - self.since >= self.window:
            self.count, self.since = 0, now
        self.count += 1
        if self.count > self.limit:
            raise LimitExceeded(self.name, f"more than {self.limit} {self.what} within {self.window:g}s")


def flood_meters(limits: ServerLimits) -> tuple[FloodMeter, FloodMeter, FloodMeter]:
    """A new connection's meters: PINGs (forgiven when data is sent), SETTINGS, and streams reset or refused.

    These are the frames a peer can make us spend work on without a call to show for it (PINGs and SETTINGS
    are answered, a reset stream was parsed and dispatched for nothing). A peer over a budget gets
    :class:`LimitExceeded`, which the connection answers with GOAWAY ENHANCE_YOUR_CALM before closing."""
    window = limits.flood_window
    return (FloodMeter("ping_flood", "PING frames while no data was sent", limits.max_pings, window),
            FloodMeter("settings_flood", "SETTINGS frames", limits.max_settings, window),
            FloodMeter("rapid_reset", "streams reset by the client or refused", limits.max_resets, window))


class SweepState:
    """What the sweep remembers of one connection between two sweeps."""

    __slots__ = ("idle_since", "idle_mark", "stall", "stall_since")

    def __init__(self) -> None:
        self.idle_since: float | None = None  # first sweep that saw no open stream, since the last new one
        self.idle_mark = -1  # the connection's last stream id at that sweep (a new call moves it)
        self.stall: object | None = None  # the unfinished header block (or partial frame) seen last sweep
        self.stall_since = 0.0


class GuardedConnection(Protocol):
    """What the sweep reads and calls on a connection (an H2Connection; declared here so this module
    imports no connection)."""

    transport: object | None
    peer: str
    limits: ServerLimits  # as they were when it was made
    sweep: SweepState
    last_stream_id: int

    def open_streams(self) -> list[Stream]: ...
    def stalled_input(self) -> object | None: ...
    def trailers_only(self, stream: Stream, block: bytes) -> None: ...
    def stop_receiving(self, stream: Stream) -> None: ...
    def fail(self, code: int, message: str, limit: str | None = None) -> None: ...
    def go_away(self) -> None: ...


class GuardOwner(Protocol):
    """The server whose connections a guard watches."""

    limits: ServerLimits
    connections: set  # of GuardedConnection


class ConnectionGuard:
    """One server's connection cap and deadline sweep.

    The cap is checked when a connection is made (:meth:`admit`); the sweep (about once a second) checks the
    deadlines: a connection with no open stream for ``idle_timeout``, a request whose headers or body still
    trickle in after ``request_timeout`` (slowloris). The sweep reads the connections' private state: it is
    their other half, kept apart so the frame parser stays small, and it costs the hot path nothing (no timer
    per stream or per call).
    """

    def __init__(self, owner: GuardOwner, log: LimitLog) -> None:
        self.owner = owner
        self.log = log
        self._hosts: dict[str, int] = {}  # connections held per peer host
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ connection cap

    def admit(self, peer: str) -> str | None:
        """None when a new connection from ``peer`` may stay (then :meth:`release` must follow when it is
        lost); else why not, for the GOAWAY it is closed with."""
        limits = self.owner.limits
        held = len(self.owner.connections)
        if held >= limits.max_connections:
            self.log.hit("max_connections", peer, f"refused a new connection: {held} held, the cap is "
                                                  f"{limits.max_connections}")
            return f"connection refused: this server holds its maximum of {limits.max_connections} connections"
        host = peer_host(peer) or peer
        from_host = self._hosts.get(host, 0)
        cap = limits.max_connections_per_host
        if cap is not None and from_host >= cap:
            self.log.hit("max_connections_per_host", peer, f"refused a new connection: {from_host} held from "
                                                           f"{host}, the cap is {cap}")
            return f"connection refused: this server holds its maximum of {cap} connections from {host}"
        self._hosts[host] = from_host + 1
        return None

    def release(self, peer: str) -> None:
        """An admitted connection from ``peer`` is gone."""
        host = peer_host(peer) or peer
        left = self._hosts.get(host, 0) - 1
        if left > 0:
            self._hosts[host] = left
        else:
            self._hosts.pop(host, None)

    # ------------------------------------------------------------ deadlines

    def start(self) -> None:
        """Start sweeping (on the running loop) until :meth:`stop`."""
        if self._timer is None:
            self._arm()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.owner.limits.sweep_interval(), self._sweep)

    def _sweep(self) -> None:
        try:
            now = time.monotonic()
            for connection in list(self.owner.connections):
                if connection.transport is not None:
                    self.check(connection, now, connection.limits)
        finally:  # an error is the loop's to log; the sweeps must go on
            self._arm()

    def check(self, connection: GuardedConnection, now: float, limits: ServerLimits) -> None:
        """Apply the deadlines to one connection at time ``now`` (``time.monotonic()``)."""
        state = connection.sweep
        streams = connection.open_streams()
        for stream in [s for s in streams if not s.request_done]:
            if stream.deadline is None:
                stream.deadline = now + limits.request_timeout
            elif now >= stream.deadline:
                message = f"request still arriving {limits.request_timeout:g}s after it started"
                self.log.hit("slow_request", connection.peer, f"stream {stream.id}: {message}")
                block = wire.encode_headers(_SLOW_REQUEST + [(b"grpc-message", wire.percent_encode(message))])
                connection.trailers_only(stream, block)
                connection.stop_receiving(stream)  # stop sending the rest
        stalled = connection.stalled_input()
        if stalled is None:
            state.stall = None
        elif stalled is not state.stall:
            state.stall, state.stall_since = stalled, now
        elif now - state.stall_since >= limits.request_timeout:
            connection.fail(wire.ENHANCE_YOUR_CALM, f"a header block or frame still arriving "
                                                     f"{limits.request_timeout:g}s after it started", "slow_request")
            return
        if streams or stalled is not None:
            state.idle_since = None
        elif state.idle_since is None or connection.last_stream_id != state.idle_mark:
            state.idle_since, state.idle_mark = now, connection.last_stream_id
        elif now - state.idle_since >= limits.idle_timeout:
            self.log.hit("idle_timeout", connection.peer, f"no open stream for {limits.idle_timeout:g}s: GOAWAY")
            connection.go_away()
