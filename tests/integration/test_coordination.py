"""torchft's coordination API (torchft_lite.coordination) against a real lighthouse on 127.0.0.1, port 0."""

import concurrent.futures
import socket
import threading
from datetime import timedelta

import pytest

from tests.conftest import WAIT, wait_until_sync
from torchft_lite.coordination import (
    LighthouseClient, LighthouseServer, ManagerClient, ManagerServer, Quorum, QuorumMember, QuorumResult, Timestamp,
)
from torchft_lite.errors import ConfigError, ManagerError, QuorumError, QuorumTimeout
from torchft_lite.group_server.manager_client import withdraw_from_process

pytestmark = pytest.mark.integration

LONG = timedelta(seconds=WAIT)


@pytest.fixture
def serve():
    """``serve(**kwargs)``: a LighthouseServer on 127.0.0.1:0, shut down after the test."""
    servers = []

    def start(**kwargs) -> LighthouseServer:
        kwargs.setdefault("min_replicas", 1)
        server = LighthouseServer(bind="127.0.0.1:0", **kwargs)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.shutdown()


def connect(server: LighthouseServer) -> LighthouseClient:
    return LighthouseClient(server.address(), connect_timeout=LONG)


def test_a_lone_replica_gets_a_quorum_carrying_everything_it_sent(serve):
    server = serve(join_timeout_ms=100)
    with connect(server) as client:
        quorum = client.quorum(
            replica_id="solo", timeout=LONG, address="http://solo:1", store_address="solo:2", step=3,
            world_size=4, shrink_only=False, data={"my_data": 1234, "nested": [1, {"x": None}]},
        )
        assert isinstance(quorum, Quorum) and isinstance(quorum.created, Timestamp)
        assert quorum.created.seconds > 0 and 0 <= quorum.created.nanos < 10**9
        assert quorum.participants == [QuorumMember(
            replica_id="solo", address="http://solo:1", store_address="solo:2", step=3, world_size=4,
            shrink_only=False, data={"my_data": 1234, "nested": [1, {"x": None}]},
        )]
        # Every optional argument left out: defaults, and no data.
        again = client.quorum(replica_id="solo", timeout=LONG)
        assert again.participants == [QuorumMember("solo", "", "", 0, 0, False, None)]
        assert again.quorum_id == quorum.quorum_id  # same membership, same id


def test_replicas_asking_from_several_threads_share_one_sorted_quorum(serve):
    server = serve(min_replicas=3)
    with connect(server) as client, concurrent.futures.ThreadPoolExecutor(3) as pool:
        quorums = list(pool.map(lambda rid: client.quorum(replica_id=rid, timeout=LONG, step=1), ["c", "a", "b"]))
    assert len({q.quorum_id for q in quorums}) == 1
    assert [m.replica_id for m in quorums[0].participants] == ["a", "b", "c"]


def test_a_heartbeat_makes_a_replica_healthy(serve):
    server = serve(heartbeat_timeout_ms=int(WAIT * 1000))
    with connect(server) as client:
        client.heartbeat("rep0")
        client.heartbeat("rep0", timeout=LONG)
        # rep0 is healthy, so a quorum of "probe" alone would not be a majority: rep0 must join too.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            probe = pool.submit(client.quorum, replica_id="probe", timeout=LONG)
            mine = client.quorum(replica_id="rep0", timeout=LONG)
            assert [m.replica_id for m in mine.participants] == ["probe", "rep0"]
            assert probe.result(WAIT).quorum_id == mine.quorum_id


def test_by_default_a_quorum_does_not_wait_long_for_a_healthy_group_that_has_not_joined(serve):
    """torchft's in-process LighthouseServer waits 100 ms for stragglers (its CLI: 60 s); its tests rely on it."""
    server = serve(heartbeat_timeout_ms=int(WAIT * 1000))
    with connect(server) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        client.heartbeat("parked")  # healthy, and never joins
        asked = [pool.submit(client.quorum, replica_id=rid, timeout=timedelta(seconds=20)) for rid in ("a", "b")]
        quorums = [future.result(WAIT) for future in asked]
    assert [m.replica_id for m in quorums[0].participants] == ["a", "b"]  # 2 of 3 healthy: a majority


def test_a_quorum_that_does_not_come_is_a_timeout_naming_the_replica(serve):
    server = serve(min_replicas=2)
    with connect(server) as client:
        with pytest.raises(QuorumTimeout, match="'?lonely'?.*0.2s") as caught:
            client.quorum(replica_id="lonely", timeout=timedelta(milliseconds=200))
    assert isinstance(caught.value, TimeoutError)


def test_a_refused_call_is_a_quorum_error_not_a_timeout(serve):
    server = serve()
    with connect(server) as client:
        with pytest.raises(QuorumError, match="INVALID_ARGUMENT") as caught:
            client.quorum(replica_id="", timeout=LONG)
    assert isinstance(caught.value, RuntimeError) and not isinstance(caught.value, TimeoutError)  # as torchft's


