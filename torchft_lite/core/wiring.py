"""What a Manager is connected to, built once from its settings.

:class:`DefaultWiring` is torchft's arrangement: the group's TCPStore, a
ManagerServer on group rank 0 whose address every rank reads from the store
and reaches through a ``ManagerClient``, and an ``HTTPTransport`` for heals
unless the user passed a transport. ``torchft_lite.testing.InMemoryWiring``
builds the same parts without sockets.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from torchft_lite.core.healer import stripes
from torchft_lite.core.settings import ManagerSettings
from torchft_lite.errors import ManagerTimeout
from torchft_lite.rpc.loop import ControlPlane

__all__ = ["Connect", "DefaultWiring", "MANAGER_ADDR_KEY", "ManagerParts", "ManagerWiring", "REPLICA_ID_KEY"]

logger = logging.getLogger(__name__)
MANAGER_ADDR_KEY = "manager_addr"
"""The store key group rank 0 publishes its ManagerServer's address under (torchft's)."""
REPLICA_ID_KEY = "replica_id"
"""The store key group rank 0 publishes the group's replica id under (torchft's)."""

Connect = Callable[[str], Any]
"""A ManagerServer's address -> a ``ManagerClient`` to it (the Manager's, so a substituted class is used)."""


@dataclass
class ManagerParts:
    client: Any
    """This rank's ``ManagerClient`` to its group's ManagerServer."""
    connect: Connect
    """How to reach a peer group's ManagerServer (to ask for its checkpoint metadata)."""
    replica_id: str
    """This incarnation's replica id as the lighthouse knows it (the user's id and a unique suffix)."""
    transport: Any
    """The checkpoint transport heals go through."""
    heal_in_place: bool
    """Heals land in the live tensors (only the default transport does that)."""
    store: Any = None
    """The group's TCPStore client, kept as long as the Manager (None without one)."""
    clock: Callable[[], float] = time.monotonic
    """Seconds, for the durations the Manager reports (tests move a fake one)."""
    server: Any = None
    """The group's ``ManagerServer`` where this rank runs it (group rank 0), else None."""

    def close(self, log: Callable[..., None], wait: bool) -> None:
        """Stop serving heals, close the client, then stop the ManagerServer; failures are logged."""
        try:
            self.transport.shutdown(wait=wait)
        except Exception as exc:  # still stop the server below
            log(logging.WARNING, "checkpoint transport shutdown failed: %s", exc)
        for what, close in (("the ManagerClient", self.client.close),
                            ("the ManagerServer", self.server.shutdown if self.server is not None else None)):
            if close is None:
                continue
            try:
                close()
            except TimeoutError as exc:  # still stop the server
                log(logging.WARNING, "shutdown incomplete: %s did not close: %s", what, exc)


class ManagerWiring(Protocol):
    def build(self, settings: ManagerSettings, transport: Any, in_place_targets: Callable[[], Any],
              control: ControlPlane, connect: Connect) -> ManagerParts:
        """Connect one rank's Manager; ``transport`` is the user's, or None for the default; ``connect`` makes the
        Manager's ``ManagerClient``s."""


class DefaultWiring:
    """TCPStore, ManagerServer on group rank 0, a ManagerClient to it on every rank, HTTP heals."""

    def build(self, settings: ManagerSettings, transport: Any, in_place_targets: Callable[[], Any],
              control: ControlPlane, connect: Connect) -> ManagerParts:
        from torch.distributed import TCPStore

        from torchft_lite.coordination import ManagerServer

        s = settings
        heal_in_place = transport is None and s.heal_in_place
        if transport is None:
            from torchft_lite.checkpointing import HTTPTransport

            # defer_server: the healer warms the server at the second step's vote (off a restart's join path).
            # num_chunks unset: each heal's streams come from its size, the source and this host's CPUs (one GET
            # where the CPUs allow one stream; see checkpointing._streams).
            transport = HTTPTransport(timeout=s.timeouts.step, hostname=s.hostname,
                                      state_dict=in_place_targets if heal_in_place else None, defer_server=True)
        # Advertised to the quorum: a source waits for every receiver it is told
        # of, so a group must not offer to stripe unless its transport does.
        heal_sources = s.heal_sources if stripes(transport) else 1
        if heal_sources < s.heal_sources:
            logger.warning("heal_sources=%d, but the checkpoint transport %s does not stripe: healing from one source",
                           s.heal_sources, type(transport).__name__)
        store = TCPStore(s.store_host, s.store_port, is_master=False, wait_for_workers=False,
                         timeout=s.timeouts.connect)
        # torchft's keys; a group torchelastic restarted uses keys of its own, so its ranks never read the address
        # of the incarnation before.
        prefix = f"torchft_lite/{s.restart_count}/" if s.restart_count else ""
        server = None
        if s.group_rank == 0:
            suffix = uuid.uuid4().hex[:12]
            replica_id = f"{s.replica_id}:{suffix}" if s.replica_id else suffix
            server = ManagerServer(
                replica_id=replica_id, lighthouse_addr=s.lighthouse_addr or "", hostname=s.hostname,
                bind=f"[::]:{s.port}", store_addr=s.store_address, world_size=s.group_world_size,
                heartbeat_interval=s.heartbeat_interval, connect_timeout=s.timeouts.connect,
                quorum_retries=s.quorum_retries, quorum_timeout=s.timeouts.quorum, heal_sources=heal_sources,
                lease_timeout=s.lease_timeout,
            )
            store.set(prefix + MANAGER_ADDR_KEY, server.address())
            store.set(prefix + REPLICA_ID_KEY, replica_id)
        try:
            address = store.get(prefix + MANAGER_ADDR_KEY).decode()
            replica_id = store.get(prefix + REPLICA_ID_KEY).decode()
        except RuntimeError as exc:  # the store's own timeout (DistStoreError)
            raise ManagerTimeout(
                f"group rank {s.group_rank}: group rank 0 did not publish its ManagerServer address in the "
                f"TCPStore at {s.store_address} within {s.timeouts.connect.total_seconds():.0f}s"
            ) from exc
        return ManagerParts(client=connect(address), connect=connect, replica_id=replica_id, transport=transport,
                            heal_in_place=heal_in_place, store=store, server=server)
