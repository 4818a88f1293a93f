"""The standby trainer (torchft_lite.cluster.standby) and ReplicaGroup's use of it: warm, then the script on go.

The scripts here are tiny and the preload light (``json``), so each process is cheap; the real preload
(torch, torch._dynamo, the library) is what the recovery benchmark's smoke run exercises.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchft_lite.cluster.local import ReplicaGroup
from torchft_lite.cluster.standby import READY, go_line

pytestmark = pytest.mark.integration

SCRIPT = """
import json, os, sys
out = os.environ["STANDBY_TEST_OUT"]
with open(out, "a") as f:
    f.write(json.dumps({"argv": sys.argv, "path0": sys.path[0], "rank": os.environ.get("RANK"),
                        "port": os.environ.get("MASTER_PORT"), "group": os.environ.get("REPLICA_GROUP_ID"),
                        "main": __name__, "pid": os.getpid(), "stdin": sys.stdin.read()}) + "\\n")
print("printed by the script")
sys.exit(int(os.environ.get("STANDBY_TEST_EXIT", "0")))
"""


def standby(script: Path, *args: str, env: dict[str, str], stderr) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torchft_lite.cluster.standby", "--preload", "json", str(script), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env, bufsize=0)


def read_line(proc: subprocess.Popen, timeout: float = 120.0) -> bytes:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line from the standby within {timeout:.0f}s"
    return proc.stdout.readline()


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "scripts" / "train.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def test_the_standby_runs_the_script_as_python_would_once_told(script, tmp_path):
    out, log = tmp_path / "out.jsonl", tmp_path / "standby.log"
    env = dict(os.environ, STANDBY_TEST_OUT=str(out), STANDBY_TEST_EXIT="3")
    with open(log, "wb") as stderr:
        proc = standby(script, "--steps", "5", env=env, stderr=stderr)
    try:
        assert read_line(proc) == READY
        assert not out.exists()  # nothing runs before go
        proc.stdin.write(go_line({"RANK": "1", "MASTER_PORT": "4321"}))
        proc.stdin.close()
        assert proc.wait(120) == 3  # the script's exit status
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
    ran = json.loads(out.read_text())
    assert ran["argv"] == [str(script), "--steps", "5"]
    assert ran["path0"] == str(script.parent) and ran["main"] == "__main__"
    assert ran["rank"] == "1" and ran["port"] == "4321" and ran["stdin"] == ""
    assert ran["pid"] == proc.pid
    assert "printed by the script" in log.read_text()  # stdout went to the launcher's log
    assert "waiting for go" in log.read_text()


@pytest.mark.parametrize("message, code", [(b"", 0), (b"not json\n", 2), (b'{"env": {"A": 1}}\n', 2)])
def test_no_go_or_a_malformed_one_runs_nothing(script, tmp_path, message, code):
    out, log = tmp_path / "out.jsonl", tmp_path / "standby.log"
    with open(log, "wb") as stderr:
        proc = standby(script, env=dict(os.environ, STANDBY_TEST_OUT=str(out)), stderr=stderr)
    try:
        assert read_line(proc) == READY
        proc.stdin.write(message)
        proc.stdin.close()
        assert proc.wait(120) == code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
    assert not out.exists()
    if code:
        assert "malformed go line" in log.read_text()


def test_a_missing_script_is_refused_before_warming(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torchft_lite.cluster.standby", "--preload", "json",
                           str(tmp_path / "nope.py")], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "no such training script" in done.stderr


def test_a_replica_group_restarts_in_its_warm_standby(script, tmp_path):
    out = tmp_path / "out.jsonl"
    group = ReplicaGroup(3, 4, "http://127.0.0.1:1", script, ["--flag"], world_size=2, log_dir=tmp_path,
                         env={"STANDBY_TEST_OUT": str(out)})
    try:
        group.start_standby(preload=["json"])
        assert group.wait_standby(120)
        standby_pids = sorted(p.pid for p in group.standbys)
        group.start()
        assert group.standbys == []
        assert sorted(p.pid for p in group.procs) == standby_pids  # no fresh process: the standbys run it
        assert group.wait(120) == [0, 0]
        runs = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])
        assert [r["rank"] for r in runs] == ["0", "1"] and {r["group"] for r in runs} == {"3"}
        assert {r["port"] for r in runs} == {str(group._store.port)}
        assert all(r["argv"][1:] == ["--flag"] for r in runs)
        assert (tmp_path / "group3.1.0.log").exists() and (tmp_path / "group3.1.1.log").exists()
        group.start()  # no standby left: a fresh process per rank
        assert group.wait(120) == [0, 0]
        assert len(out.read_text().splitlines()) == 4
    finally:
        group.stop()


def test_stop_ends_a_waiting_standby_and_kill_spares_it(script, tmp_path):
    group = ReplicaGroup(0, 2, "http://127.0.0.1:1", script, log_dir=tmp_path,
                         env={"STANDBY_TEST_OUT": str(tmp_path / "out.jsonl")})
    try:
        group.start_standby(preload=["json"])
        assert group.wait_standby(120)
        waiting = group.standbys[0]
        group.kill()  # the group's processes die; a spare elsewhere would not
        assert waiting.poll() is None
    finally:
        group.stop()
    deadline = time.monotonic() + 60
    while waiting.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiting.poll() is not None and group.standbys == []


def test_standbys_need_the_direct_mode(script):
    group = ReplicaGroup(0, 2, "http://127.0.0.1:1", script, use_torchrun=True)
    with pytest.raises(ValueError, match="direct mode"):
        group.start_standby()
    with pytest.raises(RuntimeError, match="no standbys"):
        group.wait_standby(1)