def test_shutdown_fails_a_waiting_call_at_once_and_can_be_repeated(serve):
    server = serve(min_replicas=2)
    client = connect(server)
    outcome: list[BaseException] = []

    def wait_for_quorum():
        try:
            client.quorum(replica_id="waiting", timeout=LONG)
        except QuorumError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait_for_quorum)
    waiter.start()
    try:
        wait_until_sync(lambda: server._lighthouse.statistics().participants == 1, "the call to be waiting")
        server.shutdown()
        server.shutdown()
        waiter.join(WAIT)
        assert not waiter.is_alive()
        assert len(outcome) == 1 and not isinstance(outcome[0], TimeoutError), outcome
        assert "UNAVAILABLE" in str(outcome[0])
    finally:
        client.close()


def test_connecting_to_nothing_fails_in_the_constructor():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(QuorumTimeout, match=f"127.0.0.1:{port}.*not connected within 0.3s"):
        LighthouseClient(f"http://127.0.0.1:{port}", connect_timeout=timedelta(milliseconds=300))


def test_a_taken_port_and_bad_settings_are_clear_errors(serve):
    server = serve()
    port = server.address().rpartition(":")[2]
    with pytest.raises(OSError, match="could not bind"):
        LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1)
    with pytest.raises(ConfigError, match="min_replicas"):
        LighthouseServer(bind="127.0.0.1:0", min_replicas=0)
    with pytest.raises(ConfigError, match="join_timeout_ms"):
        LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=-1)
    with pytest.raises(ConfigError, match="connect_timeout"):
        LighthouseClient(server.address(), connect_timeout="soon")
    with connect(server) as client:
        with pytest.raises(ConfigError, match="timeout"):
            client.quorum(replica_id="a", timeout=-1.0)
        with pytest.raises(TypeError, match="JSON"):
            client.quorum(replica_id="a", timeout=LONG, data={"x": object()})


def manager_server(lighthouse: LighthouseServer, replica_id: str, world_size: int) -> ManagerServer:
    return ManagerServer(replica_id=replica_id, lighthouse_addr=lighthouse.address(), hostname="127.0.0.1",
                         bind="127.0.0.1:0", store_addr="127.0.0.1:1234", world_size=world_size,
                         heartbeat_interval=timedelta(milliseconds=100), connect_timeout=LONG, quorum_retries=0)


def ask(client: ManagerClient, group_rank: int, step: int, metadata: str) -> QuorumResult:
    return client._quorum(group_rank=group_rank, step=step, checkpoint_metadata=metadata, shrink_only=False,
                          timeout=LONG, commit_failures=0, reconfigure_handle=f"handle-{group_rank}", init_sync=False)


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "over-grpc"])
def test_a_group_of_two_ranks_gets_its_quorum_votes_and_serves_its_metadata_through_manager_clients(serve, in_process):
    lighthouse = serve()
    with manager_server(lighthouse, "group", world_size=2) as server, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        if not in_process:  # as for the ranks of another process: every call goes over gRPC
            withdraw_from_process(server._server)
        clients = [ManagerClient(server.address(), connect_timeout=LONG) for _ in range(2)]
        try:
            results = list(pool.map(lambda rank: ask(clients[rank], rank, 4, f"meta-{rank}"), [0, 1]))
            assert all(isinstance(r, QuorumResult) for r in results)
            assert [(r.replica_rank, r.replica_world_size, r.max_step, r.heal) for r in results] == [(0, 1, 4, False)] * 2
            assert results[0].quorum_id == results[1].quorum_id and results[0].replica_ids == ["group"]
            assert results[1].store_address == "127.0.0.1:1234"
            # Each group rank gets every member's process-group handle for that rank (one member here).
            assert [r.reconfigure_handles for r in results] == [["handle-0"], ["handle-1"]]
            # A peer (another process, in a real job) asks for a rank's metadata to heal from it.
            peer = ManagerClient(server.address(), connect_timeout=LONG)
            try:
                assert peer._checkpoint_metadata(1, timeout=LONG) == "meta-1"
                with pytest.raises(ManagerError, match="group rank 5"):
                    peer._checkpoint_metadata(5, timeout=LONG)
            finally:
                peer.close()
            votes = list(pool.map(lambda rank: clients[rank].should_commit(rank, 4, rank == 0, timeout=LONG), [0, 1]))
            assert votes == [False, False]  # one rank voted no: nobody commits
            votes = list(pool.map(lambda rank: clients[rank].should_commit(rank, 5, True, timeout=LONG), [0, 1]))
            assert votes == [True, True]
        finally:
            for client in clients:
                client.close()


def test_a_manager_client_waits_its_timeout_for_a_group_that_is_not_complete(serve):
    lighthouse = serve()
    with manager_server(lighthouse, "half", world_size=2) as server:
        client = ManagerClient(server.address(), connect_timeout=LONG)
        try:
            with pytest.raises(QuorumTimeout, match="0.3"):
                client._quorum(group_rank=0, step=0, checkpoint_metadata="", shrink_only=False,
                               timeout=timedelta(milliseconds=300), commit_failures=0, reconfigure_handle="")
        finally:
            client.close()


def test_manager_server_settings_are_checked_and_shutdown_can_be_repeated(serve):
    lighthouse = serve()
    with pytest.raises(ConfigError, match="world_size"):
        manager_server(lighthouse, "none", world_size=0)
    server = manager_server(lighthouse, "twice", world_size=1)
    assert server.address().startswith("http://127.0.0.1:")
    server.shutdown()
    server.shutdown()
    with pytest.raises(ConfigError, match="addr"):
        ManagerClient("", connect_timeout=LONG)
