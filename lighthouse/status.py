"""The lighthouse's status as plain data: one shape for /api/status and the dashboard."""

from __future__ import annotations

import datetime
from dataclasses import asdict

from lighthouse.quorum import Epoch, QuorumState, Status
from lighthouse.stragglers.view import straggler_rows, straggler_summary
from lighthouse.timeline import Timeline
from lighthouse.view import LighthouseView
from torchft_lite.rpc.protocol import torchft_pb2 as pb


def _member_row(member: pb.QuorumMember | None, replica_id: str) -> dict:
    if member is None:
        return {"replica_id": replica_id, "address": "", "store_address": "", "step": None, "world_size": None,
                "commit_failures": 0, "data": ""}
    return {
        "replica_id": replica_id,
        "address": member.address,
        "store_address": member.store_address,
        "step": member.step,
        "world_size": member.world_size,
        "commit_failures": member.commit_failures,
        "data": member.data,
    }


def epoch_row(epoch: Epoch | None, now: float) -> dict | None:
    """The current epoch as /api/status shows it (None before the first this process started)."""
    if epoch is None:
        return None
    return {"number": epoch.number, "from_step": epoch.from_step, "to_step": epoch.to_step, "reason": epoch.reason,
            "age_s": now - epoch.started_at}


def build_status(
    server: LighthouseView,
    state: QuorumState,
    known: dict[str, pb.QuorumMember],
    now: float,
    created_wall: float | None,
    timeline: Timeline,
) -> dict:
    config = server.config
    heartbeat_age = {rid: now - last for rid, last in state.heartbeats()}
    participants = {member.replica_id: joined for member, joined in state.participants()}
    prev = state.previous_quorum
    stragglers = server.stragglers()
    straggler = straggler_rows(stragglers)

    members = []
    if prev is not None:
        max_step = max((m.payload.step for m in prev.members), default=0)
        for m in prev.members:
            row = _member_row(m.payload, m.replica_id)
            age = heartbeat_age.get(m.replica_id)
            row.update(
                recovering=m.payload.step < max_step,
                heartbeat_age_s=age,
                healthy=age is not None and age < config.heartbeat_timeout,
                participating=m.replica_id in participants,
                straggler=straggler.get(m.replica_id),
            )
            members.append(row)

    in_quorum = set(prev.replica_ids) if prev else set()
    replicas = []
    for rid in sorted(set(heartbeat_age) | set(participants)):
        row = _member_row(known.get(rid), rid)
        age = heartbeat_age.get(rid)
        joined = participants.get(rid)
        row.update(
            heartbeat_age_s=age,
            healthy=age is not None and age < config.heartbeat_timeout,
            in_quorum=rid in in_quorum,
            participating=joined is not None,
            waiting_s=None if joined is None else now - joined,
            straggler=straggler.get(rid),
        )
        replicas.append(row)

    stats = server.statistics()
    job = timeline.status(now, Status(stats.status), stats.reason, heartbeat_age, participants, stragglers.evicted)
    return {
        "lighthouse": {
            "implementation": "torchft_lite",
            "grpc_port": server.grpc_port,
            "http_port": server.http_port,
            "min_replicas": config.min_replicas,
            "join_timeout_s": config.join_timeout,
            "heartbeat_timeout_s": config.heartbeat_timeout,
            "quorum_tick_s": config.quorum_tick,
            "holder_timeout_s": config.holder_timeout,
            "admin_enabled": config.admin_token is not None,
            "access": config.access.mode,  # the mode only: the token is never shown
        },
        "status": {"state": stats.status, "reason": stats.reason},
        "job": job.to_json(now),  # the status line (lighthouse.timeline)
        "epoch": epoch_row(state.epoch, now),
        "stragglers": straggler_summary(stragglers),
        "quorum": None if prev is None else {
            "quorum_id": prev.quorum_id,
            "age_s": now - prev.issued_at,
            "created": None if created_wall is None else
            datetime.datetime.fromtimestamp(created_wall, datetime.timezone.utc).isoformat(),
            "members": members,
        },
        "replicas": replicas,
        "statistics": asdict(stats),
    }
