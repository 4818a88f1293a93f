"""A group whose lease lapsed never commits: hung or cut off right after its gradients were exchanged.

The window these tests aim at (no luck needed): the group's collectives for
the step are complete, and before it votes it is stopped (SIGSTOP) or cut off
from everyone for longer than the lighthouse's heartbeat timeout. The
lighthouse declares it gone and the survivor goes on without it. When the
group wakes up, its ranks would all vote yes: only the lease fence
(``torchft_lite.group_server.lease_fence``) stops it from committing a step that its peers
may have redone without it (a fork). Behind, it heals at the next quorum, and
every step the groups share holds identical parameters.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import pytest

from tests.integration.helpers import (
    TRAIN_DDP as SCRIPT, assert_identical_per_step, cluster, read_logs, read_reports, steps_of, wait_for,
)
from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HEARTBEAT_TIMEOUT = 2.0
HOLD_AT = 8  # the step attempt the group is stopped in, once its gradients were exchanged


def held_step(log_dir: Path, group: int, marker: str) -> int:
    """The step a rank of ``group`` logged ``marker ... of step N`` for."""
    for path in sorted(log_dir.glob(f"group{group}.*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if marker in line:
                return int(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no '{marker}' line in group {group}'s logs under {log_dir}")


def wait_for_first_step(report: Path, group: int, groups: list[ReplicaGroup]) -> None:
    """Wait until ``group`` committed a step, so that a group started after it joins the job it runs.

    Started together, the group meant to be held could run alone long enough to
    reach its hold while the other is still importing torch on a loaded machine;
    the other would then start the job over in a new epoch, and the two
    lineages' step 1 would differ, by design.
    """
    wait_for(lambda: bool(steps_of(read_reports(report), group)), f"group {group} to commit its first step",
             groups=groups)


def expired(lighthouse_log: Path) -> bool:
    return "heartbeat expired" in lighthouse_log.read_text(errors="replace")


def assert_fenced(rows: list[dict], log_dir: Path, group: int, step: int, ranks: int) -> None:
    """``group`` committed nothing at the step it was held in, said why, and trained on after healing."""
    for rank in range(ranks):
        assert step + 1 not in steps_of(rows, group, rank), (
            f"group {group} rank {rank} committed step {step} although its lease lapsed during it")
    logs = read_logs(log_dir, f"group{group}.*.log")
    assert f"step {step} not committed: the lease" in logs
    assert assert_identical_per_step(rows) > 0


@pytest.mark.parametrize("pg, ranks", [("gloo", 2), ("baby-gloo", 1)])
def test_a_group_stopped_after_its_exchange_does_not_commit_that_step_and_heals(tmp_path, pg, ranks):
    with cluster(tmp_path, min_replicas=1, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=HEARTBEAT_TIMEOUT) as (
            lighthouse, add, report):
        survivor = add(0, 2, steps=100000, sleep=0.05, world_size=ranks, pg=pg)
        wait_for_first_step(report, 0, [survivor])
        hung = add(1, 2, steps=100000, sleep=0.05, world_size=ranks, pg=pg,
                   extra=("--inject-group", "1", "--inject-stop-at", str(HOLD_AT)))
        try:
            wait_for(hung.stopped,
                     "every rank of group 1 to stop itself after its exchange", groups=[survivor, hung])
            step = held_step(tmp_path, 1, "stopping itself (SIGSTOP) after the exchange of step")
            wait_for(lambda: expired(lighthouse.log_path), "the lighthouse to declare group 1 gone",
                     groups=[survivor])
            wait_for(lambda: max(steps_of(read_reports(report), 0), default=0) >= step + 5,
                     "the survivor to go on without the stopped group", groups=[survivor])
        finally:
            hung.kill(signal.SIGCONT)
        resumed_at = max(steps_of(read_reports(report), 0))
        wait_for(lambda: max(steps_of(read_reports(report), 1), default=0) > resumed_at,
                 "the stopped group to heal and commit again", groups=[survivor, hung])
        assert_fenced(read_reports(report), tmp_path, 1, step, ranks)


def _no_namespaces() -> str | None:
    from benchmarks._chaos_faults import Network
    return Network.unavailable()


@contextlib.contextmanager
def namespaced_cluster(tmp_path: Path):
    """A lighthouse on the host and two one-rank groups, each in a network namespace of its own (the chaos
    harness's), so that one group can be cut off from everyone."""
    from benchmarks._chaos_faults import Network

    network = Network(2)
    network.setup()
    lighthouse = LighthouseProcess(min_replicas=1, heartbeat_timeout=HEARTBEAT_TIMEOUT, join_timeout=HEARTBEAT_TIMEOUT,
                                   startup_grace=0.0, host="0.0.0.0", log_path=tmp_path / "lighthouse.log")
    groups: list[ReplicaGroup] = []
    try:
        lighthouse.start()
        port = lighthouse.address.rsplit(":", 1)[1]
        release = tmp_path / "release"
        for g in range(2):
            extra = ["--inject-group", "1", "--inject-hold-at", str(HOLD_AT), "--inject-hold-file", str(release)]
            group = ReplicaGroup(
                g, 2, f"http://{network.host_ip(g)}:{port}", SCRIPT,
                ["--steps", "100000", "--report", str(tmp_path / "report.jsonl"), "--step-sleep", "0.05",
                 "--timeout", "15", *(extra if g == 1 else [])],
                log_dir=tmp_path, env=network.env(g), store_host=network.host_ip(g),
                advertise=network.group_ip(g), prefix=network.prefix(g))
            groups.append(group.start())
            if g == 0:
                wait_for_first_step(tmp_path / "report.jsonl", 0, groups)
        yield network, groups, release
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()
        network.teardown()


@pytest.mark.skipif(_no_namespaces() is not None, reason=f"partitions need network namespaces: {_no_namespaces()}")
def test_a_group_cut_off_after_its_exchange_does_not_commit_that_step_and_heals(tmp_path):
    with namespaced_cluster(tmp_path) as (network, (survivor, cut), release):
        report, lighthouse_log = tmp_path / "report.jsonl", tmp_path / "lighthouse.log"
        marker = Path(f"{release}.rank0")
        wait_for(marker.exists, "group 1 to hold after its exchange", groups=[survivor, cut])
        step = int(marker.read_text())
        network.cut(1, connected=False)
        try:
            wait_for(lambda: expired(lighthouse_log), "the lighthouse to declare group 1 gone", groups=[survivor])
            wait_for(lambda: max(steps_of(read_reports(report), 0), default=0) >= step + 5,
                     "the survivor to go on without the cut-off group", groups=[survivor])
        finally:
            network.cut(1, connected=True)
            release.write_text("go\n")
        resumed_at = max(steps_of(read_reports(report), 0))
        wait_for(lambda: max(steps_of(read_reports(report), 1), default=0) > resumed_at,
                 "the cut-off group to heal and commit again", groups=[survivor, cut])
        rows = read_reports(report)
        for rank in range(1):
            assert step + 1 not in steps_of(rows, 1, rank), "group 1 committed the step it was cut off in"
        logs = read_logs(tmp_path, "group1.*.log")
        assert f"step {step} not committed" in logs
        assert assert_identical_per_step(rows) > 0
