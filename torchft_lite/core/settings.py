"""Resolve the Manager's settings from its arguments and the environment, once.

Everything is read and validated here, before the Manager starts anything, so
a missing setting is one clear :class:`~torchft_lite.errors.ConfigError` naming
it (never a ``KeyError`` half-way through start-up).

Precedence follows torchft: explicit arguments win, except the timeouts and
quorum retries, where ``TORCHFT_TIMEOUT_SEC``, ``TORCHFT_QUORUM_TIMEOUT_SEC``,
``TORCHFT_CONNECT_TIMEOUT_SEC`` and ``TORCHFT_QUORUM_RETRIES`` take precedence
(torchft documents it so operators can retune a job without editing it).
Our own settings (``TORCHFT_LITE_*``) only fill in arguments left as ``None``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping
from urllib.parse import urlsplit

from torchft_lite.errors import ConfigError
from torchft_lite.group_server.lease_fence import DEFAULT_LEASE_TIMEOUT

__all__ = ["ManagerSettings", "Timeouts", "default_advertised_host"]

logger = logging.getLogger(__name__)

TIMEOUT_SEC_ENV = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_SEC_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_SEC_ENV = "TORCHFT_CONNECT_TIMEOUT_SEC"
QUORUM_RETRIES_ENV = "TORCHFT_QUORUM_RETRIES"
MANAGER_PORT_ENV = "TORCHFT_MANAGER_PORT"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
HOSTNAME_ENV = "TORCHFT_LITE_HOSTNAME"  # ours: the address this group advertises
HEAL_SOURCES_ENV = "TORCHFT_LITE_HEAL_SOURCES"  # ours: peers a heal may stripe over
HEAL_IN_PLACE_ENV = "TORCHFT_LITE_HEAL_IN_PLACE"  # ours: receive a heal into the live tensors
LEASE_TIMEOUT_ENV = "TORCHFT_LITE_LEASE_TIMEOUT_SEC"  # ours: the lease assumed when the lighthouse states none
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Timeouts:
    """Every limit a Manager waits by: torchft's three timeouts, and the limits derived from them, here only."""

    step: timedelta
    """torchft's ``timeout``: one collective, one heal, one commit vote (``TORCHFT_TIMEOUT_SEC``)."""
    quorum: timedelta
    """How long a quorum may take (``TORCHFT_QUORUM_TIMEOUT_SEC``)."""
    connect: timedelta
    """Reaching the group's store, ManagerServer and the lighthouse (``TORCHFT_CONNECT_TIMEOUT_SEC``)."""

    @property
    def quorum_backstop(self) -> timedelta:
        """The training thread's limit on one quorum round, whose coroutine bounds each of its own waits: the
        quorum, then a heal's metadata, receive and apply, and 20 s for the rest."""
        return self.quorum + 3 * self.step + timedelta(seconds=20)

    @property
    def commit_vote(self) -> timedelta:
        """``should_commit``'s default wait: a peer's collective may end a step timeout after this rank's, plus
        the process group's 5 s grace, then the vote itself."""
        return 2 * self.step + timedelta(seconds=5)

    def watchdog_defaults(self) -> dict[str, float]:
        """Seconds per watchdog section when the environment sets none: each section's own limits, plus slack."""
        quorum, step = self.quorum.total_seconds(), self.step.total_seconds()
        return {"quorum": quorum + step + 60.0, "heal": 3 * step + 60.0, "step": quorum + 5 * step + 300.0}


