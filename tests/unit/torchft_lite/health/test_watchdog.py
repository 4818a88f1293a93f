"""The watchdog fires for a section past its timeout, and only then."""

import subprocess
import sys
import threading

import pytest

from torchft_lite.health.watchdog import EXIT_CODE_RESCHEDULE, Watchdog, WatchdogConfig


def test_a_section_past_its_timeout_fires_once_with_what_it_waited_for():
    fired, done = [], threading.Event()
    dog = Watchdog(WatchdogConfig(quorum=0.05), "r0", on_expire=lambda *a: (fired.append(a), done.set()))
    dog.begin("quorum", "the lighthouse")
    assert done.wait(30)
    assert fired == [("r0 quorum", "the lighthouse", 0.05)]


def test_ended_and_disabled_sections_never_fire():
    fired = []
    dog = Watchdog(WatchdogConfig(step=30.0), on_expire=lambda *a: fired.append(a))
    with dog.section("step", "a step"):
        pass
    dog.begin("heal", "a heal")  # disabled: no timeout configured
    dog.close()
    assert fired == []


def test_config_from_env():
    defaults = WatchdogConfig(quorum=10.0, heal=20.0)
    config = WatchdogConfig.from_env({"TORCHFT_LITE_WATCHDOG_HEAL_SEC": "off",
                                      "TORCHFT_LITE_WATCHDOG_STEP_SEC": "5"}, defaults)
    assert (config.quorum, config.heal, config.step, config.checkpoint) == (10.0, None, 5.0, None)
    with pytest.raises(ValueError, match="TORCHFT_LITE_WATCHDOG_QUORUM_SEC"):
        WatchdogConfig.from_env({"TORCHFT_LITE_WATCHDOG_QUORUM_SEC": "soon"}, defaults)
    with pytest.raises(ValueError, match="positive"):
        WatchdogConfig(step=-1)


def test_the_default_action_dumps_stacks_and_exits_for_rescheduling():
    code = ("from torchft_lite.health.watchdog import Watchdog, WatchdogConfig\n"
            "import time\n"
            "Watchdog(WatchdogConfig(step=0.1), 'g0').begin('step', 'a hung allreduce')\n"
            "time.sleep(60)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == EXIT_CODE_RESCHEDULE
    assert "torchft_lite watchdog: g0 step exceeded" in out.stderr and "(a hung allreduce)" in out.stderr
    assert "Current thread" in out.stderr or "Thread 0x" in out.stderr  # faulthandler's stack dump


def test_an_exit_that_hangs_behind_a_stuck_thread_is_ended_by_the_backstop():
    """The thread that hung holds the log handler's lock, so the watchdog's own log line blocks: faulthandler's
    timer (armed first, needing neither the GIL nor that lock) still ends the process, with code 1."""
    code = ("import logging, time\n"
            "import torchft_lite.health.watchdog as watchdog\n"
            "watchdog.EXIT_BACKSTOP_SEC = 1.0\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "logging.getLogger().handlers[0].acquire()  # this thread holds it, then hangs\n"
            "watchdog.Watchdog(watchdog.WatchdogConfig(step=0.1), 'g0').begin('step', 'a hung allreduce')\n"
            "time.sleep(600)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:  # subprocess.run has killed it
        pytest.fail("the watchdog's exit hung behind the stuck thread and nothing ended the process")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Timeout (0:00:01)!" in out.stderr  # faulthandler's dump, with every thread's stack
    assert "in <module>" in out.stderr
