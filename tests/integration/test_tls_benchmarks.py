"""Tiny runs of the benchmarks' ``--tls`` option: each TLS case runs beside its plain twin and is reported as a ratio."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._throwaway_pki import openssl_missing

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(openssl_missing() is not None, reason=str(openssl_missing()))]

ROOT = Path(__file__).resolve().parents[2]


def test_heal_bench_tls_runs_each_of_our_cases_twice():
    cases = "ours-0-inplace,ours-4,pg-gloo"
    for receiver in ("lean", "aiohttp"):  # the aiohttp comparison client heals over TLS as well
        run = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.heal_bench", "--size-mb", "8",
                              "--steps", "1", "--cases", cases, "--tls", "--receiver", receiver, "--timeout", "120"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-4000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert set(result["gbps"]) == {"tcp", "ours-0-inplace", "ours-0-inplace+tls", "ours-4", "ours-4+tls",
                                       "pg-gloo"}
        assert set(result["tls_vs_plain"]) == {"ours-0-inplace+tls", "ours-4+tls"}
        assert all(ratio > 0 for ratio in result["tls_vs_plain"].values())
        assert result["ours_case"] == "ours-0-inplace"  # the targets are judged on plain text only
        assert "TLS on vs off" in run.stdout


def test_lighthouse_bench_tls_runs_each_of_our_lighthouses_twice():
    run = subprocess.run([sys.executable, "benchmarks/lighthouse_bench.py", "--sizes", "5", "--rounds", "2",
                          "--impls", "ours,ours-grpcio", "--tls", "--round-timeout", "60"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert [r["impl"] for r in result["results"]] == ["ours", "ours+tls", "ours-grpcio", "ours-grpcio+tls"]
    assert all(r["rounds_per_s"] > 0 for r in result["results"])
    assert result["tls_vs_plain_rounds_per_s_ours_n5"] > 0
    assert result["tls_vs_plain_rounds_per_s_ours_grpcio_n5"] > 0
