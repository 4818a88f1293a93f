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
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch.distributed import ReduceOp

from torchft_lite.core.report import ComputeAdvertiser
from torchft_lite.core.step import Step, start_allreduce
from torchft_lite.errors import ConfigError, NonFiniteError, StateDivergedError
from torchft_lite.health.fingerprint import DEFAULT_EXCLUDE, Fingerprinter
from torchft_lite.work import work_future

__all__ = ["FINGERPRINT_EVERY_ENV", "HealthConfig", "MAX_NONFINITE_STEPS_ENV", "NONFINITE_GUARD_ENV", "PACK_COUNT_MAX_BYTES"]

NONFINITE_GUARD_ENV = "TORCHFT_LITE_NONFINITE_GUARD"
MAX_NONFINITE_STEPS_ENV = "TORCHFT_LITE_MAX_NONFINITE_STEPS"
FINGERPRINT_EVERY_ENV = "TORCHFT_LITE_FINGERPRINT_EVERY"

PACK_COUNT_MAX_BYTES = 4 << 20
"""The guard's count of left-out groups travels in the same collective as a tensor up to this size (a copy of
it, one element longer); a larger tensor's count goes in a collective of its own. Below it the copy costs less
than a collective's round trip, above it the round trip is the smaller cost, and the copy's memory would grow
with the tensor (docs/health.md, "What the checks cost"). The same in every group, as the guard must be."""


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


def _zero_unless(finite: torch.Tensor, tensor: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """``out`` (``tensor`` itself when None) becomes ``tensor``, or zeros where ``finite`` (a 0-dim bool) is False."""
    if tensor.device.type == "cpu":  # the check is free on the host, and spares a finite tensor a pass
        if not bool(finite):
            (tensor if out is None else out).zero_()
        elif out is not None:
            out.copy_(tensor)
    elif out is None:  # on the device: no host sync before the allreduce is enqueued
        tensor.masked_fill_(finite.logical_not(), 0.0)
    else:
        torch.where(finite, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device), out=out)


class _PackBuffers:
    """Host buffers for the guard's one-collective path, kept for the next step's buckets of the same size.

    A fresh host buffer of a few MB is mapped anew by the C library about half the time (its heap is trimmed),
    and writing it then faults in every page: measured here, that tripled what the guard costs a 4 MB bucket.
    A step's buckets have the same sizes every step, so a few kept buffers serve them all. CUDA buffers come
    from torch's caching allocator instead. Buffers of a collective that failed are never given back (it may
    still be writing to them).
    """

    KEEP_BYTES = 64 << 20  # at most this much is kept

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            with self._lock:
                free = self._free.get((numel, dtype))
                if free:
                    buffer = free.pop()
                    self._kept -= buffer.nbytes
                    return buffer
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu":
            return
        with self._lock:
            if self._kept + buffer.nbytes <= self.KEEP_BYTES:
                self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)
                self._kept += buffer.nbytes


_PACKS = _PackBuffers()


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
      bucket's average: an allreduce sums how many groups were left out, and the average divides by the
      quorum's count of participants less that number (unchanged when every bucket is finite). Up to
      ``PACK_COUNT_MAX_BYTES`` the count travels in the bucket's own allreduce (the bucket is sent with one more
      element, 1 from a group left out and 0 from the others); a larger or quantized bucket's count goes in a
      one-element allreduce of its own. Every group (the bad one too) then applies the same average of the good
      groups' gradients, so parameters stay identical and the step commits.
    * When no group contributed (all were non-finite), or the average itself is non-finite, the step fails on
      every group alike: nothing commits.
    * A group whose own gradients were non-finite ``max_nonfinite_steps`` committed or attempted steps in a row
      raises :class:`~torchft_lite.errors.NonFiniteError` from ``should_commit``, after its vote
      (:meth:`judge`): it leaves, and :func:`torchft_lite.cluster.exit_codes.run` exits with
      ``EXIT_CODE_BAD_REPLICA`` (65) so the scheduler replaces it.

    The guard changes the collectives a step issues, so it must be on in every group of a job or in none
    (``TORCHFT_LITE_NONFINITE_GUARD=0``, or ``HealthConfig(nonfinite_guard=False)``, everywhere turns it off).
    It applies to AVG allreduces of floating-point tensors (the gradients DDP and
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
              counts: bool, waits: list[Any], quantize: bool = False) -> Any:
        """Start the step's allreduce of ``tensor`` (in place); its future yields ``tensor``, averaged.

        ``counts``: whether the quorum counts this group in ``participants`` (a spare, or a healing group
        where torchft does not count it, sends zeros and is not counted either way).
        ``waits``: see :func:`torchft_lite.work.work_future` (a work without a torch future of its own).
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
            return start_allreduce(pg, tensor, reduce_op, participants, waits)
        if quantize:  # before anything is sent
            check_quantized_reduction([tensor], reduce_op, pg)
        from torch.distributed.distributed_c10d import AllreduceOptions

        finite = torch.isfinite(tensor.sum(dtype=torch.float32))
        left_out = finite.logical_not() & counts
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        if quantize or tensor.nbytes > PACK_COUNT_MAX_BYTES:
            # The count in a collective of its own, after the sum (every rank issues them in this order): 8 bits
            # would round it, and a large tensor would cost a copy (and its memory) to carry it. A non-finite
            # tensor is zeroed in place.
            _zero_unless(finite, tensor)
            count = left_out.to(torch.float32).reshape(1)
            if quantize:
                summed = allreduce_quantized([tensor], ReduceOp.SUM, pg).get_future()
            else:
                summed = work_future(pg.allreduce([tensor], opts), [tensor], waits)
            counted = work_future(pg.allreduce([count], opts), [count], waits)
            result = torch.futures.collect_all([summed, counted])
            body, sources = tensor, (summed, counted)
        else:
            # One collective: the tensor and, after it, one element holding this group's 1 if it is left out.
            # The tensor is copied (a non-finite one as zeros) rather than zeroed in place; the average is
            # written back in the pass that divides.
            packed = _PACKS.take(tensor.numel() + 1, tensor.dtype, tensor.device)
            body, count = packed[:-1].view(tensor.shape), packed[-1:]
            _zero_unless(finite, tensor, out=body)
            count.copy_(left_out.reshape(1))
            result = work_future(pg.allreduce([packed], opts), [packed], waits)
            sources = (result,)

        def average(_: Any) -> torch.Tensor:
            # wait(), not value(): re-raises a failed collective, and on CUDA makes this callback's stream wait
            # for the results (a callback's streams wait only for the future that completed last)
            for source in sources:
                source.wait()
            if body is not tensor and body.is_cuda:  # the copy is read on this stream: its memory must not be
                body.record_stream(torch.cuda.current_stream(body.device))  # reused before that is done
            if counts and not bool(finite):
                step.nonfinite = True
            contributors = participants - round(float(count.item()))
            if contributors <= 0:  # recorded, not raised: torch would wrap it in a RuntimeError
                self._record(step, NonFiniteError("every group's gradients in this bucket were non-finite "
                                                  "(NaN/Inf): nothing to average, the step does not commit"))
                return tensor
            if body is not tensor:
                torch.div(body, contributors, out=tensor)
                _PACKS.give_back(packed)  # the collective is done with it, and so is this
            else:
                tensor.div_(contributors)
            if not bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
                self._record(step, NonFiniteError("the average of the groups' gradients is non-finite: the step "
                                                  "does not commit"))
            return tensor

        return result.then(average)

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
