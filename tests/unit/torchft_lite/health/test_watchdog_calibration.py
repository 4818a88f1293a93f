"""Watchdog timeouts calibrated from observed durations: warm-up, multiple and floor, explicit settings,
growth, the saved state (and garbage in it), and a heal not counted against its step. A fake clock
drives every duration; the watchdog's thread is only relied on where a test waits for it to fire."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from tests.conftest import FrozenClock
from torchft_lite.health.watchdog import Watchdog, WatchdogConfig

LOGGER = "torchft_lite.health.watchdog"


@pytest.fixture
def dogs():
    made: list[Watchdog] = []
    yield made
    for dog in made:
        dog.close()


def make(dogs, clock: FrozenClock, fired: list | None = None, **config) -> Watchdog:
    config = {"calibrate": True, "explicit": (), "warmup": 5, "multiple": 4.0, "floor": 1.0, **config}
    dog = Watchdog(WatchdogConfig(**config), "[g0/0]", on_expire=lambda *a: (fired if fired is not None else []).append(a),
                   clock=clock)
    dogs.append(dog)
    return dog


def occur(dog: Watchdog, clock: FrozenClock, section: str, seconds: float, times: int = 1) -> None:
    for _ in range(times):
        dog.begin(section, f"a {section}")
        clock.advance(seconds)
        dog.end(section)


def calibration_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "calibrated" in r.getMessage()]


def test_the_configured_timeout_holds_through_the_warm_up_then_multiple_x_the_maximum(dogs, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = FrozenClock()
    dog = make(dogs, clock, step=600.0)
    occur(dog, clock, "step", 2.0, times=4)
    assert dog.timeout("step") == 600.0
    assert calibration_lines(caplog) == []
    occur(dog, clock, "step", 1.0)  # the 5th: warm; the maximum is still 2 s
    assert dog.timeout("step") == 8.0
    stats = dog.statistics().sections["step"]
    assert (stats.count, stats.max_seconds, stats.calibrated) == (5, 2.0, True)
    [line] = calibration_lines(caplog)
    assert "[g0/0]" in line and "step timeout calibrated" in line and "600.0s -> 8.0s" in line
    assert "longest of 5 observed took 2.00s" in line


def test_the_floor_keeps_tiny_sections_from_a_hair_trigger(dogs, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = FrozenClock()
    dog = make(dogs, clock, quorum=180.0, floor=120.0)
    occur(dog, clock, "quorum", 0.01, times=5)
    assert dog.timeout("quorum") == 120.0
    [line] = calibration_lines(caplog)
    assert "180.0s -> 120.0s" in line and "below the floor" in line


def test_each_section_calibrates_on_its_own_observations(dogs):
    clock = FrozenClock()
    dog = make(dogs, clock, quorum=100.0, heal=200.0, step=300.0, multiple=3.0)
    occur(dog, clock, "quorum", 0.5, times=5)
    occur(dog, clock, "step", 10.0, times=5)
    occur(dog, clock, "heal", 7.0, times=4)  # one short of the warm-up
    assert (dog.timeout("quorum"), dog.timeout("step"), dog.timeout("heal")) == (1.5, 30.0, 200.0)


def test_a_growing_maximum_keeps_growing_the_timeout_and_logs_changes_over_20_percent(dogs, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    clock = FrozenClock()
    dog = make(dogs, clock, step=600.0)
    occur(dog, clock, "step", 2.0, times=5)
    assert dog.timeout("step") == 8.0
    occur(dog, clock, "step", 5.0)  # a slower step: 20 s, +150%
    assert dog.timeout("step") == 20.0
    occur(dog, clock, "step", 5.5)  # 22 s: in force, but only +10% since the last line
    assert dog.timeout("step") == 22.0
    occur(dog, clock, "step", 1.0)  # shorter ones never lower it
    assert dog.timeout("step") == 22.0
    occur(dog, clock, "step", 6.5)  # 26 s: +30% since the 20 s logged
    lines = calibration_lines(caplog)
    assert len(lines) == 3, lines
    assert "recalibrated" in lines[1] and "8.0s -> 20.0s" in lines[1] and "took 5.00s" in lines[1]
    assert "20.0s -> 26.0s" in lines[2] and "longest of 9 observed" in lines[2]


def test_explicit_settings_win(dogs):
    clock = FrozenClock()
    # Given in the config (explicit by default): fixed. Not given: calibrated from nothing (unwatched till then).
    dog = make(dogs, clock, step=600.0, explicit=None)
    assert dog.timeout("quorum") is None
    occur(dog, clock, "step", 2.0, times=10)
    occur(dog, clock, "quorum", 2.0, times=10)
    assert dog.timeout("step") == 600.0
    assert dog.timeout("quorum") == 8.0
    assert dog.statistics().sections["step"].count == 10  # observed all the same (saved for a later run)


def test_from_env_set_sections_are_explicit_and_defaulted_ones_calibrate(dogs):
    defaults = WatchdogConfig(quorum=180.0, heal=240.0, step=660.0)
    config = WatchdogConfig.from_env({"TORCHFT_LITE_WATCHDOG_CALIBRATE": "1", "TORCHFT_LITE_WATCHDOG_STEP_SEC": "50",
                                      "TORCHFT_LITE_WATCHDOG_HEAL_SEC": "off",
                                      "TORCHFT_LITE_WATCHDOG_CALIBRATE_WARMUP": "3",
                                      "TORCHFT_LITE_WATCHDOG_CALIBRATE_MULTIPLE": "2.5",
                                      "TORCHFT_LITE_WATCHDOG_CALIBRATE_FLOOR_SEC": "1"}, defaults)
    assert config.calibrate and config.explicit == {"step", "heal"}
    assert (config.warmup, config.multiple, config.floor) == (3, 2.5, 1.0)
    clock = FrozenClock()
    dog = Watchdog(config, on_expire=lambda *a: None, clock=clock)
    dogs.append(dog)
    for section in ("quorum", "heal", "step"):
        occur(dog, clock, section, 4.0, times=3)
    assert (dog.timeout("quorum"), dog.timeout("heal"), dog.timeout("step")) == (10.0, None, 50.0)


def test_calibration_is_off_unless_asked_and_still_observes(dogs, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    config = WatchdogConfig.from_env({}, WatchdogConfig(quorum=180.0, heal=240.0, step=660.0))
    assert not config.calibrate and config.explicit == frozenset()
    clock = FrozenClock()
    dog = Watchdog(config, on_expire=lambda *a: None, clock=clock)
    dogs.append(dog)
    occur(dog, clock, "step", 1.0, times=50)
    assert dog.timeout("step") == 660.0
    assert calibration_lines(caplog) == []
    assert dog.calibration_state()["sections"]["step"] == {"count": 50, "max_seconds": 1.0}


def test_the_state_round_trips_and_a_restarted_watchdog_starts_calibrated_after_its_first_occurrence(dogs, caplog):
    clock = FrozenClock()
    first = make(dogs, clock, step=600.0, quorum=180.0)
    occur(first, clock, "step", 3.0, times=6)
    occur(first, clock, "quorum", 0.5, times=2)  # not warmed up
    state = json.loads(json.dumps(first.calibration_state()))  # plain data
    assert state == {"version": 1, "sections": {"quorum": {"count": 2, "max_seconds": 0.5},
                                                "step": {"count": 6, "max_seconds": 3.0}}}
    caplog.set_level(logging.INFO, LOGGER)
    restarted = make(dogs, clock, step=600.0, quorum=180.0)
    assert restarted.load_calibration_state(state)
    [line] = calibration_lines(caplog)
    assert "restored from a durable checkpoint" in line and "600.0s -> 12.0s" in line
    # Its first step may pay one-off costs (compilation, a process group built from nothing): not tighter
    # than configured. From the second on, the restored calibration holds.
    assert restarted.timeout("step") == 600.0
    occur(restarted, clock, "step", 1.0)
    assert restarted.timeout("step") == 12.0
    occur(restarted, clock, "quorum", 0.25, times=3)  # 2 restored + 3: warm
    assert restarted.timeout("quorum") == 2.0
    assert restarted.calibration_state()["sections"]["step"] == {"count": 7, "max_seconds": 3.0}


def test_the_first_occurrence_after_a_restore_keeps_a_grown_calibration_when_it_is_larger(dogs):
    clock = FrozenClock()
    dog = make(dogs, clock, step=60.0)
    assert dog.load_calibration_state({"version": 1, "sections": {"step": {"count": 40, "max_seconds": 100.0}}})
    assert dog.timeout("step") == 400.0


def test_an_unknown_section_from_a_newer_writer_is_skipped(dogs):
    clock = FrozenClock()
    dog = make(dogs, clock, step=600.0)
    assert dog.load_calibration_state({"version": 1, "sections": {
        "step": {"count": 9, "max_seconds": 2.0}, "optimizer": {"count": 9, "max_seconds": 1.0}}})
    assert set(dog.calibration_state()["sections"]) == {"step"}


GARBAGE = [
    (None, "expected a mapping"),
    ([1, 2], "expected a mapping"),
    ({"sections": {}}, "version None"),
    ({"version": 2, "sections": {}}, "version 2"),
    ({"version": 1, "sections": [["step", 3]]}, "not a mapping"),
    ({"version": 1, "sections": {"step": 12}}, "section 'step' is int"),
    ({"version": 1, "sections": {"step": {"count": -1, "max_seconds": 1.0}}}, "count -1"),
    ({"version": 1, "sections": {"step": {"count": True, "max_seconds": 1.0}}}, "count True"),
    ({"version": 1, "sections": {"step": {"count": 30, "max_seconds": "3"}}}, "max_seconds '3'"),
    ({"version": 1, "sections": {"step": {"count": 30, "max_seconds": float("nan")}}}, "max_seconds nan"),
    ({"version": 1, "sections": {"step": {"count": 30, "max_seconds": float("inf")}}}, "max_seconds inf"),
    ({"version": 1, "sections": {"step": {"count": 30, "max_seconds": -2.0}}}, "max_seconds -2.0"),
    ({"version": 1, "sections": {"step": {"count": 30, "max_seconds": 1e12}}}, "max_seconds 1000000000000.0"),
    ({"version": 1, "sections": {"quorum": {"count": 30, "max_seconds": 1.0}, 7: {}}}, "section name 7"),
]


@pytest.mark.parametrize("state,why", GARBAGE, ids=[why for _, why in GARBAGE])
def test_garbage_in_a_saved_calibration_is_refused_whole_with_a_clear_log(dogs, caplog, state, why):
    caplog.set_level(logging.INFO, LOGGER)
    clock = FrozenClock()
    dog = make(dogs, clock, quorum=180.0, step=600.0)
    occur(dog, clock, "step", 2.0)
    assert dog.load_calibration_state(state) is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ignoring the saved calibration" in warnings[0] and why in warnings[0], warnings
    assert "configured timeouts hold" in warnings[0]
    # Nothing of it was taken, not even the well-formed part before the bad one.
    assert dog.calibration_state()["sections"] == {"step": {"count": 1, "max_seconds": 2.0}}
    assert (dog.timeout("quorum"), dog.timeout("step")) == (180.0, 600.0)


def test_time_in_a_watched_heal_does_not_count_against_the_step(dogs):
    clock = FrozenClock()
    dog = make(dogs, clock, step=10.0, heal=500.0, explicit=("step", "heal"))
    dog.begin("step", "step 3")
    clock.advance(4.0)
    dog.begin("heal", "a big state dict")
    clock.advance(300.0)  # far past the step's 10 s: the heal's own timeout watches this
    during = dog.statistics().sections
    assert during["step"].left is None and during["heal"].left == 200.0
    assert during["step"].running_for == 4.0
    dog.end("heal")
    clock.advance(1.0)
    after = dog.statistics().sections["step"]
    assert after.running_for == 5.0 and after.left == 5.0
    dog.end("step")
    assert dog.statistics().sections["step"].max_seconds == 5.0  # observed without the heal


def test_a_step_that_ends_inside_its_heal_is_observed_without_it(dogs):
    """A failed receive: the Manager ends the step, then the heal section."""
    clock = FrozenClock()
    dog = make(dogs, clock, step=10.0, heal=500.0, explicit=("step", "heal"))
    dog.begin("step", "step 3")
    clock.advance(2.0)
    dog.begin("heal", "a heal that fails")
    clock.advance(50.0)
    dog.end("step")
    dog.end("heal")
    sections = dog.statistics().sections
    assert (sections["step"].max_seconds, sections["heal"].max_seconds) == (2.0, 50.0)


def test_an_unwatched_heal_counts_as_part_of_the_step(dogs):
    clock = FrozenClock()
    dog = make(dogs, clock, step=10.0, explicit=("step",), calibrate=False)
    dog.begin("step", "step 3")
    dog.begin("heal", "a heal nobody watches")
    clock.advance(3.0)
    dog.end("heal")
    assert dog.statistics().sections["step"].left == 7.0


def wait_fired(fired: list, done: threading.Event) -> tuple:
    assert done.wait(60), "the watchdog did not fire"
    return fired[0]


def test_a_calibrated_timeout_is_the_one_that_fires(dogs):
    clock, fired, done = FrozenClock(), [], threading.Event()
    dog = Watchdog(WatchdogConfig(step=3600.0, calibrate=True, explicit=(), warmup=3, multiple=2.0, floor=0.5),
                   "[g1/0]", on_expire=lambda *a: (fired.append(a), done.set()), clock=clock)
    dogs.append(dog)
    occur(dog, clock, "step", 0.1, times=3)
    assert dog.timeout("step") == 0.5
    dog.begin("step", "step 4 (a hung allreduce)")
    clock.advance(1.0)  # the thread sees it at its next look (within its 0.5 s wait)
    assert wait_fired(fired, done) == ("[g1/0] step", "step 4 (a hung allreduce)", 0.5)


def test_a_heal_that_hangs_fires_as_a_heal_not_as_its_step(dogs):
    clock, fired, done = FrozenClock(), [], threading.Event()
    dog = Watchdog(WatchdogConfig(step=0.2, heal=0.6), on_expire=lambda *a: (fired.append(a), done.set()),
                   clock=clock)
    dogs.append(dog)
    dog.begin("step", "step 9")
    dog.begin("heal", "the state dict of step 9")
    clock.advance(100.0)
    assert wait_fired(fired, done) == ("heal", "the state dict of step 9", 0.6)


@pytest.mark.parametrize("bad,message", [
    (dict(warmup=0), "warmup"), (dict(warmup=2.5), "warmup"), (dict(warmup=True), "warmup"),
    (dict(multiple=1.0), "multiple"), (dict(multiple=float("nan")), "multiple"),
    (dict(floor=0), "floor"), (dict(floor=float("inf")), "floor"),
    (dict(explicit=("steps",)), "unknown sections"), (dict(explicit="step"), "collection"),
])
def test_bad_calibration_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        WatchdogConfig(**bad)


@pytest.mark.parametrize("env,message", [
    ({"TORCHFT_LITE_WATCHDOG_CALIBRATE": "maybe"}, "TORCHFT_LITE_WATCHDOG_CALIBRATE must be 1 or 0"),
    ({"TORCHFT_LITE_WATCHDOG_CALIBRATE_WARMUP": "2.5"}, "TORCHFT_LITE_WATCHDOG_CALIBRATE_WARMUP must be"),
    ({"TORCHFT_LITE_WATCHDOG_CALIBRATE_MULTIPLE": "0.5"}, "multiple must be a number > 1.*environment"),
    ({"TORCHFT_LITE_WATCHDOG_CALIBRATE_FLOOR_SEC": "soon"}, "FLOOR_SEC must be a number of seconds"),
])
def test_bad_calibration_variables_are_refused_naming_them(env, message):
    with pytest.raises(ValueError, match=message):
        WatchdogConfig.from_env(env, WatchdogConfig())
