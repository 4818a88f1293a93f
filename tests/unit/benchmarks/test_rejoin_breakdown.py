"""The rejoin breakdown: a restarted process's timeline (examples/rejoin_timeline.py) split into phases
(benchmarks/_rejoin_breakdown.py), with literal times; and the timeline's own recording, without processes."""

from __future__ import annotations

import json
import logging

import pytest

from benchmarks._rejoin_breakdown import LIBRARY_PHASES, PHASES, breakdown, format_table, median_breakdown
from tests.unit.helpers import load_example

EVENTS = {"process_start": 100.01, "script_start": 100.05, "torch_imported": 101.55, "library_imported": 101.70,
          "manager_begin": 102.70, "manager_constructed": 102.80, "quorum_answered": 102.83, "configured": 102.84,
          "heal_applied": 102.86, "first_commit": 102.87}


def test_every_phase_ends_at_its_event_and_they_add_up_to_the_rejoin():
    result = breakdown({"events": EVENTS}, launched=100.0)
    phases = result["phases"]
    assert list(phases) == [name for name, _, _ in PHASES]
    assert phases["launch"] == pytest.approx(0.01)
    assert phases["import torch"] == pytest.approx(1.5)
    assert phases["model and data"] == pytest.approx(1.0)
    assert phases["Manager()"] == pytest.approx(0.1)
    assert phases["heal"] == pytest.approx(0.02)
    assert phases["checkpoint read"] is None  # no durable checkpoints: its time is in the next phase
    assert sum(v for v in phases.values() if v is not None) == pytest.approx(result["total_s"]) == pytest.approx(2.87)
    assert result["from_torch_s"] == pytest.approx(102.87 - 101.55)
    assert result["library_s"] == pytest.approx(sum(phases[name] or 0.0 for name in LIBRARY_PHASES))
    assert result["library_s"] == pytest.approx(0.15 + 0.1 + 0.03 + 0.01 + 0.02 + 0.01)


def test_a_phase_the_library_did_not_report_counts_in_the_next_one():
    events = {k: v for k, v in EVENTS.items() if k not in ("quorum_answered", "configured")}
    result = breakdown({"events": events}, launched=100.0)
    assert result["phases"]["first quorum"] is None and result["phases"]["configure"] is None
    assert result["phases"]["heal"] == pytest.approx(102.86 - 102.80)
    assert sum(v for v in result["phases"].values() if v is not None) == pytest.approx(result["total_s"])


def test_without_the_launch_time_the_rejoin_counts_from_the_process_start():
    result = breakdown({"events": EVENTS})
    assert result["phases"]["launch"] is None
    assert result["phases"]["interpreter"] == pytest.approx(0.04)
    assert result["total_s"] == pytest.approx(102.87 - 100.01)


def test_a_standby_started_before_the_restart_shows_no_launch_and_a_short_interpreter():
    # The standby process existed long before the launcher's go (at 200.0); its script starts 10 ms after.
    events = {**{k: v + 100.0 for k, v in EVENTS.items()}, "process_start": 150.0, "script_start": 200.01,
              "torch_imported": 200.011, "library_imported": 200.012, "manager_begin": 200.02}
    result = breakdown({"events": events}, launched=200.0)
    assert result["phases"]["launch"] == 0.0
    assert result["phases"]["interpreter"] == pytest.approx(0.01)
    assert result["total_s"] == pytest.approx(2.87)
    assert sum(v for v in result["phases"].values() if v is not None) == pytest.approx(result["total_s"])


