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

from tests.integration.helpers import JOB_WAIT as WAIT, TRAIN_DDP as SCRIPT, read_reports, wait_for
from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup
from torchft_lite.durable._layout import Layout

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 24
EVERY = 5


def start_group(group_id: int, lighthouse: LighthouseProcess, tmp: Path, report: Path,
                checkpoint_dir: Path | None, sleep: float = 0.0, ranks: int = 1) -> ReplicaGroup:
    args = ["--steps", str(STEPS), "--report", str(report), "--step-sleep", str(sleep), "--timeout", "15",
            "--min-replicas", "2"]
    if checkpoint_dir is not None:
        args += ["--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(EVERY), "--keep-last", "2"]
    return ReplicaGroup(group_id, 2, lighthouse.address, SCRIPT, args, log_dir=tmp, world_size=ranks).start()


def checksums(rows: list[dict], pids: set[int] | None = None) -> dict[tuple[int, int, int], str]:
    """(group, rank, step) -> checksum, of the processes ``pids`` (all when None)."""
    return {(r["group"], r["rank"], r["step"]): r["checksum"] for r in rows if pids is None or r["pid"] in pids}


def reference_run(tmp_path: Path, ranks: int) -> dict[tuple[int, int, int], str]:
    ref = tmp_path / "reference"
    ref.mkdir()
    lighthouse = LighthouseProcess(min_replicas=2, join_timeout=30.0, startup_grace=0.0,
                                   log_path=ref / "lighthouse.log").start()
    groups = []
    try:
        groups = [start_group(g, lighthouse, ref, ref / "report.jsonl", None, ranks=ranks) for g in range(2)]
        for group in groups:
            assert group.wait(WAIT) == [0] * ranks, f"reference group {group.group_id} failed; logs in {ref}"
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()
    sums = checksums(read_reports(ref / "report.jsonl"))
    assert {step for _, _, step in sums} == set(range(1, STEPS + 1))
    return sums


@pytest.mark.parametrize("lighthouse_dies", [True, False], ids=["lighthouse-killed-too", "lighthouse-lives-on"])
def test_whole_job_killed_resumes_bit_identically(tmp_path, lighthouse_dies):
    # Two ranks per group where the lighthouse dies too: each rank holds its own state (group rank r of
    # every group is one data-parallel ring), so each rank's file must come back to that rank.
    ranks = 2 if lighthouse_dies else 1
    expected = reference_run(tmp_path, ranks)
    run = tmp_path / "run"
    run.mkdir()
    report, checkpoints = run / "report.jsonl", run / "checkpoints"
    lighthouse = LighthouseProcess(min_replicas=2, join_timeout=30.0, startup_grace=0.0,
                                   log_path=run / "lighthouse.log").start()
    groups: list[ReplicaGroup] = []
    try:
        groups = [start_group(g, lighthouse, run, report, checkpoints, sleep=0.15, ranks=ranks) for g in range(2)]
        layout = Layout(checkpoints)
        # Killed a few steps after the checkpoint: the lighthouse then holds a higher step than the job resumes
        # from, and (when it lives on) only a new epoch lets the resumed job form a quorum.
        wait_for(lambda: any(info.step >= 2 * EVERY for info in layout.complete())
                 and max(r["step"] for r in read_reports(report)) >= 2 * EVERY + 3,
                 f"a durable checkpoint of step {2 * EVERY} and 3 more steps", groups=groups)
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
        groups = [start_group(g, lighthouse, run, report, checkpoints, ranks=ranks) for g in range(2)]
        for group in groups:
            assert group.wait(WAIT) == [0] * ranks, f"resumed group {group.group_id} failed; logs in {run}"
        rows = read_reports(report)
        resumed = checksums(rows, {r["pid"] for r in rows} - first_pids)
        assert {step for _, _, step in resumed} == set(range(newest + 1, STEPS + 1)), \
            f"killed at step {killed_at}, newest checkpoint {newest}: the resumed run committed other steps"
        for key, checksum in resumed.items():
            assert checksum == expected[key], f"group {key[0]} rank {key[1]} step {key[2]} differs from the " \
                                              "uninterrupted run"
        for group_id in range(2):
            log = (run / f"group{group_id}.1.0.log").read_text()  # both runs append to it
            assert f"resumed from step {newest}" in log
        # A group that committed step k joined a quorum at step k - 1: a live lighthouse then held a higher step
        # than the checkpoint's, and the groups' resumed_from started a new epoch at once.
        if not lighthouse_dies and killed_at - 1 > newest:
            log = (run / "lighthouse.log").read_text()
            assert f"down to {newest} because" in log and "resumed" in log, log[-2000:]
        writers = {info.writer.split(":")[0] for info in layout.complete()}
        assert len(writers) == 1  # one group writes each checkpoint
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()


def test_sigterm_saves_the_only_copy_before_leaving_and_a_restart_resumes_from_it(tmp_path):
    from torchft_lite.cluster.exit_codes import EXIT_CODE_PREEMPTED

    report, checkpoints = tmp_path / "report.jsonl", tmp_path / "checkpoints"
    lighthouse = LighthouseProcess(min_replicas=1, join_timeout=5.0, startup_grace=0.0,
                                   log_path=tmp_path / "lighthouse.log").start()
    args = ["--steps", "1000", "--report", str(report), "--step-sleep", "0.05", "--timeout", "15",
            "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "100000"]
    group = ReplicaGroup(0, 1, lighthouse.address, SCRIPT, args, log_dir=tmp_path)
    try:
        group.start()
        wait_for(lambda: len(read_reports(report)) >= 5, "5 committed steps", groups=[group])
        group.kill(signal.SIGTERM)
        assert group.wait(WAIT) == [EXIT_CODE_PREEMPTED]
        last = max(r["step"] for r in read_reports(report))
        [info] = Layout(checkpoints).complete()
        assert info.step == last  # every 100000 steps: only the save on the way out wrote it
        group.script_args[1] = str(last + 3)  # --steps
        group.start()
        assert group.wait(WAIT) == [0]
        assert f"resumed from step {last}" in (tmp_path / "group0.2.0.log").read_text()
        rows = read_reports(report)
        assert [r["step"] for r in rows if r["step"] > last] == [last + 1, last + 2, last + 3]
    finally:
        group.stop()
        lighthouse.stop()


def test_a_checkpoint_of_another_model_is_fatal_with_the_documented_exit_code(tmp_path):
    from torchft_lite.cluster.exit_codes import EXIT_CODE_FATAL

    checkpoints = tmp_path / "checkpoints"
    lighthouse = LighthouseProcess(min_replicas=1, join_timeout=5.0, startup_grace=0.0,
                                   log_path=tmp_path / "lighthouse.log").start()
    common = ["--timeout", "15", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"]
    group = ReplicaGroup(0, 1, lighthouse.address, SCRIPT, ["--steps", "3", *common], log_dir=tmp_path)
    try:
        group.start()
        assert group.wait(WAIT) == [0]
        assert Layout(checkpoints).complete()
        other = ReplicaGroup(0, 1, lighthouse.address, SCRIPT, ["--steps", "3", "--hidden", "32", *common],
                             log_dir=tmp_path / "other")
        (tmp_path / "other").mkdir()
        group = other
        other.start()
        assert other.wait(WAIT) == [EXIT_CODE_FATAL]
        assert "CheckpointMismatchError" in (tmp_path / "other" / "group0.1.0.log").read_text()
    finally:
        group.stop()
        lighthouse.stop()
