"""The lighthouse's configuration: one frozen dataclass, from which the CLI is built.

Flags mirror torchft's ``torchft_lighthouse`` (``--bind``, ``--min_replicas``,
``--join_timeout_ms``, ``--quorum_tick_ms``, ``--heartbeat_timeout_ms``) so ops
scripts carry over; times are milliseconds on the command line, seconds in Python.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from lighthouse.quorum import QuorumConfig
from lighthouse.stragglers.scores import StragglerConfig
from torchft_lite.rpc.access import INSECURE_ENV, TOKEN_ENV, TOKEN_FILE_ENV, Access
from torchft_lite.rpc.addresses import split_host_port
from torchft_lite.rpc.tls import CA_ENV, CERT_ENV, KEY_ENV, TlsSettings

ADMIN_TOKEN_ENV = "TORCHFT_LITE_ADMIN_TOKEN"
DEFAULT_BIND = "[::]:29510"
DEFAULT_HTTP_BIND = "[::]:29511"
HTTP_DISABLED = "off"
GRPC_ENGINES = ("native", "grpcio")


@dataclass(frozen=True)
class LighthouseConfig:
    """Settings of one lighthouse process. Times are seconds."""

    min_replicas: int
    """Fewest replica groups a (non-fast) quorum may have. Required."""
    bind: str = DEFAULT_BIND
    """HOST:PORT for the gRPC LighthouseService (port 0 picks a free port)."""
    join_timeout: float = 60.0
    """How long a quorum waits for healthy replicas that have not joined yet."""
    quorum_tick: float = 0.1
    """Interval of the background re-evaluation (join timeouts, heartbeat expiry)."""
    heartbeat_timeout: float = 5.0
    """A replica is healthy while its last heartbeat is younger than this."""
    startup_grace: float | None = None
    """After a restart (``state_dir`` holds a quorum id an earlier run issued),
    no quorum until this long after start, so replicas already training
    re-register (a restarted lighthouse knows nobody); a first start answers at
    once. None: heartbeat_timeout."""
    holder_timeout: float = 30.0
    """How long the stale-quorum guard waits for a replica holding the highest
    step a quorum reached (a member of the last quorum at that step) to come
    back before participants that are all behind start a new epoch of the job
    at their own step (a following job, a job restarted from an older
    checkpoint); never sooner than ``heartbeat_timeout``. The operator's
    POST /api/epoch starts one at once."""
    http_bind: str | None = DEFAULT_HTTP_BIND
    """HOST:PORT for the dashboard, /api/status and /metrics; None disables HTTP."""
    admin_token: str | None = field(default=None, repr=False)
    """Bearer token required by admin actions (kill, new epoch); None disables them."""
    access: Access = field(default_factory=Access)
    """Who may call the gRPC and HTTP sides: the job token, else loopback peers only (torchft_lite.rpc.access)."""
    tls: TlsSettings = field(default_factory=TlsSettings)
    """TLS (torchft_lite.rpc.tls): with a certificate, the gRPC and HTTP sides serve TLS only; the CA is what
    the dashboard's Kill checks a manager's certificate against. Default: plain text."""
    state_dir: Path | None = None
    """Where the last quorum id and the highest committed step are kept, so ids
    keep increasing across restarts even if the clock steps back, and a restart
    is told from a first start (startup grace, stale-quorum guard). Without it
    ids are seeded from wall time and every start counts as a first one."""
    kill_timeout: float = 10.0
    """Timeout of the Kill RPC the dashboard sends to a replica's manager."""
    grpc_engine: str = "native"
    """'native': the lighthouse's own h2c gRPC server (torchft_lite/rpc/h2grpc, about 2.5x
    less server CPU per round than grpc.aio); 'grpcio': grpc.aio."""
    evict_stragglers: bool = False
    """Leave a group flagged as a straggler out of the next quorums (lighthouse.stragglers.rules); off: the
    flag is only shown and logged."""
    straggler_threshold: float = 2.0
    """A group is flagged when its compute time stays above this many times its quorum's median ..."""
    straggler_patience: int = 3
    """... for this many quorums in a row (also the eviction cooldown, in quorums)."""

    def __post_init__(self) -> None:
        self.quorum_config()  # validates min_replicas and the timeouts
        self.straggler_config()  # and the straggler settings
        if not isinstance(self.quorum_tick, (int, float)) or not math.isfinite(self.quorum_tick) or self.quorum_tick <= 0:
            raise ValueError(f"quorum_tick must be > 0 seconds, got {self.quorum_tick!r}")
        if not self.kill_timeout > 0:
            raise ValueError(f"kill_timeout must be > 0 seconds, got {self.kill_timeout!r}")
        split_host_port(self.bind)
        if self.http_bind is not None:
            split_host_port(self.http_bind)
        if self.grpc_engine not in GRPC_ENGINES:
            raise ValueError(f"grpc_engine must be one of {', '.join(GRPC_ENGINES)}, got {self.grpc_engine!r}")
        if self.admin_token is not None and not self.admin_token.strip():
            raise ValueError("admin_token must not be empty; leave it unset to disable admin actions")

    def advertised(self) -> dict[str, str]:
        """What ``GetConfig`` answers: the quorum settings under torchft's flag names (milliseconds)."""
        return {
            "min_replicas": str(self.min_replicas),
            "join_timeout_ms": str(round(self.join_timeout * 1000)),
            "quorum_tick_ms": str(round(self.quorum_tick * 1000)),
            "heartbeat_timeout_ms": str(round(self.heartbeat_timeout * 1000)),
            "holder_timeout_ms": str(round(self.holder_timeout * 1000)),
            "implementation": "torchft_lite",
        }

    def quorum_config(self) -> QuorumConfig:
        return QuorumConfig(
            min_replicas=self.min_replicas,
            join_timeout=self.join_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            startup_grace=self.heartbeat_timeout if self.startup_grace is None else self.startup_grace,
            holder_timeout=self.holder_timeout,
        )

    def straggler_config(self) -> StragglerConfig:
        return StragglerConfig(threshold=self.straggler_threshold, patience=self.straggler_patience,
                               evict=self.evict_stragglers)

    # ------------------------------------------------------------------ CLI

    @staticmethod
    def arg_parser() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(
            prog="torchft-lite-lighthouse",
            description=(
                "torchft_lite lighthouse: forms a quorum of replica groups each step from their "
                "heartbeats and Quorum calls. Wire-compatible with torchft's LighthouseService, so "
                "torchft managers can use it too. Serves a dashboard, /api/status and Prometheus "
                "/metrics over HTTP."
            ),
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        parser.add_argument("--bind", default=DEFAULT_BIND, help="HOST:PORT of the gRPC service")
        parser.add_argument(
            "--min_replicas", "--min-replicas", type=int, required=True, default=argparse.SUPPRESS,
            help="required: fewest replica groups a new quorum may have (a fast quorum of the previous members needs no minimum)",
        )
        parser.add_argument(
            "--join_timeout_ms", "--join-timeout-ms", type=int, default=60000,
            help="how long a quorum waits for healthy replicas that have not joined, from the first join",
        )
        parser.add_argument(
            "--quorum_tick_ms", "--quorum-tick-ms", type=int, default=100,
            help="interval of the background quorum check (join timeouts, heartbeat expiry); "
            "quorums are also checked on every Quorum call",
        )
        parser.add_argument(
            "--heartbeat_timeout_ms", "--heartbeat-timeout-ms", type=int, default=5000,
            help="a replica is healthy while its last heartbeat is younger than this",
        )
        parser.add_argument(
            "--startup_grace_ms", "--startup-grace-ms", type=int, default=None,
            help="after a restart (--state-dir holds a quorum id from an earlier run), issue no quorum for this "
            "long so replicas already training re-register (a restarted lighthouse knows nobody); a first start "
            "answers at once; default: the heartbeat timeout; 0 disables",
        )
        parser.add_argument(
            "--holder_timeout_ms", "--holder-timeout-ms", type=int, default=30000,
            help="the stale-quorum guard keeps replicas that are all behind the highest step a quorum reached "
            "from forming a quorum while a replica holding that step may come back; after this long without "
            "seeing one (since the lighthouse started, if it restored that step from --state-dir) they start a "
            "new epoch of the job at their own step instead of waiting forever (also at once when they all "
            "advertise resumed_from their durable checkpoint, no holder is healthy and every holder's replica group "
            "is back under a new id, or on POST /api/epoch); "
            "replicas from before the epoch are then refused. Never sooner than the heartbeat timeout; must be > 0",
        )
        parser.add_argument(
            "--http-bind", "--http_bind", default=DEFAULT_HTTP_BIND,
            help=f"HOST:PORT of the HTTP dashboard, /api/status and /metrics; '{HTTP_DISABLED}' disables HTTP",
        )
        parser.add_argument(
            "--admin-token", "--admin_token", default=None,
            help=f"bearer token for admin actions (the dashboard's kill button, POST /api/epoch); also read from "
            f"${ADMIN_TOKEN_ENV}. "
            "Without one, admin actions are disabled",
        )
        parser.add_argument(
            "--token-file", "--token_file", type=Path, default=None,
            help=f"file holding the job token; every gRPC call and HTTP request must then carry "
            f"'authorization: Bearer <token>' (the dashboard: open it once as /?token=<token>). Also read from "
            f"${TOKEN_FILE_ENV} or ${TOKEN_ENV}. Without a token only loopback peers are served",
        )
        parser.add_argument(
            "--insecure", action="store_true",
            help=f"with no job token, serve every peer instead of loopback ones only (also ${INSECURE_ENV}=1); "
            "logs a WARNING. Anyone who reaches the ports can then steer the job",
        )
        parser.add_argument(
            "--tls-cert", "--tls_cert", type=Path, default=None,
            help=f"PEM certificate chain to serve TLS with, on the gRPC and HTTP sides (TLS 1.2+ only; plain "
            f"text then refused); needs --tls-key. Also read from ${CERT_ENV}/${KEY_ENV} (the flags win). Clients "
            f"check it against ${CA_ENV}. Default: plain text",
        )
        parser.add_argument(
            "--tls-key", "--tls_key", type=Path, default=None,
            help=f"PEM private key of --tls-cert (also ${KEY_ENV})",
        )
        parser.add_argument(
            "--state-dir", "--state_dir", type=Path, default=None,
            help="directory to keep the last quorum id, the highest committed step and who held it in, so ids "
            "keep increasing across restarts and a restart is told from a first start (startup grace, stale-quorum guard); "
            "without it ids are seeded from wall-clock milliseconds and every start counts as a first one",
        )
        parser.add_argument(
            "--grpc-engine", "--grpc_engine", default="native", choices=GRPC_ENGINES,
            help="gRPC server implementation: 'native' (built in, h2c, about 2.5x less CPU than grpc.aio) or "
            "'grpcio' (grpc.aio)",
        )
        parser.add_argument(
            "--evict-stragglers", "--evict_stragglers", action="store_true",
            help="leave a group flagged as a straggler (see --straggler-threshold) out of the next quorums; it "
            "keeps heartbeating, its Quorum call waits, and it is readmitted after --straggler-patience quorums "
            "without it (doubled for each eviction in a row), behind, and heals. Never below min_replicas or a "
            "strict majority of the healthy groups (never one of two): then the flag is only reported. Default: "
            "only report (dashboard, /api/status, /metrics, a WARNING)",
        )
        parser.add_argument(
            "--straggler-threshold", "--straggler_threshold", type=float, default=2.0,
            help="a group is flagged as a straggler when its compute time (advertised as compute_ms by "
            "torchft_lite managers) stays above this many times the median of its quorum's (smoothed over 3 "
            "quorums), for --straggler-patience quorums in a row; must be > 1",
        )
        parser.add_argument(
            "--straggler-patience", "--straggler_patience", type=int, default=3,
            help="quorums in a row a group must stay above --straggler-threshold to be flagged; also the "
            "eviction cooldown, in quorums; must be >= 1",
        )
        parser.add_argument(
            "--log-level", "--log_level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
            help="logging level",
        )
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: dict[str, str] | None = None) -> "LighthouseConfig":
        environ = os.environ if environ is None else environ
        token = args.admin_token if args.admin_token is not None else environ.get(ADMIN_TOKEN_ENV) or None
        http_bind = None if args.http_bind.strip().lower() == HTTP_DISABLED else args.http_bind
        for flag in ("join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms", "holder_timeout_ms"):
            if getattr(args, flag) < 0:
                raise ValueError(f"--{flag} must be >= 0")
        return cls(
            min_replicas=args.min_replicas,
            bind=args.bind,
            join_timeout=args.join_timeout_ms / 1000,
            quorum_tick=args.quorum_tick_ms / 1000,
            heartbeat_timeout=args.heartbeat_timeout_ms / 1000,
            holder_timeout=args.holder_timeout_ms / 1000,
            startup_grace=None if args.startup_grace_ms is None else args.startup_grace_ms / 1000,
            http_bind=http_bind,
            admin_token=token,
            access=Access.from_env(environ, token_file=args.token_file, insecure=args.insecure),
            tls=TlsSettings.from_env(environ, cert=args.tls_cert, key=args.tls_key),
            state_dir=args.state_dir,
            grpc_engine=args.grpc_engine,
            evict_stragglers=args.evict_stragglers,
            straggler_threshold=args.straggler_threshold,
            straggler_patience=args.straggler_patience,
        )