@dataclass(frozen=True)
class ManagerSettings:
    group_rank: int
    """This process's rank within its replica group (``RANK`` from torchrun)."""
    group_world_size: int
    """Ranks in the replica group (``WORLD_SIZE``)."""
    store_host: str
    """The group's TCPStore host (``MASTER_ADDR``)."""
    store_port: int
    """The group's TCPStore port (``MASTER_PORT``)."""
    lighthouse_addr: str | None
    """The lighthouse (``TORCHFT_LIGHTHOUSE``); required on group rank 0 only."""
    replica_id: str
    """The user's replica group id; each incarnation appends a unique suffix."""
    port: int
    """ManagerServer port on group rank 0 (``TORCHFT_MANAGER_PORT``, 0 = any)."""
    hostname: str
    """Host advertised to peers (``TORCHFT_LITE_HOSTNAME``, else the machine's hostname)."""
    timeouts: Timeouts
    heartbeat_interval: float
    quorum_retries: int
    min_replica_size: int
    max_retries: int | None
    restart_count: int
    """torchrun's ``TORCHELASTIC_RESTART_COUNT``: keys this incarnation's store entries."""
    heal_sources: int = 1
    """Up-to-date peers a heal may pull disjoint parts from at once (``TORCHFT_LITE_HEAL_SOURCES``);
    used only when every quorum member advertises as many, else torchft's single source."""
    heal_in_place: bool = True
    """Receive a heal straight into the matching live tensors (``TORCHFT_LITE_HEAL_IN_PLACE``)."""
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT
    """Seconds of lease the commit fence assumes when the lighthouse does not state its heartbeat timeout
    (torchft's does not; ours does, and then that wins): ``TORCHFT_LITE_LEASE_TIMEOUT_SEC``, default 5 s,
    torchft's default. Set it to that lighthouse's ``--heartbeat_timeout_ms`` when it is lower."""

    @classmethod
    def resolve(
        cls,
        *,
        min_replica_size: int,
        timeout: timedelta,
        quorum_timeout: timedelta,
        connect_timeout: timedelta,
        rank: int | None,
        world_size: int | None,
        store_addr: str | None,
        store_port: int | None,
        lighthouse_addr: str | None,
        replica_id: str | None,
        port: int | None,
        hostname: str | None,
        heartbeat_interval: timedelta,
        max_retries: int | None,
        quorum_retries: int,
        heal_sources: int | None = None,
        heal_in_place: bool | None = None,
        env: Mapping[str, str] | None = None,
    ) -> "ManagerSettings":
        env = os.environ if env is None else env
        group_rank = rank if rank is not None else _env_int(env, "RANK", "rank")
        group_world_size = world_size if world_size is not None else _env_int(env, "WORLD_SIZE", "world_size")
        store_host = store_addr or _env_str(env, "MASTER_ADDR", "store_addr")
        store_port = store_port if store_port is not None else _env_int(env, "MASTER_PORT", "store_port")
        if group_rank == 0:
            lighthouse_addr = lighthouse_addr or _env_str(env, LIGHTHOUSE_ENV, "lighthouse_addr")
        if port is None:
            port = _env_int(env, MANAGER_PORT_ENV, "port") if env.get(MANAGER_PORT_ENV) else 0
        settings = cls(
            group_rank=group_rank,
            group_world_size=group_world_size,
            store_host=store_host,
            store_port=store_port,
            lighthouse_addr=lighthouse_addr,
            replica_id=replica_id or "",
            port=port,
            hostname=hostname or env.get(HOSTNAME_ENV) or default_advertised_host(
                lighthouse_addr or env.get(LIGHTHOUSE_ENV), store_host),
            timeouts=Timeouts(step=_env_duration(env, TIMEOUT_SEC_ENV, timeout),
                              quorum=_env_duration(env, QUORUM_TIMEOUT_SEC_ENV, quorum_timeout),
                              connect=_env_duration(env, CONNECT_TIMEOUT_SEC_ENV, connect_timeout)),
            heartbeat_interval=heartbeat_interval.total_seconds(),
            quorum_retries=_env_int(env, QUORUM_RETRIES_ENV, "quorum_retries") if env.get(QUORUM_RETRIES_ENV) else quorum_retries,
            min_replica_size=min_replica_size,
            max_retries=max_retries,
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            heal_sources=heal_sources if heal_sources is not None else (
                _env_int(env, HEAL_SOURCES_ENV, "heal_sources") if env.get(HEAL_SOURCES_ENV) else 1),
            heal_in_place=heal_in_place if heal_in_place is not None else _env_bool(env, HEAL_IN_PLACE_ENV, True),
            lease_timeout=_env_seconds(env, LEASE_TIMEOUT_ENV, timedelta(seconds=DEFAULT_LEASE_TIMEOUT)),
        )
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.group_world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.group_world_size}")
        if not 0 <= self.group_rank < self.group_world_size:
            raise ConfigError(f"rank must be in [0, world_size={self.group_world_size}), got {self.group_rank}")
        if not 0 < self.store_port < 65536:
            raise ConfigError(f"store_port (MASTER_PORT) must be in 1..65535, got {self.store_port}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port ({MANAGER_PORT_ENV}) must be in 0..65535, got {self.port}")
        if self.min_replica_size < 1:
            raise ConfigError(f"min_replica_size must be >= 1, got {self.min_replica_size}")
        t = self.timeouts
        seconds = {"timeout": t.step.total_seconds(), "quorum_timeout": t.quorum.total_seconds(),
                   "connect_timeout": t.connect.total_seconds(), "heartbeat_interval": self.heartbeat_interval,
                   "lease_timeout": self.lease_timeout}
        for name, value in seconds.items():
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}s")
        if self.quorum_retries < 0:
            raise ConfigError(f"quorum_retries must be >= 0, got {self.quorum_retries}")
        if self.max_retries is not None and self.max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0 or None, got {self.max_retries}")
        if self.heal_sources < 1:
            raise ConfigError(f"heal_sources ({HEAL_SOURCES_ENV}) must be >= 1, got {self.heal_sources}")

    @property
    def store_address(self) -> str:
        host = self.store_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.store_port}"


