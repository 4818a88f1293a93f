"""Durable checkpoints with real Managers on the in-memory fakes: no sockets, no processes.

What is saved, by whom, when; what a resume loads; and what it refuses.
"""

from __future__ import annotations

import errno
import json
import logging
import random
import shutil
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import all_in_threads
from torchft_lite.durable import DurableCheckpointer, read_checkpoint
from torchft_lite.durable._files import read_state_file
from torchft_lite.durable._layout import MANIFEST, Layout
from torchft_lite.errors import DurableCheckpointError
from torchft_lite.manager import Manager
from torchft_lite.testing import InMemoryLighthouse, InMemoryProcessGroup


class Group:
    """One replica group of one rank: a parameter, an optimizer-like counter, a data position."""

    def __init__(self, lighthouse: InMemoryLighthouse, name: str, directory: Path, size: int = 4,
                 **checkpoint: Any) -> None:
        self.weights = torch.zeros(size)
        self.moments = torch.zeros(size)
        self.position = 0
        self.manager: Manager = lighthouse.manager(
            name, InMemoryProcessGroup(), load_state_dict=self.load, state_dict=self.state,
            min_replica_size=1, timeout=timedelta(seconds=10))
        self.checkpointer = DurableCheckpointer(self.manager, directory, **{"every": 2, "keep_last": 2,
                                                                            **checkpoint})
        self.checkpointer.register_local("data", lambda: {"position": self.position}, self.load_local)

    def state(self) -> dict:
        return {"model": {"w": self.weights}, "optim": {"m": self.moments, "lr": 0.5}}

    def load(self, state: dict) -> None:
        self.weights.copy_(state["model"]["w"])
        self.moments.copy_(state["optim"]["m"])

    def load_local(self, local: dict) -> None:
        self.position = local["position"]

    def step(self) -> bool:
        self.manager.start_quorum()
        grad = torch.full_like(self.weights, float(self.position % 5 + 1)) + torch.rand(self.weights.shape)
        self.manager.allreduce(grad).wait()
        self.position += 1
        committed = self.manager.should_commit()
        if committed:  # the optimizer steps in place, as torch's do
            self.moments.mul_(0.5).add_(grad)
            self.weights.sub_(self.moments)
        return committed

    def close(self) -> None:
        self.checkpointer.close()
        self.manager.shutdown()


def run(groups: list[Group], steps: int) -> None:
    def loop(group: Group) -> None:
        for _ in range(steps):
            group.step()
            assert group.checkpointer.wait(30)  # deterministic: no save is skipped for a slow disk

    all_in_threads(groups, loop, 60, "a training thread hung")
    for group in groups:
        group.checkpointer.flush()  # the last step's checkpoint, if due (it is otherwise taken as the next starts)
        assert group.checkpointer.wait(30)


@pytest.fixture
def made():
    groups: list[Group] = []
    yield groups
    for group in groups:
        group.close()


def test_one_group_writes_each_checkpoint_and_the_others_only_their_local_state(tmp_path, made):
    lighthouse = InMemoryLighthouse(min_replicas=2)
    made += [Group(lighthouse, "g0", tmp_path), Group(lighthouse, "g1", tmp_path)]
    run(made, 9)
    assert made[0].manager.current_step() == made[1].manager.current_step()
    complete = Layout(tmp_path).complete()
    steps = [info.step for info in complete]
    assert steps and all(step % 2 == 0 for step in steps)
    assert len(steps) <= 2  # keep_last
    writers = {info.writer.split(":")[0] for info in complete}
    assert len(writers) == 1, f"two groups wrote checkpoints: {writers}"
    writer = writers.pop()
    stats = {g.manager.replica_id.split(":")[0]: g.checkpointer.statistics() for g in made}
    assert stats[writer].saves_completed >= 1 and stats[writer].saves_failed == 0
    other = "g1" if writer == "g0" else "g0"
    assert stats[other].saves_completed == 0 and stats[other].local_saves >= 1
    newest = complete[0]
    assert sorted(newest.files) == ["state-r0.tft"]
    assert Layout(tmp_path).local_file(newest.step, "g0", 0).exists()
    assert Layout(tmp_path).local_file(newest.step, "g1", 0).exists()


