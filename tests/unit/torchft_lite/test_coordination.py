"""torchft_lite.coordination without a network: what importing it loads, its docs, and the quorum's conversion."""

import inspect
import subprocess
import sys

import pytest

from torchft_lite import coordination
from torchft_lite.coordination import (
    LighthouseClient, LighthouseServer, ManagerClient, ManagerServer, Quorum, QuorumMember, QuorumResult, Timestamp,
)
from torchft_lite.errors import QuorumError
from torchft_lite.rpc.protocol import torchft_pb2 as pb

SERVER_SIDE = ("lighthouse.server", "lighthouse.quorum", "lighthouse.http", "lighthouse.status", "lighthouse.metrics",
               "lighthouse.config")


def test_importing_it_loads_no_lighthouse_server_code():
    probe = ("import sys, torchft_lite.coordination\n"
             "print(' '.join(sorted(m for m in sys.modules if m.startswith(('lighthouse', 'torchft_lite.rpc')))))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert "torchft_lite.rpc.lighthouse_client" in loaded
    assert not set(SERVER_SIDE) & set(loaded), loaded


@pytest.mark.parametrize("cls", [LighthouseServer, LighthouseClient, ManagerServer, ManagerClient, Quorum, QuorumMember,
                                 QuorumResult, Timestamp])
def test_every_class_documents_its_arguments(cls):
    # torchft's coordination_test asks the same of its classes.
    assert "Args:" in (cls.__doc__ or "")


def test_the_public_names_are_torchfts():
    assert set(coordination.__all__) >= {"LighthouseClient", "LighthouseServer", "ManagerClient", "ManagerServer",
                                         "Quorum", "QuorumMember", "QuorumResult"}
    params = inspect.signature(ManagerServer).parameters
    assert list(params)[:9] == ["replica_id", "lighthouse_addr", "hostname", "bind", "store_addr", "world_size",
                                "heartbeat_interval", "connect_timeout", "quorum_retries"]
    assert list(inspect.signature(ManagerClient).parameters) == ["addr", "connect_timeout"]
    params = inspect.signature(ManagerClient._quorum).parameters
    assert list(params)[1:9] == ["group_rank", "step", "checkpoint_metadata", "shrink_only", "timeout",
                                 "commit_failures", "reconfigure_handle", "init_sync"]
    assert list(inspect.signature(ManagerClient._checkpoint_metadata).parameters)[1:] == ["rank", "timeout"]
    assert list(inspect.signature(ManagerClient.should_commit).parameters)[1:] == ["group_rank", "step",
                                                                                   "should_commit", "timeout"]
    params = inspect.signature(LighthouseServer).parameters
    assert list(params)[:5] == ["bind", "min_replicas", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"]
    params = inspect.signature(LighthouseClient.quorum).parameters
    assert list(params)[1:] == ["replica_id", "timeout", "address", "store_address", "step", "world_size",
                                "shrink_only", "data"]


def test_a_quorum_message_becomes_plain_data():
    message = pb.Quorum(quorum_id=7)
    message.participants.add(replica_id="a", address="http://a:1", store_address="a:2", step=5, world_size=2,
                             shrink_only=True, data='{"heal_sources": 2}')
    message.participants.add(replica_id="b")  # a member that sent no data
    message.created.FromNanoseconds(1_700_000_000_123_456_789)
    quorum = coordination._quorum_from_proto(message)
    assert quorum == Quorum(7, [
        QuorumMember("a", "http://a:1", "a:2", 5, 2, True, {"heal_sources": 2}),
        QuorumMember("b", "", "", 0, 0, False, None),
    ], Timestamp(1_700_000_000, 123_456_789))


def test_member_data_that_is_not_json_is_a_quorum_error_naming_the_member():
    message = pb.Quorum(quorum_id=1)
    message.participants.add(replica_id="odd", data="not json")
    with pytest.raises(QuorumError, match="'odd'.*not JSON"):
        coordination._quorum_from_proto(message)


def test_an_empty_quorum_result_is_filled_in_field_by_field_as_torchfts():
    result = QuorumResult()
    assert (result.quorum_id, result.recover_src_replica_rank, result.max_replica_rank, result.heal) == (0, None, None,
                                                                                                     False)
    assert result.recover_dst_replica_ranks == result.replica_ids == result.reconfigure_handles == []
    result.quorum_id, result.recover_dst_replica_ranks = 5, [1]
    assert QuorumResult().recover_dst_replica_ranks == []  # no list shared between results


def test_a_quorum_answer_round_trips_through_the_wire_message():
    from torchft_lite.group_server.quorum_compute import response_of, result_of

    result = QuorumResult(quorum_id=3, replica_rank=1, replica_world_size=2, recover_src_manager_address="http://a:1",
                          recover_src_replica_rank=0, store_address="a:2", max_step=9, max_world_size=1, heal=True,
                          replica_ids=["a", "b"], reconfigure_handles=["{}", "{}"], recover_src_replica_ranks=[0],
                          recover_src_manager_addresses=["http://a:1"])
    assert result_of(response_of(result)) == result
    assert result_of(response_of(QuorumResult())) == QuorumResult()  # None stays None, not 0
