"""Replica fingerprints: silent data corruption is found by majority and healed, not spread.

A flipped bit in one group's parameters stays finite, so the non-finite guard
can't see it. Every ``fingerprint_every`` steps (``HealthConfig``) every rank's
:class:`Fingerprinter` fingerprints its state at the start of the step
(:func:`fingerprint_of`) and sends it with its quorum request; its group folds its
ranks' into the group's, and :mod:`torchft_lite.health.fingerprint_vote` says what
the quorum does with them. docs/health.md ("Replica fingerprints") for users.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from torchft_lite.health.fingerprint_vote import (
    FOLD, MAX_SUMS, differing_ranks, first_difference, parse_fingerprint, vote,
)

__all__ = ["DEFAULT_EXCLUDE", "Fingerprint", "Fingerprinter", "fingerprint_of"]

DEFAULT_EXCLUDE = r"(^|\.)(running_mean|running_var|num_batches_tracked)$"
"""Paths (dot-joined keys) left out of the fingerprint by default: BatchNorm's per-group statistics."""
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Fingerprint:
    """A state's fingerprint (see :func:`fingerprint_of`)."""

    digest: str
    """Hex BLAKE2b-128 over every covered tensor's path, dtype, shape and sum64."""
    sums: tuple[int, ...]
    """32-bit sums (modulo 2**32 - 1) of runs of consecutive covered tensors (one tensor per run up to
    ``MAX_SUMS`` tensors)."""
    runs: tuple[tuple[str, str], ...]
    """The first and last path of each run, for naming the tensor that differs."""
    nbytes: int

    def advertised(self, step: int) -> dict[str, Any]:
        packed = struct.pack(f"<{len(self.sums)}I", *self.sums)
        return {"step": step, "digest": self.digest, "sums": base64.b64encode(packed).decode("ascii")}


