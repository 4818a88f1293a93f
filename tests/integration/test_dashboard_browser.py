"""The dashboard in a real headless Chromium (Debian's package, installed by `make test`)."""

from __future__ import annotations

import concurrent.futures

import pytest

from lighthouse.thread import BackgroundLighthouse
from tests.conftest import FakeManager, lighthouse_config
from tests.integration.helpers import form_quorum

pytestmark = [pytest.mark.integration, pytest.mark.browser]


class ManagerThread:
    """A FakeManager served from its own event loop thread (the page calls it via the lighthouse)."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.manager = asyncio.run_coroutine_threadsafe(FakeManager().start(), self.loop).result(30)

    def stop(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.manager.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def test_dashboard_shows_quorum_and_kill_button_works(browser, tmp_path):
    managers = ManagerThread()
    try:
        with BackgroundLighthouse(lighthouse_config(min_replicas=2, admin_token="tok")) as lighthouse:
            form_quorum(lighthouse, {"alpha": (10, managers.manager.address), "<b>beta</b>": (7, "http://beta:1")})
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"http://127.0.0.1:{lighthouse.http_port}/")
            quorum_id = str(lighthouse.snapshot()["quorum"]["quorum_id"])
            page.wait_for_function(f"document.getElementById('quorum-id').textContent === '{quorum_id}'",
                                   timeout=30_000)
            rows = page.locator("#members tbody tr")
            assert rows.count() == 2
            # Replica ids are shown as text, never interpreted as HTML.
            assert rows.nth(0).locator("td").nth(0).inner_text() == "<b>beta</b>"
            assert page.locator("#members b").count() == 0
            assert "recovering" in rows.nth(0).inner_text()  # step 7 < max step 10
            assert "up to date" in rows.nth(1).inner_text()
            assert page.locator("#member-count").inner_text() == "2"
            assert page.locator("#reason").inner_text().strip() != "-"
            page.screenshot(path=str(tmp_path / "dashboard.png"))

            page.on("dialog", lambda dialog: dialog.accept())
            page.fill("#token", "wrong")
            rows.nth(1).locator("button.kill").click()
            page.wait_for_function("document.getElementById('flash').textContent.includes('403')", timeout=30_000)
            assert managers.manager.kills == []

            page.fill("#token", "tok")
            rows.nth(1).locator("button.kill").click()
            page.wait_for_function("document.getElementById('flash').textContent.includes('kill sent to alpha')",
                                   timeout=30_000)
            assert managers.manager.kills == ["killed from the lighthouse dashboard"]
            assert errors == []
    finally:
        managers.stop()


def test_kill_buttons_are_disabled_without_admin_token(browser):
    with BackgroundLighthouse(lighthouse_config(min_replicas=1)) as lighthouse:
        form_quorum(lighthouse, {"solo": (0, "http://solo:1")})
        page = browser.new_page()
        page.goto(f"http://127.0.0.1:{lighthouse.http_port}/")
        page.wait_for_selector("#members tbody tr button.kill", timeout=30_000)
        assert page.locator("button.kill").first.is_disabled()
        assert "admin actions disabled" in page.locator("#admin-note").inner_text()


def test_dashboard_says_when_the_lighthouse_is_unreachable(browser):
    lighthouse = BackgroundLighthouse(lighthouse_config()).start()
    page = browser.new_page()
    page.goto(f"http://127.0.0.1:{lighthouse.http_port}/")
    page.wait_for_function("document.getElementById('config').textContent.includes('min_replicas')",
                           timeout=30_000)
    lighthouse.stop()
    page.wait_for_function("document.getElementById('error').textContent.includes('unreachable')", timeout=30_000)


def test_a_blocked_job_gets_a_new_epoch_from_the_dashboard_button(browser, tmp_path):
    import threading

    # The lighthouse outlived a job that reached step 300; a new job at step 0 waits behind the guard.
    (tmp_path / "max_step").write_text("300\n")
    config = lighthouse_config(min_replicas=1, admin_token="tok", state_dir=tmp_path, holder_timeout=3600.0)
    with BackgroundLighthouse(config) as lighthouse:
        waiter = threading.Thread(target=form_quorum, args=(lighthouse, {"fresh": (0, "http://fresh:1")}))
        waiter.start()
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("dialog", lambda dialog: dialog.accept())
        page.goto(f"http://127.0.0.1:{lighthouse.http_port}/")
        page.wait_for_selector("#epoch-button", state="visible", timeout=30_000)
        assert "300" in page.locator("#reason").inner_text()  # the guard says what it waits for
        assert page.locator("#epoch").is_hidden()
        page.fill("#token", "tok")
        page.locator("#epoch-button").click()
        page.wait_for_function("document.getElementById('flash').textContent.includes('a new epoch started (number 1 since this lighthouse started)')",
                               timeout=30_000)
        page.wait_for_selector("#epoch", state="visible", timeout=30_000)
        assert "300" in page.locator("#epoch").inner_text()
        waiter.join(60)
        assert not waiter.is_alive()  # the blocked Quorum call got its quorum
        assert (tmp_path / "max_step").read_text().strip() == "0"
        page.screenshot(path=str(tmp_path / "epoch.png"))
        assert errors == []


def test_dashboard_shows_straggler_scores_and_an_eviction(browser, tmp_path):
    import asyncio
    import json

    from torchft_lite.rpc.lighthouse_client import LighthouseClient

    async def rounds(port: int) -> None:
        async with LighthouseClient(f"127.0.0.1:{port}") as client:
            for step in range(5):  # x is 5x slower: flagged, and evicted, after the 5th quorum
                for rid in "abx":  # all known as healthy first: with min_replicas=1 nobody forms a quorum alone
                    await client.heartbeat(rid, timeout=60)
                await asyncio.gather(*(
                    client.quorum(rid, timeout=60, step=step,
                                  data=json.dumps({"compute_ms": ms, "compute_step": step}))
                    for rid, ms in (("a", 100.0), ("b", 110.0), ("x", 500.0))))

    with BackgroundLighthouse(lighthouse_config(min_replicas=1, evict_stragglers=True)) as lighthouse:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(lambda: asyncio.run(rounds(lighthouse.grpc_port))).result(120)
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"http://127.0.0.1:{lighthouse.http_port}/")
        page.wait_for_function("document.querySelectorAll('#replicas tbody tr').length === 3", timeout=30_000)
        headers = page.locator("#replicas thead th").all_inner_texts()
        assert headers[-4:] == ["compute", "relative", "individual", "straggler"]
        rows = {row.locator("td").first.inner_text(): row.locator("td").all_inner_texts()
                for row in page.locator("#replicas tbody tr").all()}
        assert rows["x"][-4:] == ["500.0 ms", "4.55x", "-", "evicted: readmitted after 3 more quorums"]
        assert rows["a"][-4:] == ["100.0 ms", "0.91x", "-", "ok"]
        assert page.locator("#replicas td.straggler.bad").count() == 1
        assert "eviction on" in page.locator("#straggler-config").inner_text()
        assert "left out as stragglers: x" in page.locator("#reason").inner_text()
        page.screenshot(path=str(tmp_path / "stragglers.png"))
        assert errors == []