def test_the_first_step_report_is_kept_and_medians_skip_missing_phases():
    report = {"quorum_s": 0.01, "compute_s": 0.002, "allreduce_s": 0.003, "commit_s": 0.02, "healed_seconds": 0.015,
              "healed_bytes": 900_000, "step": 7}
    one = breakdown({"events": EVENTS, "first_step": report}, launched=100.0)
    assert one["first_step"] == {k: v for k, v in report.items() if k != "step"}
    two = breakdown({"events": {k: v for k, v in EVENTS.items() if k != "configured"}}, launched=100.0)
    median = median_breakdown([one, two])
    assert median["samples"] == 2
    assert median["phases"]["configure"] == pytest.approx(0.01)  # only the sample that has it
    table = format_table({"torchft_lite": median, "torchft": median})
    assert "torchft_lite" in table.splitlines()[0]
    assert any(line.startswith("library's part") for line in table.splitlines())


def test_the_timeline_notes_marks_log_events_and_writes_one_line(tmp_path):
    timeline_module = load_example("rejoin_timeline.py", "rejoin_timeline")
    path = tmp_path / "timeline.jsonl"
    timeline = timeline_module.Timeline(str(path), "torchft_lite", script_start=123.0)
    package = logging.getLogger("torchft_lite")  # the script's --log-level INFO, for the library's loggers
    previous = package.level
    package.setLevel(logging.INFO)
    logger = logging.getLogger("torchft_lite.manager")
    try:
        timeline.mark("torch_imported", at=124.0)
        timeline.mark("torch_imported", at=999.0)  # the first time wins
        logger.info("[g0:abc/0 step=0 quorum=-1] quorum 3: reconfigured as replica 1 of 2 (1 up to date) in 0.01s")
        logger.info("[g0:abc/0 step=0 quorum=3] healing from replica 0 (http://x) to step 12")
        logger.info("[g0:abc/0 step=0 quorum=3] healed: 0.9 MB in 0.01s (90 MB/s) from replica(s) 0")
        logging.getLogger("torchft_lite.group_server.server").info("[g0:abc] quorum 3 at step 0: 2 member(s)")
        logging.getLogger("torchft_lite.manager").info("unrelated line")
        timeline.step_finished(type("Report", (), {"committed": False})())  # not committed: not kept
        timeline.first_commit(group=1, rank=0, step=13)
        timeline.first_commit(group=1, rank=0, step=14)  # once per process
    finally:
        package.setLevel(previous)
        timeline.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["group"] == 1 and line["step"] == 13 and line["library"] == "torchft_lite"
    events = line["events"]
    assert events["script_start"] == 123.0 and events["torch_imported"] == 124.0
    assert {"quorum_answered", "configured", "heal_started", "heal_applied", "first_commit"} <= set(events)
    assert events["configured"] <= events["heal_started"] <= events["heal_applied"]
    assert line["first_step"] is None


def test_the_timeline_knows_torchfts_log_lines():
    timeline_module = load_example("rejoin_timeline.py", "rejoin_timeline")
    events: dict[str, float] = {}
    handler = timeline_module._LogEvents("torchft", events)
    for message in ("[r/0 - step 0] reconfiguring for quorum_id=4", "[r/0 - step 0] resetting fr recording for "
                    "quorum id 4", "[r/0 - step 0] healing required, fetching checkpoint metadata from x",
                    "[r/0 - step 12] Loaded state dict."):
        handler.emit(logging.LogRecord("torchft.manager", logging.INFO, __file__, 1, message, None, None))
    assert set(events) == {"quorum_answered", "configured", "heal_started", "heal_applied"}


def test_a_timeline_without_a_path_records_nothing(tmp_path):
    timeline = load_example("rejoin_timeline.py", "rejoin_timeline").Timeline(None, "torchft_lite", script_start=1.0)
    timeline.mark("torch_imported")
    timeline.first_commit(group=0, rank=0, step=1)
    assert timeline.events == {}
    assert list(tmp_path.iterdir()) == []


def test_the_process_start_is_before_now():
    import time

    start = load_example("rejoin_timeline.py", "rejoin_timeline").process_start_time()
    if start is None:
        pytest.skip("no /proc on this platform: the process start is not known")
    assert start <= time.time()
