"""Fixtures shared by the integration tests (their plain helpers are in helpers.py next to this file)."""

from __future__ import annotations

import concurrent.futures
import shutil
from datetime import timedelta

import pytest
import torch.distributed as dist

from lighthouse.thread import BackgroundLighthouse
from tests.conftest import WAIT, lighthouse_config
from tests.integration.helpers import ScriptedSource
from torchft_lite.checkpointing import HTTPTransport

LIGHTHOUSE = dict(min_replicas=1, join_timeout=1.0)
"""The ``lighthouse`` fixture's settings, unless a test or module marks others with
``@pytest.mark.lighthouse(**settings)``."""


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "lighthouse(**settings): the lighthouse fixture's lighthouse_config settings")


@pytest.fixture
def lighthouse(request):
    """A BackgroundLighthouse on port 0 for this test (its ``server.address()`` is what Managers dial), with
    LIGHTHOUSE's settings and those of the closest ``lighthouse`` mark; stopped after the test."""
    mark = request.node.get_closest_marker("lighthouse")
    with BackgroundLighthouse(lighthouse_config(**{**LIGHTHOUSE, **(mark.kwargs if mark else {})})) as lh:
        yield lh


@pytest.fixture
def store():
    """A master TCPStore on 127.0.0.1, port 0, that waits for no workers (60 s timeout)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


@pytest.fixture
def make_transport():
    """``make(**kwargs)``: an HTTPTransport on 127.0.0.1 (timeout WAIT unless given), shut down after the test."""
    transports = []

    def make(**kwargs) -> HTTPTransport:
        kwargs.setdefault("timeout", timedelta(seconds=WAIT))
        transport = HTTPTransport(hostname="127.0.0.1", bind_host="127.0.0.1", **kwargs)
        transports.append(transport)
        return transport

    try:
        yield make
    finally:
        for transport in transports:
            transport.shutdown()


@pytest.fixture
def threads():
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        yield pool


@pytest.fixture
def scripted(threads):
    """``scripted(answer)``: a ScriptedSource answering with ``answer(path, query)``, closed after the test."""
    sources: list[ScriptedSource] = []

    def start(answer) -> ScriptedSource:
        sources.append(ScriptedSource(threads, answer))
        return sources[-1]

    yield start
    for source in sources:
        source.close()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def browser():
    """A headless Chromium (Debian's package, installed by ``make test``) driven by playwright; skips, saying
    what is missing, where either is."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (make test installs Debian's package when run as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (dev extras)")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )
        try:
            yield browser
        finally:
            browser.close()
