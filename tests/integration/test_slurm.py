"""The Slurm recipe (examples/slurm) on a real single-node Slurm started by the test.

The lighthouse job and a two-task array of replica groups are submitted with
the recipe's own sbatch scripts. One group's trainer is SIGKILLed: its task's
script sees exit code 137, which the exit-code table says to requeue; Slurm
requeues the task, the group comes back, heals from the other and the job
ends with both groups identical, every task COMPLETED, and the lighthouse's
job ended by itself. Skipped, naming why, without root or without Slurm's
packages (``make slurm`` installs them where root and apt are at hand).
"""

from __future__ import annotations

import time

import pytest

from tests.integration.cluster_jobs import (
    REPO, assert_identical_per_step, job_env, kill_and_rejoin, read_reports, wait_for_rows, write_token,
)
from tests.integration.slurm_cluster import SingleNodeSlurm
from torchft_lite.cluster.local import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECIPE = REPO / "examples" / "slurm"
WAIT = 240.0
STEPS = 30
UNAVAILABLE = SingleNodeSlurm.unavailable()


@pytest.fixture
def slurm(tmp_path):
    cluster = SingleNodeSlurm(tmp_path / "slurm")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def submit(slurm: SingleNodeSlurm, env: dict[str, str], *args: str) -> str:
    out = slurm.run(["sbatch", "--parsable", *args], env=env, cwd=REPO).stdout.strip()
    return out.split(";")[0]


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"skipped: {UNAVAILABLE}")
def test_a_killed_group_is_requeued_by_slurm_rejoins_heals_and_the_job_completes(tmp_path, slurm):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    token_file = write_token(tmp_path / "job-token")
    report = job_dir / "report.jsonl"
    env = {**job_env(), "JOB_DIR": str(job_dir), "TORCHFT_LITE_TOKEN_FILE": str(token_file),
           "LIGHTHOUSE_PORT": str(free_port()), "LIGHTHOUSE_HTTP_BIND": "off", "LIGHTHOUSE_HOST": "127.0.0.1",
           "MIN_REPLICAS": "2", "EXIT_WHEN_IDLE": "5", "RANKS_PER_GROUP": "1", "MAX_REQUEUES": "2"}
    lighthouse = submit(slurm, env, "--cpus-per-task=1", f"--output={job_dir}/lighthouse.out",
                        str(RECIPE / "lighthouse.sbatch"))
    groups = submit(slurm, env, "--array=0-1", "--cpus-per-task=1", f"--output={job_dir}/group-%a.out",
                    str(RECIPE / "replica-groups.sbatch"), "--steps", str(STEPS), "--min-replicas", "2",
                    "--step-sleep", "0.05", "--timeout", "15", "--report", str(report))

    def ended() -> str | None:
        states = {job: slurm.job(job).get("JobState") for job in (lighthouse, f"{groups}_0", f"{groups}_1")}
        bad = {job: state for job, state in states.items() if state in ("FAILED", "CANCELLED", "TIMEOUT")}
        return f"Slurm jobs ended: {bad} (see {job_dir})" if bad else None

    victims, rejoin = kill_and_rejoin(report, 1, at_step=8, timeout=WAIT, still_running=ended)

    def finished() -> bool:
        return all(slurm.job(job).get("JobState") == "COMPLETED"
                   for job in (lighthouse, f"{groups}_0", f"{groups}_1"))

    wait_for_rows(report, lambda _: finished(), "every Slurm job to complete", WAIT, ended)
    assert slurm.job(f"{groups}_1")["Restarts"] == "1"
    assert slurm.job(f"{groups}_0")["Restarts"] == "0"
    assert "exited with 137: requeueing it" in (job_dir / "group-1.out").read_text()
    rows = read_reports(report)
    assert rejoin.first_step > 1, f"the requeued group started over at step {rejoin.first_step}: no heal"
    assert max(r["step"] for r in rows if r["group"] == 1 and r["pid"] not in victims) == STEPS
    assert max(r["step"] for r in rows if r["group"] == 0) == STEPS
    assert assert_identical_per_step(rows) > 0
    print(f"slurm requeue: restart-to-rejoin {rejoin.seconds:.2f}s (first step {rejoin.first_step})")


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"skipped: {UNAVAILABLE}")
def test_a_token_file_others_can_read_is_refused_with_exit_code_78_and_not_requeued(tmp_path, slurm):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    token_file = write_token(tmp_path / "job-token", 0o644)
    env = {"JOB_DIR": str(job_dir), "TORCHFT_LITE_TOKEN_FILE": str(token_file),
           "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9"}
    job = submit(slurm, env, "--array=0-0", "--cpus-per-task=1", f"--output={job_dir}/group-%a.out",
                 str(RECIPE / "replica-groups.sbatch"))
    deadline = time.monotonic() + WAIT
    while slurm.job(f"{job}_0").get("JobState") not in ("FAILED", "COMPLETED"):
        assert time.monotonic() < deadline, f"the task never ended: {slurm.job(f'{job}_0')}"
        time.sleep(0.5)
    state = slurm.job(f"{job}_0")
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "78:0" and state["Restarts"] == "0"
    assert "readable by you only" in (job_dir / "group-0.out").read_text()
