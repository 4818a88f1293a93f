"""``python -m torchft_lite.launch``: torchrun whose exit code is the failed worker's, not always 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchft_lite.cluster.local import stop_tree
from torchft_lite.launch import exit_code_of

pytestmark = [pytest.mark.integration]

WORKER = """
import os, sys, time
if os.environ["LOCAL_RANK"] == "1":
    if sys.argv[1] == "hang":
        open(sys.argv[2], "w").write(str(os.getpid()))
        time.sleep(120)
    sys.exit(int(sys.argv[1]))
time.sleep(120)
"""


def launch(tmp_path: Path, *worker_args: str) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return subprocess.Popen([sys.executable, "-m", "torchft_lite.launch", "--standalone", "--nproc_per_node=2",
                             "--max_restarts=0", str(script), *worker_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


@pytest.mark.parametrize("code", [78, 75])
def test_the_first_failed_workers_code_is_the_launchers(tmp_path, code):
    proc = launch(tmp_path, str(code))
    try:
        assert proc.wait(120) == code  # torchrun itself would exit with 1
    finally:
        stop_tree(proc)


def test_a_worker_killed_by_a_signal_exits_as_a_shell_says(tmp_path):
    pid_file = tmp_path / "pid"
    proc = launch(tmp_path, "hang", str(pid_file))
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the worker never started"
            assert proc.poll() is None, f"the launcher exited with {proc.returncode} before its worker started"
            time.sleep(0.1)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        assert proc.wait(120) == 128 + signal.SIGKILL
    finally:
        stop_tree(proc)


def test_exit_code_of():
    assert exit_code_of(78) == 78
    assert exit_code_of(-15) == 143
    assert exit_code_of(300) == 1
