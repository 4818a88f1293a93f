"""What only a subprocess process group does: aborts are kills, spares are warm, children die with their parent.

The behaviour shared with the in-process groups (collectives, errors,
reconfiguration across real processes) is covered by test_process_group.py,
which runs every test with ProcessGroupBabyGloo too. Here two groups live in
the test process (each with its own child), rendezvousing from two threads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import alive, all_in_threads, wait_until_sync
from torchft_lite.errors import CollectiveError, CollectiveTimeout
from torchft_lite.process_group import ProcessGroupBabyGloo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0  # generous: two shared cores, several interpreters importing torch at once


@pytest.fixture
def groups():
    made: list[ProcessGroupBabyGloo] = []

    def make(count: int, timeout_s: float = 30.0) -> list[ProcessGroupBabyGloo]:
        new = [ProcessGroupBabyGloo(timeout=timedelta(seconds=timeout_s)) for _ in range(count)]
        made.extend(new)
        return new

    try:
        yield make
    finally:
        for pg in made:
            pg.shutdown()


def configure(pgs: list[ProcessGroupBabyGloo], addr: str, rendezvous: timedelta | None = None) -> None:
    """Configure ``pgs`` as ranks 0..n-1 of one group, concurrently (a rendezvous needs every rank).

    ``rendezvous``: the rendezvous' own timeout (default: the groups' timeout, which stays their collectives').
    """
    all_in_threads(range(len(pgs)),
                   lambda rank: pgs[rank].configure(addr, f"replica-{rank}", rank, len(pgs), timeout=rendezvous),
                   WAIT_S, "configure() did not return")


def allreduce(pgs: list[ProcessGroupBabyGloo], tensors: list[torch.Tensor]) -> None:
    works = [pg.allreduce([tensor]) for pg, tensor in zip(pgs, tensors)]
    for work in works:
        work.wait()


def test_the_group_starts_its_child_at_once_and_the_first_configure_takes_it(store, groups) -> None:
    [pg] = groups(1)
    early = pg.spare_pid()
    assert early is not None and alive(early)  # warming up while the trainer starts
    assert pg.wait_warm(timedelta(seconds=WAIT_S)) is True
    configure([pg], f"127.0.0.1:{store.port}/torchft/1/0")
    assert pg.child_pid() == early and pg.spare_pid() not in (None, early)


def test_a_healthy_reconfigure_keeps_the_child_and_one_after_an_abort_takes_the_warm_spare(store, groups) -> None:
    pgs = groups(2)
    configure(pgs, f"127.0.0.1:{store.port}/torchft/1/0")
    first = [pg.child_pid() for pg in pgs]
    spares = [pg.spare_pid() for pg in pgs]  # started as soon as the first configure was done
    assert all(alive(pid) for pid in first + spares) and set(first).isdisjoint(spares)
    tensors = [torch.full((3,), float(rank + 1)) for rank in range(2)]
    allreduce(pgs, tensors)
    assert [t.tolist() for t in tensors] == [[3.0] * 3] * 2

    # A new quorum with nothing wrong: the same children build the new communicator (no interpreter to start).
    configure(pgs, f"127.0.0.1:{store.port}/torchft/2/0")
    assert [pg.child_pid() for pg in pgs] == first and [pg.spare_pid() for pg in pgs] == spares
    allreduce(pgs, tensors)
    assert [t.tolist() for t in tensors] == [[6.0] * 3] * 2

    # After an abort the child is killed, and the next configure takes the spare.
    for pg in pgs:
        pg.abort()
    for pid in first:
        wait_until_sync(lambda: not alive(pid), f"the aborted child {pid} to exit", WAIT_S)
    configure(pgs, f"127.0.0.1:{store.port}/torchft/3/0")
    assert [pg.child_pid() for pg in pgs] == spares
    assert all(pg.spare_pid() not in (None, *spares) for pg in pgs)  # a new spare is warming up
    allreduce(pgs, tensors)
    assert [t.tolist() for t in tensors] == [[12.0] * 3] * 2


def test_a_reconfigure_with_an_operation_still_running_kills_that_child(store, groups) -> None:
    # Reusing it would let the old operation go on writing into the trainer's shared tensors later.
    waiting, _silent = pgs = groups(2, timeout_s=60.0)
    configure(pgs, f"127.0.0.1:{store.port}/torchft/1/0")
    child = waiting.child_pid()
    work = waiting.allreduce([torch.ones(2)])  # the other rank never joins this one
    configure(pgs, f"127.0.0.1:{store.port}/torchft/2/0")  # a new quorum while it waits
    with pytest.raises(CollectiveError):
        work.wait()
    wait_until_sync(lambda: not alive(child), f"the busy child {child} to be killed", WAIT_S)
    assert waiting.child_pid() != child and waiting.errored() is None
    tensors = [torch.ones(2), torch.full((2,), 2.0)]
    allreduce(pgs, tensors)
    assert [t.tolist() for t in tensors] == [[3.0, 3.0]] * 2


def test_an_overdue_collective_kills_the_child_and_errors_the_group(store, groups) -> None:
    waiting, _silent = pgs = groups(2, timeout_s=3.0)
    # The rendezvous of two fresh children may take longer than the collectives' 3 s on a loaded machine.
    configure(pgs, f"127.0.0.1:{store.port}/torchft/1/0", rendezvous=timedelta(seconds=WAIT_S))
    child = waiting.child_pid()
    work = waiting.allreduce([torch.ones(2)])  # the other rank never joins
    with pytest.raises(CollectiveTimeout):
        work.get_future().wait()
    assert isinstance(waiting.errored(), CollectiveTimeout)
    wait_until_sync(lambda: not alive(child), f"the overdue child {child} to be killed", WAIT_S)
    with pytest.raises(CollectiveError, match="errored until the next configure"):
        waiting.allreduce([torch.ones(2)])

    configure(pgs, f"127.0.0.1:{store.port}/torchft/2/0", rendezvous=timedelta(seconds=WAIT_S))
    tensors = [torch.ones(2), torch.ones(2)]
    allreduce(pgs, tensors)
    assert [t.tolist() for t in tensors] == [[2.0, 2.0]] * 2 and waiting.errored() is None


def test_a_child_that_dies_fails_its_pending_work_at_once(store, groups) -> None:
    pgs = groups(2, timeout_s=600.0)  # far beyond the test's own timeout: only the death can end the wait
    configure(pgs, f"127.0.0.1:{store.port}/torchft/1/0")
    child = pgs[0].child_pid()
    work = pgs[0].allreduce([torch.ones(2)])
    os.kill(child, signal.SIGKILL)
    with pytest.raises(CollectiveError, match="gone"):
        work.wait()
    assert pgs[0].errored() is not None


def test_abort_kills_the_child(store, groups) -> None:
    [pg] = groups(1)
    configure([pg], f"127.0.0.1:{store.port}/torchft/1/0")
    child = pg.child_pid()
    pg.abort()
    wait_until_sync(lambda: not alive(child), f"the aborted child {child} to exit", WAIT_S)
    assert isinstance(pg.errored(), CollectiveError)


def test_a_killed_child_leaves_no_thread_reading_its_socket(store, groups) -> None:
    before = set(threading.enumerate())
    [pg] = groups(1)
    configure([pg], f"127.0.0.1:{store.port}/torchft/1/0")  # starts a warm spare too
    current = pg.child_pid()
    pg.shutdown()  # kills the spare here (the current child on a teardown thread)
    # A reader still running when its socket's descriptor is closed could read whatever reuses the number.
    readers = [thread.name for thread in set(threading.enumerate()) - before
               if thread.name.startswith("torchft_lite-pg-child-") and thread.name != f"torchft_lite-pg-child-{current}"]
    assert readers == []


def test_tensors_are_shared_in_place_or_staged_when_their_memory_cannot_move(store, groups) -> None:
    pgs = groups(2)
    configure(pgs, f"127.0.0.1:{store.port}/torchft/1/0")
    owned = [torch.full((4,), 2.0), torch.full((4,), 5.0)]
    view = owned[0][1:3]
    allreduce(pgs, owned)
    assert [t.tolist() for t in owned] == [[7.0] * 4] * 2
    assert all(t.is_shared() for t in owned) and view.tolist() == [7.0, 7.0]  # views follow their storage

    foreign = [torch.frombuffer(bytearray(16), dtype=torch.float32).fill_(rank + 1) for rank in range(2)]
    allreduce(pgs, foreign)  # torch cannot move a bytearray's memory: it goes through a shared copy
    assert [t.tolist() for t in foreign] == [[3.0] * 4] * 2
    assert not any(t.is_shared() for t in foreign)


    gathered = [[torch.zeros(1), torch.zeros(1)] for _ in range(2)]
    works = [pg.allgather([out], [torch.tensor([float(rank)])]) for rank, (pg, out) in enumerate(zip(pgs, gathered))]
    assert [work.get_future().wait() for work in works] == [[out] for out in gathered]
    assert [[t.item() for t in out] for out in gathered] == [[0.0, 1.0]] * 2
    tensor = torch.full((2,), 4.0)
    other = torch.full((2,), 1.0)
    works = [dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg, async_op=True) for pg, t in zip(pgs, (tensor, other))]
    for work in works:
        work.wait()
    assert tensor.tolist() == other.tolist() == [4.0, 4.0]


def test_children_exit_when_their_parent_is_killed(store, tmp_path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from datetime import timedelta\n"
        "from torchft_lite.process_group import ProcessGroupBabyGloo\n"
        "pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=30))\n"
        "pg.configure(sys.argv[1], 'r', 0, 1)\n"
        "print(pg.child_pid(), pg.spare_pid(), flush=True)\n"
        "time.sleep(600)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    parent = subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{store.port}/torchft/1/0"],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = parent.stdout.readline()
        assert line, f"the parent exited with {parent.wait(WAIT_S)} before configuring"
        children = [int(pid) for pid in line.split()]
        assert all(alive(pid) for pid in children)
        parent.kill()
        parent.wait(WAIT_S)
        for pid in children:
            wait_until_sync(lambda: not alive(pid), f"child {pid} to exit after its parent was killed", WAIT_S)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(WAIT_S)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_baby_nccl_without_cuda_is_a_config_error_before_any_child_starts(store) -> None:
    from torchft_lite.errors import ConfigError
    from torchft_lite.process_group import ProcessGroupBabyNCCL

    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=5))
    with pytest.raises(ConfigError, match="CUDA"):
        pg.configure(f"127.0.0.1:{store.port}/torchft/1/0", "replica-a", 0, 1)
    assert pg.child_pid() is None and pg.spare_pid() is None
