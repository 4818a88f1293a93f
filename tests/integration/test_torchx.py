"""The torchx recipe: ``torchx run -s local_cwd torchft_lite/torchx.py:hsdp`` runs a real job.

The lighthouse role and two replica groups start; one group's trainer is
SIGKILLed; its torchrun agent restarts it (the component's ``max_restarts``);
it heals from the live group and the job ends with torchx saying SUCCEEDED
(the lighthouse role ends by itself once the groups are done).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.cluster_jobs import (
    REPO, assert_identical_per_step, job_env, kill_and_rejoin, read_reports, write_token,
)
from torchft_lite.cluster.local import free_port, stop_tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TORCHX = Path(sys.executable).parent / "torchx"
WAIT = 240.0  # generous: the torchx CLI, a lighthouse and two torch trainers share two cores
STEPS = 30

try:
    import torchx.specs  # noqa: F401
    TORCHX_MISSING = None if TORCHX.exists() else f"the torchx command is not next to {sys.executable}"
except ImportError:
    TORCHX_MISSING = "torchx is not installed (pip install -e '.[dev]' installs torchx-nightly)"


def component_args(token_file: Path, report: Path) -> list[str]:
    # min_replicas 2 on both sides: the live group waits for the killed one, so the job can't end
    # before the restarted group healed and committed with it, however slow the machine is.
    return ["--replicas", "2", "--workers_per_replica", "1", "--max_restarts", "3",
            "--lighthouse_port", str(free_port()), "--dashboard_port", "-1", "--min_replicas", "2",
            "--exit_when_idle", "5", "--token_file", str(token_file),
            "--", "--steps", str(STEPS), "--min-replicas", "2", "--step-sleep", "0.05", "--timeout", "15",
            "--report", str(report)]


@pytest.mark.skipif(TORCHX_MISSING is not None, reason=f"skipped: {TORCHX_MISSING}")
def test_torchx_local_job_restarts_a_killed_group_which_heals_and_the_job_succeeds(tmp_path):
    token_file = write_token(tmp_path / "job-token")
    report = tmp_path / "report.jsonl"
    command = [str(TORCHX), "run", "-s", "local_cwd", "--scheduler_args", f"log_dir={tmp_path / 'logs'}",
               "torchft_lite/torchx.py:hsdp", *component_args(token_file, report)]
    with open(tmp_path / "torchx.out", "wb") as out:
        job = subprocess.Popen(command, cwd=REPO, env=job_env(), stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        def ended() -> str | None:
            return None if job.poll() is None else f"torchx exited with {job.returncode} (see {tmp_path}/torchx.out)"

        victims, rejoin = kill_and_rejoin(report, 1, at_step=8, timeout=WAIT, still_running=ended)
        job.wait(WAIT)
        output = (tmp_path / "torchx.out").read_text(errors="replace")
        assert job.returncode == 0, output[-3000:]
        assert "SUCCEEDED" in output, output[-3000:]
        rows = read_reports(report)
        assert rejoin.first_step > 1, f"the restarted group started over at step {rejoin.first_step}: no heal"
        assert {r["step"] for r in rows if r["group"] == 1 and r["pid"] not in victims} >= {STEPS}
        assert max(r["step"] for r in rows if r["group"] == 0) == STEPS
        assert assert_identical_per_step(rows) > 0
        print(f"torchx local_cwd: restart-to-rejoin {rejoin.seconds:.2f}s (first step {rejoin.first_step})")
    finally:
        stop_tree(job, 10)
