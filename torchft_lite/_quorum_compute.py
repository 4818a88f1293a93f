"""What one replica group learns from an issued quorum: a pure function.

The ManagerServer asks the lighthouse for a quorum once per step and then, for
each rank of its group, calls :func:`compute_quorum_result`. No network, no
clock, no torch: tests pass literal members.

The rules match torchft's so mixed fleets agree on ranks, stores and heal
assignments:

* replica rank = position of this replica id among the members (sorted by id);
* the max step and the members at it ("up to date");
* a member is behind when its step is below the max, or, at step 0 with
  ``init_sync``, when it is not the primary (so every replica starts from the
  same weights);
* the behind members are dealt round-robin over the up-to-date ones, offset by
  the group rank so different group ranks heal from different peers;
* group rank ``r`` of every replica rendezvous on the TCPStore of the
  up-to-date member ``r mod len(up to date)`` (the primary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["QuorumMember", "QuorumResult", "compute_quorum_result"]


@dataclass(frozen=True)
class QuorumMember:
    """A member of an issued quorum, as plain data."""

    replica_id: str
    address: str  # its ManagerServer, where peers ask for checkpoint metadata
    store_address: str  # "host:port" of its group's TCPStore
    step: int
    world_size: int = 1
    commit_failures: int = 0


@dataclass(frozen=True)
class QuorumResult:
    """This replica's view of a quorum (mirrors ``ManagerQuorumResponse``)."""

    quorum_id: int
    replica_rank: int
    replica_world_size: int
    max_step: int
    max_replica_rank: int | None  # rank among the up-to-date members; None when behind
    max_world_size: int  # how many members are up to date
    store_address: str  # the primary's TCPStore for this group rank
    heal: bool
    recover_src_replica_rank: int | None
    recover_src_manager_address: str
    recover_dst_replica_ranks: tuple[int, ...]
    commit_failures: int
    replica_ids: tuple[str, ...] = field(default=())


def compute_quorum_result(
    quorum_id: int,
    members: Sequence[QuorumMember],
    replica_id: str,
    group_rank: int,
    init_sync: bool = True,
) -> QuorumResult:
    """Ranks, max step, store and heal assignment for ``replica_id``'s ``group_rank``.

    Raises ``ValueError`` when the replica is not a member or the quorum is empty.
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
    at_max = [rank for rank, m in enumerate(ordered) if m.step == max_step]
    primary = ordered[at_max[group_rank % len(at_max)]]
    force_recover = init_sync and max_step == 0

    behind = [
        rank
        for rank, m in enumerate(ordered)
        if m.step != max_step or (force_recover and m.replica_id != primary.replica_id)
    ]
    behind_set = set(behind)
    up_to_date = [rank for rank in range(len(ordered)) if rank not in behind_set]

    my_src: int | None = None
    my_dsts: list[int] = []
    for i, dst in enumerate(behind):
        src = up_to_date[(i + group_rank) % len(up_to_date)]
        if src == replica_rank:
            my_dsts.append(dst)
        if dst == replica_rank:
            my_src = src

    max_replica_rank = at_max.index(replica_rank) if replica_rank in at_max else None
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
        recover_dst_replica_ranks=tuple(my_dsts),
        commit_failures=max(m.commit_failures for m in ordered),
        replica_ids=tuple(ids),
    )
