"""One step of the Manager, from ``start_quorum`` to ``should_commit``.

``start_quorum`` creates a :class:`Step`; the next ``start_quorum`` replaces
it, so nothing of a step is reset by hand. The finished step stays readable
until then (``num_participants()`` and ``errored()`` answer for it, as in
torchft).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from torchft_lite.errors import ExceptionWithTraceback

__all__ = ["Participation", "Step", "WorldSizeMode", "participation_of", "start_allreduce"]


class WorldSizeMode(Enum):
    """How many replicas take part in a step (torchft's ``torchft.manager.WorldSizeMode``).

    DYNAMIC: every up-to-date replica participates; gradients are averaged over them.
    FIXED_WITH_SPARES: exactly ``min_replica_size`` participate; spares contribute zeros.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


@dataclass(frozen=True)
class Participation:
    """Who takes part in a step's collectives."""

    rank: int | None = None
    """This replica's rank among the participants, None when it sits the step out."""
    world_size: int = 0
    """How many replicas the peers average over."""


@dataclass(eq=False)
class Step:
    """The state of one step. Written by the control-plane loop until ``ready``, then by the training thread."""

    number: int
    """The Manager's step when the step began."""
    training_thread: int | None = None
    """The thread that called ``start_quorum``: state is applied and served only there."""
    quorum: concurrent.futures.Future | None = None
    """The whole quorum, heal included (``should_commit`` waits for it)."""
    ready: concurrent.futures.Future | None = None
    """The quorum and the process group (collectives wait for it)."""
    open: bool = False
    """Between ``start_quorum`` and the end of ``should_commit``."""

    error: BaseException | None = None
    """The first error: the step will not commit."""
    _reported: ExceptionWithTraceback | None = field(default=None, repr=False)
    participation: Participation = Participation()
    members: frozenset[str] = frozenset()
    """Replica ids of this step's quorum (empty until it is known)."""
    quorum_id: int | None = None
    """The id of this step's quorum (None until it is known)."""
    gone: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Replica id -> (the event's ``quorum_id``, why), every member-gone event since ``start_quorum``."""
    collectives_ready: bool = False
    """The process group is configured for this step's quorum."""

    healing: bool = False
    """A replica behind the max step: it receives the state dict this step."""
    received: Any = None
    """The received, not yet applied, state (a ``HealResult``)."""
    pre_heal_state: dict[str, int] | None = None
    """The Manager's own state before a heal was applied (restored if the group's step failed)."""
    torn_at_max_step: bool = False
    """The state is torn and this quorum makes it up to date: fail stop at the end of the step."""
    nonfinite: bool = False
    """This group's own gradients were non-finite in a bucket and left out of the average (``health.nonfinite``)."""

    send_to: list[int] = field(default_factory=list)
    """Replica ranks that heal from this one this step."""
    send_step: int | None = None
    """The step they expect."""
    published: bool = False
    """This step's state was handed to the transport (at most once a step)."""
    released: bool = False
    """... and taken back: its receivers finished, or their time ran out."""
    served_before: int | None = None
    """The transport's ``bytes_served`` when the state was published."""

    work: list[Any] = field(default_factory=list)
    """Every collective this step started (``ManagedWork``)."""

    # Where the training thread's time went (``step_report.StepReport``), ``time.monotonic()``.
    started_at: float = field(default_factory=time.monotonic)
    """``start_quorum`` began."""
    compute_from: float | None = None
    """``start_quorum`` returned: the forward and backward pass run."""
    first_allreduce_at: float | None = None
    """The first ``allreduce`` call."""
    commit_from: float | None = None
    """``should_commit`` was called."""
    late_quorum_wait: float = 0.0
    """Seconds blocked on the quorum after ``start_quorum`` returned (``wait_quorum``)."""
    healed: Any = None
    """The applied heal: its ``HealResult`` without the state."""

    def member_gone(self) -> str | None:
        """Why a member of this step's quorum left, if one did (an event from before the quorum does not count)."""
        members = self.members
        return next((why for replica_id, (left_in, why) in list(self.gone.items())
                     if replica_id in members and not self.predates_quorum(left_in)), None)

    def predates_quorum(self, event_quorum_id: int) -> bool:
        """A member-gone event whose ``quorum_id`` (the lighthouse's last issued quorum when the member left) is
        older than this step's quorum: the member left before this quorum was issued, and the lighthouse took
        it back in (it came back: a partition healed, the lighthouse restarted), so the event is not about this
        quorum. Failing the step on it would skip collectives that member waits for, stuck until its timeout.
        0 (a lighthouse that sends no id) or an unknown quorum: the event counts."""
        return 0 < event_quorum_id < (self.quorum_id or 0)

    def record(self, error: BaseException) -> bool:
        """Keep ``error`` if it is the step's first; True when it was."""
        if self.error is not None:
            return False
        self.error = error
        return True

    def error_with_traceback(self) -> ExceptionWithTraceback | None:
        """The step's first error as ``Manager.errored()`` hands it out (the same object every time)."""
        error = self.error
        if error is None:
            return None
        if self._reported is None or self._reported.original_exception is not error:
            self._reported = ExceptionWithTraceback(error)
        return self._reported


def participation_of(response: Any, *, counts_healing: bool, spares_above: int | None) -> Participation:
    """Who takes part, from the group's quorum answer (a ``QuorumResult``).

    ``counts_healing``: a synchronous quorum applies the heal before the
    forward pass, so every member takes part (torchft's rule); otherwise only
    the replicas at the max step do. ``spares_above``: with
    ``FIXED_WITH_SPARES``, only that many take part and the rest contribute zeros.
    """
    if counts_healing:
        rank, size = response.replica_rank, response.replica_world_size
    else:
        rank, size = response.max_replica_rank, response.max_world_size
    if spares_above is not None:
        rank = rank if rank is not None and rank < spares_above else None
        size = min(size, spares_above)
    return Participation(rank, size)


def start_allreduce(pg: Any, tensor: Any, reduce_op: Any, participants: int, waits: list[Any]) -> Any:
    """Start an allreduce of ``tensor`` on ``pg``, in place; its future yields ``tensor``.

    AVG is a SUM divided by ``participants`` (the replicas the peers count, not
    the process group's size: healing replicas and spares contribute zeros).
    ``waits``: see :func:`torchft_lite.work.work_future` (a work without a torch future of its own).
    """
    from torch.distributed import ReduceOp
    from torch.distributed.distributed_c10d import AllreduceOptions

    from torchft_lite.work import work_future

    average = reduce_op == ReduceOp.AVG
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM if average else reduce_op
    fut = work_future(pg.allreduce([tensor], opts), [tensor], waits)
    if average:
        def divide(f: Any) -> Any:
            f.value()  # re-raises a failed collective
            return tensor.div_(participants)

        return fut.then(divide)
    return fut.then(lambda f: (f.value(), tensor)[1])
