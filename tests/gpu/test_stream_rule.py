"""The stream rule on a real GPU: a result handed back through a work or future is complete on the reader's stream.

Two ranks of one ``ProcessGroupGloo`` in this process: rank 0 reduces CUDA
tensors, rank 1 (a thread) CPU tensors of the same sizes. gloo stages CUDA
tensors through host memory and copies the result back on streams of its own,
so the host learns "done" before the bytes are on the GPU. Each path the
Manager uses is read by a kernel launched straight after its wait, on a
stream of the reader's own, while the current stream was kept busy by a long
matrix product queued before the inputs were written. Before the stream rule,
the division callback and the readers raced gloo's copies (the divergence the
first GPU run found).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchft_lite.collectives import start_quantized_allreduce
from torchft_lite.core.step import Step, start_allreduce
from torchft_lite.health.nonfinite import HealthConfig, NonFiniteGuard
from torchft_lite.process_group import ProcessGroupGloo
from torchft_lite.work import ManagedWork, guard_future

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.timeout(300),
]

ELEMENTS = 32 << 20  # 128 MiB of float32 per tensor: a copy back that takes a few milliseconds
SMALL = 1 << 20  # 4 MiB: the non-finite guard's count travels in the tensor's own collective (PACK_COUNT_MAX_BYTES)
TENSORS = 4
TIMEOUT = timedelta(seconds=120)


def two_ranks() -> tuple[ProcessGroupGloo, ProcessGroupGloo, dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    groups = [ProcessGroupGloo(timeout=TIMEOUT) for _ in range(2)]
    threads = [threading.Thread(target=groups[r].configure,
                                args=(f"127.0.0.1:{store.port}/stream_rule", f"replica-{r}", r, 2))
               for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT.total_seconds())
    return groups[0], groups[1], store


def busy_then_fill(value: float, elements: int = ELEMENTS) -> list[torch.Tensor]:
    """Tensors holding ``value``, written on the current stream behind a long matrix product."""
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(8):
        busy = busy @ busy
        busy = busy / busy.norm()
    return [torch.empty(elements, device="cuda").fill_(value) for _ in range(TENSORS)]


def wrong_on_a_fresh_stream(wait: Callable[[], object], tensor: torch.Tensor, expected: float,
                            tolerance: float = 0.0) -> int:
    """Elements of ``tensor`` that are not ``expected``, read by a kernel launched straight after ``wait()``
    with a fresh high-priority stream current (the reader's own)."""
    reader = torch.cuda.Stream(priority=-1)
    with torch.cuda.stream(reader):
        wait()
        wrong = ((tensor - expected).abs() > tolerance).sum()
    reader.synchronize()
    return int(wrong.item())


def mirror(pg: ProcessGroupGloo, issue: Callable[[ProcessGroupGloo, torch.Tensor], object],
           elements: int = ELEMENTS) -> threading.Thread:
    """Rank 1: the same collectives on CPU tensors holding 2.0, in the same order."""

    def run() -> None:
        for _ in range(TENSORS):
            issue(pg, torch.full((elements,), 2.0))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def sum_and_wait(pg, tensor):
    pg.allreduce([tensor], ReduceOp.SUM).wait()


def guarded_sum_and_wait(pg, tensor):
    sum_and_wait(pg, tensor)
    sum_and_wait(pg, torch.zeros(1))  # the guard's count of left-out groups


def packed_sum_and_wait(pg, tensor):
    sum_and_wait(pg, torch.cat([tensor, torch.zeros(1)]))  # a small tensor carries the guard's count itself


def quantized_and_wait(pg, tensor):
    start_quantized_allreduce(pg, tensor, ReduceOp.AVG, 2).wait()


@pytest.fixture()
def ranks():
    rank0, rank1, store = two_ranks()
    yield rank0, rank1
    rank0.shutdown()
    rank1.shutdown()
    del store


def check(results: list[int]) -> None:
    assert results == [0] * len(results), f"elements read before their result landed, per tensor: {results}"


def exercise(ranks, mirrored, start: Callable[[ProcessGroupGloo, torch.Tensor], object], expected: float,
             tolerance: float = 0.0, elements: int = ELEMENTS) -> None:
    """Rank 1 runs ``mirrored`` on CPU tensors; rank 0 starts ``start(group, tensor)`` on each of its busy-written
    CUDA tensors, then reads each result on a fresh stream straight after that handle's ``wait()``."""
    rank0, rank1 = ranks
    helper = mirror(rank1, mirrored, elements)
    tensors = busy_then_fill(1.0, elements)
    handles = [start(rank0, t) for t in tensors]
    check([wrong_on_a_fresh_stream(handle.wait, t, expected, tolerance) for handle, t in zip(handles, tensors)])
    helper.join(TIMEOUT.total_seconds())


class Errors(list):
    """The errors a guarded future reported (the Manager records them; here none may come)."""

    def managed(self, future: torch.futures.Future, tensor: torch.Tensor) -> ManagedWork:
        """What Manager.allreduce returns for ``future``."""
        return ManagedWork(guard_future(future, tensor, self.append, TIMEOUT.total_seconds(), "an allreduce"))


def test_a_gloo_works_wait_leaves_the_readers_stream_waiting(ranks):
    exercise(ranks, sum_and_wait, lambda pg, t: pg.allreduce([t], ReduceOp.SUM), 3.0)


def test_a_gloo_future_and_the_division_after_it_are_ordered_on_the_readers_stream(ranks):
    exercise(ranks, sum_and_wait, lambda pg, t: start_allreduce(pg, t, ReduceOp.AVG, 2, []), 1.5)  # unguarded path


@pytest.mark.parametrize("elements", [ELEMENTS, SMALL], ids=["count-of-its-own", "count-in-the-tensor"])
def test_the_managers_guarded_allreduce_hands_back_a_finished_average(ranks, elements):
    # The non-finite guard is on by default. A large tensor: two collectives, averaged in a callback of both; a
    # small one: one collective of a copy one element longer, averaged back into the tensor in a callback.
    errors = Errors()
    guard = NonFiniteGuard(HealthConfig(), lambda *args, **kwargs: None, lambda step, exc: errors.append(exc))
    exercise(ranks, guarded_sum_and_wait if elements == ELEMENTS else packed_sum_and_wait,
             lambda pg, t: errors.managed(guard.start(pg, t, ReduceOp.AVG, 2, Step(number=0), True, []), t), 1.5,
             elements=elements)
    assert errors == []


def test_a_managed_works_future_is_ordered_for_a_reader_that_only_holds_the_future(ranks):
    # DDP's reducer waits on the comm hook's future, not on the work.
    errors = Errors()
    exercise(ranks, sum_and_wait,
             lambda pg, t: errors.managed(start_allreduce(pg, t, ReduceOp.AVG, 2, []), t).get_future(), 1.5)
    assert errors == []


def test_a_quantized_allreduce_and_its_division_are_ordered_on_the_readers_stream(ranks):
    # 1.0 and 2.0 are exact in 8 bits (each block's scale is its max / 127); 1e-2 leaves room for rounding
    exercise(ranks, quantized_and_wait, lambda pg, t: start_quantized_allreduce(pg, t, ReduceOp.AVG, 2), 1.5,
             tolerance=1e-2)
