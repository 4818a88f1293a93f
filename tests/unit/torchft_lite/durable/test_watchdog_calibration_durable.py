"""The watchdog's calibration travels with durable checkpoints: saved in each rank's local file, restored by
``resume()`` so a restarted job starts calibrated; an older checkpoint without it, or one with garbage in it,
still resumes. Real Managers on the in-memory fakes: no sockets, no processes."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from torchft_lite.durable import DurableCheckpointer
from torchft_lite.durable._layout import Layout
from torchft_lite.health.watchdog import WatchdogConfig
from torchft_lite.serialization.decode import decode_bytes
from torchft_lite.serialization.encode import encode_to_bytes
from torchft_lite.testing import InMemoryLighthouse, InMemoryProcessGroup

# Calibrated timeouts land on the 300 s floor, far from anything these steps take, and apart from the
# configured 600 s so a test can tell which one is in force.
CONFIG = WatchdogConfig(quorum=600.0, heal=600.0, step=900.0, calibrate=True, explicit=(), warmup=3, floor=300.0)


class Group:
    """One replica group of one rank with a durable checkpointer every 4 steps."""

    def __init__(self, directory: Path) -> None:
        self.weights = torch.zeros(4)
        self.manager = InMemoryLighthouse(min_replicas=1).manager(
            "g", InMemoryProcessGroup(), load_state_dict=self.load, state_dict=lambda: {"w": self.weights},
            min_replica_size=1, timeout=timedelta(seconds=10), watchdog=CONFIG)
        self.checkpointer = DurableCheckpointer(self.manager, directory, every=4)

    def load(self, state: dict) -> None:
        self.weights.copy_(state["w"])

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.manager.start_quorum()
            grad = torch.ones_like(self.weights)
            self.manager.allreduce(grad).wait()
            assert self.manager.should_commit()
            self.weights.sub_(grad)
            assert self.checkpointer.wait(60)
        self.checkpointer.flush()
        assert self.checkpointer.wait(60)

    def close(self) -> None:
        self.checkpointer.close()
        self.manager.shutdown()


@pytest.fixture
def groups():
    made: list[Group] = []

    def make(directory: Path) -> Group:
        made.append(Group(directory))
        return made[-1]

    yield make
    for group in made:
        group.close()


def saved_local(directory: Path, step: int) -> tuple[Path, dict]:
    path = Layout(directory).local_file(step, "g", 0)
    got_step, local = decode_bytes(path.read_bytes())
    assert got_step == step
    return path, local


def rewrite_local(directory: Path, step: int, change) -> None:
    path, local = saved_local(directory, step)
    change(local)
    path.write_bytes(encode_to_bytes(step, local))


def test_the_calibration_is_saved_and_a_resumed_job_starts_calibrated(tmp_path, groups, caplog):
    first = groups(tmp_path)
    first.train(4)
    _, local = saved_local(tmp_path, 4)
    saved = local["watchdog"]
    # Taken at step 4's commit: 4 quorums ended, steps 1-3 ended (step 4's ends after its commit).
    assert saved["sections"]["quorum"]["count"] == 4 and saved["sections"]["step"]["count"] == 3

    caplog.set_level(logging.INFO, "torchft_lite.health.watchdog")
    resumed = groups(tmp_path)
    assert resumed.checkpointer.resume() == 4
    assert resumed.manager.watchdog.calibration_state() == saved
    assert any("quorum timeout calibrated (restored from a durable checkpoint): 600.0s -> 300.0s" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    # The first step after a restart keeps the configured timeouts (its one-off costs); then calibrated.
    assert resumed.manager.watchdog.timeout("quorum") == 600.0
    resumed.train(1)
    assert (resumed.manager.watchdog.timeout("quorum"), resumed.manager.watchdog.timeout("step")) == (300.0, 300.0)

    fresh = groups(tmp_path / "elsewhere")  # the same one step without the checkpoint: still warming up
    fresh.train(1)
    assert (fresh.manager.watchdog.timeout("quorum"), fresh.manager.watchdog.timeout("step")) == (600.0, 900.0)


def test_a_checkpoint_written_before_calibration_existed_resumes(tmp_path, groups, caplog):
    groups(tmp_path).train(4)
    rewrite_local(tmp_path, 4, lambda local: local.pop("watchdog"))
    caplog.set_level(logging.INFO)
    resumed = groups(tmp_path)
    assert resumed.checkpointer.resume() == 4
    assert torch.equal(resumed.weights, torch.full((4,), -4.0))
    assert resumed.manager.watchdog.calibration_state()["sections"] == {}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    resumed.train(1)
    assert resumed.manager.watchdog.timeout("quorum") == 600.0


def test_garbage_in_the_saved_calibration_is_refused_and_the_checkpoint_still_resumes(tmp_path, groups, caplog):
    groups(tmp_path).train(4)

    def corrupt(local: dict) -> None:
        local["watchdog"]["sections"]["step"]["count"] = "lots"

    rewrite_local(tmp_path, 4, corrupt)
    caplog.set_level(logging.INFO)
    resumed = groups(tmp_path)
    assert resumed.checkpointer.resume() == 4
    assert resumed.manager.current_step() == 4 and torch.equal(resumed.weights, torch.full((4,), -4.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ignoring the saved calibration" in warnings[0] and "'lots'" in warnings[0]
    assert resumed.manager.watchdog.calibration_state()["sections"] == {}
    resumed.train(1)
    assert (resumed.manager.watchdog.timeout("quorum"), resumed.manager.watchdog.timeout("step")) == (600.0, 900.0)
