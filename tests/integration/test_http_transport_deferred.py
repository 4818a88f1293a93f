"""HTTPTransport(defer_server=True): the port is bound at once, the server (and aiohttp) starts later.

The Manager's own transport is made this way, so a restarted replica's join
path does not import an HTTP server it needs only as a heal's source.
"""

import http.client
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch

from torchft_lite.checkpointing import HTTPTransport
from torchft_lite.errors import CheckpointError
from tests.conftest import WAIT, wait_until_sync

pytestmark = pytest.mark.integration

LONG = timedelta(seconds=WAIT)


def test_a_deferred_transport_binds_its_port_but_imports_no_http_server():
    script = textwrap.dedent("""
        import socket, sys
        from datetime import timedelta
        from torchft_lite.checkpointing import HTTPTransport
        transport = HTTPTransport(timedelta(seconds=30), hostname="127.0.0.1", bind_host="127.0.0.1",
                                  defer_server=True)
        with socket.create_connection(("127.0.0.1", transport.port), timeout=30):
            pass  # the kernel accepts it: the port is bound and listening
        print("aiohttp" in sys.modules, "torchft_lite.checkpointing._http_server" in sys.modules)
        transport.shutdown()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("bind_host", ["127.0.0.1", "::"])  # "::", the default, is a dual-stack socket
def test_a_request_that_came_before_the_server_started_is_answered_after_the_send(make_transport, threads,
                                                                                   bind_host):
    server = HTTPTransport(LONG, hostname="127.0.0.1", bind_host=bind_host, defer_server=True)
    client = make_transport()
    early = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT)
    try:
        early.request("GET", f"/checkpoint/3?session=early&timeout={WAIT}")  # sent; nobody reads it yet
        assert server._server is None
        sent = {"w": torch.arange(1000, dtype=torch.float32)}
        received = threads.submit(client.recv_checkpoint, 0, server.metadata(), 3, LONG)
        server.send_checkpoint([1], 3, sent, LONG)  # starts the server, which answers both
        answer = early.getresponse()
        assert answer.status == 200 and len(answer.read()) > sent["w"].nbytes  # the whole encoding
        assert torch.equal(received.result(WAIT)["w"], sent["w"])
        server.disallow_checkpoint()
        assert server.statistics().bytes_served > 0
    finally:
        early.close()
        server.shutdown()


def test_warm_up_starts_the_server_in_the_background(make_transport, threads):
    server, client = make_transport(defer_server=True), make_transport()
    assert server._server is None
    server.warm_up()
    wait_until_sync(lambda: server._server is not None, "the deferred server to start")
    received = threads.submit(client.recv_checkpoint, 0, server.metadata(), 1, LONG)
    wait_until_sync(lambda: server.statistics().held_requests == 1, "the request to be held by the running server")
    server.send_checkpoint([1], 1, {"x": torch.ones(3)}, LONG)
    assert torch.equal(received.result(WAIT)["x"], torch.ones(3))
    server.warm_up()  # started already: nothing happens
    server.disallow_checkpoint()


def test_shutting_down_a_transport_whose_server_never_started_frees_its_port(make_transport):
    transport = make_transport(defer_server=True)
    port = transport.port
    transport.shutdown()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=WAIT).close()
    with pytest.raises(CheckpointError, match="shut down"):
        transport.send_checkpoint([1], 1, {"x": torch.ones(1)}, LONG)
    transport.warm_up()  # after shutdown: nothing to start, and no error
    assert transport._server is None


def test_a_port_in_use_fails_the_constructor_naming_it(make_transport):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(CheckpointError, match=f"cannot listen on 127.0.0.1:{port}"):
            make_transport(defer_server=True, port=port)
