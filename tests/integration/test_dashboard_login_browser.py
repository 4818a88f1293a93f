"""The dashboard of a lighthouse with a job token, in a real headless Chromium: the one-time login and its absence."""

from __future__ import annotations

import pytest

from lighthouse.thread import BackgroundLighthouse
from tests.conftest import lighthouse_config
from tests.integration.helpers import form_quorum
from torchft_lite.rpc.access import Access

pytestmark = [pytest.mark.integration, pytest.mark.browser]

TOKEN = "browser-job-s3cret"


def test_logging_in_with_the_token_shows_the_live_dashboard_and_drops_the_token_from_the_url(browser, monkeypatch):
    monkeypatch.setenv("TORCHFT_LITE_TOKEN", TOKEN)  # what form_quorum's LighthouseClient sends
    with BackgroundLighthouse(lighthouse_config(min_replicas=1, access=Access(TOKEN))) as lighthouse:
        context = browser.new_context()  # a fresh profile
        try:
            page = context.new_page()
            errors = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            base = f"http://127.0.0.1:{lighthouse.http_port}/"
            page.goto(f"{base}?token={TOKEN}")
            assert page.url == base and TOKEN not in page.url  # the 303 took the token out of the address
            page.wait_for_function("document.getElementById('config').textContent.includes('min_replicas 1')",
                                   timeout=30_000)
            assert page.locator("#access").inner_text() == "job token"
            assert page.locator("#quorum-id").inner_text() == "none yet"
            assert page.evaluate("document.cookie") == ""  # HttpOnly: no script reads the login

            form_quorum(lighthouse, {"solo": (4, "http://solo:1")})  # the page follows the live status
            quorum_id = str(lighthouse.snapshot()["quorum"]["quorum_id"])
            page.wait_for_function(f"document.getElementById('quorum-id').textContent === '{quorum_id}'",
                                   timeout=30_000)
            assert page.locator("#members tbody tr td").first.inner_text() == "solo"
            assert page.locator("#error").inner_text() == ""
            assert TOKEN not in page.content()
            assert errors == []
        finally:
            context.close()


def test_a_browser_that_has_not_logged_in_gets_the_login_hint_not_the_dashboard(browser):
    with BackgroundLighthouse(lighthouse_config(min_replicas=1, access=Access(TOKEN))) as lighthouse:
        context = browser.new_context()
        try:
            page = context.new_page()
            response = page.goto(f"http://127.0.0.1:{lighthouse.http_port}/")
            assert response is not None and response.status == 401
            hint = page.locator("#login-hint").inner_text()
            assert "/?token=<job token>" in hint and "TORCHFT_LITE_TOKEN" in hint
            assert page.locator("#quorum-id").count() == 0 and page.locator("#config").count() == 0

            response = page.goto(f"http://127.0.0.1:{lighthouse.http_port}/?token=not-the-token")
            assert response is not None and response.status == 401
            assert "wrong job token" in page.locator("#refusal").inner_text()
            assert context.cookies() == []
        finally:
            context.close()
