"""Reconfigure handles: torchft's way to form a group from the members' own descriptions.

Each member publishes ``get_reconfigure_handle()``: a JSON object naming the
member (``id``, stable for the life of the process group), a TCPStore the
member hosts (``store``, ``host:port``) and its global rank for logs
(``global_rank``). A reconfigure hands every member the same ordered list of
handles and a communicator id (``uuid``): a member's rank is the position of
its own handle, and everyone rendezvouses on the first member's store under
the prefix ``torchft/<uuid>``, so two communicators never share keys.
``reconfigure_with_store`` exchanges handles through a store when there is no
Manager to do it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torchft_lite.core.settings import HOSTNAME_ENV
from torchft_lite.errors import ConfigError

__all__ = ["RankInfo", "ReconfigureOptions", "Rendezvous", "advertised_host", "make_handle", "plan_rendezvous"]

try:  # torch >= 2.14 has native process group reconfiguration and its own options
    from torch._C._distributed_c10d import ReconfigureOptions  # type: ignore[attr-defined]
except ImportError:
    @dataclass
    class ReconfigureOptions:  # type: ignore[no-redef]
        """What ``ProcessGroup.reconfigure`` takes (the shape of torch's own, for torch < 2.14)."""

        uuid: int = 0
        """The communicator id: unique to one reconfiguration."""
        handles: list[str] = field(default_factory=list)
        """Every member's ``get_reconfigure_handle()``, in rank order."""
        timeout: timedelta | None = None
        """Bounds the rendezvous; None: the group's own timeout."""
        hints: dict[str, str] = field(default_factory=dict)
        """Backend hints (unused here)."""


@dataclass(frozen=True)
class RankInfo:
    """Who this process is, set by ``ProcessGroup.set_rank_info`` (for logs and handles)."""

    replica_id: str
    group_rank: int
    group_world_size: int
    global_rank: int | None = None


@dataclass(frozen=True)
class Rendezvous:
    """What one reconfigure means for one member."""

    store_addr: str
    """``host:port/torchft/<uuid>`` on the first member's store."""
    rank: int
    world_size: int
    uuid: int
    global_ranks: list[int] | None
    """Every member's global rank, or None when any member did not say."""


def advertised_host() -> str:
    """The host peers dial to reach a store this process hosts (``TORCHFT_LITE_HOSTNAME``, else the hostname).

    Read at each call, never at import.
    """
    return os.environ.get(HOSTNAME_ENV) or socket.gethostname()


def _host_port(host: str, port: int) -> str:
    try:
        is_v6 = isinstance(ipaddress.ip_address(host.split("%")[0]), ipaddress.IPv6Address)
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


def make_handle(handle_id: str, host: str, port: int, global_rank: int | None) -> str:
    """A member's handle: its id, the store it hosts, its global rank."""
    return json.dumps({"id": handle_id, "store": _host_port(host, port), "global_rank": global_rank})


def _parse_handle(handle: Any, index: int) -> dict[str, Any]:
    if isinstance(handle, bytes):
        handle = handle.decode("utf-8")
    try:
        peer = json.loads(handle)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"reconfigure handle {index} is not JSON: {handle!r}") from exc
    if not isinstance(peer, dict) or not isinstance(peer.get("id"), str) or not isinstance(peer.get("store"), str):
        raise ConfigError(f"reconfigure handle {index} needs string 'id' and 'store' fields, got {handle!r}")
    global_rank = peer.get("global_rank")
    if global_rank is not None and (isinstance(global_rank, bool) or not isinstance(global_rank, int)):
        raise ConfigError(f"reconfigure handle {index}: 'global_rank' must be an int or null, got {global_rank!r}")
    return peer


def plan_rendezvous(opts: Any, handle_id: str) -> Rendezvous:
    """This member's rank, the world size and the store address for the reconfigure ``opts``.

    Raises :class:`ConfigError` when the handles are not an ordered list, a
    handle is malformed, or this member's own handle is missing or repeated.
    """
    handles = opts.handles
    if not isinstance(handles, (list, tuple)):
        raise ConfigError(f"reconfigure handles must be an ordered list (the rank order), got "
                          f"{type(handles).__name__}")
    if not handles:
        raise ConfigError("reconfigure got no handles")
    uuid = opts.uuid
    if isinstance(uuid, bool) or not isinstance(uuid, int) or uuid < 0:
        raise ConfigError(f"reconfigure uuid must be a non-negative int, got {uuid!r}")
    peers = [_parse_handle(handle, index) for index, handle in enumerate(handles)]
    ids = [peer["id"] for peer in peers]
    if ids.count(handle_id) != 1:
        raise ConfigError(f"this process group's handle (id {handle_id!r}) appears {ids.count(handle_id)} times "
                          f"among the {len(ids)} reconfigure handles; it must appear exactly once")
    global_ranks = [peer.get("global_rank") for peer in peers]
    return Rendezvous(
        store_addr=f"{peers[0]['store']}/torchft/{uuid}",
        rank=ids.index(handle_id),
        world_size=len(peers),
        uuid=uuid,
        global_ranks=None if None in global_ranks else global_ranks,
    )
