"""A tiny run of benchmarks/checkpoint_bench.py: it runs, prints its table, and ends with one valid JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("ours", "dcp", "torch_save")


def test_a_tiny_checkpoint_bench_measures_every_method_and_restart(tmp_path):
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.checkpoint_bench", "--hidden", "512",
                          "--layers", "3", "--batch", "8", "--every", "1,2", "--steps", "4", "--warmup", "1",
                          "--dir", str(tmp_path), "--timeout", "120"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["every"] == [1, 2] and result["methods"] == list(METHODS)
    assert set(result["results"]) == {"none", *METHODS}
    for method, by_every in result["results"].items():
        assert set(by_every) == {"1", "2"}, method
        for every, row in by_every.items():
            assert row["mean_ms"] > 0 and row["p50_ms"] > 0 and row["wall_s"] > 0, (method, every)
            assert isinstance(row["over_mean_pct"], float) and isinstance(row["over_p50_pct"], float)
            assert row["uncommitted"] == 0 and row["failed"] == 0
            if method != "none":
                assert row["saves"] >= 1 and row["bytes"] > 3 * 512 * 512 * 4, (method, every)  # params + 2 moments
                assert row["write_s"] > 0 and row["blocked_s"] >= 0
    for method in METHODS:
        restart = result["resume"][method]
        assert restart["committed"] is True and restart["resumed_step"] > 0
        assert restart["to_first_step_s"] > restart["after_import_torch_s"] > restart["load_s"] > 0
    goal = result["goal"]
    assert goal["passed"] is None and "every 10" in goal["why"]  # no every-10 block in this run
    assert any(line.startswith("ours ") for line in lines[:-1])
    assert not list(tmp_path.iterdir()), "the benchmark left files behind"


def test_help_explains_every_flag():
    run = subprocess.run([sys.executable, "-W", "ignore", "benchmarks/checkpoint_bench.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0
    for flag in ("--hidden", "--layers", "--batch", "--every", "--steps", "--warmup", "--repeats", "--methods",
                 "--dir", "--no-resume", "--timeout", "--check"):
        assert flag in run.stdout
