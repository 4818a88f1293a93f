"""A short run of benchmarks/recovery_bench.py: it runs, prints the rejoin breakdown, and ends with one JSON line.

The breakdown reads the restarted trainer's timeline, partly from the libraries' own log lines; this run
fails when one of them stops being found (a phase would go missing), for torchft too when it is installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._rejoin_breakdown import LIBRARY_PHASES, PHASES

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def torchft_installed() -> bool:
    from benchmarks.recovery_bench import torchft_available

    return torchft_available()


def test_a_short_recovery_bench_breaks_the_rejoin_down_for_each_impl():
    impls = ["torchft_lite", "torchft_lite+standby"] + (["torchft"] if torchft_installed() else [])
    run = subprocess.run([sys.executable, "benchmarks/recovery_bench.py", "--groups", "2", "--trials", "1",
                          "--scenarios", "survive", "--impls", ",".join(impls)],
                         cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert set(summary["results"]) == set(impls)
    assert any(line.startswith("phase (median s)") for line in lines[:-1])
    assert any(line.startswith("library's part") for line in lines[:-1])
    for impl, result in summary["results"].items():
        [sample] = result["breakdowns"]
        phases = sample["phases"]
        # every event was seen: the library's log lines and the script's marks are still what the timeline reads
        # (no durable checkpoints in this bench: nothing is read from one)
        assert all(phases[name] is not None for name, _, _ in PHASES if name != "checkpoint read"), (impl, phases)
        assert phases["checkpoint read"] is None
        assert sum(v for v in phases.values() if v is not None) == pytest.approx(sample["total_s"], abs=1e-6)
        assert sample["library_s"] == pytest.approx(sum(phases[name] or 0.0 for name in LIBRARY_PHASES), abs=1e-6)
        assert sample["in_standby"] == impl.endswith("+standby")
        assert result["breakdown"]["samples"] == 1
    ours = summary["results"]["torchft_lite"]["breakdowns"][0]
    assert ours["first_step"]["healed_bytes"] > 900_000  # ~1 MB of state was healed in its first step
    targets = summary["rejoin_targets_met"]
    assert set(targets) >= {"ours_from_torch_le_0.5s", "ours_rejoin_below_torchft", "standby_from_torch_le_0.5s"}
    assert (targets["ours_rejoin_below_torchft"] is None) == ("torchft" not in impls)


def test_unknown_impls_are_refused():
    run = subprocess.run([sys.executable, "benchmarks/recovery_bench.py", "--impls", "torchft_lite,nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown ['nope']" in run.stderr
