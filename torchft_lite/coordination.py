"""torchft's low-level coordination API: the lighthouse and a replica group's ManagerServer, their clients,
and the quorum they agree on.

Scripts written against ``torchft.coordination`` (or ``torchft._torchft``) use these names unchanged::

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    client = LighthouseClient(lighthouse.address(), connect_timeout=timedelta(seconds=10))
    quorum = client.quorum(replica_id="a", timeout=timedelta(seconds=30), step=0)
    lighthouse.shutdown()

A Manager reaches its group's ManagerServer through :class:`ManagerClient`, which returns a
:class:`QuorumResult` per quorum. Every call waits at most its ``timeout``: no answer in time raises :class:`~torchft_lite.errors.QuorumTimeout`
(a ``TimeoutError``), any other failure :class:`~torchft_lite.errors.QuorumError`, and bad settings
:class:`~torchft_lite.errors.ConfigError` (a ``ValueError``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Coroutine, Hashable, Optional, TypeVar

from torchft_lite.errors import ConfigError, QuorumError, QuorumTimeout
from torchft_lite.group_server.manager_client import (
    HANDOFF as _HANDOFF, ManagerClient, seconds_of as _seconds, serve_in_process, withdraw_from_process,
)
from torchft_lite.group_server.quorum_compute import QuorumResult
from torchft_lite.rpc.lighthouse_client import (
    LighthouseClient as _AsyncLighthouseClient, LighthouseError, LighthouseTimeout,
)
from torchft_lite.rpc.loop import control_plane

if TYPE_CHECKING:
    from torchft_lite.rpc.protocol import torchft_pb2 as pb

__all__ = ["LighthouseClient", "LighthouseServer", "ManagerClient", "ManagerServer", "Quorum", "QuorumMember",
           "QuorumResult", "Timestamp"]

T = TypeVar("T")


# ---------------------------------------------------------------- data


@dataclass
class QuorumMember:
    """One replica group in a quorum: what it sent with its Quorum call.

    Args:
        replica_id: the group's id, unique among live groups.
        address: its ManagerServer's address, where peers ask for checkpoints.
        store_address: its TCPStore, ``host:port``.
        step: the step it had committed when it asked.
        world_size: the number of ranks in the group.
        shrink_only: whether it asked for a quorum of previous members only.
        data: the JSON data it sent along; None when it sent none.
    """

    replica_id: str
    address: str
    store_address: str
    step: int
    world_size: int
    shrink_only: bool
    data: Optional[dict[Hashable, object]] = None


@dataclass
class Timestamp:
    """A point in wall-clock time, as protobuf's ``Timestamp``.

    Args:
        seconds: whole seconds since the Unix epoch.
        nanos: the nanoseconds past ``seconds``.
    """

    seconds: int
    nanos: int


@dataclass
class Quorum:
    """A quorum the lighthouse issued.

    Args:
        quorum_id: its id; it changes whenever the membership does (or a member reported commit failures).
        participants: its members, sorted by replica id.
        created: when the lighthouse issued it.
    """

    quorum_id: int
    participants: list[QuorumMember] = field(default_factory=list)
    created: Timestamp = field(default_factory=lambda: Timestamp(0, 0))


def _encode_data(data: dict[Hashable, object]) -> str:
    try:
        return json.dumps(data)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"quorum data must be JSON-serializable: {exc}") from exc


def _member_from_proto(member: pb.QuorumMember) -> QuorumMember:
    data = None
    if member.data:
        try:
            data = json.loads(member.data)
        except ValueError as exc:
            raise QuorumError(f"quorum member {member.replica_id!r} sent data that is not JSON: {exc}") from exc
    return QuorumMember(
        replica_id=member.replica_id, address=member.address, store_address=member.store_address,
        step=member.step, world_size=member.world_size, shrink_only=member.shrink_only, data=data,
    )


def _quorum_from_proto(quorum: pb.Quorum) -> Quorum:
    return Quorum(
        quorum_id=quorum.quorum_id,
        participants=[_member_from_proto(m) for m in quorum.participants],
        created=Timestamp(quorum.created.seconds, quorum.created.nanos),
    )


# ---------------------------------------------------------------- server


class LighthouseServer:
    """A lighthouse serving in a background thread of this process (torchft_lite's, torchft-compatible).

    It is serving when the constructor returns, on an event loop thread of its own. Its code is imported
    only when one is created, so a trainer that only talks to a lighthouse never loads it. It has no HTTP
    dashboard (run ``python -m lighthouse`` for one) and no state directory, so it is always a first start:
    its first quorum comes without a startup grace.

    Args:
        bind: ``HOST:PORT`` to serve gRPC on; port 0 picks a free port (``"[::]:0"``).
        min_replicas: the fewest replica groups a new quorum may have.
        join_timeout_ms: how long a quorum waits for healthy groups that have not joined (default 100, as
            torchft's in-process server; the ``python -m lighthouse`` CLI defaults to 60000).
        quorum_tick_ms: the interval of the background quorum check (default 100).
        heartbeat_timeout_ms: a group is healthy while its last heartbeat is younger than this (default 5000).
        start_timeout: seconds to wait for the server to start serving (not in torchft).

    Raises ``ConfigError`` for a bad setting and ``OSError`` when ``bind`` is taken.
    """

    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: Optional[int] = None,
        quorum_tick_ms: Optional[int] = None,
        heartbeat_timeout_ms: Optional[int] = None,
        *,
        start_timeout: float = 30.0,
    ) -> None:
        # The server's modules are loaded here, never by importing this module.
        from lighthouse.config import LighthouseConfig
        from lighthouse.thread import BackgroundLighthouse
        from torchft_lite.rpc.access import Access

        # torchft's in-process defaults (its CLI waits far longer for stragglers to join).
        join_timeout_ms = 100 if join_timeout_ms is None else join_timeout_ms
        settings: dict[str, float] = {}
        for name, value in (("join_timeout", join_timeout_ms), ("quorum_tick", quorum_tick_ms),
                            ("heartbeat_timeout", heartbeat_timeout_ms)):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ConfigError(f"{name}_ms must be an integer number of milliseconds >= 0, got {value!r}")
                settings[name] = value / 1000
        try:
            # The job token of this process's environment, as `python -m lighthouse` reads it.
            config = LighthouseConfig(min_replicas=min_replicas, bind=bind, http_bind=None, access=Access.from_env(),
                                      **settings)
        except ValueError as exc:
            raise ConfigError(f"LighthouseServer: {exc}") from exc
        self._lighthouse = BackgroundLighthouse(config, start_timeout=start_timeout).start()

    def address(self) -> str:
        """The address replicas use (``TORCHFT_LIGHTHOUSE``): ``http://host:port``."""
        return self._lighthouse.address()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving (waiting Quorum calls fail as UNAVAILABLE); waits up to ``timeout`` s. Idempotent."""
        self._lighthouse.stop(timeout)

    def __enter__(self) -> "LighthouseServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


class ManagerServer:
    """A replica group's coordinator (torchft's ``ManagerServer``), serving on this process's control plane.

    It is serving when the constructor returns. It gathers the group's ranks for each quorum and commit vote,
    speaks for the group at the lighthouse (heartbeats and a lease) and answers peers' checkpoint-metadata
    calls (:mod:`torchft_lite.group_server.server`). A :class:`ManagerClient` of this process calls it directly.

    Args:
        replica_id: the group's id at the lighthouse, unique to this incarnation.
        lighthouse_addr: the lighthouse, ``http://host:port``.
        hostname: the host in this server's advertised address (what the other ranks and peers dial).
        bind: ``HOST:PORT`` to serve gRPC on; port 0 picks a free port (``"[::]:0"``).
        store_addr: ``host:port`` of the group's TCPStore, advertised to the quorum.
        world_size: the number of ranks in the group; a quorum waits for all of them.
        heartbeat_interval: time between heartbeats to the lighthouse (a ``timedelta``, or seconds).
        connect_timeout: how long to wait for the lighthouse, and for this server to start (the same).
        quorum_retries: extra lighthouse Quorum attempts after a failed one.
        quorum_timeout: (ours) how long a lighthouse Quorum call may take when the ranks' request has no deadline.
        heal_sources: (ours) how many peers a healing rank of this group can pull from at once (striping).
        lease_timeout: (ours) the lease the commit fence assumes until the lighthouse states its own, in seconds.

    Raises ``ConfigError`` for a bad setting and ``OSError`` when ``bind`` is taken.
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: timedelta | float,
        connect_timeout: timedelta | float,
        quorum_retries: int = 0,
        *,
        quorum_timeout: timedelta | float = timedelta(seconds=60),
        heal_sources: int = 1,
        lease_timeout: float | None = None,
    ) -> None:
        # The server's modules are loaded here, never by importing this module.
        from torchft_lite.group_server.server import ManagerServer as _AsyncManagerServer, ManagerServerConfig

        connect = _seconds(connect_timeout, "connect_timeout")
        extra = {} if lease_timeout is None else {"lease_timeout": lease_timeout}
        try:
            config = ManagerServerConfig(
                replica_id=replica_id, lighthouse_addr=lighthouse_addr, hostname=hostname, store_address=store_addr,
                world_size=world_size, bind=bind, heartbeat_interval=_seconds(heartbeat_interval, "heartbeat_interval"),
                connect_timeout=connect, quorum_timeout=_seconds(quorum_timeout, "quorum_timeout"),
                quorum_retries=quorum_retries, heal_sources=heal_sources, **extra,
            )
            server = _AsyncManagerServer(config)
        except ValueError as exc:
            raise ConfigError(f"ManagerServer: {exc}") from exc
        self._control = control_plane()
        self._control.run(server.start(), connect + _HANDOFF, f"ManagerServer {replica_id} to start")
        self._server = server
        self._stopped = False
        serve_in_process(server)

    def address(self) -> str:
        """The address the group's ranks and healing peers dial: ``http://host:port`` (``https`` with TLS)."""
        return self._server.address()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Leave: the lease closes first (the lighthouse drops the group at once), then stop serving; waits up to
        ``timeout`` s. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        withdraw_from_process(self._server)
        self._control.run(self._server.stop(), timeout, f"ManagerServer {self._server.config.replica_id} to stop")

    def __enter__(self) -> "ManagerServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


