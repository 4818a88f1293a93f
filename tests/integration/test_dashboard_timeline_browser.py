"""The dashboard's timeline and status line in a real headless Chromium, while a real job runs: two replica
groups of ``examples/train_ddp.py``, one SIGKILLed and restarted. The timeline must show the death, the stall and
the heal, and the status line go from training to stalled (or healing) and back to training.

``make dashboard-screenshot`` runs this test with ``TORCHFT_LITE_DASHBOARD_SCREENSHOT`` set, to make the
README's picture; without it the screenshots go to the test's temporary directory.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from lighthouse.thread import BackgroundLighthouse
from tests.conftest import lighthouse_config, wait_until_sync
from tests.integration.helpers import TRAIN_DDP
from torchft_lite.cluster.local import ReplicaGroup, job_access

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.slow]

SCREENSHOT_ENV = "TORCHFT_LITE_DASHBOARD_SCREENSHOT"
START = 240_000  # ms: two torch processes start on two busy cores
CHANGE = 120_000  # ms: a state change or a marker after what caused it
# Steps trained before the kill and after the heal: a few in the suite, more for the README's picture.
STEPS_AROUND = 150 if os.environ.get(SCREENSHOT_ENV) else 10

# Every change of the status line's state, as the page saw it (the page polls once a second).
RECORD_STATES = """() => {
  window.__states = [];
  const job = document.getElementById('job');
  const note = () => { const s = job.dataset.state; if (s && window.__states.at(-1) !== s) window.__states.push(s); };
  new MutationObserver(note).observe(job, {attributes: true, attributeFilter: ['data-state']});
  note();
}"""


def group(group_id: int, address: str, tmp_path: Path) -> ReplicaGroup:
    # min_replicas 2 on both sides: the survivor cannot go on alone, so the kill is a stall the page must show.
    return ReplicaGroup(group_id, 2, address, TRAIN_DDP, ["--steps", "1000000", "--step-sleep", "0.05",
                                                          "--timeout", "15", "--min-replicas", "2"], log_dir=tmp_path)


def wait_state(page, state: str, timeout: int = CHANGE) -> None:
    page.wait_for_function(f"document.getElementById('job').dataset.state === '{state}'", timeout=timeout)


def wait_marker(page, selector: str, timeout: int = CHANGE) -> None:
    page.wait_for_selector(f"#timeline {selector}", state="attached", timeout=timeout)


def train_on(lighthouse: BackgroundLighthouse, steps: int) -> None:
    """Wait until the job committed ``steps`` more steps (as the lighthouse's quorums say)."""
    start = lighthouse.snapshot()["job"]["step"] or 0
    wait_until_sync(lambda: (lighthouse.snapshot()["job"]["step"] or 0) >= start + steps,
                    f"{steps} more steps of the job", timeout=START / 1000)


def hover_detail(page, selector: str) -> str:
    page.locator(f"#timeline {selector}").first.dispatch_event("mouseenter")
    return page.locator("#timeline-detail").inner_text()


def test_a_killed_and_restarted_group_shows_on_the_timeline_and_in_the_status_line(browser, tmp_path):  # noqa: F811
    access = job_access()  # the job token the groups get from their environment
    config = lighthouse_config(min_replicas=2, join_timeout=5.0, heartbeat_timeout=2.0, access=access)
    shots = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "timeline.png")
    groups: list[ReplicaGroup] = []
    with BackgroundLighthouse(config) as lighthouse:
        try:
            groups = [group(g, lighthouse.address(), tmp_path).start() for g in (0, 1)]
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"http://127.0.0.1:{lighthouse.http_port}/?token={access.token}")  # logs in, then /
            page.evaluate(RECORD_STATES)
            page.wait_for_function("document.getElementById('job-headline').textContent"
                                   ".startsWith('training: 2 groups at step')", timeout=START)
            assert page.locator("#job").get_attribute("class") == ""  # no colour while all is well
            page.wait_for_function("parseFloat((/([0-9.]+) steps\\/s$/.exec(document.getElementById('job-headline')"
                                   ".textContent) || [0, '0'])[1]) > 0", timeout=CHANGE)
            page.wait_for_selector("#timeline path.rate", state="attached", timeout=CHANGE)
            train_on(lighthouse, STEPS_AROUND)

            at_kill = len(page.evaluate("window.__states"))
            groups[1].kill(signal.SIGKILL)
            wait_marker(page, ".marker-gone")
            assert "train_ddp_1 gone: lease ended" in hover_detail(page, ".marker-gone")
            wait_state(page, "stalled")
            headline = page.locator("#job-headline").inner_text()
            assert headline.startswith("stalled ") and "train_ddp_1 gone" in headline, headline
            assert page.locator("#job").get_attribute("class") == "bad"
            assert "min_replicas=2" in page.locator("#reason").inner_text()  # the rules' reason, as they say it
            wait_marker(page, ".marker-stall.live")
            page.locator("#overview").screenshot(path=str(tmp_path / "stalled.png"))

            groups[1].start()
            wait_state(page, "training", timeout=START)
            wait_marker(page, ".marker-heal:not(.live)")
            wait_marker(page, ".marker-stall:not(.live)")
            wait_marker(page, ".marker-back")
            heal = hover_detail(page, ".marker-heal:not(.live)")
            assert "train_ddp_1 healed" in heal and "from train_ddp_0" in heal, heal
            assert "without a quorum" in hover_detail(page, ".marker-stall:not(.live)")
            assert "train_ddp_1 back in quorum" in page.locator("#events").inner_text()
            states = page.evaluate("window.__states")
            after = states[at_kill:]  # healing lasts about one step here: the page, polling each second, may miss it
            assert states[at_kill - 1] == "training" and after[0] == "stalled" and after[-1] == "training", states
            assert set(after) <= {"stalled", "healing", "training"}, states
            assert page.locator("#job").get_attribute("class") == ""
            train_on(lighthouse, STEPS_AROUND)
            page.wait_for_function("document.getElementById('job-headline').textContent.endsWith('steps/s')",
                                   timeout=CHANGE)
            page.locator("#overview").screenshot(path=str(shots))
            assert errors == []
        finally:
            for g in groups:
                g.stop()
