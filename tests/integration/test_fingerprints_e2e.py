"""Replica fingerprints end to end (torchft_lite.health.fingerprint): real lighthouse, gloo, ``examples/train_ddp.py``.

A bit flipped in one group's parameters (``--inject-bitflip-at``) is found at the next fingerprint step; with
three groups the flipped one heals from the other two and every group ends identical; with two nobody can
tell which is right, so nothing commits after the detection and both exit with EXIT_CODE_DIVERGED (70).
"""

from __future__ import annotations

import pytest

from tests.integration.helpers import JOB_WAIT as WAIT, cluster, read_logs, read_reports, steps_of
from torchft_lite.cluster.exit_codes import EXIT_CODE_DIVERGED

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EVERY_4 = {"TORCHFT_LITE_FINGERPRINT_EVERY": "4"}


def checksums_at(rows: list[dict], step: int) -> dict[int, str]:
    return {r["group"]: r["checksum"] for r in rows if r["step"] == step and r["rank"] == 0}


def test_a_bit_flipped_in_one_of_three_groups_is_found_and_healed_from_the_majority(tmp_path):
    with cluster(tmp_path, min_replicas=3, join_timeout=10.0) as (_, add, report):
        groups = [add(g, 3, steps=12, min_replicas=2, env=EVERY_4,
                      extra=("--inject-group", "2", "--inject-bitflip-at", "6")) for g in range(3)]
        for group in groups:
            assert group.wait(WAIT) == [0], f"group {group.group_id} failed; logs in {tmp_path}"
    rows = read_reports(report)
    corrupt = read_logs(tmp_path, f"group{2}.*.log")
    assert corrupt.count("injected a bit flip at step 6") == 1
    # Found at the next fingerprint (step 8), by every group, naming the group and the tensor.
    for g in range(3):
        found = [line for line in read_logs(tmp_path, f"group{g}.*.log").splitlines()
                 if "silent data corruption" in line]
        assert found and all("step 8" in line for line in found), (g, found)
        assert any("first tensor that differs" in line and "model." in line for line in found), found
    assert "healed:" in corrupt.split("silent data corruption", 1)[1]
    # The flip shows in group 2's parameters from step 7 to 8, and nowhere after the heal.
    assert len(set(checksums_at(rows, 7).values())) == 2
    for step in range(9, 13):
        sums = checksums_at(rows, step)
        assert set(sums) == {0, 1, 2} and len(set(sums.values())) == 1, (step, sums)
    for g in range(3):
        assert steps_of(rows, g)[-1] == 12


def test_two_groups_that_differ_stop_with_the_diverged_code_and_commit_nothing_after(tmp_path):
    with cluster(tmp_path, min_replicas=2, join_timeout=10.0) as (_, add, report):
        groups = [add(g, 2, steps=12, min_replicas=2, env=EVERY_4,
                      extra=("--inject-group", "1", "--inject-bitflip-at", "2")) for g in range(2)]
        for group in groups:
            assert group.wait(WAIT) == [EXIT_CODE_DIVERGED], f"group {group.group_id}; logs in {tmp_path}"
    rows = read_reports(report)
    for g in range(2):
        assert max(steps_of(rows, g)) == 4, steps_of(rows, g)  # the fingerprint of step 4 stopped both
        log = read_logs(tmp_path, f"group{g}.*.log")
        assert "disagree with no majority" in log and "exit code 70" in log


def test_a_bit_flipped_on_group_rank_1_is_found_named_and_healed(tmp_path):
    """Ranks of a group fingerprint their own state; the group's fingerprint covers all of them."""
    with cluster(tmp_path, min_replicas=3, join_timeout=10.0) as (_, add, report):
        groups = [add(g, 3, steps=8, world_size=2, min_replicas=2, env=EVERY_4,
                      extra=("--inject-group", "0", "--inject-rank", "1", "--inject-bitflip-at", "3"))
                  for g in range(3)]
        for group in groups:
            assert group.wait(WAIT) == [0, 0], f"group {group.group_id} failed; logs in {tmp_path}"
    rows = read_reports(report)
    found = [line for line in read_logs(tmp_path, f"group{1}.*.log").splitlines() if "silent data corruption" in line]
    assert found and all("step 4" in line and "group rank(s) 1 differ" in line for line in found), found
    for step in range(5, 9):
        for rank in (0, 1):
            sums = {r["group"]: r["checksum"] for r in rows if r["step"] == step and r["rank"] == rank}
            assert set(sums) == {0, 1, 2} and len(set(sums.values())) == 1, (step, rank, sums)
