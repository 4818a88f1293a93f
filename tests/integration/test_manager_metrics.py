"""A trainer's /metrics server (torchft_lite.metrics.registry, _metrics_server) on port 0: opt-in by environment, the job
token or loopback-only as every other server of a job, HTTPS with the job's certificate, gone at shutdown; and
one real ``examples/train_ddp.py`` group scraped while it trains."""

from __future__ import annotations

import http.client
import logging
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from benchmarks._throwaway_pki import openssl_missing
from tests.conftest import WAIT, non_loopback_address, wait_until_sync
from tests.integration.helpers import bearer, fetch
from tests.unit.helpers import Replica, replicas  # noqa: F401  (the fixture)
from torchft_lite.metrics.registry import ManagerMetrics, metrics_from_env
from torchft_lite.rpc.access import Access
from torchft_lite.rpc.tls import TlsSettings
from torchft_lite.testing import InMemoryLighthouse

pytestmark = pytest.mark.integration

TOKEN = "metrics-test-token-4f9a"
COMMITTED = 'torchft_lite_steps_committed_total{group_rank="0",replica_id="solo"}'


def scrape_from(address: str, port: int) -> tuple[int, str]:
    """GET /metrics from (and to) ``address``, so the server sees that address as its peer."""
    connection = http.client.HTTPConnection(address, port, timeout=WAIT, source_address=(address, 0))
    try:
        connection.request("GET", "/metrics")
        answer = connection.getresponse()
        return answer.status, answer.read().decode()
    finally:
        connection.close()


