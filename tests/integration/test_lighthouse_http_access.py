"""The lighthouse's HTTP side under the job's access policy: the token (a header, or the dashboard's login cookie),
protected mode without one, and the refusals that change nothing."""

import asyncio
import json
from http.cookies import SimpleCookie

import aiohttp
import pytest

from tests.conftest import WAIT, FakeManager, non_loopback_address, running_lighthouse, wait_until
from tests.integration.helpers import bearer, http
from torchft_lite.rpc.access import Access
from torchft_lite.rpc.lighthouse_client import LighthouseClient

pytestmark = pytest.mark.integration

TOKEN = "job-s3cret-token"
ADMIN = "admin-s3cret"
GETS = ["/", "/api/status", "/api/history", "/metrics", "/healthz", "/no-such-page"]


def test_with_a_token_every_route_refuses_without_it_and_serves_with_the_header_or_the_cookie(monkeypatch):
    monkeypatch.setenv("TORCHFT_LITE_TOKEN", TOKEN)  # what the LighthouseClient below sends

    async def scenario():
        async with running_lighthouse(access=Access(TOKEN)) as server:
            port = server.http_port
            async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as client:
                await client.quorum("a", timeout=WAIT, step=3)
            for path in GETS:
                for headers in ({}, bearer("wrong"), {"Authorization": f"Basic {TOKEN}"},
                                {"Cookie": f"torchft_lite_session_{port}=forged"}):
                    status, body, answer = await http(port, "GET", path, headers=headers)
                    assert status == 401, (path, headers, body)
                    assert answer["WWW-Authenticate"].startswith("Bearer") and TOKEN not in str(body)
                    assert "TORCHFT_LITE_TOKEN" in str(body) or "/?token=" in str(body)
            status, page, answer = await http(port, "GET", "/")
            assert answer["Content-Type"].startswith("text/html") and "/?token=&lt;job token&gt;" in page
            assert "/api/status" not in page  # not the dashboard
            status, body, _ = await http(port, "GET", "/api/status")
            assert "error" in body

            for path in GETS[:-1]:
                assert (await http(port, "GET", path, headers=bearer(TOKEN)))[0] == 200, path
            assert (await http(port, "GET", "/no-such-page", headers=bearer(TOKEN)))[0] == 404

            cookie = {"Cookie": f"torchft_lite_session_{port}={Access(TOKEN).session_cookie()}"}
            status, body, _ = await http(port, "GET", "/api/status", headers=cookie)
            assert status == 200 and body["lighthouse"]["access"] == "token"
            assert [r["replica_id"] for r in body["replicas"]] == ["a"]
            status, text, _ = await http(port, "GET", "/api/status", headers=bearer(TOKEN))
            assert TOKEN not in json.dumps(text) and Access(TOKEN).session_cookie() not in json.dumps(text)

            status, text, _ = await http(port, "GET", "/metrics", headers=bearer(TOKEN))
            counted = [line for line in text.splitlines()
                       if line.startswith('lighthouse_http_unauthorized_requests_total{kind="unauthenticated"}')]
            assert counted and float(counted[0].split()[-1]) >= len(GETS) * 4, counted

    asyncio.run(scenario())


def test_the_login_sets_an_httponly_strict_cookie_without_the_token_and_redirects():
    async def scenario():
        async with running_lighthouse(access=Access(TOKEN)) as server:
            port = server.http_port
            status, body, headers = await http(port, "GET", f"/?token={TOKEN}")
            assert status == 303 and headers["Location"] == "/"
            cookie = SimpleCookie(headers["Set-Cookie"])[f"torchft_lite_session_{port}"]
            assert cookie.value == Access(TOKEN).session_cookie() and TOKEN not in headers["Set-Cookie"]
            assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/"

            status, page, headers = await http(port, "GET", "/?token=wrong")
            assert status == 401 and "Set-Cookie" not in headers and "/?token=" in page and "wrong" in page

            # A browser's way: the cookie jar keeps the login; the dashboard and its data are served.
            async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
                async with browser.get(f"http://127.0.0.1:{port}/?token={TOKEN}") as response:
                    assert response.status == 200 and str(response.url).endswith(f":{port}/")
                    assert "/api/status" in await response.text()
                status, body, _ = await http(port, "GET", "/api/status", session=browser)
                assert status == 200 and body["lighthouse"]["access"] == "token"

    asyncio.run(scenario())


