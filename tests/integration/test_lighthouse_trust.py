"""The lighthouse trusts nothing a member claims beyond its own slot (issue 16), and a full state dir is survived.

Out-of-range fields are refused with INVALID_ARGUMENT, a reason and a metric,
and change nothing; one forged member with a huge step can't move what
``--state-dir`` persists; a state dir whose writes fail never stops the
lighthouse. Lease ownership is tested in ``test_lighthouse_leases.py``.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from prometheus_client import generate_latest

from lighthouse import fencing
from lighthouse.fencing import QuorumIdStore
from lighthouse.metrics import build_registry
from lighthouse.validation import MAX_DATA_BYTES, STEP_LIMIT
from tests.conftest import WAIT, disk_full, running_lighthouse
from tests.integration.helpers import client_for
from torchft_lite.rpc.protocol import torchft_pb2 as pb

pytestmark = pytest.mark.integration

HUGE = STEP_LIMIT - 1  # the largest step a member may claim


def member(**fields) -> pb.QuorumMember:
    fields.setdefault("replica_id", "m")
    return pb.QuorumMember(**fields)


OUT_OF_RANGE = [
    ("step", member(step=-1), "requester.step must be from 0"),
    ("step", member(step=STEP_LIMIT), "requester.step must be from 0"),
    ("step", member(step=2**63 - 1), "requester.step must be from 0"),
    ("world_size", member(world_size=2**64 - 1), "requester.world_size"),
    ("commit_failures", member(commit_failures=-5), "requester.commit_failures"),
    ("commit_failures", member(commit_failures=2**62), "requester.commit_failures"),
    ("replica_id", member(replica_id="a\x00b"), "printable characters without whitespace"),
    ("replica_id", member(replica_id="two words"), "printable characters without whitespace"),
    ("replica_id", member(replica_id="x" * 1025), "longer than 1024"),
    ("address", member(address="h" * 2000), "requester.address must be at most 1024"),
    ("store_address", member(store_address="host:1\n"), "requester.store_address"),
    ("data", member(data="d" * (MAX_DATA_BYTES + 1)), f"more than {MAX_DATA_BYTES}"),
    ("reconfigure_handles", member(reconfigure_handles=["h" * 5000]), "requester.reconfigure_handles"),
    ("missing_requester", None, "requester is required"),
]


@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_out_of_range_member_fields_are_refused_with_a_reason_and_change_nothing(engine):
    async def scenario():
        async with running_lighthouse(grpc_engine=engine) as server:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                quorum = channel.unary_unary("/torchft.LighthouseService/Quorum")
                for reason, requester, message in OUT_OF_RANGE:
                    request = pb.LighthouseQuorumRequest() if requester is None else \
                        pb.LighthouseQuorumRequest(requester=requester)
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await quorum(request.SerializeToString(), timeout=WAIT)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, reason
                    assert message in info.value.details(), (reason, info.value.details())
                for rpc, request in (("Heartbeat", pb.LighthouseHeartbeatRequest(replica_id="tab\there")),
                                     ("Lease", pb.LeaseRequest(replica_id="\x7f"))):
                    call = channel.unary_stream if rpc == "Lease" else channel.unary_unary
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        answer = call(f"/torchft.LighthouseService/{rpc}")(request.SerializeToString(), timeout=WAIT)
                        if rpc == "Lease":
                            await answer.read()
                        else:
                            await answer
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rpc

            stats = server.statistics()
            assert (stats.participants, stats.heartbeating_replicas, stats.leases_held, stats.max_step) == (0, 0, 0, 0)
            assert stats.invalid_requests == len(OUT_OF_RANGE) + 2
            metrics = generate_latest(build_registry(server)).decode()
            assert 'lighthouse_invalid_requests_total{reason="step"} 3.0' in metrics
            assert 'lighthouse_invalid_requests_total{reason="replica_id"} 5.0' in metrics
            assert 'lighthouse_invalid_requests_total{reason="data"} 1.0' in metrics
            assert 'lighthouse_invalid_requests_total{reason="malformed"} 0.0' in metrics

            async with client_for(server) as c:  # the largest values in range are served
                served = await c.quorum("ok", timeout=WAIT, step=HUGE, data="d" * MAX_DATA_BYTES)
                assert [(m.replica_id, m.step) for m in served.participants] == [("ok", HUGE)]

    asyncio.run(scenario())


def test_one_forged_member_with_a_huge_step_does_not_move_what_the_state_dir_keeps(tmp_path):
    async def scenario():
        async with running_lighthouse(min_replicas=3, state_dir=tmp_path) as server, client_for(server) as c:
            first = await asyncio.gather(c.quorum("a", timeout=WAIT, step=5), c.quorum("b", timeout=WAIT, step=5),
                                         c.quorum("forged", timeout=WAIT, step=HUGE))
            assert [m.replica_id for m in first[0].participants] == ["a", "b", "forged"]
            assert server.statistics().max_step == HUGE  # the running guard holds the claim (see fencing)
            assert QuorumIdStore(tmp_path).initial_max_step() == 5
        assert QuorumIdStore(tmp_path).initial_max_step() == 5, "the shutdown's final write keeps the agreed step"

        # A restarted lighthouse's guard starts from the agreed step: the honest replicas are not held back.
        async with running_lighthouse(min_replicas=2, state_dir=tmp_path, startup_grace=0.0) as server, \
                client_for(server) as c:
            again = await asyncio.gather(c.quorum("a", timeout=WAIT, step=5), c.quorum("b", timeout=WAIT, step=5))
            assert [m.replica_id for m in again[0].participants] == ["a", "b"]
            assert server.statistics().max_step == 5

    asyncio.run(scenario())


def test_a_state_dir_whose_writes_fail_is_logged_counted_and_survived(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(fencing, "_write_atomically", disk_full)

    async def scenario():
        async with running_lighthouse(state_dir=tmp_path, join_timeout=0.3) as server, client_for(server) as c:
            # A straggler that heartbeats but never joins: the quorum of a and b comes from the quorum tick once
            # the join timeout passes (the tick loop is where a failed write used to end the lighthouse).
            await c.heartbeat("straggler", timeout=WAIT)
            quorum = await asyncio.gather(c.quorum("a", timeout=WAIT, step=1), c.quorum("b", timeout=WAIT, step=1))
            assert [m.replica_id for m in quorum[0].participants] == ["a", "b"]
            again = await asyncio.gather(c.quorum("a", timeout=WAIT, step=2), c.quorum("b", timeout=WAIT, step=2))
            assert [m.step for m in again[0].participants] == [2, 2]  # a fast quorum, from the Quorum call
            assert server._serve_task is not None and not server._serve_task.done()
            assert (await c.get_config(timeout=WAIT))["implementation"] == "torchft_lite"
            stats = server.statistics()
            assert stats.state_write_failures >= 2 and stats.max_step == 2
            assert "lighthouse_state_dir_write_failures_total" in generate_latest(build_registry(server)).decode()

    with caplog.at_level(logging.ERROR, logger="lighthouse"):
        asyncio.run(scenario())  # stopping (a last forced write) raises nothing either
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and all("No space left on device" in e for e in errors)
    assert not list(tmp_path.iterdir())