def refuses_connections(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except urllib.error.HTTPError:
        return False
    except OSError:
        return True
    return False


@pytest.fixture
def solo(replicas, monkeypatch) -> Replica:
    """One group on the in-memory lighthouse, its environment clear of metrics, token and TLS settings."""
    for name in ("TORCHFT_LITE_METRICS_PORT", "TORCHFT_LITE_METRICS_HOST", "TORCHFT_LITE_TOKEN",
                 "TORCHFT_LITE_TOKEN_FILE", "TORCHFT_LITE_INSECURE", "TORCHFT_LITE_TLS_CERT", "TORCHFT_LITE_TLS_KEY",
                 "TORCHFT_LITE_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    return replicas(InMemoryLighthouse(), "solo", 1.0)


def test_the_variable_makes_the_manager_serve_its_metrics_until_it_shuts_down(replicas, monkeypatch, caplog):
    monkeypatch.setenv("TORCHFT_LITE_METRICS_PORT", "0")
    for name in ("TORCHFT_LITE_TOKEN", "TORCHFT_LITE_TOKEN_FILE", "TORCHFT_LITE_INSECURE", "TORCHFT_LITE_TLS_CERT",
                 "TORCHFT_LITE_TLS_KEY", "TORCHFT_LITE_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.INFO, logger="torchft_lite.metrics.registry"):
        group = replicas(InMemoryLighthouse(), "solo", 1.0)
    server = group.manager.metrics.server
    assert server.port > 0 and any(server.url in r.getMessage() for r in caplog.records)  # the port is logged
    assert group.step()[0] and group.step()[0]
    status, body, headers = fetch(server.url, text=True)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert f"{COMMITTED} 2.0" in body.splitlines()
    assert 'torchft_lite_step_phase_seconds_count{group_rank="0",phase="compute",replica_id="solo"} 2.0' in body
    assert fetch(server.url.replace("/metrics", "/other"), text=True)[0] == 404
    group.manager.shutdown()
    wait_until_sync(lambda: refuses_connections(server.url), "the metrics port to close after shutdown")
    assert not server.serving


def test_with_a_job_token_a_scrape_must_carry_it_and_the_token_is_never_logged(solo, caplog):
    with caplog.at_level(logging.DEBUG):
        metrics = metrics_from_env(solo.manager, {"TORCHFT_LITE_METRICS_PORT": "0", "TORCHFT_LITE_TOKEN": TOKEN})
        url = metrics.server.url
        assert solo.step()[0]
        status, body, headers = fetch(url, text=True)
        assert status == 401 and headers.get("WWW-Authenticate") == "Bearer" and "TORCHFT_LITE_TOKEN" in body
        status, body, _ = fetch(url, headers=bearer("not-the-token"), text=True)
        assert status == 401 and "wrong job token" in body
        status, body, _ = fetch(url, headers=bearer(TOKEN), text=True)
        assert status == 200 and f"{COMMITTED} 1.0" in body.splitlines()
        status, _, _ = fetch(url + f"?token={TOKEN}", text=True)  # only the header counts
        assert status == 401
    assert metrics.server.refusals == {"unauthenticated": 3}
    assert caplog.records and not any(TOKEN in record.getMessage() for record in caplog.records)
    metrics.close()
    assert refuses_connections(url)


def test_with_no_token_only_loopback_peers_are_served_unless_insecure(solo):
    address = non_loopback_address()
    metrics = metrics_from_env(solo.manager, {"TORCHFT_LITE_METRICS_PORT": "0", "TORCHFT_LITE_METRICS_HOST": "0.0.0.0"})
    try:
        port = metrics.server.port
        assert scrape_from("127.0.0.1", port)[0] == 200
        status, body = scrape_from(address, port)
        assert status == 403 and "loopback" in body and "TORCHFT_LITE_TOKEN" in body
    finally:
        metrics.close()
    insecure = ManagerMetrics(solo.manager, replica_id="insecure")
    try:
        insecure.serve("0.0.0.0", 0, access=Access(insecure=True))
        assert scrape_from(address, insecure.server.port)[0] == 200
    finally:
        insecure.close()


@pytest.mark.skipif(openssl_missing() is not None, reason=str(openssl_missing()))
def test_with_the_jobs_certificate_it_serves_https_only(solo, pki):
    metrics = ManagerMetrics(solo.manager)
    try:
        metrics.serve("127.0.0.1", 0, access=Access(TOKEN),
                      tls=TlsSettings(pki.cert, pki.key).server_context())
        assert metrics.server.url.startswith("https://127.0.0.1:")
        client = TlsSettings(ca=pki.ca).client_context()
        status, body, _ = fetch(metrics.server.url, headers=bearer(TOKEN), context=client, text=True)
        assert status == 200 and 'torchft_lite_steps_committed_total{group_rank="0",replica_id="solo"}' in body
        with pytest.raises((OSError, http.client.HTTPException)):  # plain text gets no answer
            fetch(metrics.server.url.replace("https://", "http://"), text=True)
    finally:
        metrics.close()


@pytest.mark.slow
def test_a_real_trainer_serves_its_steps_while_it_trains(tmp_path: Path):
    from tests.integration.helpers import cluster, metrics_urls, wait_for
    from torchft_lite.cluster.local import job_access

    with cluster(tmp_path, min_replicas=1) as (_, add, _report):
        group = add(0, 1, steps=200, sleep=0.1, env={"TORCHFT_LITE_METRICS_PORT": "0"})
        found: list[str] = []

        def logged_url() -> bool:
            found[:] = metrics_urls(tmp_path)
            return bool(found)

        wait_for(logged_url, "the trainer to log its metrics address", groups=[group])
        url, headers = found[0], job_access().headers()
        assert fetch(url, text=True)[0] == 401  # the cluster runs with a job token

        def committed_steps() -> float:
            status, body, _ = fetch(url, headers=headers, text=True)
            assert status == 200, body
            match = re.search(r'^torchft_lite_steps_committed_total\{group_rank="0",replica_id="train_ddp_0"\} '
                              r'(\S+)$', body, re.M)
            return float(match.group(1)) if match else 0.0

        wait_for(lambda: committed_steps() >= 3, "three committed steps in the trainer's metrics", groups=[group])
        _, body, _ = fetch(url, headers=headers, text=True)
        assert 'torchft_lite_watchdog_timeout_seconds{group_rank="0",replica_id="train_ddp_0",section="step"}' in body
        assert 'torchft_lite_step_phase_seconds_bucket{group_rank="0",le="600.0",phase="allreduce"' in body