def test_admin_actions_need_the_admin_token_with_a_login_or_alone_and_a_refusal_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHFT_LITE_TOKEN", TOKEN)
    (tmp_path / "max_step").write_text("300\n")  # an earlier job reached step 300: a new one at 0 waits

    async def scenario():
        manager = await FakeManager().start()
        try:
            async with running_lighthouse(access=Access(TOKEN), admin_token=ADMIN, state_dir=tmp_path,
                                          holder_timeout=3600.0, heartbeat_timeout=60.0) as server:
                port = server.http_port
                async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as client:
                    fresh = asyncio.ensure_future(client.quorum("fresh", timeout=WAIT, step=0,
                                                                address=manager.address))
                    await wait_until(lambda: server.statistics().status == "behind_committed", "the guard to hold")
                    kill = "/api/replicas/fresh/kill"
                    for headers, expected in (({}, 401), (bearer("wrong"), 401), (bearer(TOKEN), 403)):
                        for path in ("/api/epoch", kill):  # the job token alone is no admin token
                            status, body, _ = await http(port, "POST", path, headers=headers)
                            assert status == expected, (path, headers, body)
                    assert manager.kills == [] and server.statistics().epochs == 0 and not fresh.done()
                    # An operator's script: the admin token alone admits an admin action (not a GET).
                    assert (await http(port, "GET", "/api/status", headers=bearer(ADMIN)))[0] == 401
                    status, body, _ = await http(port, "POST", kill, headers=bearer(ADMIN), json={"msg": "script"})
                    assert status == 200 and manager.kills == ["script"], body

                    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
                        assert (await http(port, "GET", f"/?token={TOKEN}", session=browser))[0] == 303
                        status, body, _ = await http(port, "POST", kill, session=browser)
                        assert status == 401 and "admin token" in body["error"]  # logged in, but no admin token
                        status, body, _ = await http(port, "POST", kill, session=browser, headers=bearer(ADMIN),
                                                     json={"msg": "from the test"})
                        assert status == 200 and manager.kills == ["script", "from the test"]
                        status, body, _ = await http(port, "POST", "/api/epoch", session=browser,
                                                     headers=bearer(ADMIN))
                        assert status == 202 and body["epoch"]["number"] == 1
                    await asyncio.wait_for(fresh, WAIT)
        finally:
            await manager.stop()

    asyncio.run(scenario())


def test_without_a_token_a_peer_that_is_not_loopback_is_refused_unless_insecure():
    address = non_loopback_address()

    async def scenario():
        for access in (Access(), Access(insecure=True)):
            async with running_lighthouse(access=access, http_bind="0.0.0.0:0") as server:
                port = server.http_port
                for path in GETS[:-1]:
                    status, body, _ = await http(port, "GET", path, host=address)
                    if access.insecure:
                        assert status == 200, (path, body)
                    else:
                        assert status == 403 and "TORCHFT_LITE_TOKEN" in str(body) and address in str(body), body
                    assert (await http(port, "GET", path))[0] == 200  # from loopback: served
                status, body, _ = await http(port, "GET", "/api/status")
                assert body["lighthouse"]["access"] == ("insecure" if access.insecure else "loopback-only")
                if not access.insecure:
                    status, text, _ = await http(port, "GET", "/metrics")
                    assert f'lighthouse_http_unauthorized_requests_total{{kind="forbidden"}} {len(GETS) - 1}.0' in text

    asyncio.run(scenario())
