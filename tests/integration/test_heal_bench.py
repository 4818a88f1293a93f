"""A tiny run of benchmarks/heal_bench.py: it runs, prints its table, and ends with one valid JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_heal_bench_prints_a_table_and_json():
    cases = "tcp,ours-0,ours-4-inplace,pg-ours,pg-gloo"
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.heal_bench", "--size-mb", "16",
                          "--tensor-mb", "2", "--steps", "2", "--cases", cases, "--timeout", "120"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert set(result["gbps"]) == set(cases.split(","))
    assert all(value > 0 for value in result["gbps"].values())
    assert set(result["targets_met"]) == {"http_vs_loopback_ge_0.75", "http_vs_torchft_ge_1.5",
                                          "receiver_peak_extra_le_1.1x"}
    assert result["peak_extra_x"]["ours-4-inplace"]["receiver"] < 1.0  # received in place: no second copy
    # every case is paired with the raw TCP step run right after each of its steps
    assert result["vs_tcp"]["tcp"] == 1.0 and all(value > 0 for value in result["vs_tcp"].values())
    assert result["ours_case"] == "ours-4-inplace" and result["ours_vs_loopback"] == result["vs_tcp"]["ours-4-inplace"]
    assert all(cpu["receiver"] > 0 for cpu in result["cpu_s_per_gib"].values())
    # the first transfer (into a receiver that never received) is judged on its own too
    assert set(result["first_vs_tcp"]) == set(cases.split(",")) and result["first_vs_tcp"]["tcp"] == 1.0
    assert result["first_transfer"]["ours_vs_loopback"] == result["first_vs_tcp"]["ours-4-inplace"]
    assert set(result["targets_met_first_transfer"]) == set(result["targets_met"])
    assert any(line.startswith("ours-0") for line in lines[:-1])


def test_the_ceiling_runs_even_when_not_asked_for():
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.heal_bench", "--size-mb", "8",
                          "--steps", "1", "--cases", "ours-0-inplace", "--timeout", "120"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(result["gbps"]) == {"tcp", "ours-0-inplace"}


def test_our_cases_can_heal_through_aiohttps_client():
    """The comparison the lean heal client is kept on: the same heal, received through aiohttp's client."""
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.heal_bench", "--size-mb", "8",
                          "--steps", "1", "--cases", "ours-0-inplace,ours-4", "--receiver", "aiohttp",
                          "--timeout", "120"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["receiver"] == "aiohttp"
    assert set(result["gbps"]) == {"tcp", "ours-0-inplace", "ours-4"}
    assert all(value > 0 for value in result["vs_tcp"].values())


def test_help_explains_the_flags():
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.heal_bench", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0
    for flag in ("--size-mb", "--tensor-mb", "--steps", "--cases", "--timeout", "--receiver"):
        assert flag in run.stdout
