"""The checkpoint server under the job's access policy, and the receiver sessions a flood or a stray report can't fake.

A replica's live state dict is what it serves: without the job token (or, with
none set, from a host other than this one) nothing of it may leave, and a
``done`` that is not a receiver's own must not end the heal of one still to come.
"""

import logging
from datetime import timedelta

import pytest
import torch

from tests.conftest import WAIT, non_loopback_address, wait_until_sync
from tests.integration.helpers import fetch, same_encoding
from torchft_lite.checkpointing import HTTPTransport, _http_server
from torchft_lite.errors import CheckpointHTTPError
from torchft_lite.rpc.access import Access

pytestmark = pytest.mark.integration

LONG = timedelta(seconds=WAIT)
TOKEN = "job-s3cret"


def state_dict() -> dict:
    return {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(3), "step": 5}


def test_every_route_without_or_with_a_wrong_token_is_401_and_serves_nothing(make_transport):
    server = make_transport(access=Access(TOKEN))
    sent = state_dict()
    server.send_checkpoint([1], 5, sent, LONG)
    base = f"{server.metadata()}/5"
    routes = [("GET", f"{base}?session=s1"), ("GET", f"{base}/header?session=s1"),
              ("GET", f"{base}/data?session=s1&start=0&end=1048576"), ("GET", f"{base}/checksums?session=s1"),
              ("POST", f"{base}/done?session=s1&ok=1"), ("GET", f"{server.metadata()}/6?session=s1&timeout=30"),
              ("GET", f"{server.metadata()}/nothing-here")]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": f"Bearer {TOKEN}x"}):
        for method, url in routes:
            status, body, answer_headers = fetch(url, method, headers)
            assert status == 401, (method, url, headers, body)
            assert answer_headers.get("WWW-Authenticate", "").startswith("Bearer")
            assert len(body) < 400 and b"TORCHFT_LITE_TOKEN" in body and TOKEN.encode() not in body
    stats = server.statistics()
    assert (stats.bytes_served, stats.receivers_finished, stats.held_requests) == (0, 0, 0)
    with pytest.raises(CheckpointHTTPError, match="HTTP Error 401"):
        make_transport(access=Access()).recv_checkpoint(0, server.metadata(), 5, LONG)
    assert server.statistics().bytes_served == 0

    received = make_transport(access=Access(TOKEN)).recv_checkpoint(0, server.metadata(), 5, LONG)
    assert same_encoding(received, sent)
    server.disallow_checkpoint()


def test_transports_take_the_token_from_the_environment_as_the_managers_does(make_transport, monkeypatch):
    monkeypatch.setenv("TORCHFT_LITE_TOKEN", TOKEN)
    server, client = make_transport(), make_transport(num_chunks=3)  # access=None: Access.from_env()
    sent = state_dict()
    server.send_checkpoint([1], 5, sent, LONG)
    assert fetch(f"{server.metadata()}/5/header?session=s1")[0] == 401  # so the server does require it
    assert same_encoding(client.recv_checkpoint(0, server.metadata(), 5, LONG), sent)
    server.disallow_checkpoint()


def test_token_and_access_are_one_or_the_other():
    with pytest.raises(ValueError, match="not both"):
        HTTPTransport(LONG, token=TOKEN, access=Access(TOKEN))


def test_without_a_token_only_loopback_peers_are_served_unless_insecure(make_transport):
    address = non_loopback_address()
    transports = []
    try:
        for access in (Access(), Access(insecure=True)):
            server = HTTPTransport(LONG, hostname=address, bind_host="0.0.0.0", access=access)
            transports.append(server)
            sent = state_dict()
            server.send_checkpoint([1], 5, sent, LONG)
            client = make_transport()
            if access.insecure:
                assert same_encoding(client.recv_checkpoint(0, server.metadata(), 5, LONG), sent)
            else:
                with pytest.raises(CheckpointHTTPError, match="HTTP Error 403") as caught:
                    client.recv_checkpoint(0, server.metadata(), 5, LONG)
                assert "TORCHFT_LITE_TOKEN" in str(caught.value) and address in str(caught.value)
                assert server.statistics().bytes_served == 0
                # The same server answers a peer on loopback.
                loopback = f"http://127.0.0.1:{server.port}/checkpoint"
                assert same_encoding(client.recv_checkpoint(0, loopback, 5, LONG), sent)
            server.disallow_checkpoint()
    finally:
        for server in transports:
            server.shutdown()


