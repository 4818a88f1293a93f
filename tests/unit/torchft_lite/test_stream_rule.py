"""The stream rule (``torchft_lite.work``), in what a CPU can check: who waits, in which order.

On a GPU the rule means the consumer's current stream waits for a result; what
makes it so is that every wait ends in the CUDA-aware future's ``wait()`` (or
c10d's ``Work.wait()``), and that a result is set only after the backend's
``Work.synchronize()``. These tests pin that order with futures and works
that record their calls; tests/gpu/test_stream_rule.py checks the effect on a
real device.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torchft_lite.collectives import _QuantizedWork
from torchft_lite.errors import CollectiveError
from torchft_lite.process_group import tracked_work
from torchft_lite.process_group.tracked_work import TrackedWork
from torchft_lite.work import ManagedWork, completion_streams, cuda_devices, device_future


class RecordingFuture(torch.futures.Future):
    """A torch future that counts its ``wait()`` calls (where a CUDA-aware one makes the caller's streams wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self):
        self.waits += 1
        return super().wait()


class BackendWork(dist.Work):
    """A backend's work: its future completes when the test says; ``synchronize()`` notes what was done by then."""

    def __init__(self, has_future: bool = True) -> None:
        super().__init__()
        self.source: torch.futures.Future = torch.futures.Future()
        self.has_future = has_future
        self.synchronized: list[bool] = []  # whether our future was already set at each synchronize()
        self.ours: torch.futures.Future | None = None

    def synchronize(self) -> None:
        self.synchronized.append(self.ours is not None and self.ours.done())

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.source.wait()
        self.synchronize()  # what c10d's Work.wait() does once the work is done
        return True

    def get_future(self) -> torch.futures.Future:
        if not self.has_future:
            raise RuntimeError("no future for this work (as gloo's send and recv)")
        return self.source


def tracked(backend: BackendWork, outputs=None, devices=()) -> TrackedWork:
    def fail(exc: BaseException, timeout: timedelta) -> CollectiveError:
        return CollectiveError(str(exc))

    return TrackedWork(backend, op="allreduce", timeout=timedelta(seconds=30), wait=lambda w, t: w.wait(t),
                       on_error=fail, outputs=outputs, devices=devices)


def test_a_tracked_work_on_cuda_sets_its_future_only_after_the_backends_synchronize(monkeypatch) -> None:
    # The device path, with its CUDA pieces made plain: side streams (none here) and a CUDA-aware future.
    monkeypatch.setattr(tracked_work, "completion_streams", lambda devices: contextlib.nullcontext())
    monkeypatch.setattr(tracked_work, "device_future", lambda devices: torch.futures.Future())
    backend = BackendWork()
    work = tracked(backend, devices=(torch.device("cuda", 0),))
    backend.ours = work.get_future()
    backend.source.set_result([torch.ones(2)])
    assert backend.ours.done()
    assert backend.synchronized == [False]  # synchronized once, before the result was set


def test_a_tracked_work_on_cpu_sets_its_future_from_the_backends_result_alone() -> None:
    backend = BackendWork()
    work = tracked(backend)
    backend.ours = work.get_future()
    backend.source.set_result([torch.ones(2)])
    assert torch.equal(backend.ours.value()[0], torch.ones(2))
    assert backend.synchronized == []  # nothing to order on a CPU


def test_a_tracked_works_wait_after_its_result_reached_the_future_waits_on_that_future(monkeypatch) -> None:
    futures: list[RecordingFuture] = []

    def recording(devices):
        futures.append(RecordingFuture())
        return futures[-1]

    monkeypatch.setattr(tracked_work, "device_future", recording)
    backend = BackendWork()
    work = tracked(backend)
    work.get_future()
    backend.source.set_result([torch.ones(2)])  # the backend's work is released now
    assert work.wait()
    assert futures[0].waits == 1  # where a CUDA future leaves the caller's streams waiting for its events


def test_a_tracked_work_without_a_backend_future_yields_its_outputs_after_a_synchronizing_wait() -> None:
    received = [torch.zeros(3)]
    backend = BackendWork(has_future=False)
    work = tracked(backend, outputs=received)
    future = work.get_future()
    backend.source.set_result(None)
    assert future.wait() is received  # the received tensors: a CUDA future records their events
    assert backend.synchronized and backend.synchronized[0] is False


def test_managed_work_wait_with_a_timeout_ends_in_the_futures_wait() -> None:
    future = RecordingFuture()
    future.set_result(torch.ones(1))
    assert ManagedWork(future).wait(timedelta(seconds=5))
    assert future.waits == 1


def test_managed_work_wait_that_times_out_returns_false_without_waiting() -> None:
    future = RecordingFuture()
    assert not ManagedWork(future).wait(timedelta(seconds=0))
    assert future.waits == 0


def test_a_quantized_works_wait_ends_in_the_futures_wait() -> None:
    future = RecordingFuture()
    future.set_result([torch.ones(1)])
    assert _QuantizedWork(future, None).wait()
    assert future.waits == 1


def test_a_quantized_works_wait_raises_the_collectives_error() -> None:
    future = RecordingFuture()
    future.set_exception(RuntimeError("peer gone"))
    with pytest.raises(RuntimeError, match="peer gone"):
        _QuantizedWork(future, None).wait()


def test_cpu_values_make_plain_futures_and_no_streams() -> None:
    value = {"a": [torch.ones(1), (torch.zeros(2),)], "b": 3}
    assert cuda_devices(value) == ()
    future = device_future(cuda_devices(value))
    future.set_result(value)
    assert future.wait() is value
    with completion_streams(()):
        pass  # nothing to enter without CUDA devices
