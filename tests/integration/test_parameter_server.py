"""ParameterServer (torchft's API) with real gloo sessions: a round trip, a client killed mid-session, access.

Run as a script, this file is a client process: it opens a session, does one
round, says so on stdout, and waits to be killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.conftest import WAIT, wait_until_sync
from torchft_lite.parameter_server import ParameterServer
from torchft_lite.process_group import ProcessGroup, ProcessGroupGloo
from torchft_lite.rpc.access import Access

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO_ROOT = Path(__file__).resolve().parents[2]
SESSION_TIMEOUT = timedelta(seconds=5)  # how long the server waits for a client that died


class Adder(ParameterServer):
    """Adds 23 to what the client sends, round after round, until the session fails or the client stops."""

    def __init__(self, **kwargs) -> None:
        self.sessions: dict[str, str] = {}  # session id -> "ok" or the error that ended it
        self.changed = threading.Condition()
        super().__init__(port=0, hostname="127.0.0.1", **kwargs)

    @classmethod
    def new_process_group(cls) -> ProcessGroup:
        return ProcessGroupGloo(timeout=SESSION_TIMEOUT)

    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        try:
            for _ in range(2):
                data = torch.zeros(1)
                pg.broadcast_one(data, root=1).wait()  # from the client
                data += 23
                pg.broadcast_one(data, root=0).wait()  # back to it
            outcome = "ok"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            with self.changed:
                self.sessions[session_id] = outcome
                self.changed.notify_all()

    def outcomes(self) -> list[str]:
        with self.changed:
            return list(self.sessions.values())


def one_round(pg: ProcessGroup, value: float) -> float:
    data = torch.full((1,), value)
    pg.broadcast_one(data, root=1).wait()
    pg.broadcast_one(data, root=0).wait()
    return data.item()


@pytest.fixture
def server():
    started = []

    def start(**kwargs) -> Adder:
        started.append(Adder(**kwargs))
        return started[-1]

    try:
        yield start
    finally:
        for ps in started:
            ps.shutdown()


def test_a_session_sends_to_the_server_and_gets_its_answer(server):
    ps = server()
    assert ps.address().startswith("http://127.0.0.1:") and ps.address().endswith("/new_session")
    pg = Adder.new_session(ps.address())
    try:
        assert (pg.rank(), pg.size()) == (1, 2)
        assert one_round(pg, 12.0) == 12.0 + 23
        assert one_round(pg, 1.0) == 1.0 + 23
    finally:
        pg.shutdown()
    wait_until_sync(lambda: ps.outcomes() == ["ok"], "the session to end")


def test_a_client_killed_mid_session_fails_only_its_session(server):
    ps = server()
    client = subprocess.Popen([sys.executable, __file__, ps.address()], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert client.stdout.readline().strip() == "35.0"  # one round done; the server waits for the next
        client.kill()
        client.wait(WAIT)
        # The server's collective fails within the process group's timeout; the session ends with the error.
        wait_until_sync(lambda: len(ps.outcomes()) == 1, "the killed client's session to fail")
        assert ps.outcomes()[0] != "ok", ps.outcomes()
        # The server goes on: a new client gets a new session.
        pg = Adder.new_session(ps.address())
        try:
            assert one_round(pg, 2.0) == 25.0 and one_round(pg, 3.0) == 26.0
        finally:
            pg.shutdown()
        wait_until_sync(lambda: sorted(ps.outcomes())[-1] == "ok" and len(ps.outcomes()) == 2, "the new session")
    finally:
        client.kill()
        client.wait(WAIT)


def test_only_holders_of_the_job_token_open_sessions_and_only_on_its_one_path(server, monkeypatch):
    ps = server(access=Access("s3cret"))
    monkeypatch.delenv("TORCHFT_LITE_TOKEN", raising=False)
    with pytest.raises(urllib.error.HTTPError) as refused:
        Adder.new_session(ps.address(), timeout=timedelta(seconds=WAIT))
    assert refused.value.code == 401 and ps.refusals == {"unauthenticated": 1}
    monkeypatch.setenv("TORCHFT_LITE_TOKEN", "s3cret")
    bad_path = ps.address().replace("/new_session", "/other")
    request = urllib.request.Request(bad_path, headers={"Authorization": "Bearer s3cret"})
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(request, timeout=WAIT)
    assert wrong.value.code == 400
    pg = Adder.new_session(ps.address())
    try:
        assert one_round(pg, 0.0) == 23.0 and one_round(pg, 1.0) == 24.0
    finally:
        pg.shutdown()
    wait_until_sync(lambda: ps.outcomes() == ["ok"], "the session to end")


def main(address: str) -> None:
    pg = Adder.new_session(address)
    print(one_round(pg, 12.0), flush=True)
    threading.Event().wait(300)  # until the test kills this process


if __name__ == "__main__":
    main(sys.argv[1])