def test_a_done_from_a_session_that_never_asked_does_not_end_the_heal_of_a_receiver_to_come(make_transport, threads):
    server = make_transport()
    sent = state_dict()
    server.send_checkpoint([1, 2], 5, sent, LONG)  # two receivers expected
    assert same_encoding(make_transport().recv_checkpoint(0, server.metadata(), 5, LONG), sent)
    released = threads.submit(server.disallow_checkpoint)  # waits for the second
    # A second report from the first receiver under another name, or a stale one: it stands for no receiver.
    status, body, _ = fetch(f"{server.metadata()}/5/done?session=stray&ok=1", "POST")
    # Counted, it would release the step now, and the second receiver would get a 400.
    assert same_encoding(make_transport().recv_checkpoint(0, server.metadata(), 5, LONG), sent)
    released.result(WAIT)
    assert status == 409 and b"asked this server" in body


def test_an_early_done_from_a_session_that_never_asked_counts_for_nothing(make_transport, threads):
    server = make_transport()
    status = fetch(f"{server.metadata()}/6/done?session=stray&ok=1", "POST")[0]
    sent = state_dict()
    server.send_checkpoint([1], 6, sent, LONG)
    released = threads.submit(server.disallow_checkpoint)
    # Counted at the publish, it would have released the step at once, and the receiver would get a 400.
    assert same_encoding(make_transport().recv_checkpoint(0, server.metadata(), 6, LONG), sent, step=6)
    released.result(WAIT)
    assert status == 409


def test_receivers_past_the_cap_are_answered_503_and_logged(make_transport, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="torchft_lite.checkpointing.http_transport")
    monkeypatch.setattr(_http_server, "_MAX_SESSIONS", 2)
    server = make_transport()
    server.send_checkpoint([1, 2], 5, state_dict(), LONG)
    base = f"{server.metadata()}/5/header"
    assert [fetch(f"{base}?session=s{i}")[0] for i in range(2)] == [200, 200]
    status, body, _ = fetch(f"{base}?session=s2")
    assert status == 503 and b"at most 2" in body
    assert fetch(f"{base}?session=s0")[0] == 200  # a session already counted goes on
    assert any("refusing more (503)" in message for message in caplog.messages)
    for i in range(2):
        assert fetch(f"{server.metadata()}/5/done?session=s{i}&ok=1", "POST")[0] == 200
    server.disallow_checkpoint()


def test_held_requests_past_the_cap_are_answered_503(make_transport, monkeypatch, threads):
    monkeypatch.setattr(_http_server, "_MAX_HELD", 1)
    server = make_transport()
    held = threads.submit(fetch, f"{server.metadata()}/6/header?session=h1&timeout={WAIT}")
    wait_until_sync(lambda: server.statistics().held_requests == 1, "the first request to be held")
    status, body, _ = fetch(f"{server.metadata()}/6/header?session=h2&timeout={WAIT}")
    assert status == 503 and b"retry later" in body
    server.send_checkpoint([1], 6, state_dict(), LONG)
    assert held.result(WAIT)[0] == 200
    assert fetch(f"{server.metadata()}/6/done?session=h1&ok=1", "POST")[0] == 200
    server.disallow_checkpoint()


def test_a_striping_receiver_releases_a_secondary_that_never_answered_it(make_transport):
    """The secondary publishes after the receiver finished from the primary: its early done still counts,
    because the receiver asked it first (a held request, then one held for no time)."""
    first, second = make_transport(), make_transport()
    small = {"small": torch.ones(10)}
    first.send_checkpoint([1], 5, small, LONG)
    client = make_transport()
    received = client.recv_checkpoint_striped([(0, first.metadata()), (1, second.metadata())], 5, LONG)
    assert same_encoding(received, small)
    second.send_checkpoint([1], 5, small, LONG)
    assert second.statistics().receivers_finished == 1  # so its disallow_checkpoint returns at once
    for server in (first, second):
        server.disallow_checkpoint()


def test_the_token_is_never_logged(make_transport, caplog):
    caplog.set_level(logging.DEBUG)
    server = make_transport(access=Access(TOKEN))
    server.send_checkpoint([1], 5, state_dict(), LONG)
    fetch(f"{server.metadata()}/5/header?session=s1", headers={"Authorization": "Bearer wrong"})
    make_transport(access=Access(TOKEN)).recv_checkpoint(0, server.metadata(), 5, LONG)
    server.disallow_checkpoint()
    assert caplog.messages and not any(TOKEN in message for message in caplog.messages)
    assert any("refused" in message for message in caplog.messages)

