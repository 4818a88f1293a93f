"""What one step did and where its time went: the Manager's :class:`StepReport`.

At the end of every ``should_commit`` (committed or not) the Manager tells its
step listeners ``step_finished(report)`` (``Manager.add_step_listener``); the
metrics exporter (:mod:`torchft_lite.metrics.registry`) is one, and a user with
their own registry or logger can add another. Group rank 0's
:class:`ComputeAdvertiser` advertises the step's compute time to the lighthouse,
which scores stragglers on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ComputeAdvertiser", "StepReport", "report_of"]


@dataclass(frozen=True)
class StepReport:
    """One finished step (``StepListener.step_finished``); times in seconds.

    Where the time of a step goes, as the training thread sees it: every span (``quorum_s``, ``compute_s``,
    ``allreduce_s``, ``commit_s``) ends where the next one starts, so they add up to ``total_s``.
    """

    step: int
    """The step the Manager was at when it began (it commits as ``step + 1``)."""
    committed: bool
    error: str | None
    """Why it did not commit: ``"TypeName: message"`` of the step's first error; None when none was recorded
    (it may still not commit: too few participants, or another rank of the group failed)."""
    quorum_id: int
    participants: int
    """How many groups the step's collectives averaged over."""
    participating: bool
    """This group contributed (False: a spare, or healing under an asynchronous quorum)."""
    healed_bytes: int
    """Bytes of the state received and applied this step (0 when it did not heal)."""
    healed_seconds: float
    healed_from: tuple[int, ...]
    """Replica ranks the heal came from."""
    nonfinite: bool
    """This group's gradients were non-finite and were left out of the average (``torchft_lite.health.nonfinite``)."""
    quorum_s: float
    """Blocked on the quorum: in ``start_quorum`` (a synchronous quorum, its heal included) or in the first
    ``allreduce`` (an asynchronous quorum that was not back when the forward and backward pass needed it)."""
    compute_s: float
    """``start_quorum`` returned -> the first ``allreduce`` call: the forward pass and the backward pass up to
    the first gradient bucket (the group's own work; what a straggler is slow at). With no ``allreduce`` before
    ``should_commit`` (LocalSGD's inner steps), up to ``should_commit``."""
    allreduce_s: float
    """The first ``allreduce`` call -> ``should_commit``, less the quorum wait in it: the reduction and the rest
    of the backward pass it overlaps (DDP waits for its buckets before ``backward`` returns)."""
    commit_s: float
    """``should_commit`` itself: waiting for and applying a heal, the group's vote."""
    total_s: float


def report_of(step: Any, committed: bool, quorum_id: int, now: float | None = None) -> StepReport:
    """The report of ``step`` (a ``core.step.Step``) that ends at ``now`` (``time.monotonic()``)."""
    now = time.monotonic() if now is None else now
    began = step.compute_from if step.compute_from is not None else step.started_at
    commit_from = step.commit_from if step.commit_from is not None else now
    reduce_from = step.first_allreduce_at if step.first_allreduce_at is not None else commit_from
    heal = step.healed
    error = step.error
    return StepReport(
        step=step.number,
        committed=committed,
        error=None if error is None else f"{type(error).__name__}: {error}",
        quorum_id=quorum_id,
        participants=step.participation.world_size,
        participating=step.participation.rank is not None and not step.healing,
        healed_bytes=heal.tensor_bytes if heal is not None else 0,
        healed_seconds=heal.seconds if heal is not None else 0.0,
        healed_from=tuple(heal.sources) if heal is not None else (),
        nonfinite=step.nonfinite,
        quorum_s=max(0.0, began - step.started_at) + step.late_quorum_wait,
        compute_s=max(0.0, reduce_from - began),
        allreduce_s=max(0.0, commit_from - reduce_from - step.late_quorum_wait),
        commit_s=max(0.0, now - commit_from),
        total_s=max(0.0, now - step.started_at),
    )


class ComputeAdvertiser:
    """Group rank 0's step listener: advertises each step's compute time, which the lighthouse scores
    stragglers on (``compute_ms``, and the ``compute_step`` it was measured at)."""

    def __init__(self, advertise: Callable[[str, object], None]) -> None:
        self._advertise = advertise

    def step_finished(self, report: StepReport) -> None:
        self._advertise("compute_ms", round(report.compute_s * 1000.0, 3))
        self._advertise("compute_step", report.step)