def test_resume_loads_the_newest_checkpoint_and_continues_bit_identically(tmp_path, made):
    torch.manual_seed(7)
    lighthouse = InMemoryLighthouse(min_replicas=1)
    reference = Group(lighthouse, "ref", tmp_path / "ref", every=4)
    made.append(reference)
    run([reference], 4)
    assert reference.checkpointer.checkpoints()[0].step == 4
    run([reference], 3)
    expected = (reference.weights.clone(), reference.moments.clone(), reference.position)

    resumed = Group(InMemoryLighthouse(min_replicas=1), "ref", tmp_path / "ref", every=4)
    made.append(resumed)
    torch.manual_seed(12345)  # a restarted process starts with other RNG states
    assert resumed.checkpointer.resume() == 4
    assert resumed.manager.current_step() == 4
    assert resumed.position == 4
    committed_in = reference.checkpointer.checkpoints()[0].quorum_id  # the manifest names the commit's quorum
    assert committed_in is not None and committed_in == reference.manager.state_quorum_id()
    assert resumed.manager._client.advertised == {"resumed_from": 4, "resumed_quorum": committed_in}
    run([resumed], 3)
    assert resumed.manager.current_step() == 7
    assert torch.equal(resumed.weights, expected[0]) and torch.equal(resumed.moments, expected[1])
    assert resumed.position == expected[2]


def test_the_snapshot_is_the_committed_state_even_though_the_next_step_changes_it(tmp_path, made):
    lighthouse = InMemoryLighthouse(min_replicas=1)
    group = Group(lighthouse, "solo", tmp_path, every=3)
    made.append(group)
    run([group], 3)
    at_three = group.weights.clone()
    run([group], 2)  # steps 4 and 5 change the weights
    step, state = read_checkpoint(Layout(tmp_path).complete()[0])
    assert step == 3 and state["torchft"]["step"] == 3
    assert torch.equal(state["user"]["default"]["model"]["w"], at_three)
    assert not torch.equal(group.weights, at_three)


def corrupt_newest(tmp_path: Path, how: str) -> int:
    newest = Layout(tmp_path).complete()[0]
    path = newest.path / "state-r0.tft"
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif how == "manifest":
        (newest.path / MANIFEST).unlink()
    elif how == "manifest-garbage":
        (newest.path / MANIFEST).write_text("{not json")
    return newest.step


@pytest.mark.parametrize("how", ["flip", "truncate", "manifest", "manifest-garbage"])
def test_a_torn_or_corrupt_checkpoint_is_skipped_for_the_one_before(tmp_path, made, how, caplog):
    group = Group(InMemoryLighthouse(), "g", tmp_path)
    made.append(group)
    run([group], 4)
    bad = corrupt_newest(tmp_path, how)
    assert bad == 4
    fresh = Group(InMemoryLighthouse(), "g", tmp_path)
    made.append(fresh)
    with caplog.at_level(logging.WARNING):
        assert fresh.checkpointer.resume() == 2
    if how in ("flip", "truncate"):
        assert any("skipping the durable checkpoint of step 4" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_loaded(tmp_path, made):
    group = Group(InMemoryLighthouse(), "g", tmp_path)
    made.append(group)
    run([group], 2)
    other = Group(InMemoryLighthouse(), "g", tmp_path, size=5)
    made.append(other)
    before = other.weights.clone()
    with pytest.raises(DurableCheckpointError, match=r"default\.model\.w|another model"):
        other.checkpointer.resume()
    assert torch.equal(other.weights, before) and other.manager.current_step() == 0


def test_no_checkpoint_starts_fresh(tmp_path, made):
    group = Group(InMemoryLighthouse(), "g", tmp_path)
    made.append(group)
    assert group.checkpointer.resume() is None
    assert group.manager.current_step() == 0


def test_a_full_disk_fails_the_save_and_training_goes_on(tmp_path, made, monkeypatch, caplog):
    from torchft_lite.durable import _files

    group = Group(InMemoryLighthouse(), "g", tmp_path)
    made.append(group)
    real_open = open

    def full_disk_open(file, mode="r", *args, **kwargs):
        if "w" in mode and str(file).endswith("state-r0.tft.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(_files, "open", full_disk_open, raising=False)
    with caplog.at_level(logging.ERROR):
        run([group], 5)
    assert group.manager.current_step() == 5
    stats = group.checkpointer.statistics()
    assert stats.saves_failed >= 1 and stats.saves_completed == 0
    assert "disk is full" in (stats.last_error or "")
    assert any("disk is full" in r.getMessage() for r in caplog.records)
    assert Layout(tmp_path).complete() == []


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path, made):
    group = Group(InMemoryLighthouse(), "g", tmp_path, every=2, keep_last=3)
    made.append(group)
    run([group], 14)
    assert [info.step for info in Layout(tmp_path).complete()] == [14, 12, 10]
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == [f"step-{s:012d}" for s in (10, 12, 14)]


def test_prune_never_removes_the_newest_complete_even_with_newer_partial_writes(tmp_path, made):
    group = Group(InMemoryLighthouse(), "g", tmp_path, every=2, keep_last=1)
    made.append(group)
    run([group], 4)
    layout = Layout(tmp_path)
    (layout.root / ".staging-000000000009-dead").mkdir()
    layout.step_dir(8).mkdir()  # no manifest: an interrupted write
    layout.prune(1)
    assert [info.step for info in layout.complete()] == [4]
    assert layout.step_dir(8).exists()  # above the newest complete: may be in flight elsewhere


def test_a_second_writer_for_one_step_is_refused(tmp_path, made):
    group = Group(InMemoryLighthouse(), "g", tmp_path, every=2)
    made.append(group)
    run([group], 2)
    before = (Layout(tmp_path).step_dir(2) / MANIFEST).read_text()
    twin = Group(InMemoryLighthouse(), "twin", tmp_path, every=2)
    made.append(twin)
    run([twin], 2)
    stats = twin.checkpointer.statistics()
    assert stats.saves_failed == 1 and "already exists" in stats.last_error
    assert (Layout(tmp_path).step_dir(2) / MANIFEST).read_text() == before
    assert json.loads(before)["writer"].startswith("g:")


def test_a_save_still_in_flight_makes_the_next_one_skip(tmp_path, made, monkeypatch):
    from torchft_lite.durable import checkpointer as module

    gate = threading.Event()
    real = module.write_state_file

    def slow_write(*args, **kwargs):
        gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "write_state_file", slow_write)
    group = Group(InMemoryLighthouse(), "g", tmp_path, every=1)
    made.append(group)
    for _ in range(4):
        group.step()
    gate.set()
    assert group.checkpointer.wait(30)
    stats = group.checkpointer.statistics()
    assert stats.saves_skipped >= 2 and stats.saves_completed >= 1


