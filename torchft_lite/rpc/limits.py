"""How much one peer may take from a gRPC server before it is cut off: the flood limits, for either engine.

Why: the lighthouse is one process on one event loop serving every replica
group of a job, and it listens where any pod of the cluster can reach it. A
peer that holds thousands of connections, opens and resets streams as fast as
it can write them ("rapid reset", CVE-2023-44487), floods PING or SETTINGS
frames (each one answered), or trickles a request in a byte at a time
(slowloris) would otherwise take the event loop or the memory that the
Quorum and Heartbeat calls of every group need: a way to stall a whole job
from outside it. A valid token does not change this: the token guards what a
call may do, these limits guard what a connection may cost.

The native engine (:mod:`torchft_lite.rpc.h2grpc`) enforces every field of
:class:`ServerLimits`, counts each limit hit by name and logs it at WARNING,
rate-limited (:class:`LimitLog`). The grpcio engine gets the channel
arguments that match (:func:`grpcio_options`); what it cannot limit is said
there.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from torchft_lite.rpc.refusals import CountedLog

__all__ = ["LimitLog", "ServerLimits", "grpcio_options"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one server lets its peers hold and send. Times are seconds; sizes bytes.

    The defaults leave real clients far from every limit: a replica group holds
    one connection with a few streams, sends a heartbeat a second, a PING every
    ten seconds at most (keepalive) and requests of a few kilobytes.
    """

    max_connections: int = 10_000
    """Connections held at once; a new one beyond it is closed at once (GOAWAY ENHANCE_YOUR_CALM) and counted."""
    max_connections_per_host: int | None = None
    """Connections held at once from one peer host; None: no such cap (a load test, or many replica groups
    behind one NAT address, may need thousands from one host)."""
    max_concurrent_streams: int = 4096
    """Streams (calls) open at once on one connection, advertised in SETTINGS; beyond it RST_STREAM REFUSED_STREAM."""
    max_header_list_bytes: int = 16 * 1024
    """Decoded size of one request's header list, advertised in SETTINGS; beyond it GOAWAY (HPACK state is lost)."""
    max_request_bytes: int = 4 * 1024 * 1024
    """One request message; a larger one is answered RESOURCE_EXHAUSTED without being buffered whole."""
    max_connection_request_bytes: int = 32 * 1024 * 1024
    """Request bytes one connection's open calls may hold together (received, or still being answered)."""
    handshake_timeout: float = 10.0
    """Time a new connection has to send the HTTP/2 preface."""
    idle_timeout: float = 300.0
    """A connection with no open stream for this long gets GOAWAY and is closed (a lease is an open stream,
    so a lease holder is never idle)."""
    request_timeout: float = 30.0
    """Time a request's headers and body have to arrive in full once they started (slowloris): a stream
    still receiving after it is ended with DEADLINE_EXCEEDED; a header block still arriving, GOAWAY."""
    flood_window: float = 10.0
    """The window the frame budgets below count in."""
    max_pings: int = 100
    """PING frames per window while the server sends no data on the connection; beyond it GOAWAY ENHANCE_YOUR_CALM."""
    max_settings: int = 100
    """SETTINGS frames per window (each one is applied and acknowledged); beyond it GOAWAY ENHANCE_YOUR_CALM."""
    max_resets: int = 200
    """Streams per window that the peer resets while they are open, or opens beyond max_concurrent_streams
    (rapid reset); beyond it GOAWAY ENHANCE_YOUR_CALM."""

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_concurrent_streams", "max_header_list_bytes", "max_request_bytes",
                     "max_connection_request_bytes", "max_pings", "max_settings", "max_resets"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_connections_per_host is not None and (
                not isinstance(self.max_connections_per_host, int) or self.max_connections_per_host < 1):
            raise ValueError(f"max_connections_per_host must be a positive integer or None, "
                             f"got {self.max_connections_per_host!r}")
        for name in ("handshake_timeout", "idle_timeout", "request_timeout", "flood_window"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")

    def sweep_interval(self) -> float:
        """How often the native engine checks its deadlines: often enough that they fire within a quarter
        of the shorter one (at most every second), rarely enough that 10,000 connections cost nothing."""
        return min(1.0, max(0.05, min(self.idle_timeout, self.request_timeout, self.handshake_timeout) / 4))


def grpcio_options(limits: ServerLimits) -> list[tuple[str, int]]:
    """grpc.aio server channel arguments for ``limits``, as far as grpcio (1.85) has them.

    grpcio cannot limit, and this engine therefore does not:

    * connections per peer host (it has only the server-wide cap);
    * the header list size of requests sent before the peer acknowledged the
      server's SETTINGS: grpc-core applies ``max_metadata_size`` only from
      then on, and serves such a request whatever its size (8 MB was tried);
    * SETTINGS frames per window (grpc-core applies and acknowledges each; it
      only stops reading a peer that leaves its acknowledgements unread);
    * a budget of streams reset by the peer: grpc-core has its own
      rapid-reset handling, with no setting for the budget;
    * a deadline for a request's body to arrive (slowloris): a stream that
      trickles stays open, and such a connection is never idle; only a
      connection age would bound it, which would also cut every lease;
    * counting or logging any limit it hits: none reaches ``limits_hit``.
    """
    return [
        ("grpc.max_allowed_incoming_connections", limits.max_connections),
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        ("grpc.max_connection_idle_ms", round(limits.idle_timeout * 1000)),
        ("grpc.server_handshake_timeout_ms", round(limits.handshake_timeout * 1000)),
        ("grpc.max_metadata_size", limits.max_header_list_bytes),
        ("grpc.absolute_max_metadata_size", limits.max_header_list_bytes),
        ("grpc.max_receive_message_length", limits.max_request_bytes),
        # PINGs: a PING sooner than this after the previous one, while the server
        # sends no data, is a strike; after max_ping_strikes, GOAWAY ENHANCE_YOUR_CALM.
        # (The C name is ..._MIN_RECV_PING_INTERVAL_...; the string has no "recv",
        # and grpc ignores an argument it does not know.)
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


class LimitLog(CountedLog):
    """Limits a server's peers hit: ``counts`` by limit name, and a rate-limited WARNING per hit."""

    def hit(self, name: str, peer: str, detail: str) -> None:
        """Count one hit of limit ``name`` by ``peer``; ``detail`` says what happened (never a header value)."""
        unlogged = self._count(name)
        if unlogged is None:
            return
        logger.warning("%s: %s hit a flood limit (%s): %s%s", self.server, peer, name, detail,
                       f" [{unlogged} more limit hit(s) since the last such line were not logged]" if unlogged else "")