# ---------------------------------------------------------------- client


class LighthouseClient:
    """A connection to a lighthouse (torchft_lite's or torchft's), usable from any thread.

    The constructor connects, so a wrong address fails at once. It drives the asyncio lighthouse client
    (``torchft_lite.rpc.lighthouse_client``) on the process's control-plane loop.

    Args:
        addr: the lighthouse's address: ``http://host:port`` (as ``LighthouseServer.address()`` gives) or ``host:port``.
        connect_timeout: how long to wait for the connection (a ``timedelta``, or seconds).
    """

    def __init__(self, addr: str, connect_timeout: timedelta | float) -> None:
        seconds = _seconds(connect_timeout, "connect_timeout")
        if not isinstance(addr, str) or not addr:
            raise ConfigError(f"LighthouseClient: addr must be a non-empty address, got {addr!r}")
        self.addr = addr
        self.connect_timeout = connect_timeout
        self._client = _AsyncLighthouseClient(addr, connect_timeout=seconds)
        self._run(self._client.connect(timeout=seconds), seconds, f"connecting to lighthouse {addr}")

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        try:
            return control_plane().run(coro, timeout + _HANDOFF, what)
        except LighthouseTimeout as exc:
            raise QuorumTimeout(str(exc)) from exc
        except LighthouseError as exc:
            raise QuorumError(str(exc)) from exc
        except TimeoutError as exc:  # the control plane's own wait
            raise QuorumTimeout(str(exc)) from exc

    def quorum(
        self,
        replica_id: str,
        timeout: timedelta | float,
        address: Optional[str] = None,
        store_address: Optional[str] = None,
        step: Optional[int] = None,
        world_size: Optional[int] = None,
        shrink_only: Optional[bool] = None,
        data: Optional[dict[Hashable, object]] = None,
    ) -> Quorum:
        """Join the next quorum and wait until one including ``replica_id`` is issued.

        Args:
            replica_id: this group's id.
            timeout: how long to wait for the quorum (a ``timedelta``, or seconds).
            address: this group's ManagerServer address.
            store_address: this group's TCPStore, ``host:port``.
            step: the step this group has committed.
            world_size: the number of ranks in this group.
            shrink_only: admit no new members (previous members only).
            data: JSON-serializable data the other members receive with this member.
        """
        seconds = _seconds(timeout, "timeout")
        payload = "" if data is None else _encode_data(data)
        message = self._run(
            self._client.quorum(
                replica_id, timeout=seconds, address=address or "", store_address=store_address or "",
                step=step or 0, world_size=world_size or 0, shrink_only=bool(shrink_only), data=payload,
            ),
            seconds, f"a quorum for {replica_id!r} from lighthouse {self.addr}",
        )
        return _quorum_from_proto(message)

    def heartbeat(self, replica_id: str, timeout: timedelta | float = timedelta(seconds=5)) -> None:
        """Tell the lighthouse ``replica_id`` is alive.

        Args:
            replica_id: this group's id.
            timeout: how long to wait for the lighthouse's answer (a ``timedelta``, or seconds).
        """
        seconds = _seconds(timeout, "timeout")
        self._run(self._client.heartbeat(replica_id, timeout=seconds), seconds,
                  f"a heartbeat of {replica_id!r} to lighthouse {self.addr}")

    def close(self, timeout: float = 5.0) -> None:
        """Close the connection (not in torchft, whose client closes when collected)."""
        self._run(self._client.close(), timeout, f"closing the connection to lighthouse {self.addr}")

    def __enter__(self) -> "LighthouseClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
