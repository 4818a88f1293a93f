"""The lighthouse as users run it: a separate process, flags, signals."""

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest


pytestmark = pytest.mark.integration


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "lighthouse", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--bind", "--min_replicas", "--join_timeout_ms", "--quorum_tick_ms", "--heartbeat_timeout_ms",
                 "--http-bind", "--admin-token", "--state-dir", "[::]:29510", "60000", "5000"):
        assert flag in out.stdout, flag


def test_runs_serves_and_stops_cleanly_on_sigterm(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lighthouse", "--min_replicas", "1", "--bind", "127.0.0.1:0",
         "--http-bind", "127.0.0.1:0", "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        seen = []
        for line in proc.stdout:  # log lines first, then the "listening" line
            seen.append(line)
            match = re.search(r"listening on: http://127\.0\.0\.1:(\d+), dashboard at http://localhost:(\d+)/", line)
            if match or len(seen) > 20:
                break
        assert match, "".join(seen)
        http_port = int(match.group(2))
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=30) as response:
            assert response.read() == b"ok"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert "received SIGTERM, shutting down" in output and "lighthouse stopped" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_port_in_use_exits_1_with_a_clear_message():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "lighthouse", "--min_replicas", "1", "--bind", f"127.0.0.1:{port}",
             "--http-bind", "off"], capture_output=True, text=True, timeout=60,
        )
    assert out.returncode == 1
    assert f"could not bind gRPC to 127.0.0.1:{port}" in out.stderr


@pytest.mark.parametrize("argv, message", [([], "--min_replicas"), (["--min_replicas", "0"], "min_replicas"),
                                           (["--min_replicas", "1", "--bind", "nope"], "HOST:PORT")])
def test_bad_flags_are_usage_errors(argv, message):
    out = subprocess.run([sys.executable, "-m", "lighthouse", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr


def test_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "torchft-lite-lighthouse")
    assert os.path.exists(script)
    out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--min_replicas" in out.stdout
