"""What a Manager lends the parts built around it (durable checkpoints, metrics): :class:`ManagerContext`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchft_lite.core.healer import RegisteredState
from torchft_lite.core.settings import ManagerSettings
from torchft_lite.group_server.manager_client import ManagerClient

__all__ = ["ManagerContext"]


@dataclass(frozen=True)
class ManagerContext:
    """One rank's Manager as the parts built around it see it: ``Manager.context``.

    What they need and nothing they could break: the settings it resolved, how it reaches its group, and
    the state a heal carries. The step, the quorum and the collectives stay the Manager's.
    """

    settings: ManagerSettings
    client: ManagerClient
    """How this rank reaches its group's ManagerServer (what it advertises to the quorum goes through it)."""
    store: Any
    """The group's TCPStore, or None where the Manager has none (``torchft_lite.testing``)."""
    state: RegisteredState
    """What a heal carries: the registered pieces and the Manager's own state; ``state.torn`` after a failed heal."""
    fingerprinter: Any
    """The replica fingerprints' ``Fingerprinter``, or None when they are off."""
