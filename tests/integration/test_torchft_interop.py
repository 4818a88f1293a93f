"""Wire compatibility with torchft's own (Rust) implementation.

torchft's ManagerServer/ManagerClient drive our lighthouse, and our client
drives torchft's lighthouse. Uses torchft's native extension directly
(benchmarks/torchft_ref.py), so it needs neither torch nor OpenTelemetry and
takes well under a second. Skipped when torchft-nightly is not installed, except under
.ci/run, where that fails the run (tests.conftest.needs_torchft).
"""

import asyncio
import threading
from datetime import timedelta

import pytest

from benchmarks import torchft_ref
from lighthouse.thread import BackgroundLighthouse
from tests.conftest import lighthouse_config, needs_torchft
from torchft_lite.rpc.lighthouse_client import LighthouseClient

pytestmark = pytest.mark.integration

native = torchft_ref.load()
requires_torchft = needs_torchft(native is not None, "torchft-nightly not installed (make installs it)")


@requires_torchft
def test_torchft_managers_form_quorums_on_our_lighthouse():
    with BackgroundLighthouse(lighthouse_config(min_replicas=2, join_timeout=5.0)) as lighthouse:
        address = f"http://127.0.0.1:{lighthouse.grpc_port}"
        managers = {
            rid: native.ManagerServer(
                replica_id=rid, lighthouse_addr=address, hostname="127.0.0.1", bind="127.0.0.1:0",
                store_addr=f"127.0.0.1:{port}", world_size=1, heartbeat_interval=timedelta(milliseconds=100),
                connect_timeout=timedelta(seconds=30), quorum_retries=0,
            )
            for rid, port in (("ft-a", 1111), ("ft-b", 2222))
        }
        results, errors = {}, []

        def step(rid: str, step_number: int) -> None:
            try:
                client = native.ManagerClient(managers[rid].address(), connect_timeout=timedelta(seconds=30))
                for _ in range(2):  # a second round exercises the fast-quorum path
                    result = client._quorum(
                        group_rank=0, step=step_number, checkpoint_metadata=f"meta-{rid}", shrink_only=False,
                        init_sync=True, commit_failures=0, timeout=timedelta(seconds=60),
                        reconfigure_handle=f"handle-{rid}",
                    )
                results[rid] = result
            except Exception as exc:  # reported below with the replica id
                errors.append((rid, exc))

        threads = [threading.Thread(target=step, args=(rid, s)) for rid, s in (("ft-a", 5), ("ft-b", 3))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for manager in managers.values():
            manager.shutdown()
        assert not errors, errors
        a, b = results["ft-a"], results["ft-b"]
        assert a.quorum_id == b.quorum_id > 0
        assert (a.replica_world_size, a.max_step) == (2, 5)
        # b is behind and heals from a, the torchft way.
        assert b.heal and b.recover_src_replica_rank == 0 and not a.heal
        assert a.recover_dst_replica_ranks == [1]
        assert a.store_address == "127.0.0.1:1111"
        status = lighthouse.snapshot()
        assert [m["replica_id"] for m in status["quorum"]["members"]] == ["ft-a", "ft-b"]


@requires_torchft
def test_our_client_on_torchfts_lighthouse():
    server = native.LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000)
    try:
        port = server.address().rsplit(":", 1)[1]

        async def scenario():
            async with LighthouseClient(f"127.0.0.1:{port}") as client:
                await client.heartbeat("x", timeout=30)
                quorums = await asyncio.gather(
                    client.quorum("x", timeout=60, step=2, address="http://x:1", world_size=3),
                    client.quorum("y", timeout=60, step=4, data='{"k": 1}'),
                )
            return quorums

        quorums = asyncio.run(scenario())
    finally:
        server.shutdown()
    assert quorums[0].quorum_id == quorums[1].quorum_id
    members = {m.replica_id: m for m in quorums[0].participants}
    assert (members["x"].step, members["x"].world_size, members["y"].data) == (2, 3, '{"k": 1}')


@requires_torchft
@pytest.mark.slow
def test_our_managers_train_on_torchfts_lighthouse(tmp_path):
    """Two replica groups of examples/train_ddp.py with our Manager, quorums from torchft's lighthouse.

    Fingerprints every 2 steps and each step's compute time ride in ``QuorumMember.data``, which torchft's
    lighthouse passes through untouched: the groups vote on identical fingerprints and nobody heals."""
    import json
    import time
    from pathlib import Path

    from torchft_lite.cluster.local import ReplicaGroup

    server = native.LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10000)
    script = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
    report = tmp_path / "report.jsonl"
    groups = []
    try:
        address = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
        for g in range(2):
            groups.append(ReplicaGroup(g, 2, address, script, ["--steps", "8", "--report", str(report)],
                                       log_dir=tmp_path, env={"TORCHFT_LITE_FINGERPRINT_EVERY": "2"}).start())
        deadline = time.monotonic() + 240
        for group in groups:
            assert group.wait(max(1.0, deadline - time.monotonic())) == [0], f"see logs in {tmp_path}"
        rows = [json.loads(line) for line in report.read_text().splitlines()]
        by_step: dict[int, set[str]] = {}
        for row in rows:
            by_step.setdefault(row["step"], set()).add(row["checksum"])
        assert sorted(by_step) == list(range(1, 9))
        assert all(len(sums) == 1 for sums in by_step.values()), by_step
        assert len(rows) == 16  # both groups committed every step
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("group*.log"))
        assert logs.count("fingerprint of step") >= 2 * 3 and "silent data corruption" not in logs
    finally:
        for group in groups:
            group.stop()
        server.shutdown()
