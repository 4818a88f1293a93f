"""The lighthouse's HTTP side: dashboard, /api/status, /metrics and the authenticated kill."""

import asyncio

import pytest

from tests.conftest import WAIT, FakeManager, running_lighthouse
from tests.integration.helpers import http
from torchft_lite.rpc.lighthouse_client import LighthouseClient

pytestmark = pytest.mark.integration


def test_status_metrics_and_dashboard():
    async def scenario():
        async with running_lighthouse(min_replicas=2) as server:
            async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as c:
                await c.heartbeat("spare", timeout=WAIT)
                await asyncio.gather(
                    c.quorum("a", timeout=WAIT, step=5, address="http://a:1", store_address="a:2", world_size=2),
                    c.quorum("b", timeout=WAIT, step=3, address="http://b:1", store_address="b:2", world_size=1),
                    c.quorum("spare", timeout=WAIT, step=5),
                )
            status, body, _ = await http(server, "GET", "/api/status")
            assert status == 200
            quorum = body["quorum"]
            assert [m["replica_id"] for m in quorum["members"]] == ["a", "b", "spare"]
            b = quorum["members"][1]
            assert (b["step"], b["recovering"], b["address"], b["healthy"]) == (3, True, "http://b:1", True)
            assert quorum["members"][0]["recovering"] is False
            assert body["status"]["state"] in ("no_participants", "below_min_replicas")
            assert body["lighthouse"]["admin_enabled"] is False
            assert {r["replica_id"] for r in body["replicas"]} == {"a", "b", "spare"}

            status, text, headers = await http(server, "GET", "/metrics")
            assert status == 200 and headers["Content-Type"].startswith("text/plain")
            for name in ("lighthouse_quorum_id", "lighthouse_quorum_members 3.0", "lighthouse_participants",
                         "lighthouse_heartbeating_replicas 3.0", "lighthouse_quorums_issued_total 1.0",
                         "lighthouse_quorum_formation_seconds_count 1.0",
                         'lighthouse_invalid_requests_total{reason="malformed"} 0.0'):
                assert name in text, name

            status, page, headers = await http(server, "GET", "/")
            assert status == 200 and headers["Content-Type"].startswith("text/html")
            assert "/api/status" in page and "<script" in page and "http" not in page.split("<script")[0].lower() \
                .replace("http-equiv", "")
            assert (await http(server, "GET", "/healthz"))[1] == "ok"
            assert (await http(server, "GET", "/nope"))[0] == 404
            assert (await http(server, "DELETE", "/api/status"))[0] == 405

    asyncio.run(scenario())


def test_kill_is_disabled_without_an_admin_token():
    async def scenario():
        async with running_lighthouse() as server:
            status, body, _ = await http(server, "POST", "/api/replicas/a/kill",
                                         headers={"Authorization": "Bearer anything"})
            assert status == 403
            assert "disabled" in body["error"]

    asyncio.run(scenario())


def test_kill_requires_the_right_bearer_token_and_calls_the_manager():
    async def scenario():
        manager = await FakeManager().start()
        try:
            async with running_lighthouse(admin_token="s3cret") as server:
                async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as c:
                    await c.quorum("victim", timeout=WAIT, address=manager.address)
                path = "/api/replicas/victim/kill"
                status, body, headers = await http(server, "POST", path)
                assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
                status, body, _ = await http(server, "POST", path, headers={"Authorization": "Basic s3cret"})
                assert status == 401
                status, body, _ = await http(server, "POST", path, headers={"Authorization": "Bearer wrong"})
                assert status == 403 and "wrong admin token" in body["error"]
                assert manager.kills == []

                auth = {"Authorization": "Bearer s3cret"}
                status, body, _ = await http(server, "POST", "/api/replicas/nobody/kill", headers=auth)
                assert status == 404 and "unknown replica" in body["error"]
                status, body, _ = await http(server, "POST", path, headers=auth, data=b"{not json")
                assert status == 400
                status, body, _ = await http(server, "POST", path, headers=auth, json={"msg": "chaos test"})
                assert status == 200 and body["killed"] == "victim"
                assert manager.kills == ["chaos test"]
        finally:
            await manager.stop()

    asyncio.run(scenario())


def test_kill_of_an_unreachable_manager_is_a_502():
    async def scenario():
        manager = await FakeManager().start()
        address = manager.address
        await manager.stop()  # nothing listens there any more
        async with running_lighthouse(admin_token="t") as server:
            async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as c:
                await c.quorum("gone", timeout=WAIT, address=address)
            status, body, _ = await http(server, "POST", "/api/replicas/gone/kill",
                                         headers={"Authorization": "Bearer t"})
            assert status == 502 and "Kill RPC" in body["error"]

    asyncio.run(scenario())
