"""Which replica groups hold a corrupted state: a majority vote on fingerprints, as a pure function.

Each rank sends its fingerprint (:mod:`torchft_lite.health.fingerprint`) with its
quorum request; the group's ManagerServer folds its ranks' (:func:`group_fingerprint`)
and advertises that under ``"fingerprint"`` in ``QuorumMember.data``, and every group
computes the same :func:`vote` from the same quorum. No torch and no I/O here: the
ManagerServer runs it on each quorum, and group rank 0's
:class:`~torchft_lite.health.fingerprint.Fingerprinter` again to name the first
tensor that differs in its log.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["FINGERPRINT_KEY", "Verdict", "first_difference", "group_fingerprint", "parse_fingerprint", "vote"]

FINGERPRINT_KEY = "fingerprint"
MAX_SUMS = 2048
"""Per-tensor sums one fingerprint carries at most (consecutive tensors share a sum beyond that):
2048 x 4 bytes is 11 KB of base64, well inside the lighthouse's 64 KB of member data."""
_DIGEST = re.compile(r"[0-9a-f]{16,64}")
MAX_RANKS = 4096
FOLD = (1 << 32) - 1
"""Per-tensor sums travel folded to 32 bits modulo 2**32 - 1: a change of 2**k in a 64-bit sum stays visible."""


@dataclass(frozen=True)
class Advertised:
    """One member's fingerprint as it advertised it."""

    step: int
    digest: str
    sums: tuple[int, ...] = ()
    """32-bit sums of consecutive runs of tensors, for naming the first that differs (may be empty)."""
    ranks: tuple[str, ...] = ()
    """Each group rank's own digest (a group's fingerprint), for naming the rank that differs."""


@dataclass(frozen=True)
class Verdict:
    """The vote of one quorum (see :func:`vote`)."""

    step: int
    majority: tuple[str, ...]
    """Replica ids holding the majority's digest (empty on a split)."""
    corrupt: tuple[str, ...]
    """Replica ids at the max step whose digest differs from the majority's (all of them on a split)."""
    split: bool
    digests: Mapping[str, str]
    """Replica id -> digest, for the log."""

    def describe(self) -> str:
        if self.split:
            return (f"replica fingerprints at step {self.step} disagree with no majority ("
                    + ", ".join(f"{rid}: {d[:12]}" for rid, d in sorted(self.digests.items()))
                    + "): nobody can tell which state is right")
        return (f"replica group(s) {', '.join(self.corrupt)} hold a state at step {self.step} that differs from the "
                f"majority's ({', '.join(self.majority)}; digest {self.digests[self.majority[0]][:12]})")


def parse_fingerprint(data: str) -> Advertised | None:
    """The fingerprint in a member's ``QuorumMember.data``; None when it has none or it is malformed."""
    try:
        parsed = json.loads(data) if data else None
    except (ValueError, RecursionError):
        return None
    raw = parsed.get(FINGERPRINT_KEY) if isinstance(parsed, dict) else None
    if not isinstance(raw, dict):
        return None
    step, digest, sums, ranks = raw.get("step"), raw.get("digest"), raw.get("sums", ""), raw.get("ranks", [])
    if type(step) is not int or step < 0 or not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        return None
    if not (isinstance(ranks, list) and len(ranks) <= MAX_RANKS
            and all(isinstance(r, str) and _DIGEST.fullmatch(r) for r in ranks)):
        ranks = []
    return Advertised(step, digest, _unpack_sums(sums), tuple(ranks))


def group_fingerprint(step: int, ranks: Sequence[str]) -> dict[str, Any] | None:
    """The group's fingerprint at ``step`` from each group rank's (its ``state_fingerprint``, in rank order).

    None unless every rank sent a valid one of ``step``: a group that can't vouch for all its ranks does not
    vote (nor does the quorum, see :func:`vote`). The digest covers every rank's, in order; the sums are the
    ranks' added up per tensor run (a flipped bit on any rank changes one), when their lengths agree.
    """
    parsed = [parse_fingerprint(f'{{"{FINGERPRINT_KEY}": {text}}}') if text else None for text in ranks]
    if not parsed or any(fp is None or fp.step != step for fp in parsed):
        return None
    digest = hashlib.blake2b("\n".join(fp.digest for fp in parsed).encode(), digest_size=16).hexdigest()
    lengths = {len(fp.sums) for fp in parsed}
    sums = [sum(column) % FOLD for column in zip(*(fp.sums for fp in parsed))] if len(lengths) == 1 else []
    return {"step": step, "digest": digest, "ranks": [fp.digest for fp in parsed],
            "sums": base64.b64encode(struct.pack(f"<{len(sums)}I", *sums)).decode("ascii")}


def _unpack_sums(text: Any) -> tuple[int, ...]:
    if not isinstance(text, str) or len(text) > 4 * ((MAX_SUMS * 4 + 2) // 3):
        return ()
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return ()
    if len(raw) % 4:
        return ()
    return struct.unpack(f"<{len(raw) // 4}I", raw)


def vote(members: Sequence[tuple[str, int, Advertised | None]]) -> Verdict | None:
    """The verdict on ``(replica id, step, fingerprint)`` members; None when there is nothing to judge.

    Nothing to judge: fewer than two members at the max step, or one of them has no fingerprint of it (a
    torchft manager advertises none, and computes its heal assignment without this rule: then nobody applies
    it). Groups at the same step that took part in the same commits must hold the same bytes; when they
    don't, one of them was hit by silent data corruption. The vote is among the members at the max step:

    * one digest held by a strict majority: the others are *corrupt*. Every group computes the same verdict
      from the same quorum, so each treats them as behind: they heal from the majority in this quorum, as a
      restarted group would.
    * no strict majority (two groups that differ, or a three-way split): nobody can tell which state is right.
      The quorum fails with :class:`~torchft_lite.errors.StateDivergedError` on every group and nothing
      commits; each group exits with ``EXIT_CODE_DIVERGED`` (70) so a person (or a whole-job resume from the
      last durable checkpoint) decides.

    What a group advertises::

        "fingerprint": {"step": 300, "digest": "9f0c...", "sums": "<base64>", "ranks": ["51ab...", ...]}
    """
    if not members:
        return None
    max_step = max(step for _, step, _ in members)
    at_max = [(rid, fp) for rid, step, fp in members if step == max_step]
    if len(at_max) < 2 or any(fp is None or fp.step != max_step for _, fp in at_max):
        return None
    digests = {rid: fp.digest for rid, fp in at_max}
    counts: dict[str, int] = {}
    for digest in digests.values():
        counts[digest] = counts.get(digest, 0) + 1
    if len(counts) == 1:
        return Verdict(max_step, tuple(sorted(digests)), (), False, digests)
    winner, votes = max(counts.items(), key=lambda item: item[1])
    if 2 * votes <= len(at_max):
        return Verdict(max_step, (), tuple(sorted(digests)), True, digests)
    majority = tuple(sorted(rid for rid, d in digests.items() if d == winner))
    corrupt = tuple(sorted(rid for rid, d in digests.items() if d != winner))
    return Verdict(max_step, majority, corrupt, False, digests)


def differing_ranks(a: Advertised, b: Advertised) -> list[int]:
    """The group ranks whose own digests differ between two groups' fingerprints."""
    return [rank for rank, (x, y) in enumerate(zip(a.ranks, b.ranks)) if x != y]


def first_difference(mine: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The index of the first sum that differs (None if none does, or the lists can't be compared)."""
    if not mine or len(mine) != len(theirs):
        return None
    return next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
