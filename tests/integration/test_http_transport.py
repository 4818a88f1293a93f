"""HTTPTransport over real sockets: held requests, steps, chunks, tokens, release and failures."""

import logging
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.conftest import WAIT, wait_until_sync
from tests.integration.helpers import digest
from torchft_lite.checkpointing import HTTPTransport, _http_server, _http_socket
from torchft_lite.errors import CheckpointError, CheckpointHTTPError, CheckpointTimeout, CheckpointTransferError
from torchft_lite.serialization import decode, encode, spec

pytestmark = pytest.mark.integration

LONG = timedelta(seconds=WAIT)


def state_dict(big_elements: int = 1000) -> dict:
    torch.manual_seed(1)
    model = torch.nn.Linear(5, 3)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    optim.step()
    return {"user": {"model": model.state_dict(), "optim": optim.state_dict(),
                     "big": torch.randn(big_elements), "half": torch.randn(7, 3).to(torch.bfloat16)},
            "torchft": {"step": 5, "batches_committed": 10, "note": ("x", None, b"\x01")}}


def test_a_request_before_publish_is_held_then_served(make_transport, threads, caplog):
    caplog.set_level(logging.INFO, logger="torchft_lite.checkpointing.http_transport")
    server, client = make_transport(), make_transport()
    sent = state_dict()
    received = threads.submit(client.recv_checkpoint, 0, server.metadata(), 5, LONG)
    wait_until_sync(lambda: server.statistics().held_requests == 1, "the receiver's request to be held")
    server.send_checkpoint([1], 5, sent, LONG)
    assert digest(5, received.result(WAIT)) == digest(5, sent)
    server.disallow_checkpoint()
    stats = server.statistics()
    assert stats.published_step is None and stats.bytes_served > 0
    assert any("released step 5" in message and "127.0.0.1" in message for message in caplog.messages)


def test_metadata_is_the_url_with_the_advertised_host(make_transport):
    server = make_transport()
    assert server.metadata() == f"http://127.0.0.1:{server.port}/checkpoint"


def test_a_wrong_step_is_refused_naming_both_steps(make_transport):
    server, client = make_transport(), make_transport()
    server.send_checkpoint([], 5, state_dict(), LONG)
    # torchft's answer and words: a 400, raised as urllib's HTTPError
    with pytest.raises(urllib.error.HTTPError, match=r"HTTP Error 400: .*serving 5 but got step=4") as caught:
        client.recv_checkpoint(0, server.metadata(), 4, LONG)
    assert isinstance(caught.value, CheckpointTransferError) and caught.value.code == 400
    assert b"serving 5 but got step=4" in caught.value.read()
    server.disallow_checkpoint()


