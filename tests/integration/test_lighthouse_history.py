"""A real lighthouse on a fake clock keeps the job's history: /api/history, the status line in /api/status, and
the timeline's metrics, as a group goes, comes back under a new id and heals."""

import asyncio

import pytest

from lighthouse.server import LighthouseServer
from tests.conftest import WAIT, FrozenClock, lighthouse_config, wait_until
from tests.integration.helpers import http
from torchft_lite.rpc.lighthouse_client import LighthouseClient

pytestmark = pytest.mark.integration

WALL = 1_800_000_000.0  # the wall clock runs this far ahead of the monotonic one


def test_a_group_gone_back_and_healed_is_in_the_history_the_status_line_and_the_metrics():
    clock = FrozenClock(1000.0)

    async def scenario():
        server = LighthouseServer(lighthouse_config(min_replicas=1, heartbeat_timeout=5.0), clock=clock,
                                  wall_clock=lambda: clock.now + WALL)
        await server.start()
        try:
            async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as c:
                for rid in ("a:1", "b:1"):  # both known as healthy first: neither forms a quorum alone
                    await c.heartbeat(rid, timeout=WAIT)
                await asyncio.gather(*(c.quorum(rid, timeout=WAIT, step=5) for rid in ("a:1", "b:1")))
                clock.now += 6.0  # b's heartbeat is too old at the next decision
                await c.heartbeat("a:1", timeout=WAIT)
                await c.quorum("a:1", timeout=WAIT, step=6)
                clock.now += 1.0  # b restarted: a new process of group b, at step 0
                await c.heartbeat("b:2", timeout=WAIT)
                late = asyncio.create_task(c.quorum("b:2", timeout=WAIT, step=0))
                await wait_until(lambda: server.statistics().participants == 1, "b:2 waiting in its Quorum call")
                await asyncio.gather(c.quorum("a:1", timeout=WAIT, step=7), late)
                status, body, _ = await http(server, "GET", "/api/status")
                assert body["job"]["state"] == "healing"
                assert body["job"]["headline"].startswith("healing b from a (7 steps behind")
                clock.now += 1.0
                await asyncio.gather(*(c.quorum(rid, timeout=WAIT, step=8) for rid in ("a:1", "b:2")))

            status, history, _ = await http(server, "GET", "/api/history")
            assert status == 200
            markers = history["markers"]
            assert [m["kind"] for m in markers] == ["gone", "back", "heal"]
            gone, back, heal = markers
            assert (gone["replica_id"], gone["t"]) == ("b:1", 1006.0 + WALL)
            assert gone["text"] == "b gone: no heartbeat for 5.0s (in quorum %d, at step 5)" % (
                server.statistics().quorum_id - 2)
            assert back["replica_id"] == "b:2" and back["text"].startswith("b back in quorum")
            assert (heal["t"], heal["duration_s"], heal["steps"]) == (1007.0 + WALL, 1.0, 7)
            samples = history["samples"]
            assert samples["t"] and all(WALL < t <= clock.now + WALL for t in samples["t"])
            assert samples["step"][-1] in (7, 8)  # the last sample came before or after the last quorum
            assert history["capacity"] == 6 * 3600 and history["interval_s"] == 1.0

            newer = (await http(server, "GET", f"/api/history?samples_after={history['samples_after']}"
                                               f"&markers_after={history['markers_after']}"))[1]
            assert newer["markers"] == [] and newer["markers_after"] == history["markers_after"]
            # it ended 0 s ago
            assert (await http(server, "GET", "/api/history?seconds=0.5"))[1]["markers"] == [heal]

            status, body, _ = await http(server, "GET", "/api/status")
            assert body["job"]["state"] == "training" and body["job"]["trouble"] is False
            assert body["job"]["headline"].startswith("training: 2 groups at step 8")
            assert body["job"]["detail"] == body["status"]["reason"]

            _, metrics, _ = await http(server, "GET", "/metrics")
            for line in ("lighthouse_heals_total 1.0", "lighthouse_heal_seconds_total 1.0",
                         "lighthouse_groups_gone_total 1.0", "lighthouse_groups_back_total 1.0",
                         'lighthouse_job_state{state="training"} 1.0', 'lighthouse_job_state{state="stalled"} 0.0',
                         "lighthouse_stalls_total 0.0", "lighthouse_steps_per_second "):
                assert line in metrics, line

            for query in ("samples_after=x", "markers_after=-2", "seconds=nan", "seconds=0", "seconds=-1",
                          "seconds=inf"):
                status, body, _ = await http(server, "GET", f"/api/history?{query}")
                assert status == 400 and "samples_after" in body["error"], query
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_a_restarted_lighthouse_marks_its_restart_and_a_first_start_marks_nothing(tmp_path):
    async def markers(state_dir) -> list[dict]:
        server = LighthouseServer(lighthouse_config(state_dir=state_dir))
        await server.start()
        try:
            return (await http(server, "GET", "/api/history"))[1]["markers"]
        finally:
            await server.stop()

    assert asyncio.run(markers(None)) == []
    (tmp_path / "last_quorum_id").write_text("17\n")
    (restart,) = asyncio.run(markers(tmp_path))
    assert restart["kind"] == "restart" and restart["text"].startswith("lighthouse restarted (")
    assert "17" in restart["text"]