def test_rng_states_are_restored(tmp_path, made):
    group = Group(InMemoryLighthouse(), "g", tmp_path, every=1)
    made.append(group)
    random.seed(3)
    run([group], 1)
    expected = (torch.rand(3), random.random())
    fresh = Group(InMemoryLighthouse(), "g", tmp_path, every=1)
    made.append(fresh)
    torch.manual_seed(99)
    random.seed(99)
    fresh.checkpointer.resume()
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_preemption_saves_the_current_step_before_leaving(tmp_path, made):
    group = Group(InMemoryLighthouse(), "g", tmp_path, every=100)
    made.append(group)
    run([group], 3)
    assert Layout(tmp_path).complete() == []
    group.checkpointer.leaving()
    [info] = Layout(tmp_path).complete()
    assert info.step == 3
    step, state = read_state_file(info.path / "state-r0.tft", info.files["state-r0.tft"])
    assert torch.equal(state["user"]["default"]["model"]["w"], group.weights)


def test_a_group_that_does_not_write_checkpoints_still_saves_before_leaving(tmp_path, made):
    """The writer may be gone in the same seconds (killed, hung): the group leaving may hold the only copy."""
    lighthouse = InMemoryLighthouse(min_replicas=2)
    made += [Group(lighthouse, "g0", tmp_path, every=100), Group(lighthouse, "g1", tmp_path, every=100)]
    run(made, 3)
    [other] = [g for g in made if g.checkpointer._last_commit_rank != 0]  # not the quorum's writer
    other.checkpointer.leaving()
    [info] = Layout(tmp_path).complete()
    assert info.step == 3 and info.writer == other.manager.replica_id
    _, state = read_state_file(info.path / "state-r0.tft", info.files["state-r0.tft"])
    assert torch.equal(state["user"]["default"]["model"]["w"], other.weights)


def test_a_state_torn_by_a_failed_heal_is_not_saved_before_leaving(tmp_path, made, caplog):
    group = Group(InMemoryLighthouse(), "g", tmp_path, every=100)
    made.append(group)
    run([group], 3)
    group.manager.context.state.torn = True  # a heal failed part-way: the tensors mix two steps
    with caplog.at_level(logging.ERROR):
        group.checkpointer.leaving()
    assert Layout(tmp_path).complete() == []
    assert "a failed heal left the state mixing two steps" in caplog.text


