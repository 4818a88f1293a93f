"""heal_bench's view of our defaults: ours-default (HTTPTransport(timeout), fresh tensors) against torchft's best case,
for the first transfer into a fresh process and for the transfers after it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# What heal_bench itself checks before it runs torchft's cases: torchft's transport imports (it needs otel).
TORCHFT = subprocess.run([sys.executable, "-c", "import torchft.checkpointing.http_transport"], capture_output=True,
                         timeout=120).returncode == 0


def test_ours_default_is_compared_with_torchfts_best_case_in_every_view():
    cases = "ours-default,ours-0-inplace" + (",torchft-0,torchft-2" if TORCHFT else "")
    run = subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.heal_bench", "--size-mb", "8",
                          "--tensor-mb", "2", "--steps", "3", "--cases", cases, "--timeout", "120"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    # the first transfer and the ones after it are reported apart, for every case
    for case in ["tcp"] + cases.split(","):
        assert result["first_vs_tcp"][case] > 0 and result["repeated_vs_tcp"][case] > 0
    default = result["default"]
    assert default["case"] == "ours-default"
    assert set(default) == {"case", "all_steps", "first_transfer", "repeated"}
    assert default["first_transfer"]["vs_tcp"] == result["first_vs_tcp"]["ours-default"]
    assert default["repeated"]["vs_tcp"] == result["repeated_vs_tcp"]["ours-default"]
    assert set(result["targets_met_default"]) == {"first_vs_torchft_ge_1.5", "repeated_vs_torchft_ge_1.0",
                                                  "vs_loopback_ge_0.5", "all_steps_vs_torchft_ge_1.0",
                                                  "vs_multi_stream_ge_0.6"}
    # no tcp-N case ran: the multi-stream ceiling is the one stream
    assert all(default[view]["multi_stream_case"] == "tcp" for view in ("all_steps", "first_transfer", "repeated"))
    if TORCHFT:
        for view in ("all_steps", "first_transfer", "repeated"):
            theirs = {case: result[key][case] for case in ("torchft-0", "torchft-2")
                      for key in [{"all_steps": "vs_tcp", "first_transfer": "first_vs_tcp",
                                   "repeated": "repeated_vs_tcp"}[view]]}
            assert default[view]["torchft_case"] == max(theirs, key=theirs.get)  # torchft's best in that view
            assert default[view]["vs_torchft"] == pytest.approx(default[view]["vs_tcp"] / max(theirs.values()),
                                                                abs=0.002)
    else:
        assert all(default[view]["vs_torchft"] is None for view in ("all_steps", "first_transfer", "repeated"))
    assert any(line.startswith("ours-default (HTTPTransport(timeout), fresh tensors)") for line in lines)
