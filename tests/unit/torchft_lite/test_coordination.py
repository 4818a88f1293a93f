"""torchft_lite.coordination without a network: what importing it loads, its docs, and the quorum's conversion."""

import inspect
import subprocess
import sys

import pytest

from torchft_lite import coordination
from torchft_lite.coordination import LighthouseClient, LighthouseServer, Quorum, QuorumMember, Timestamp
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


@pytest.mark.parametrize("cls", [LighthouseServer, LighthouseClient, Quorum, QuorumMember, Timestamp])
def test_every_class_documents_its_arguments(cls):
    # torchft's coordination_test asks the same of its classes.
    assert "Args:" in (cls.__doc__ or "")


def test_the_public_names_are_torchfts():
    assert set(coordination.__all__) >= {"LighthouseClient", "LighthouseServer", "Quorum", "QuorumMember"}
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