def test_chunked_fetch_gives_identical_tensors(make_transport):
    server, client = make_transport(), make_transport(num_chunks=4)
    sent = state_dict(big_elements=300_001)
    server.send_checkpoint([1], 5, sent, LONG)
    received = client.recv_checkpoint(0, server.metadata(), 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert torch.equal(received["user"]["big"], sent["user"]["big"])
    server.disallow_checkpoint()


def test_the_token_is_required_and_checked(make_transport):
    server = make_transport(token="s3cret")
    server.send_checkpoint([1], 5, state_dict(), LONG)
    with pytest.raises(CheckpointHTTPError, match="HTTP Error 401: .*check the token") as caught:
        make_transport().recv_checkpoint(0, server.metadata(), 5, LONG)
    assert caught.value.code == 401
    with pytest.raises(CheckpointHTTPError, match="HTTP Error 401: .*check the token.*wrong job token"):
        make_transport(token="guess").recv_checkpoint(0, server.metadata(), 5, LONG)
    received = make_transport(token="s3cret").recv_checkpoint(0, server.metadata(), 5, LONG)
    assert received["torchft"]["step"] == 5
    server.disallow_checkpoint()


def test_done_reports_carry_the_token_and_release_a_source_that_served_nothing(make_transport):
    """The secondary gets no range of a one-block state dict: only the receiver's POST of done releases it."""
    first, second = make_transport(token="s3cret"), make_transport(token="s3cret")
    for server in (first, second):
        server.send_checkpoint([1], 5, {"small": torch.ones(10)}, LONG)
    client = make_transport(token="s3cret")
    client.recv_checkpoint_striped([(0, first.metadata()), (1, second.metadata())], 5, LONG)
    assert [server.statistics().receivers_finished for server in (first, second)] == [1, 1]
    for server in (first, second):
        server.disallow_checkpoint()


def test_bytes_corrupted_in_transit_fail_the_receive_and_are_reported(make_transport, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="torchft_lite.checkpointing.http_transport")
    honest = encode.EncodedStateDict.body

    def corrupting(self, *args, **kwargs):
        pieces, length = honest(self, *args, **kwargs)

        def damaged():
            for i, view in enumerate(pieces):  # each block is checksummed before it is yielded
                data = bytearray(view)
                if i == 0 and data:
                    data[0] ^= 0xFF
                yield data

        return damaged(), length

    monkeypatch.setattr(encode.EncodedStateDict, "body", corrupting)
    server, client = make_transport(), make_transport()
    server.send_checkpoint([1], 5, state_dict(), LONG)
    with pytest.raises(CheckpointTransferError, match="checksum mismatch"):
        client.recv_checkpoint(0, server.metadata(), 5, LONG)
    server.disallow_checkpoint()
    assert any("released step 5" in message and "failed" in message for message in caplog.messages)


def test_disallow_waits_for_the_expected_receiver(make_transport, threads):
    server, client = make_transport(), make_transport()
    sent = state_dict()
    server.send_checkpoint([1], 5, sent, LONG)
    released = threads.submit(server.disallow_checkpoint)
    # Had disallow not waited for this receiver, it would get 400 "released".
    assert digest(5, client.recv_checkpoint(0, server.metadata(), 5, LONG)) == digest(5, sent)
    released.result(WAIT)


def test_disallow_returns_without_receivers(make_transport, threads):
    server = make_transport()
    threads.submit(server.disallow_checkpoint).result(WAIT)  # nothing published
    server.send_checkpoint([], 5, state_dict(), timedelta(hours=1))
    threads.submit(server.disallow_checkpoint).result(WAIT)  # nobody expected: no hour-long wait


def test_after_disallow_an_older_step_is_refused_and_the_released_one_waits_for_its_retry(make_transport, threads):
    server, client = make_transport(), make_transport()
    server.send_checkpoint([1], 5, state_dict(), LONG)
    client.recv_checkpoint(0, server.metadata(), 5, LONG)
    server.disallow_checkpoint()
    with pytest.raises(CheckpointHTTPError, match="400: .*released its checkpoint after step 5"):
        client.recv_checkpoint(0, server.metadata(), 4, LONG)
    # Step 5 did not commit, say: it is retried and published again, and a receiver that asked between the
    # release and the new publish is held until then instead of refused (its heal would fail, and the
    # source would wait its whole timeout for it).
    retried = threads.submit(client.recv_checkpoint, 0, server.metadata(), 5, LONG)
    wait_until_sync(lambda: server.statistics().held_requests == 1, "the request for the released step to be held")
    sent = state_dict()
    server.send_checkpoint([1], 5, sent, LONG)
    assert digest(5, retried.result(WAIT)) == digest(5, sent)
    server.disallow_checkpoint()  # the held receiver counted: no wait for the timeout
    server.send_checkpoint([], 6, sent, LONG)  # the job went on: step 5 is never served again
    with pytest.raises(CheckpointHTTPError, match="400: .*serving 6 but got step=5"):
        client.recv_checkpoint(0, server.metadata(), 5, LONG)


def test_publishing_again_first_releases_the_published_step(make_transport, threads):
    """As torchft lets it: the next send replaces the step, once that step's receivers are served."""
    server, client = make_transport(), make_transport()
    first, second = state_dict(), state_dict(big_elements=10)
    server.send_checkpoint([1], 5, first, LONG)
    publishing = threads.submit(server.send_checkpoint, [1], 6, second, LONG)
    # The expected receiver of step 5 still gets it: the second send waits for it, as disallow_checkpoint does.
    assert digest(5, client.recv_checkpoint(0, server.metadata(), 5, LONG)) == digest(5, first)
    publishing.result(WAIT)
    assert digest(6, client.recv_checkpoint(0, server.metadata(), 6, LONG)) == digest(6, second)
    with pytest.raises(CheckpointHTTPError, match="serving 6 but got step=5"):
        client.recv_checkpoint(0, server.metadata(), 5, LONG)
    server.disallow_checkpoint()


def test_allow_checkpoint_serves_the_last_sent_state_dict_as_another_step(make_transport):
    server, client = make_transport(), make_transport()
    assert (server._disallowed, server._step, server._checkpoint_lock.w_locked()) == (True, -1, True)
    server.allow_checkpoint(1)  # nothing sent yet: torchft serves None
    assert (server._disallowed, server._step, server._checkpoint_lock.w_locked()) == (False, 1, False)
    assert client.recv_checkpoint(0, server.metadata(), 1, LONG) is None
    sent = state_dict()
    server.send_checkpoint([], 5, sent, LONG)
    server.disallow_checkpoint()
    assert server._disallowed and server._step == 5
    server.allow_checkpoint(7)
    server.allow_checkpoint(7)  # again: nothing changes
    assert digest(7, client.recv_checkpoint(0, server.metadata(), 7, LONG)) == digest(7, sent)
    server.disallow_checkpoint()
    server.disallow_checkpoint()  # twice is fine
    assert server.statistics().published_step is None


def test_an_unsupported_value_fails_on_the_callers_thread(make_transport):
    with pytest.raises(CheckpointError, match="at user.fn"):
        make_transport().send_checkpoint([1], 5, {"user": {"fn": print}}, LONG)


def raw_request(port: int, path: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    got = 0
    while got < 64 * 1024:  # the headers and part of the body
        got += len(sock.recv(4096))
    return sock


def test_a_receiver_killed_mid_transfer_counts_as_finished(make_transport, threads):
    server = make_transport()
    server.send_checkpoint([1], 5, {"big": torch.ones(8 << 20)}, timedelta(hours=1))
    sock = raw_request(server.port, "/checkpoint/5?session=victim")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # reset, as the kernel does for a killed process with unread data
    threads.submit(server.disallow_checkpoint).result(WAIT)  # no hour-long wait


def test_a_receiver_that_read_everything_need_not_report(make_transport, threads):
    server = make_transport()
    server.send_checkpoint([1], 5, state_dict(), timedelta(hours=1))
    url = server.metadata() + "/5?session=silent"
    with urllib.request.urlopen(url, timeout=WAIT) as response:
        blob = response.read()
    assert decode.decode_bytes(blob)[0] == 5
    threads.submit(server.disallow_checkpoint).result(WAIT)  # every byte was written: no hour-long wait


def test_a_stalled_receiver_is_cut_off_at_the_send_timeout(make_transport, threads):
    server = make_transport()
    server.send_checkpoint([1], 5, {"big": torch.ones(8 << 20)}, timedelta(seconds=1))
    sock = raw_request(server.port, "/checkpoint/5?session=stalled")
    try:
        threads.submit(server.disallow_checkpoint).result(WAIT)
        sock.settimeout(WAIT)
        with pytest.raises(ConnectionResetError):  # drain what was sent before the abort
            while sock.recv(1 << 20):
                pass
            raise ConnectionResetError("closed cleanly")  # EOF counts too: the stream was cut short
    finally:
        sock.close()
    assert server.statistics().bytes_served < 32 << 20


def test_receive_timeout_is_a_checkpoint_timeout(make_transport):
    server, client = make_transport(), make_transport()
    with pytest.raises(CheckpointTimeout, match="timed out after 0.5s receiving step 7") as caught:
        client.recv_checkpoint(0, server.metadata(), 7, timedelta(seconds=0.5))
    assert isinstance(caught.value, urllib.error.URLError) and isinstance(caught.value, RuntimeError)


def test_a_zero_receive_timeout_fails_at_once_as_torchfts_urlopen_does(make_transport):
    server, client = make_transport(), make_transport()
    server.send_checkpoint([], 5, state_dict(), LONG)
    with pytest.raises(urllib.error.URLError, match="urlopen error timed out after 0.0s") as caught:
        client.recv_checkpoint(0, server.metadata(), 5, timedelta(0))
    assert isinstance(caught.value, CheckpointTimeout)
    assert client.recv_checkpoint(0, server.metadata(), 5) is not None  # None: the constructor's timeout
    server.disallow_checkpoint()


@pytest.mark.parametrize("timeout", [None, timedelta(0)])
def test_a_send_without_a_timeout_of_its_own_serves_for_the_constructors(make_transport, timeout):
    server, client = make_transport(), make_transport()
    sent = state_dict()
    server.send_checkpoint([1], 5, sent, timeout)
    assert digest(5, client.recv_checkpoint(0, server.metadata(), 5, LONG)) == digest(5, sent)
    server.disallow_checkpoint()


def test_connection_refused_is_a_transfer_error(make_transport):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(CheckpointTransferError, match="failed") as caught:
        make_transport().recv_checkpoint(0, f"http://127.0.0.1:{port}/checkpoint", 5, LONG)
    assert isinstance(caught.value, urllib.error.URLError) and not isinstance(caught.value, TimeoutError)


def test_shutdown_answers_held_requests_and_is_idempotent(make_transport, threads):
    server, client = make_transport(), make_transport()
    received = threads.submit(client.recv_checkpoint, 0, server.metadata(), 5, LONG)
    wait_until_sync(lambda: server.statistics().held_requests == 1, "the receiver's request to be held")
    server.shutdown()
    server.shutdown()
    with pytest.raises(CheckpointTransferError):
        received.result(WAIT)


RECEIVER = textwrap.dedent("""
    import hashlib, sys
    from datetime import timedelta
    from torchft_lite.checkpointing import HTTPTransport
    from torchft_lite.serialization import encode
    transport = HTTPTransport(timedelta(seconds=60), num_chunks=2, hostname="127.0.0.1", bind_host="127.0.0.1")
    try:
        state = transport.recv_checkpoint(0, sys.argv[1], 5, timedelta(seconds=60))
        print(hashlib.sha256(encode.encode_to_bytes(5, state)).hexdigest())
    finally:
        transport.shutdown()
""")


def test_a_receiver_in_another_process(make_transport):
    server = make_transport()
    sent = state_dict(big_elements=100_000)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    child = subprocess.Popen([sys.executable, "-c", RECEIVER, server.metadata()], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, text=True)
    try:
        server.send_checkpoint([1], 5, sent, LONG)
        server.disallow_checkpoint()  # returns once the child has reported back
        out, err = child.communicate(timeout=WAIT)
        assert child.returncode == 0, err
        assert out.strip() == digest(5, sent)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# ---------------------------------------------------------------- snapshot safety, damaged streams, in place


def big_state_dict(megabytes: int = 48) -> dict:
    """More than the kernel's socket buffers hold, so disallow_checkpoint returns mid-stream for a slow reader."""
    return {"w": torch.arange((megabytes << 20) // 4, dtype=torch.float32), "b": torch.ones(3), "step": 7}


def test_mutating_right_after_disallow_leaves_what_was_served_intact(make_transport, threads, monkeypatch):
    # Small kernel buffers on both ends: most of the stream waits in the server's own write queue,
    # which holds views of the tensors, not copies.
    monkeypatch.setattr(_http_socket, "SEND_BUFFER_BYTES", 64 << 10)
    server = make_transport()
    sent = big_state_dict()
    expected = digest(5, sent)
    server.send_checkpoint([1], 5, sent, LONG)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"GET /checkpoint/5?session=slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    received = bytearray()
    released = threads.submit(server.disallow_checkpoint)
    ended = False
    while not released.done():  # a slow reader: the server's queue and the kernel's buffers stay full
        chunk = sock.recv(256 << 10)
        if not chunk:  # all sent: disallow_checkpoint is returning (on a loaded machine, this can come first)
            ended = True
            break
        received += chunk
        time.sleep(0.005)
    released.result(WAIT)
    with torch.no_grad():  # the optimizer step the Manager runs once disallow_checkpoint returns
        sent["w"].mul_(-1).add_(1)
        sent["b"].zero_()
    sock.settimeout(WAIT)
    while not ended and (chunk := sock.recv(1 << 20)):
        received += chunk
    sock.close()
    body = bytes(received).split(b"\r\n\r\n", 1)[1]
    step, state = decode.decode_bytes(body)  # checks every block's checksum too
    assert digest(step, state) == expected


@pytest.mark.parametrize("num_chunks", [0, 4])
def test_a_receiver_gets_the_values_from_before_a_mutation_after_disallow(make_transport, threads, num_chunks):
    server, client = make_transport(), make_transport(num_chunks=num_chunks)
    sent = big_state_dict(16)
    expected = digest(5, sent)
    server.send_checkpoint([1], 5, sent, LONG)
    receiving = threads.submit(client.recv_checkpoint, 0, server.metadata(), 5, LONG)
    server.disallow_checkpoint()
    with torch.no_grad():
        sent["w"].fill_(-1.0)
    assert digest(5, receiving.result(WAIT)) == expected


def head_then_body(head: bytes, body: bytes):
    """A ``scripted`` source's answer: ``head`` then ``body`` to every request but a receiver's done (200): for
    streams our server never sends."""
    return lambda path, query: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" if "/done" in path else head + body


def ok_head(length: int) -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\nContent-Type: application/octet-stream\r\n\r\n".encode()


@pytest.mark.parametrize("cut", [10, 200, -1000, -1])
def test_a_truncated_stream_is_detected(make_transport, scripted, cut):
    blob = encode.encode_to_bytes(5, state_dict(big_elements=10_000))
    fake = scripted(head_then_body(ok_head(len(blob)), blob[:cut]))  # declares all, sends less, closes
    with pytest.raises(CheckpointTransferError, match="truncated"):
        make_transport().recv_checkpoint(0, fake.url, 5, LONG)


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_corrupted_stream_is_detected(make_transport, scripted, where):
    blob = bytearray(encode.encode_to_bytes(5, state_dict(big_elements=10_000)))
    blob[-100 if where == "data" else spec.PREFIX_SIZE + 5] ^= 0x40
    fake = scripted(head_then_body(ok_head(len(blob)), bytes(blob)))
    with pytest.raises(CheckpointTransferError, match="checksum mismatch"):
        make_transport().recv_checkpoint(0, fake.url, 5, LONG)


def test_an_answer_without_content_length_is_refused(make_transport, scripted):
    fake = scripted(head_then_body(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"0\r\n\r\n"))
    with pytest.raises(CheckpointTransferError, match="Content-Length"):
        make_transport().recv_checkpoint(0, fake.url, 5, LONG)


@pytest.mark.parametrize("num_chunks", [0, 4])
def test_receive_in_place_fills_the_local_tensors(make_transport, num_chunks):
    server = make_transport()
    sent = state_dict(big_elements=300_000)
    local = state_dict(big_elements=300_000)
    with torch.no_grad():
        for tensor in (local["user"]["big"], local["user"]["model"]["weight"]):
            tensor.zero_()
    local["user"]["half"] = torch.zeros(2, 2, dtype=torch.bfloat16)  # another shape: not a target
    big, weight = local["user"]["big"], local["user"]["model"]["weight"]
    client = make_transport(num_chunks=num_chunks, state_dict=lambda: local)
    server.send_checkpoint([1], 5, sent, LONG)
    received = client.recv_checkpoint(0, server.metadata(), 5, LONG)
    server.disallow_checkpoint()
    assert received["user"]["big"] is big and received["user"]["model"]["weight"] is weight
    assert torch.equal(big, sent["user"]["big"]) and torch.equal(weight, sent["user"]["model"]["weight"])
    assert received["user"]["half"] is not local["user"]["half"]
    assert digest(5, received) == digest(5, sent)


def test_striping_pulls_disjoint_ranges_from_two_peers(make_transport):
    first, second = make_transport(), make_transport()
    sent = state_dict(big_elements=1_500_000)  # 6 MB: several 1 MiB checksum blocks to share out
    for server in (first, second):
        server.send_checkpoint([1], 5, sent, LONG)
    client = make_transport()
    received = client.recv_checkpoint_striped([(0, first.metadata()), (1, second.metadata())], 5, LONG)
    assert digest(5, received) == digest(5, sent)
    served = [server.statistics().bytes_served for server in (first, second)]
    assert all(count > 1_000_000 for count in served), served  # both sent a share of the data
    assert sum(served) < 1.2 * 6_000_000, served  # and not the whole of it each
    for server in (first, second):  # the receiver told both it had finished
        assert server.statistics().receivers_finished == 1
        server.disallow_checkpoint()


def test_striping_from_a_peer_that_serves_another_step_heals_from_the_primary(make_transport, caplog):
    caplog.set_level(logging.WARNING, logger="torchft_lite.checkpointing.http_transport")
    first, second = make_transport(), make_transport()
    sent = state_dict(big_elements=600_000)
    first.send_checkpoint([1], 5, sent, LONG)
    second.send_checkpoint([1], 6, sent, timedelta(seconds=1))  # its receiver never comes
    received = make_transport().recv_checkpoint_striped([(0, first.metadata()), (1, second.metadata())], 5, LONG)
    assert digest(5, received) == digest(5, sent)
    assert any("replica 1" in m and "HTTP 400" in m and "serving 6 but got step=5" in m for m in caplog.messages)
    for server in (first, second):
        server.disallow_checkpoint()


def test_a_range_off_the_checksum_blocks_is_a_400(make_transport):
    server = make_transport()
    server.send_checkpoint([1], 5, state_dict(big_elements=600_000), LONG)
    url = f"{server.metadata()}/5/data?session=s1&start=0&end=1000"
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(url, timeout=WAIT)
    assert caught.value.code == 400 and b"block boundaries" in caught.value.read()
    server.disallow_checkpoint()


@pytest.mark.parametrize("state", [{"small": torch.ones(10)}, {"nothing": 1}], ids=["one-block", "no-data"])
def test_striping_a_state_dict_with_fewer_blocks_than_sources_releases_every_source(make_transport, state):
    """Each source waits for the receiver in disallow_checkpoint: the one that served nothing must be told too."""
    first, second = make_transport(), make_transport()
    for server in (first, second):
        server.send_checkpoint([1], 5, state, LONG)
    received = make_transport().recv_checkpoint_striped([(0, first.metadata()), (1, second.metadata())], 5, LONG)
    assert digest(5, received) == digest(5, state)
    for server in (first, second):
        assert server.statistics().receivers_finished == 1  # so disallow_checkpoint returns at once
        server.disallow_checkpoint()


def _post_done(server: HTTPTransport, step: int, session: str, ok: bool = True) -> int:
    url = f"{server.metadata()}/{step}/done?session={session}&ok={int(ok)}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=WAIT) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _ask(server: HTTPTransport, step: int, session: str) -> int:
    """A request for ``step``'s header that the server holds for no time: it notes the session, as a striping
    receiver's does before it reports done to a secondary that served it nothing."""
    try:
        with urllib.request.urlopen(f"{server.metadata()}/{step}/header?session={session}&timeout=0",
                                    timeout=WAIT) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_done_that_arrives_before_the_publish_counts_for_it(make_transport, threads):
    # A striping receiver whose primary took over every range of this (slow) secondary can finish, and say so,
    # before this replica publishes: the publish must count it, not wait its whole timeout for it.
    server = make_transport(timeout=timedelta(seconds=3 * WAIT))
    assert _ask(server, 5, "early") == 504  # not published: held for no time, but the session is noted
    assert _post_done(server, 5, "early") == 200
    server.send_checkpoint([1], 5, state_dict(), timedelta(seconds=3 * WAIT))
    assert server.statistics().receivers_finished == 1
    threads.submit(server.disallow_checkpoint).result(WAIT)  # returns without waiting out the send timeout
    assert _post_done(server, 5, "late") == 409  # released: nothing to count any more
    assert _post_done(server, 4, "old") == 409  # older than what was served: it will never be published


def test_early_done_reports_are_bounded(make_transport):
    server = make_transport()
    for step in range(100, 130):
        assert _ask(server, step, "s") == 504
        assert _post_done(server, step, "s") == 200
    assert len(server._server._early_done) <= _http_server._MAX_EARLY_STEPS
    server.send_checkpoint([1, 2], 6, state_dict(), LONG)
    assert server.statistics().receivers_finished == 0  # reports for other steps count for nothing here
    assert server._server._early_done and min(server._server._early_done) > 6
