"""What ``make compat`` runs: every test file in torchft's wheel, and the tests left out.

The files are found in the installed ``torchft`` package at run time (:func:`wheel_test_files`), so a
nightly that adds a test file adds it to the run: there is no list to keep by hand. ``EXCLUDED`` names
the tests that do not run, each with its reason. Paths are relative to the package directory.
"""

from __future__ import annotations

import re
from pathlib import Path


def wheel_test_files(wheel_dir: Path) -> list[str]:
    """Every test file (``*_test.py``) in the torchft package at ``wheel_dir``, as sorted relative paths.

    Some hold no tests that can run here (``checkpointing/transport_test.py`` is helpers for the transport
    tests; ``collectives_test.py`` and ``quantization_test.py`` define their tests only where Triton
    imports): they run, and collect nothing on either side.
    """
    return sorted(path.relative_to(wheel_dir).as_posix() for path in wheel_dir.rglob("*_test.py")
                  if "__pycache__" not in path.parts)


# Test id (file::Class::method, or file::function) -> why it is not run. Only tests that read torchft's
# private attributes, patch its internals or test a private torchft module no public path needs belong
# here, never a test just because torchft_lite fails it today. A Manager scenario left out here is ported
# to our own tests (the reason names where). An id also covers the cases @parameterized.expand generates
# from it (method_0_..., method_1_...).
EXCLUDED: dict[str, str] = {
    "process_group_test.py::ProcessGroupTest::test_reconfigure_baby_process_group":
        "asserts on the baby group's private child handles (_future_thread, _future_pipe, _p) and wants a new "
        "child process at every reconfigure; ours builds the new communicator in the same child while it is "
        "healthy (a reconfigure in ~0.01 s instead of a child's ~1 s start; pinned by tests/integration/"
        "test_process_group_baby.py::test_a_healthy_reconfigure_keeps_the_child_and_one_after_an_abort_takes_the_"
        "warm_spare)",
    "process_group_test.py::ProcessGroupTest::test_nccl_timeouts":
        "patches the stream_timeout/context_timeout helpers in torchft.process_group's namespace and counts their "
        "calls (one per wait); ours arms one deadline per collective when it starts, waited for or not. Needs "
        "CUDA and NCCL >= 2.25 (skipped on both sides without)",
    "manager_test.py::TestManager::test_quorum_checkpoint_errors":
        "hands one replica a quorum in which it both heals and serves a heal (torchft's rules never issue one: a "
        "healing member serves nobody) and expects the send's error first: torchft sends from its quorum thread "
        "before receiving, ours serves from the training thread once the step's quorum is known, after the receive "
        "has started, and refuses to serve a step it is not at. Ported: "
        "tests/unit/torchft_lite/test_manager_scenarios.py::test_quorum_checkpoint_errors (each failure on its own)",
    "multiprocessing_test.py::MultiprocessingTest::test_monitored_queue_put":
        "tests torchft.multiprocessing._MonitoredPipe, a private helper of torchft's child-process groups that no "
        "public API hands out; ours talk to their child over process_group/_child_link.py instead",
    "multiprocessing_test.py::MultiprocessingTest::test_monitored_queue_get":
        "tests torchft.multiprocessing._MonitoredPipe (see test_monitored_queue_put)",
}


def excluded_pattern(test_id: str) -> str:
    """A regex matching ``test_id`` and the parameterized cases generated from it."""
    return re.escape(test_id) + r"(_\d+(_.*)?)?"
