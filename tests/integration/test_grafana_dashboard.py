"""examples/grafana: every metric the dashboard queries exists in the live /metrics of a running lighthouse and a
running trainer (one ``examples/train_ddp.py`` group), so a renamed metric can't leave a panel silently empty."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lighthouse.thread import BackgroundLighthouse
from tests.conftest import lighthouse_config, wait_until_sync
from tests.integration.helpers import TRAIN_DDP, fetch, metrics_urls
from torchft_lite.cluster.local import ReplicaGroup, job_access

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "examples" / "grafana"
START = 240.0  # seconds: a torch process starts on two busy cores
METRIC = re.compile(r"\b((?:lighthouse|torchft_lite)_[a-z0-9_]+)\b")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def queries(node) -> list[str]:
    """Every PromQL expression in the dashboard: the panels' targets and the variables' queries."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            else:
                found.extend(queries(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(queries(item))
    return found


def exposed_names(text: str) -> set[str]:
    """The series names a Prometheus scrape of ``text`` yields, families without samples yet included
    (a labelled histogram no heal has observed is still declared)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            base = name.removesuffix("_total")
            names.update(base + suffix for suffix in SUFFIXES.get(kind, ()))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def scrape(url: str) -> str:
    """The metrics ``url`` serves to a caller with the job's token."""
    return fetch(url, headers=job_access().headers(), text=True, expect=200)[1]


def test_the_dashboard_is_well_formed():
    dashboard = json.loads((GRAFANA / "torchft_lite_dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15 and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        assert panel["description"], panel["title"]
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in ("steps per second", "stalls", "heal bandwidth", "straggler", "nan", "fingerprint", "checkpoint"):
        assert topic in titles, topic


def test_the_scrape_config_names_both_sides_with_the_job_token():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed; the scrape config is checked as YAML with it")
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"torchft_lite_lighthouse", "torchft_lite_trainers"}
    for job in jobs.values():
        assert job["authorization"]["credentials_file"] and job["static_configs"][0]["targets"]


def test_every_metric_the_dashboard_queries_is_served_by_a_live_lighthouse_and_trainer(tmp_path):
    wanted = {name for expr in queries(json.loads((GRAFANA / "torchft_lite_dashboard.json").read_text()))
              for name in METRIC.findall(expr)}
    assert any(n.startswith("lighthouse_") for n in wanted) and any(n.startswith("torchft_lite_") for n in wanted)
    config = lighthouse_config(min_replicas=1, access=job_access())
    with BackgroundLighthouse(config) as lighthouse:
        trainer = ReplicaGroup(0, 1, lighthouse.address(), TRAIN_DDP, ["--steps", "1000000", "--step-sleep", "0.05"],
                               log_dir=tmp_path, env={"TORCHFT_LITE_METRICS_PORT": "0"})
        try:
            trainer.start()
            urls: list[str] = []

            def logged_url() -> bool:
                assert trainer.alive(), f"the trainer exited; its log is in {tmp_path}"
                urls[:] = metrics_urls(tmp_path)
                return bool(urls)

            wait_until_sync(logged_url, "the trainer to log its metrics address", timeout=START)
            wait_until_sync(lambda: "torchft_lite_steps_committed_total{" in scrape(urls[0])
                            and (lighthouse.snapshot()["job"]["step"] or 0) >= 3, "three committed steps",
                            timeout=START)
            served = exposed_names(scrape(f"http://127.0.0.1:{lighthouse.http_port}/metrics"))
            served |= exposed_names(scrape(urls[0]))
        finally:
            trainer.stop()
    missing = sorted(wanted - served)
    assert not missing, f"the dashboard queries metrics nobody serves: {missing}"
