"""Health checks on what a step would commit: the non-finite guard, and the wiring of a rank's checks.

One bad batch, or a flaky accelerator, can make a group's gradients NaN or Inf;
averaged in, they would poison every group at once, and a heal would copy the
poison on. :class:`NonFiniteGuard` keeps them out of the average (how, on the
class); :class:`HealthConfig` is the Manager's ``health=`` and
:func:`health_checks` wires a rank's guard and fingerprints. docs/health.md ("The
non-finite guard") says what a user sees.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch.distributed import ReduceOp

from torchft_lite.core.report import ComputeAdvertiser
from torchft_lite.core.step import Step, start_allreduce
from torchft_lite.errors import ConfigError, NonFiniteError, StateDivergedError
from torchft_lite.health.fingerprint import DEFAULT_EXCLUDE, Fingerprinter

__all__ = ["FINGERPRINT_EVERY_ENV", "HealthConfig", "MAX_NONFINITE_STEPS_ENV", "NONFINITE_GUARD_ENV"]

NONFINITE_GUARD_ENV = "TORCHFT_LITE_NONFINITE_GUARD"
MAX_NONFINITE_STEPS_ENV = "TORCHFT_LITE_MAX_NONFINITE_STEPS"
FINGERPRINT_EVERY_ENV = "TORCHFT_LITE_FINGERPRINT_EVERY"


@dataclass(frozen=True)
class HealthConfig:
    """The Manager's health checks (keyword ``health=``): the non-finite guard (:class:`NonFiniteGuard`) and
    replica fingerprints (:mod:`torchft_lite.health.fingerprint`)."""

    nonfinite_guard: bool = True
    """Keep non-finite gradients out of the average (must match in every group of the job)."""
    max_nonfinite_steps: int = 3
    """A group whose own gradients were non-finite this many steps in a row leaves (exit code 65)."""
    fingerprint_every: int = 100
    """Fingerprint the state every this many steps; 0 turns it off (``torchft_lite.health.fingerprint``)."""
    fingerprint_exclude: str | None = DEFAULT_EXCLUDE
    """A regular expression: state paths it matches are not fingerprinted (state groups may hold differently)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_nonfinite_steps, int) or self.max_nonfinite_steps < 1:
            raise ConfigError(f"max_nonfinite_steps must be an int >= 1, got {self.max_nonfinite_steps!r}")
        if not isinstance(self.fingerprint_every, int) or self.fingerprint_every < 0:
            raise ConfigError(f"fingerprint_every must be an int >= 0 (0: off), got {self.fingerprint_every!r}")
        try:
            re.compile(self.fingerprint_exclude or "")
        except re.error as exc:
            raise ConfigError(f"fingerprint_exclude is not a regular expression: {exc}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "HealthConfig":
        """``TORCHFT_LITE_NONFINITE_GUARD`` (1/0, default 1), ``TORCHFT_LITE_MAX_NONFINITE_STEPS`` (default 3)."""
        environ = os.environ if environ is None else environ
        flag = environ.get(NONFINITE_GUARD_ENV, "1").strip().lower()
        if flag not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ConfigError(f"{NONFINITE_GUARD_ENV} must be 1 or 0, got {flag!r}")
        limit = _int_env(environ, MAX_NONFINITE_STEPS_ENV, cls.max_nonfinite_steps, ">= 1")
        every = _int_env(environ, FINGERPRINT_EVERY_ENV, cls.fingerprint_every, ">= 0 (0: off)")
        return cls(nonfinite_guard=flag in ("1", "true", "yes", "on"), max_nonfinite_steps=limit,
                   fingerprint_every=every)


def _int_env(environ: Mapping[str, str], name: str, default: int, what: str) -> int:
    raw = environ.get(name, str(default)).strip()
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer {what}, got {raw!r}") from None


def health_checks(config: HealthConfig, state: Callable[[], Any], advertise: Callable[[str, object], None] | None,
                  client: Any, listeners: Any, log: Callable[..., None],
                  record: Callable[[Step, BaseException], None]) -> tuple["NonFiniteGuard", Fingerprinter]:
    """One rank's health checks, wired: its non-finite guard and its Fingerprinter (added to ``listeners``, the
    Manager's ``StepListeners``). On group rank 0 (where ``advertise`` is set) the compute-time advertiser for
    the lighthouse's straggler scores is added too, and the Fingerprinter logs each quorum's verdict."""
    fingerprinter = Fingerprinter(config.fingerprint_every, state, log, config.fingerprint_exclude)
    listeners.add(fingerprinter)
    if config.fingerprint_every and hasattr(client, "watch_quorums"):
        client.watch_quorums(fingerprinter.quorum_issued)
    if advertise is not None:
        listeners.add(ComputeAdvertiser(advertise))
    return NonFiniteGuard(config, log, record, advertise), fingerprinter


class NonFiniteGuard:
    """The Manager's side of the guard: starts guarded allreduces, and judges each step after its vote.

    * Before a gradient bucket enters the allreduce, the group checks it (one fused reduction: the bucket's
      float32 sum is finite exactly when every element is, short of an overflow past 3e38, which is no usable
      gradient either). A non-finite bucket is replaced by zeros, and the group does not count in that
      bucket's average: a second, one-element allreduce sums how many groups were left out, and the average
      divides by the quorum's count of participants less that number (unchanged when every bucket is
      finite). Every group (the bad one too) then applies the same average of the good groups' gradients, so
      parameters stay identical and the step commits.
    * When no group contributed (all were non-finite), or the average itself is non-finite, the step fails on
      every group alike: nothing commits.
    * A group whose own gradients were non-finite ``max_nonfinite_steps`` committed or attempted steps in a row
      raises :class:`~torchft_lite.errors.NonFiniteError` from ``should_commit``, after its vote
      (:meth:`judge`): it leaves, and :func:`torchft_lite.cluster.exit_codes.run` exits with
      ``EXIT_CODE_BAD_REPLICA`` (65) so the scheduler replaces it.

    The guard changes the collectives a step issues (two per bucket), so it must be on in every group of a job
    or in none (``TORCHFT_LITE_NONFINITE_GUARD=0``, or ``HealthConfig(nonfinite_guard=False)``, everywhere turns
    it off). It applies to AVG allreduces of floating-point tensors (the gradients DDP and
    ``Manager.allreduce`` average); other reductions pass through as before.
    """

    def __init__(self, config: HealthConfig, log: Callable[..., None], record: Callable[[Step, BaseException], None],
                 advertise: Callable[[str, object], None] | None = None) -> None:
        """``record``: fails a step (the Manager's); ``advertise``: adds a key to the group's member data
        (group rank 0's), where the lighthouse's ``/api/status`` shows it."""
        self.config = config
        self._log, self._record, self._advertise = log, record, advertise
        self.in_a_row = 0
        self.steps_skipped = 0  # steps this group's own gradients were left out of (for metrics and status)

    def start(self, pg: Any, tensor: torch.Tensor, reduce_op: Any, participants: int, step: Step,
              counts: bool, quantize: bool = False) -> Any:
        """Start the step's allreduce of ``tensor`` (in place); its future yields ``tensor``, averaged.

        ``counts``: whether the quorum counts this group in ``participants`` (a spare, or a healing group
        where torchft does not count it, sends zeros and is not counted either way).
        ``quantize``: sum in 8 bits (``torchft_lite.collectives``); the count of left-out groups stays exact.
        A quantized reduction the input can never take (dtype, reduce op, group) raises
        ``UnsupportedQuantization`` before anything is sent (see ``failed_to_start``).
        """
        if quantize:  # imported on first use: a trainer that never quantizes does not load it
            from torchft_lite.collectives import (
                allreduce_quantized, check_quantized_reduction, start_quantized_allreduce,
            )
        if not (self.config.nonfinite_guard and reduce_op == ReduceOp.AVG and tensor.is_floating_point()):
            if quantize:  # checks its input before it sends anything
                return start_quantized_allreduce(pg, tensor, reduce_op, participants)
            return start_allreduce(pg, tensor, reduce_op, participants)
        if quantize:  # before the guard below may zero the tensor
            check_quantized_reduction([tensor], reduce_op, pg)
        from torch.distributed.distributed_c10d import AllreduceOptions

        finite = torch.isfinite(tensor.sum(dtype=torch.float32))
        if tensor.device.type == "cpu":
            if not bool(finite):  # free on the host, and it saves the (usual) finite bucket a write pass
                tensor.zero_()
        else:  # on the device: no host sync before the allreduce is enqueued
            tensor.masked_fill_(finite.logical_not(), 0.0)
        left_out = (finite.logical_not() & counts).to(torch.float32).reshape(1)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        if quantize:  # every rank issues its collectives in this order: the quantized sum, then the count
            summed = allreduce_quantized([tensor], ReduceOp.SUM, pg).get_future()
        else:
            summed = pg.allreduce([tensor], opts).get_future()
        counted = pg.allreduce([left_out], opts).get_future()

        def average(_: Any) -> torch.Tensor:
            # wait(), not value(): re-raises a failed collective, and on CUDA makes this callback's stream wait
            # for both results (a callback's streams wait only for the future that completed last)
            summed.wait(), counted.wait()
            if counts and not bool(finite):
                step.nonfinite = True
            contributors = participants - int(left_out.item())
            if contributors <= 0:  # recorded, not raised: torch would wrap it in a RuntimeError
                self._record(step, NonFiniteError("every group's gradients in this bucket were non-finite "
                                                  "(NaN/Inf): nothing to average, the step does not commit"))
                return tensor
            tensor.div_(contributors)
            if not bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
                self._record(step, NonFiniteError("the average of the groups' gradients is non-finite: the step "
                                                  "does not commit"))
            return tensor

        return torch.futures.collect_all([summed, counted]).then(average)

    def failed_to_start(self, step: Step, error: Exception) -> None:
        """The Manager's allreduce did not start: fail the step, unless the error is a quantized reduction
        the input can never take (an ``UnsupportedQuantization``: a programming error, every step would fail
        alike), which is raised to the caller."""
        from torchft_lite.quantization import UnsupportedQuantization

        if isinstance(error, UnsupportedQuantization):
            raise error
        self._record(step, error)

    def judge(self, step: Step, committed: bool) -> None:
        """After the vote: name this group when its gradients were left out; leave after too many in a row.

        Replica states that diverged with no majority (fingerprints) raise ``StateDivergedError``: stop."""
        if isinstance(step.error, StateDivergedError):
            raise step.error
        if not step.nonfinite:
            if step.collectives_ready:
                self.in_a_row = 0
            return
        self.in_a_row += 1
        self.steps_skipped += 1
        if self._advertise is not None:
            self._advertise("nonfinite_steps", self.steps_skipped)
        self._log(logging.WARNING, "this group's gradients were non-finite (NaN/Inf) and were left out of the "
                  "average; the step %s (%d in a row, leaving at %d)", "committed without them" if committed
                  else "did not commit", self.in_a_row, self.config.max_nonfinite_steps)
        if self.in_a_row >= self.config.max_nonfinite_steps:
            raise NonFiniteError(f"this group's gradients were non-finite {self.in_a_row} steps in a row "
                                 f"(max_nonfinite_steps={self.config.max_nonfinite_steps}): leaving so it can be "
                                 f"replaced (exit code 65)")
