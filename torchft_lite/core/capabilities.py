"""What the Manager may use of a process group or checkpoint transport beyond torchft's interface.

torchft's own process groups and transports (or a user's) may lack these;
ours have them. Each is a runtime-checkable ``Protocol``: the Manager asks
``isinstance(pg, Abortable)`` and uses the capability when it is there,
instead of probing attribute names.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

__all__ = ["Abortable", "Advertises", "ReportsErrors", "ServesStatistics", "StepListener", "WarmsUp"]


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


@runtime_checkable
class Advertises(Protocol):
    """A ManagerClient that can add a key to what the group advertises in ``QuorumMember.data``."""

    def advertise(self, key: str, value: Any) -> None: ...


class StepListener(Protocol):
    """Told by the Manager where a step stands (``Manager.add_step_listener``); every call on the training thread.

    ``DurableCheckpointer`` is one. A listener's exception is logged and does not stop the step.
    """

    def step_starting(self, step: int) -> None:
        """``start_quorum``: the state is that of committed step ``step`` (the optimizer has stepped)."""

    def state_changing(self) -> None:
        """``should_commit``, before a heal is applied or the optimizer may step: stop reading the state."""

    def step_committed(self, step: int, replica_rank: int | None) -> None:
        """The group committed; the Manager is at ``step`` now (the optimizer steps next).

        ``replica_rank``: this group's rank among the step's participants (0 is the first
        of them in the quorum's order, the same answer in every group), None if it sat out.
        """

    def leaving(self) -> None:
        """The Manager leaves on a preemption signal, at a safe point between steps, before it shuts down."""

    def step_finished(self, report: Any) -> None:
        """Optional: ``should_commit`` is returning; ``report`` is a ``step_report.StepReport`` (what the step
        did, where its time went). A listener without this method is not called for it."""
