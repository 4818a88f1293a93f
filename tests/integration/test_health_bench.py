"""A tiny run of benchmarks/health_bench.py: it runs, prints its table, and ends with one valid JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_health_bench_measures_the_guard_and_a_fingerprint_per_size():
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.health_bench", "--sizes-mb", "2,4.5",
                          "--bucket-mb", "1", "--repeats", "1", "--fingerprint-every", "10"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    assert lines[1].split()[:2] == ["state", "MB"]
    result = json.loads(lines[-1])
    assert result["benchmark"] == "health" and result["fingerprint_every"] == 10
    assert [row["state_mb"] for row in result["rows"]] == [2.0, 4.5]
    assert [row["guard_buckets"] for row in result["rows"]] == [2, 5]  # 1 MB buckets, the last one shorter
    for row in result["rows"]:
        assert row["guard_guard_s"] > 0 and row["guard_plain_s"] > 0 and row["fingerprint_ms"] > 0
        assert row["fingerprint_per_step_ms"] == pytest.approx(row["fingerprint_ms"] / 10)


def test_bad_arguments_are_refused_with_a_message():
    run = subprocess.run([sys.executable, "-m", "benchmarks.health_bench", "--sizes-mb", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "must be positive" in run.stderr