def default_advertised_host(lighthouse_addr: str | None, store_host: str | None, *,
                            hostname: Callable[[], str] = socket.gethostname,
                            resolve: Callable[[str], list[str]] | None = None,
                            route: Callable[[str], str | None] | None = None) -> str:
    """The host this group advertises when ``TORCHFT_LITE_HOSTNAME`` is not set: the machine's hostname, unless
    that resolves to loopback addresses only (Debian maps it to 127.0.1.1) while the job spans hosts (the
    lighthouse, else the group's store, is not on loopback). Then peers on other hosts could never reach this
    group's heal server or ManagerServer, so it advertises the address of the interface this host reaches the
    lighthouse (or the store) through, and logs a WARNING saying so and how to choose another network.

    ``resolve(name)``: the addresses ``name`` resolves to; ``route(host)``: the local address a packet to
    ``host`` would leave from (injectable for tests)."""
    name = hostname()
    resolve = resolve or _resolve
    route = route or _route_address
    addresses = resolve(name)
    if not addresses or not all(_is_loopback(a) for a in addresses):
        return name  # resolves to a real address (or not at all: peers' resolvers may still know it)
    for target in (_host_of(lighthouse_addr), store_host):
        if not target or _is_loopback(target) or target == "localhost":
            continue
        local = route(target)
        if local is not None and not _is_loopback(local):
            logger.warning("this host's name %r resolves to %s only, which peers on other hosts can't reach: "
                           "advertising %s instead (the address that reaches %s). Set TORCHFT_LITE_HOSTNAME to the "
                           "address of the network heals should use (say, the InfiniBand interface's)",
                           name, ", ".join(sorted(addresses)), local, target)
            return local
    return name  # everything is on this host: loopback is right


def _resolve(name: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(name, None)})
    except OSError:
        return []


def _route_address(host: str) -> str | None:
    """The local address a UDP socket connected to ``host`` gets (no packet is sent; the kernel picks a route)."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(sockaddr)
            return sock.getsockname()[0]
    except OSError:
        return None


def _host_of(address: str | None) -> str | None:
    if not address:
        return None
    parsed = urlsplit(address if "://" in address else f"http://{address}")
    return parsed.hostname


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


def _env_str(env: Mapping[str, str], name: str, argument: str) -> str:
    value = env.get(name)
    if not value:
        raise ConfigError(f"{argument} not given and ${name} is not set (torchrun sets it; or pass {argument}=...)")
    return value


def _env_int(env: Mapping[str, str], name: str, argument: str) -> int:
    value = _env_str(env, name, argument)
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {value!r}") from None


def _env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name)
    if value is None or value == "":
        return default
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"${name} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def _env_duration(env: Mapping[str, str], name: str, default: timedelta) -> timedelta:
    return timedelta(seconds=_env_seconds(env, name, default))


def _env_seconds(env: Mapping[str, str], name: str, default: timedelta) -> float:
    value = env.get(name)
    if value is None or value == "":
        return default.total_seconds()
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"${name} must be a number of seconds, got {value!r}") from None
