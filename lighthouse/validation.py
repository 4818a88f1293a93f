"""What the lighthouse accepts from a member: every number and size a request carries, range-checked.

A member's ``QuorumMember`` is copied into every quorum response and onto the
dashboard, its step feeds the stale-quorum guard and the state directory, and
its ids key the lighthouse's tables. So nothing in it is taken on trust: a
field outside its range (a negative or absurd step, an id with control
characters, megabytes of ``data``) is refused with INVALID_ARGUMENT, a
message that names the field and its limit, and a count by reason
(``lighthouse_invalid_requests_total{reason}``). A flood of bad requests is
logged at most once every :data:`LOG_EVERY` seconds per reason, with how many
were not logged.

The limits are far above what a real job sends (see each constant) and below
what would cost the lighthouse or its members memory or exactness: steps stay
below 2**53 so that a JSON reader (the dashboard's JavaScript) holds them
exactly.
"""

from __future__ import annotations

import collections
import logging
import time

import grpc
from google.protobuf.message import DecodeError

from torchft_lite.rpc.protocol import torchft_pb2 as pb

__all__ = ["MAX_DATA_BYTES", "MAX_REPLICA_ID_LEN", "REASONS", "STEP_LIMIT", "RequestChecks", "member_problem",
           "replica_id_problem"]

logger = logging.getLogger(__name__)

STEP_LIMIT = 2**53
"""Steps are in ``[0, STEP_LIMIT)``: a million steps a second would take 285 years to reach it."""
MAX_REPLICA_ID_LEN = 1024
"""Characters in a replica id (torchft's are a group name, a colon and a uuid)."""
MAX_ADDRESS_LEN = 1024
"""Characters in ``address`` and ``store_address`` (a host name is at most 253)."""
MAX_WORLD_SIZE = 1 << 20
"""Ranks in one replica group."""
MAX_COMMIT_FAILURES = 2**31 - 1
"""Consecutive failed commits a member may report."""
MAX_DATA_BYTES = 64 * 1024
"""UTF-8 bytes of ``data`` (a few small JSON fields in practice)."""
MAX_HANDLES = 4096
"""``reconfigure_handles``: one per group rank."""
MAX_HANDLE_BYTES = 4096
MAX_MEMBER_BYTES = 1 << 20
"""The whole serialized member, unknown fields included: every quorum response carries it to every member."""
LOG_EVERY = 10.0

REASONS = ("malformed", "missing_requester", "replica_id", "step", "world_size", "commit_failures", "address",
           "store_address", "data", "reconfigure_handles", "member_size")
"""Every ``reason`` label a refusal can carry (all exported at 0 from the start, as Prometheus advises)."""


def replica_id_problem(replica_id: str, what: str = "replica_id") -> str | None:
    """Why ``replica_id`` is refused, or None: it must be 1 to 1024 printable characters without whitespace."""
    if not replica_id:
        return f"{what} must be a non-empty string"
    if len(replica_id) > MAX_REPLICA_ID_LEN:
        return f"{what} is longer than {MAX_REPLICA_ID_LEN} characters ({len(replica_id)})"
    if not replica_id.isprintable() or any(c.isspace() for c in replica_id):
        return f"{what} must be printable characters without whitespace, got {_shown(replica_id)}"
    return None


def member_problem(member: pb.QuorumMember) -> tuple[str, str] | None:
    """``(reason, message)`` for the first field of ``member`` out of range, or None when all are in range."""
    problem = replica_id_problem(member.replica_id, "requester.replica_id")
    if problem is not None:
        return "replica_id", problem
    for reason, value, low, high in (("step", member.step, 0, STEP_LIMIT - 1),
                                     ("world_size", member.world_size, 0, MAX_WORLD_SIZE),
                                     ("commit_failures", member.commit_failures, 0, MAX_COMMIT_FAILURES)):
        if not low <= value <= high:
            return reason, f"requester.{reason} must be from {low} to {high}, got {value}"
    for reason in ("address", "store_address"):
        value = getattr(member, reason)
        if len(value) > MAX_ADDRESS_LEN or not value.isprintable():
            return reason, (f"requester.{reason} must be at most {MAX_ADDRESS_LEN} printable characters, "
                            f"got {_shown(value)} ({len(value)} characters)")
    size = len(member.data.encode("utf-8", "surrogatepass"))
    if size > MAX_DATA_BYTES:
        return "data", f"requester.data is {size} bytes, more than {MAX_DATA_BYTES} (keep it to a few small fields)"
    handles = member.reconfigure_handles
    if len(handles) > MAX_HANDLES or any(len(h.encode("utf-8", "surrogatepass")) > MAX_HANDLE_BYTES for h in handles):
        return "reconfigure_handles", (f"requester.reconfigure_handles must be at most {MAX_HANDLES} handles of at "
                                       f"most {MAX_HANDLE_BYTES} bytes each, got {len(handles)}")
    size = member.ByteSize()
    if size > MAX_MEMBER_BYTES:
        return "member_size", f"requester is {size} bytes serialized, more than {MAX_MEMBER_BYTES} (unknown fields?)"
    return None


class RequestChecks:
    """The lighthouse handlers' checks: each awaits ``context.abort`` (which raises) on a refusal, after
    counting it in :attr:`refused` by reason and logging it (rate-limited)."""

    def __init__(self) -> None:
        self.refused: collections.Counter[str] = collections.Counter()
        self._logged_at: dict[str, float] = {}
        self._unlogged: collections.Counter[str] = collections.Counter()

    @property
    def invalid(self) -> int:
        """Requests refused with INVALID_ARGUMENT so far."""
        return sum(self.refused[reason] for reason in REASONS)

    async def refuse(self, context: grpc.aio.ServicerContext, reason: str, message: str,
                     code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        """Count, log and answer ``code`` with ``message``; raises (``context.abort`` does)."""
        self.refused[reason] += 1
        now = time.monotonic()
        if now - self._logged_at.get(reason, -LOG_EVERY) >= LOG_EVERY:
            self._logged_at[reason] = now
            unlogged, self._unlogged[reason] = self._unlogged[reason], 0
            more = f" (and {unlogged} more like it in the last {LOG_EVERY:.0f}s)" if unlogged else ""
            logger.warning("refused a request from %s (%s): %s%s", context.peer(), code.name, message, more)
        else:
            self._unlogged[reason] += 1
        await context.abort(code, message)

    async def parse(self, cls, data: bytes, context: grpc.aio.ServicerContext):
        """``cls`` decoded from ``data``, or an INVALID_ARGUMENT answer for bytes that are not one."""
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            await self.refuse(context, "malformed", f"malformed {cls.__name__}: {exc}")

    async def replica_id(self, replica_id: str, what: str, context: grpc.aio.ServicerContext) -> None:
        problem = replica_id_problem(replica_id, what)
        if problem is not None:
            await self.refuse(context, "replica_id", problem)

    async def member(self, request: pb.LighthouseQuorumRequest, context: grpc.aio.ServicerContext) -> pb.QuorumMember:
        """The request's ``requester``, every field of it in range."""
        if not request.HasField("requester"):
            await self.refuse(context, "missing_requester", "LighthouseQuorumRequest.requester is required")
        problem = member_problem(request.requester)
        if problem is not None:
            await self.refuse(context, *problem)
        return request.requester


def _shown(text: str, limit: int = 40) -> str:
    """A bounded, escaped preview of a refused string (a refusal never echoes megabytes into the log)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
