"""benchmarks/diloco_bench.py on a tiny configuration: its JSON has every case's figures, and DiLoCo sends less.

Two groups of examples/train_diloco.py per case, a real lighthouse per case
(the benchmark stops every process it starts, also when a case fails).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import diloco_bench

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_tiny_run_reports_every_case_and_diloco_sends_fewer_bytes_than_ddp(tmp_path, capsys):
    out = tmp_path / "result.json"
    diloco_bench.main(["--steps", "20", "--sync-every", "5,10", "--hidden", "16", "--link-mb-per-s", "50",
                       "--link-latency-ms", "1", "--timeout", "240", "--json", str(out)])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result  # the JSON line is printed last
    assert result["bench"] == "diloco" and result["steps"] == 20 and result["link_mb_per_s"] == 50
    rows = {r["case"]: r for r in result["rows"]}
    assert list(rows) == ["ddp", "ddp-fast-link", "diloco-5", "diloco-10", "diloco-10-q"]
    for name, row in rows.items():
        assert "error" not in row, f"{name}: {row.get('error')}"
        assert row["groups_agree"], f"{name}: the two groups ended with different held-out losses"
        assert row["inner_steps"] == 20 and row["wall_s"] > 0 and row["eval_loss"] > 0
        assert {"bytes_per_rank", "bytes_vs_ddp", "speedup_vs_ddp", "loss_vs_ddp", "syncs"} <= set(row)
    assert [rows[c]["syncs"] for c in ("ddp", "diloco-5", "diloco-10")] == [20, 4, 2]
    assert rows["ddp"]["link_limited"] and not rows["ddp-fast-link"]["link_limited"]
    assert rows["ddp-fast-link"]["bytes_per_rank"] == rows["ddp"]["bytes_per_rank"] > 0
    # DDP sends the gradients every step; DiLoCo sends as much once per sync.
    assert 0 < rows["diloco-10"]["bytes_per_rank"] < rows["diloco-5"]["bytes_per_rank"] < rows["ddp"]["bytes_per_rank"]
    assert rows["diloco-10"]["bytes_vs_ddp"] < 0.2
    quantized = rows["diloco-10-q"]
    assert quantized.get("note") or quantized["bytes_per_rank"] < 0.5 * rows["diloco-10"]["bytes_per_rank"]


def test_steps_must_be_a_multiple_of_every_sync_interval():
    with pytest.raises(SystemExit):
        diloco_bench.parse_args(["--steps", "30", "--sync-every", "20"])
