"""A short chaos run (the long one is `python benchmarks/chaos.py --seed 1 --faults 200`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHAOS = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def test_twenty_faults_of_every_kind_lose_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, str(CHAOS), "--seed", "3", "--faults", "20", "--ranks", "2", "--baseline", "5",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )
    assert out.stdout.strip(), out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert sum(summary["faults"].values()) >= 20
    assert summary["divergent_steps"] == 0 and summary["duplicated_steps"] == 0
    assert summary["missing_steps"] == 0 and summary["batch_accounting_errors"] == 0
    assert summary["hangs"] == [] and summary["committed_steps"] > 0
    assert out.returncode == 0 and summary["ok"], out.stdout[-3000:]