def test_two_groups_saving_one_step_before_leaving_keep_the_first_copy_without_an_error(tmp_path, made, caplog):
    lighthouse = InMemoryLighthouse(min_replicas=2)
    made += [Group(lighthouse, "g0", tmp_path, every=100), Group(lighthouse, "g1", tmp_path, every=100)]
    run(made, 3)
    with caplog.at_level(logging.INFO, logger="torchft_lite.durable.checkpointer"):
        threads = [threading.Thread(target=g.checkpointer.leaving) for g in made]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    [info] = Layout(tmp_path).complete()
    assert info.step == 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "another group saved it first" in caplog.text
    assert not list(tmp_path.glob(".staging-*")), "the second copy was left behind"
    assert all(g.checkpointer.statistics().saves_failed == 0 for g in made)


def test_another_group_renaming_its_copy_right_after_this_one_looked_is_not_an_error(tmp_path, made, caplog,
                                                                                     monkeypatch):
    """The race a CI run hit: the other group's copy lands just after this one looked for it."""
    group = Group(InMemoryLighthouse(), "g", tmp_path, every=100)
    made.append(group)
    run([group], 3)
    final = Layout(tmp_path).step_dir(3)
    exists, looked = Path.exists, []

    def the_other_group_wins_after_the_first_look(self: Path, *args: Any, **kwargs: Any) -> bool:
        answer = exists(self, *args, **kwargs)
        if self == final and not looked:
            looked.append(True)
            [staging] = tmp_path.glob(".staging-*")
            shutil.copytree(staging, final)  # the other group's complete copy, renamed into place
        return answer

    monkeypatch.setattr(Path, "exists", the_other_group_wins_after_the_first_look)
    with caplog.at_level(logging.INFO, logger="torchft_lite.durable.checkpointer"):
        group.checkpointer.leaving()
    assert looked and [info.step for info in Layout(tmp_path).complete()] == [3]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "another group saved it first" in caplog.text and not list(tmp_path.glob(".staging-*"))


@pytest.mark.parametrize("bad", [dict(every=0), dict(keep_last=0), dict(every=True), dict(every=1.5)])
def test_bad_settings_are_refused(tmp_path, made, bad):
    from torchft_lite.errors import ConfigError

    lighthouse = InMemoryLighthouse()
    manager = lighthouse.manager("g", InMemoryProcessGroup(), load_state_dict=None, state_dict=None,
                                 min_replica_size=1)
    try:
        with pytest.raises(ConfigError):
            DurableCheckpointer(manager, tmp_path, **bad)
    finally:
        manager.shutdown()


class FakeStore:
    """A TCPStore's set/get: get waits (bounded) for the key."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def set(self, key: str, value: Any) -> None:
        with self.changed:
            self.data[key] = value.encode() if isinstance(value, str) else value
            self.changed.notify_all()

    def get(self, key: str) -> bytes:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.data, timeout=10):
                raise RuntimeError(f"timed out waiting for {key}")  # as torch's DistStoreError is
            return self.data[key]


def test_ranks_of_a_group_agree_on_rank_0s_list_and_on_a_step_every_rank_can_read():
    from torchft_lite.durable._resume import GroupAgreement

    store = FakeStore()
    rank0, rank1 = GroupAgreement(store, "p/", 0, 2), GroupAgreement(store, "p/", 1, 2)
    results: dict[str, Any] = {}

    def rank(name: str, agreement: GroupAgreement, seen: list[int], readable: set[int]) -> None:
        steps = agreement.candidates(seen)
        results[name] = (steps, next((s for s in steps if agreement.all_readable(s, s in readable)), None))

    threads = [threading.Thread(target=rank, args=("r0", rank0, [10, 5], {10, 5})),
               # rank 1 scanned later (a newer checkpoint appeared) and can't read its part of step 10
               threading.Thread(target=rank, args=("r1", rank1, [15, 10, 5], {15, 5}))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert results == {"r0": ([10, 5], 5), "r1": ([10, 5], 5)}


def test_a_rank_that_never_hears_from_rank_0_fails_clearly():
    from torchft_lite.durable._resume import GroupAgreement

    class Silent(FakeStore):
        def get(self, key: str) -> bytes:
            raise RuntimeError("Socket Timeout")

    with pytest.raises(DurableCheckpointError, match="group rank 0 did not say"):
        GroupAgreement(Silent(), "p/", 1, 2).candidates([3])
