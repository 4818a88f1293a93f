"""benchmarks/gpu_check.py's summary: the table's lines and what fails the check, from literal results."""

from __future__ import annotations

from benchmarks.gpu_check import failed, format_table, missing_packages, rows

MACHINE = {"python": "3.12.3", "torch": "2.11.0+cu130", "device": "cuda", "gpu": "NVIDIA H200"}


def results(**overrides) -> dict:
    base = {
        "machine": MACHINE, "missing": [],
        "tests": {"passed": 20, "failed": 0, "skipped": 3},
        "training": {
            "ours": {"divergent_steps": 0, "compared_steps": 700, "step_p50_s": 0.078, "rejoin_p50_s": 12.0,
                     "stall_p50_s": 0.4},
            "ours_fingerprints": {"divergent_steps": 0, "compared_steps": 690},
            "torchft": {"divergent_steps": 0, "compared_steps": 650, "step_p50_s": 0.080, "rejoin_p50_s": 13.1,
                        "stall_p50_s": 5.0},
        },
        "heal": {"size_mb": 1024, "h2d_gbps": 55.0,
                 "seconds": {"ours-default-inplace": [0.45, 0.3, 0.31], "ours-default": [0.9, 0.5, 0.5],
                             "torchft-0": [0.9, 0.6, 0.5], "torchft-4": [0.79, 0.46, 0.8]},
                 "send_s": {"ours-default-inplace": [0.001, 0.002], "torchft-4": [0.7, 0.71]}},
    }
    base.update(overrides)
    return base


def line(table, start: str) -> tuple:
    return next(row for row in table if row[0].startswith(start))


def test_every_goal_is_judged_against_torchft_in_the_same_run():
    table = rows(results())
    assert line(table, "tests/gpu")[1:] == ("20 passed, 0 failed, 3 skipped", "", "none fails", "yes")
    assert line(table, "3 groups")[1:3] == ("0 of 700", "0 of 650")
    assert line(table, "step time")[1:] == ("78.0 ms", "80.0 ms", "<= torchft's", "yes")
    assert line(table, "restarted group")[4] == "yes"
    first = line(table, "first heal")
    assert first[1:3] == ("0.45 s", "0.79 s") and first[4] == "yes"  # 0.79 / 0.45 = 1.76x, the goal 1.5x
    assert line(table, "repeated heals")[1:3] == ("0.30 s", "0.55 s")  # torchft's best median of its repeats
    assert line(table, "send_checkpoint")[1:] == ("2.0 ms", "710.0 ms", "<= 10 ms", "yes")
    assert not failed(results())


def test_a_divergent_step_a_failed_test_or_a_broken_phase_fails_the_check():
    diverged = results()
    diverged["training"]["ours"]["divergent_steps"] = 5
    assert failed(diverged)
    assert failed(results(tests={"passed": 1, "failed": 1, "skipped": 0}))
    assert failed(results(heal={"error": "heal_bench printed no result"}))
    out_of_time = results(training={"error": "skipped: 500 s of the 540 s budget were spent before it"})
    assert failed(out_of_time) and line(rows(out_of_time), "3 groups")[1].startswith("skipped")
    assert line(rows(diverged), "3 groups")[4] == "NO"
    slow = results()
    slow["heal"]["seconds"]["ours-default-inplace"] = [0.6, 0.3]  # 0.79 / 0.6 = 1.3x: missed, shown, not failed
    assert line(rows(slow), "first heal")[4] == "NO" and not failed(slow)


def test_without_torchft_its_column_says_so_and_nothing_is_judged_against_it():
    alone = results(missing=["torchft-nightly (the torchft comparisons: ModuleNotFoundError)"])
    alone["training"].pop("torchft")
    table = rows(alone)
    assert line(table, "step time")[2:] == ("-", "<= torchft's", "-")
    assert "missing: torchft-nightly" in format_table(alone)


def test_this_machine_has_what_ours_needs():
    # torchft and its imports are optional (make venv tolerates their absence); ours are not
    assert not [name for name in missing_packages() if name.startswith(("hpack", "protobuf"))]
