"""What the Manager may use of a process group or checkpoint transport beyond torchft's interface.

torchft's own process groups and transports (or a user's) may lack these;
ours have them. Each is a runtime-checkable ``Protocol``: the Manager asks
``isinstance(pg, Abortable)`` and uses the capability when it is there,
instead of probing attribute names.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

__all__ = ["Abortable", "ReportsErrors", "ServesStatistics", "WarmsUp"]


@runtime_checkable
class Abortable(Protocol):
    """A process group whose collectives in flight can be failed at once (peers then fail theirs)."""

    def abort(self) -> None: ...


@runtime_checkable
class ReportsErrors(Protocol):
    """A process group that remembers the error of a collective that failed since it was configured."""

    def errored(self) -> BaseException | None: ...


@runtime_checkable
class WarmsUp(Protocol):
    """A process group that starts something ahead of its first configure (a child process)."""

    def wait_warm(self, timeout: timedelta) -> None: ...


@runtime_checkable
class ServesStatistics(Protocol):
    """A checkpoint transport that counts what it served (``statistics().bytes_served``)."""

    def statistics(self) -> Any: ...
