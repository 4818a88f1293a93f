"""What one replica group learns from an issued quorum: a pure function.

The ManagerServer asks the lighthouse for a quorum once per step and then, for
each rank of its group, calls :func:`compute_quorum_result`: replica rank, max
step, the store to rendezvous on and who heals from whom. No network, no clock,
no torch: tests pass literal members. The rules (on the function) match torchft's
so mixed fleets agree, plus fingerprint votes and striped heals of our own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from torchft_lite.errors import StateDivergedError
from torchft_lite.health.fingerprint_vote import Advertised, vote

__all__ = ["QuorumMember", "QuorumResult", "compute_quorum_result", "heal_sources_of", "member_data", "response_of",
           "result_of"]

HEAL_SOURCES_KEY = "heal_sources"


@dataclass(frozen=True)
class QuorumMember:
    """A member of an issued quorum, as plain data."""

    replica_id: str
    address: str  # its ManagerServer, where peers ask for checkpoint metadata
    store_address: str  # "host:port" of its group's TCPStore
    step: int
    world_size: int = 1
    commit_failures: int = 0
    heal_sources: int = 1  # how many sources it can heal from at once (see heal_sources_of)
    fingerprint: Advertised | None = None  # of the state at its step (see health.fingerprint_vote)
    reconfigure_handles: tuple[str, ...] = ()  # its ranks' process-group handles, by group rank


@dataclass
class QuorumResult:
    """One rank's view of an issued quorum: torchft's ``QuorumResult`` (``ManagerClient._quorum`` returns one).

    Every field has a default, so a test can build one empty and fill in what it needs, as with torchft's.

    Args:
        quorum_id: the quorum's id; the process group is rebuilt when it changes.
        replica_rank: this replica's rank among all members (sorted by replica id).
        replica_world_size: how many members the quorum has, behind ones included.
        recover_src_manager_address: the ManagerServer of the peer this replica heals from ("" when it does not).
        recover_src_replica_rank: that peer's replica rank; None when this replica does not heal.
        recover_dst_replica_ranks: the replica ranks that heal from this one.
        store_address: the TCPStore this group rank's process group meets on (the primary's).
        max_step: the highest step any member has committed.
        max_replica_rank: this replica's rank among the members at ``max_step``; None when it is behind.
        max_world_size: how many members are at ``max_step``.
        heal: whether this replica must receive the state dict this step.
        commit_failures: the most consecutive failed commits any member reported.
        replica_ids: every member's replica id, in replica-rank order.
        reconfigure_handles: for this group rank, every member's process-group handle in replica-rank order
            (``ProcessGroup.get_reconfigure_handle``); empty when a member sent none.
        recover_src_replica_ranks: (ours) every peer this replica heals from, the primary first (striping).
        recover_src_manager_addresses: (ours) their ManagerServers, in the same order.
    """

    quorum_id: int = 0
    replica_rank: int = 0
    replica_world_size: int = 0
    recover_src_manager_address: str = ""
    recover_src_replica_rank: int | None = None
    recover_dst_replica_ranks: list[int] = field(default_factory=list)
    store_address: str = ""
    max_step: int = 0
    max_replica_rank: int | None = None
    max_world_size: int = 0
    heal: bool = False
    commit_failures: int = 0
    replica_ids: list[str] = field(default_factory=list)
    reconfigure_handles: list[str] = field(default_factory=list)
    recover_src_replica_ranks: list[int] = field(default_factory=list)
    recover_src_manager_addresses: list[str] = field(default_factory=list)


def compute_quorum_result(
    quorum_id: int,
    members: Sequence[QuorumMember],
    replica_id: str,
    group_rank: int,
    init_sync: bool = True,
) -> QuorumResult:
    """Ranks, max step, store and heal assignment for ``replica_id``'s ``group_rank``.

    Raises ``ValueError`` when the replica is not a member or the quorum is empty, and
    ``StateDivergedError`` when the members at the max step advertise fingerprints with no majority.

    The rules (torchft's, so mixed fleets agree on ranks, stores and heal assignments):

    * replica rank = position of this replica id among the members (sorted by id);
    * the max step and the members at it ("up to date");
    * a member is behind when its step is below the max, or, at step 0 with
      ``init_sync``, when it is not the primary (so every replica starts from the
      same weights);
    * (ours) so is a member at the max step whose state fingerprint differs
      from the one a majority advertises (:mod:`torchft_lite.health.fingerprint_vote`):
      it heals from them; with no majority the quorum fails for every member;
    * the behind members are dealt round-robin over the up-to-date ones, offset by
      the group rank so different group ranks heal from different peers;
    * striping (ours): when every member advertises ``heal_sources`` K > 1 in its
      ``QuorumMember.data``, behind member ``i`` heals from the K up-to-date
      members following its single source (that one first) and each of them lists
      it among its destinations. K is the minimum over the members (a member that
      advertises nothing, such as torchft's, counts as 1), so every group computes
      the same assignment; with K = 1 it is exactly torchft's;
    * group rank ``r`` of every replica rendezvous on the TCPStore of the
      up-to-date member ``r mod len(up to date)`` (the primary);
    * group rank ``r`` of every replica gets every member's process-group handle
      for group rank ``r``, in replica-rank order (torchft's reconfigure
      handles: a process group's rank is the position of its own handle).
    """
    if not members:
        raise ValueError(f"quorum {quorum_id} has no members")
    if group_rank < 0:
        raise ValueError(f"group_rank must be >= 0, got {group_rank}")
    ordered = sorted(members, key=lambda m: m.replica_id)
    ids = [m.replica_id for m in ordered]
    try:
        replica_rank = ids.index(replica_id)
    except ValueError:
        raise ValueError(f"replica {replica_id!r} is not a member of quorum {quorum_id} ({len(ids)} members)") from None

    max_step = max(m.step for m in ordered)
    verdict = vote([(m.replica_id, m.step, m.fingerprint) for m in ordered])
    if verdict is not None and verdict.split:
        raise StateDivergedError(f"{StateDivergedError.MARK} {verdict.describe()}")
    corrupt = set(verdict.corrupt) if verdict is not None else set()  # at the max step, but not up to date
    at_max = [rank for rank, m in enumerate(ordered) if m.step == max_step and m.replica_id not in corrupt]
    primary = ordered[at_max[group_rank % len(at_max)]]
    force_recover = init_sync and max_step == 0

    behind = [
        rank
        for rank, m in enumerate(ordered)
        if m.step != max_step or m.replica_id in corrupt or (force_recover and m.replica_id != primary.replica_id)
    ]
    behind_set = set(behind)
    up_to_date = [rank for rank in range(len(ordered)) if rank not in behind_set]

    stripes = min(min(max(m.heal_sources, 1) for m in ordered), len(up_to_date))
    my_srcs: list[int] = []
    my_dsts: list[int] = []
    for i, dst in enumerate(behind):
        srcs = [up_to_date[(i + group_rank + j) % len(up_to_date)] for j in range(stripes)]
        if replica_rank in srcs:
            my_dsts.append(dst)
        if dst == replica_rank:
            my_srcs = srcs
    my_src = my_srcs[0] if my_srcs else None

    max_replica_rank = at_max.index(replica_rank) if replica_rank in at_max else None
    handles = [m.reconfigure_handles[group_rank] if group_rank < len(m.reconfigure_handles) else ""
               for m in ordered]
    return QuorumResult(
        quorum_id=quorum_id,
        replica_rank=replica_rank,
        replica_world_size=len(ordered),
        max_step=max_step,
        max_replica_rank=max_replica_rank,
        max_world_size=len(at_max),
        store_address=primary.store_address,
        heal=my_src is not None,
        recover_src_replica_rank=my_src,
        recover_src_manager_address=ordered[my_src].address if my_src is not None else "",
        recover_dst_replica_ranks=my_dsts,
        commit_failures=max(m.commit_failures for m in ordered),
        replica_ids=ids,
        reconfigure_handles=handles if any(handles) else [],  # [] when no member sent any
        recover_src_replica_ranks=my_srcs,
        recover_src_manager_addresses=[ordered[src].address for src in my_srcs],
    )


def response_of(result: QuorumResult) -> Any:
    """``result`` as the ``ManagerQuorumResponse`` a rank receives."""
    from torchft_lite.rpc.protocol import torchft_pb2 as pb

    response = pb.ManagerQuorumResponse(
        quorum_id=result.quorum_id,
        recover_src_manager_address=result.recover_src_manager_address,
        recover_dst_replica_ranks=result.recover_dst_replica_ranks,
        store_address=result.store_address,
        max_step=result.max_step,
        max_world_size=result.max_world_size,
        replica_rank=result.replica_rank,
        replica_world_size=result.replica_world_size,
        heal=result.heal,
        commit_failures=result.commit_failures,
        replica_ids=result.replica_ids,
        reconfigure_handles=result.reconfigure_handles,
        recover_src_replica_ranks=result.recover_src_replica_ranks,
        recover_src_manager_addresses=result.recover_src_manager_addresses,
    )
    if result.recover_src_replica_rank is not None:
        response.recover_src_replica_rank = result.recover_src_replica_rank
    if result.max_replica_rank is not None:
        response.max_replica_rank = result.max_replica_rank
    return response


def result_of(response: Any) -> QuorumResult:
    """A ``ManagerQuorumResponse`` as the :class:`QuorumResult` it carries (the inverse of :func:`response_of`)."""
    return QuorumResult(
        quorum_id=response.quorum_id,
        replica_rank=response.replica_rank,
        replica_world_size=response.replica_world_size,
        recover_src_manager_address=response.recover_src_manager_address,
        recover_src_replica_rank=(response.recover_src_replica_rank if response.HasField("recover_src_replica_rank")
                                  else None),
        recover_dst_replica_ranks=list(response.recover_dst_replica_ranks),
        store_address=response.store_address,
        max_step=response.max_step,
        max_replica_rank=response.max_replica_rank if response.HasField("max_replica_rank") else None,
        max_world_size=response.max_world_size,
        heal=response.heal,
        commit_failures=response.commit_failures,
        replica_ids=list(response.replica_ids),
        reconfigure_handles=list(response.reconfigure_handles),
        recover_src_replica_ranks=list(response.recover_src_replica_ranks),
        recover_src_manager_addresses=list(response.recover_src_manager_addresses),
    )


def heal_sources_of(data: str) -> int:
    """The ``heal_sources`` a member advertises in its ``QuorumMember.data``; 1 when it says nothing.

    ``data`` is opaque user data, JSON by convention: anything that is not a
    JSON object with a positive integer under ``heal_sources`` (empty, another
    program's text) counts as 1, torchft's single source.
    """
    parsed = _json_object(data)
    value = None if parsed is None else parsed.get(HEAL_SOURCES_KEY)
    if type(value) is not int or value < 1:
        return 1
    return value


def member_data(heal_sources: int, data: str = "") -> str:
    """``data`` with ``heal_sources`` merged in, to advertise in ``QuorumMember.data``.

    1 is torchft's behaviour and adds nothing, so a default group's bytes on the
    wire stay torchft's. Raises ``ValueError`` when ``data`` holds something
    other than a JSON object (merging into it would destroy it).
    """
    if heal_sources < 1:
        raise ValueError(f"heal_sources must be >= 1, got {heal_sources}")
    if heal_sources == 1:
        return data
    parsed = {} if not data else _json_object(data)
    if parsed is None:
        raise ValueError(f"QuorumMember.data is not a JSON object, can't add {HEAL_SOURCES_KEY}: {data[:80]!r}")
    return json.dumps({**parsed, HEAL_SOURCES_KEY: heal_sources}, separators=(",", ":"), sort_keys=True)


def _json_object(data: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(data) if data else None
    except (ValueError, RecursionError):  # not JSON, or nested absurdly deep: a peer's data is untrusted
        return None
    return parsed if isinstance(parsed, dict) else None
