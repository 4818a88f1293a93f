"""End to end: the whole job dies (every group, and the lighthouse or not) and resumes from a durable checkpoint.

Real lighthouse processes and ``examples/train_ddp.py`` groups with
``--checkpoint-dir``. The resumed run must hold, at every step it commits,
the very parameters a run of the same seed that was never interrupted held
at that step (the data position and RNG states come back with the state).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.integration.test_fault_tolerant_ddp import SCRIPT, WAIT, read_reports, wait_for
from torchft_lite.durable._layout import Layout
from torchft_lite.local_cluster import LighthouseProcess, ReplicaGroup

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 24
EVERY = 5


def start_group(group_id: int, lighthouse: LighthouseProcess, tmp: Path, report: Path,
                checkpoint_dir: Path | None, sleep: float = 0.0) -> ReplicaGroup:
    args = ["--steps", str(STEPS), "--report", str(report), "--step-sleep", str(sleep), "--timeout", "15",
            "--min-replicas", "2"]
    if checkpoint_dir is not None:
        args += ["--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(EVERY), "--keep-last", "2"]
    return ReplicaGroup(group_id, 2, lighthouse.address, SCRIPT, args, log_dir=tmp).start()


def checksums(rows: list[dict], pids: set[int] | None = None) -> dict[tuple[int, int], str]:
    """(group, step) -> checksum, of the processes ``pids`` (all when None)."""
    return {(r["group"], r["step"]): r["checksum"] for r in rows if pids is None or r["pid"] in pids}


def reference_run(tmp_path: Path) -> dict[tuple[int, int], str]:
    ref = tmp_path / "reference"
    ref.mkdir()
    lighthouse = LighthouseProcess(min_replicas=2, join_timeout=30.0, startup_grace=0.0,
                                   log_path=ref / "lighthouse.log").start()
    groups = []
    try:
        groups = [start_group(g, lighthouse, ref, ref / "report.jsonl", None) for g in range(2)]
        for group in groups:
            assert group.wait(WAIT) == [0], f"reference group {group.group_id} failed; logs in {ref}"
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()
    sums = checksums(read_reports(ref / "report.jsonl"))
    assert {step for _, step in sums} == set(range(1, STEPS + 1))
    return sums


@pytest.mark.parametrize("lighthouse_dies", [True], ids=["lighthouse-killed-too"])
def test_whole_job_killed_resumes_bit_identically(tmp_path, lighthouse_dies):
    expected = reference_run(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    report, checkpoints = run / "report.jsonl", run / "checkpoints"
    lighthouse = LighthouseProcess(min_replicas=2, join_timeout=30.0, startup_grace=0.0,
                                   log_path=run / "lighthouse.log").start()
    groups: list[ReplicaGroup] = []
    try:
        groups = [start_group(g, lighthouse, run, report, checkpoints, sleep=0.15) for g in range(2)]
        layout = Layout(checkpoints)
        wait_for(lambda: any(info.step >= 2 * EVERY for info in layout.complete()),
                 f"a durable checkpoint of step {2 * EVERY}", groups=groups)
        first_pids = {r["pid"] for r in read_reports(report)}
        killed_at = max(r["step"] for r in read_reports(report))
        for group in groups:
            group.kill(signal.SIGKILL)
        if lighthouse_dies:
            lighthouse.kill()
            lighthouse = LighthouseProcess(min_replicas=2, join_timeout=30.0, startup_grace=0.0,
                                           log_path=run / "lighthouse2.log").start()
        newest = layout.complete()[0].step
        assert newest >= 2 * EVERY and newest % EVERY == 0
        groups = [start_group(g, lighthouse, run, report, checkpoints) for g in range(2)]
        for group in groups:
            assert group.wait(WAIT) == [0], f"resumed group {group.group_id} failed; logs in {run}"
        rows = read_reports(report)
        resumed = checksums(rows, {r["pid"] for r in rows} - first_pids)
        assert {step for _, step in resumed} == set(range(newest + 1, STEPS + 1)), \
            f"killed at step {killed_at}, newest checkpoint {newest}: the resumed run committed other steps"
        for key, checksum in resumed.items():
            assert checksum == expected[key], f"group {key[0]} step {key[1]} differs from the uninterrupted run"
        for group_id in range(2):
            log = (run / f"group{group_id}.1.0.log").read_text()  # both runs append to it
            assert f"resumed from step {newest}" in log
        writers = {info.writer.split(":")[0] for info in layout.complete()}
        assert len(writers) == 1  # one group writes each checkpoint
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()