def _sum64(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s bytes as little-endian 64-bit words (the last one zero-padded), on its device."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    whole = raw.numel() - raw.numel() % 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # an odd storage offset: view dtypes need alignment
        words = raw[:whole].clone().view(torch.int64)
    total = words.sum()
    if whole != raw.numel():
        tail = torch.zeros(8, dtype=torch.uint8, device=raw.device)
        tail[: raw.numel() - whole] = raw[whole:]
        total = total + tail.view(torch.int64)[0]
    return total


def _paths_and_tensors(state: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a nested dict/list state, by its dot-joined path, in the state's order."""
    if isinstance(state, torch.Tensor):
        local = getattr(state, "_local_tensor", None)  # a DTensor: this rank's shard
        return [(prefix, local if isinstance(local, torch.Tensor) else state)]
    if isinstance(state, dict):
        items: Sequence[tuple[Any, Any]] = list(state.items())
    elif isinstance(state, (list, tuple)):
        items = list(enumerate(state))
    else:
        return []
    found: list[tuple[str, torch.Tensor]] = []
    for key, value in items:
        found.extend(_paths_and_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def fingerprint_of(state: Any, exclude: str | None = DEFAULT_EXCLUDE) -> Fingerprint:
    """The fingerprint of ``state`` (nested dicts and lists of tensors and other values).

    It covers the floating-point tensors of the registered state (the parameters and the optimizer's moments):
    each tensor's bytes are summed as 64-bit words, modulo 2**64, on the tensor's own device (the heal format's
    ``sum64``; any single flipped bit changes it), and a 128-bit BLAKE2b digest covers every tensor's path,
    dtype, shape and sum. Integer tensors and other values (step counters, a data loader's position, which
    groups may legitimately hold differently) are left out, and so are the paths ``exclude`` matches: by
    default BatchNorm's running statistics, which DDP does not average across groups.

    Every rank fingerprints its own state (ranks of a group may hold different shards or, with per-rank data,
    different parameters; group rank ``r`` of every group holds the same); the group's fingerprint covers all
    of its ranks', so a flipped bit on any rank is found, and the log names the rank.
    """
    pattern = re.compile(exclude) if exclude else None
    covered = [(path, t) for path, t in _paths_and_tensors(state)
               if t.is_floating_point() and not (pattern is not None and pattern.search(path))]
    if not covered:
        return Fingerprint(hashlib.blake2b(b"", digest_size=16).hexdigest(), (), (), 0)
    sums = [s & _MASK for s in torch.stack([_sum64(t).cpu() for _, t in covered]).tolist()]
    digest = hashlib.blake2b(digest_size=16)
    for (path, tensor), total in zip(covered, sums):
        digest.update(f"{path}\0{tensor.dtype}\0{tuple(tensor.shape)}\0{total:016x}\n".encode())
    per_run = -(-len(covered) // MAX_SUMS)
    runs, run_sums = [], []
    for start in range(0, len(covered), per_run):
        chunk = range(start, min(start + per_run, len(covered)))
        run_sums.append(sum(sums[i] for i in chunk) % FOLD)
        runs.append((covered[chunk[0]][0], covered[chunk[-1]][0]))
    nbytes = sum(t.numel() * t.element_size() for _, t in covered)
    return Fingerprint(digest.hexdigest(), tuple(run_sums), tuple(runs), nbytes)


class Fingerprinter:
    """Every rank's step listener: fingerprints its state every ``every`` steps, for its next quorum request.

    Group rank 0's also logs the quorum's verdict (:meth:`quorum_issued`, on the ManagerServer's loop).
    """

    def __init__(self, every: int, state: Callable[[], Any], log: Callable[..., None],
                 exclude: str | None = DEFAULT_EXCLUDE) -> None:
        self.every = every
        self._state, self._log, self._exclude = state, log, exclude
        self.last: tuple[int, Fingerprint] | None = None
        """The step and fingerprint last taken."""
        self.seconds = 0.0
        """How long the last fingerprint took."""
        self.fingerprints = 0
        """Fingerprints computed (for metrics)."""
        self.corruptions = 0
        """Quorums whose vote found a group holding another state (for metrics)."""

    def pause(self, why: str) -> None:
        """Fingerprint no more: the groups' states legitimately differ at ``start_quorum`` (LocalSGD, DiLoCo)."""
        if self.every > 0:
            self._log(logging.INFO, "replica fingerprints are off: %s", why)
        self.every = 0

    def step_starting(self, step: int) -> None:
        if self.every <= 0 or step <= 0 or step % self.every:
            return
        started = time.monotonic()
        fingerprint = fingerprint_of(self._state(), self._exclude)
        self.seconds = time.monotonic() - started
        self.last = (step, fingerprint)
        self.fingerprints += 1
        self._log(logging.INFO, "fingerprint of step %d: %s (%d tensor run(s), %.1f MB, %.3fs)", step,
                  fingerprint.digest[:12], len(fingerprint.sums), fingerprint.nbytes / 1e6, self.seconds)

    def for_step(self, step: int) -> str:
        """This rank's ``ManagerQuorumRequest.state_fingerprint`` at ``step``: JSON, or empty when it took none."""
        if self.last is None or self.last[0] != step:
            return ""
        return json.dumps(self.last[1].advertised(step), separators=(",", ":"))

    def quorum_issued(self, members: Sequence[tuple[str, int, str]]) -> None:
        """The lighthouse issued a quorum of ``(replica id, step, data)``: log the fingerprint vote's verdict."""
        parsed = {rid: (step, parse_fingerprint(data)) for rid, step, data in members}
        verdict = vote([(rid, step, fp) for rid, (step, fp) in parsed.items()])
        if verdict is None or not verdict.corrupt:
            return
        self.corruptions += 1
        where = ""
        reference = (verdict.majority or verdict.corrupt)[0]
        odd = next(rid for rid in verdict.corrupt if rid != reference)
        theirs, ours = parsed[odd][1], parsed[reference][1]
        ranks = differing_ranks(theirs, ours)
        if ranks:
            where += f"; group rank(s) {', '.join(map(str, ranks))} differ"
        index = first_difference(theirs.sums, ours.sums)
        if index is not None and self.last is not None and index < len(self.last[1].runs):
            first, last = self.last[1].runs[index]
            where += f"; first tensor that differs between {odd} and {reference}: " + (
                first if first == last else f"{first} .. {last}")
        action = ("every group stops (exit code 70): restart the job from its last durable checkpoint"
                  if verdict.split else f"{', '.join(verdict.corrupt)} heal(s) from the majority in this quorum")
        self._log(logging.WARNING, "silent data corruption: %s%s; %s", verdict.describe(), where, action)
