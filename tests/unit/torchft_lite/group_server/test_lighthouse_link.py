"""Following the lighthouse's events never dies silently (issue 16): a rank's relay from its group's
ManagerServer (``ManagerClient.follow_events``) and the ManagerServer's own lease (``LighthouseLink``)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from tests.conftest import wait_until, wait_until_sync
from torchft_lite.group_server.lighthouse_link import LighthouseLink
from torchft_lite.group_server.manager_client import ManagerClient
from torchft_lite.rpc.protocol import torchft_pb2 as pb

GONE = pb.LeaseEvent(kind=pb.LeaseEvent.MEMBER_GONE, replica_id="other", quorum_id=3, reason="lease ended")
GRANTED = pb.LeaseEvent(kind=pb.LeaseEvent.GRANTED, replica_id="me")


class FakeCall:
    """A server-streaming call: yields ``events``, then raises ``error`` or stays open until cancelled."""

    def __init__(self, events: list[pb.LeaseEvent], error: BaseException | None = None) -> None:
        self._events, self._error = events, error
        self.cancelled = False

    def __aiter__(self):
        return self._stream()

    async def _stream(self):
        for event in self._events:
            yield event
        if self._error is not None:
            raise self._error
        await asyncio.Event().wait()  # open until cancelled

    def cancel(self) -> None:
        self.cancelled = True


class FlakyServer:
    """Each call to the stream method takes the next outcome: an exception to raise at once, or a FakeCall."""

    def __init__(self, outcomes: list) -> None:
        self._outcomes = outcomes
        self.calls = 0

    def open(self, *args) -> FakeCall:
        outcome = self._outcomes[min(self.calls, len(self._outcomes) - 1)]
        self.calls += 1
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    events = lease = open

    async def heartbeat(self, replica_id: str, *, timeout: float) -> None:
        return None

    async def close(self) -> None:
        return None


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="refused")


def client_of(server: FlakyServer) -> ManagerClient:
    """A ManagerClient (a rank > 0's: its group's server is in another process) whose stub is ``server``."""
    client = ManagerClient("127.0.0.1:1", connect_timeout=5.0)
    client._stub = server
    return client


def test_a_rank_keeps_following_events_through_unexpected_errors(caplog):
    server = FlakyServer([FakeCall([], rpc_error(grpc.StatusCode.UNAVAILABLE)),
                          RuntimeError("a bug opening the stream"),  # unexpected: logged even mid-streak
                          FakeCall([GONE, GONE])])
    client = client_of(server)
    got: list[pb.LeaseEvent] = []

    def listener(event: pb.LeaseEvent) -> None:
        got.append(event)
        if len(got) == 1:
            raise ValueError("a bug in the listener")

    with caplog.at_level(logging.WARNING, logger="torchft_lite"):
        try:
            client.follow_events(listener)
            wait_until_sync(lambda: len(got) == 2, "both events after the failures")
        finally:
            client.close()
    assert server.calls == 3 and got == [GONE, GONE]
    logged = caplog.text
    assert "a bug opening the stream" in logged and "UNAVAILABLE" in logged and "a bug in the listener" in logged


def test_a_rank_stops_following_only_a_server_without_events(caplog):
    server = FlakyServer([rpc_error(grpc.StatusCode.UNIMPLEMENTED)])
    client = client_of(server)
    with caplog.at_level(logging.INFO, logger="torchft_lite"):
        try:
            client.follow_events(lambda event: None)
            wait_until_sync(lambda: client._events.done(), "following to end")
        finally:
            client.close()
    assert server.calls == 1
    assert "relays no lighthouse events" in caplog.text


def test_the_lease_loop_survives_unexpected_errors_and_refusals(caplog):
    async def scenario():
        server = FlakyServer([FakeCall([], rpc_error(grpc.StatusCode.ALREADY_EXISTS)),
                              RuntimeError("a bug opening the lease"),
                              FakeCall([GRANTED, GONE])])
        link = LighthouseLink(server, "me", heartbeat_interval=60.0)
        relayed: list[pb.LeaseEvent] = []
        link.add_event_listener(relayed.append)
        link.start()
        try:
            await wait_until(lambda: relayed == [GONE], "the event after the failures")
            assert link.lease_held
        finally:
            await link.stop()
        assert server.calls == 3

    with caplog.at_level(logging.WARNING, logger="torchft_lite"):
        asyncio.run(scenario())
    assert "a bug opening the lease" in caplog.text and "ALREADY_EXISTS" in caplog.text
