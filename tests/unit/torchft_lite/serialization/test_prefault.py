"""Populating a fresh receive's pages: it never changes a byte, and only fresh tensors are populated."""

import threading

import pytest
import torch

from tests.conftest import wait_until_sync
from torchft_lite.serialization import decode, encode, prefault

POLL = dict(timeout=30.0, interval=0.005)  # how the tests below wait for the populating threads

MiB = 1 << 20


def state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(MiB // 4, generator=generator), "b": torch.randn(3 * MiB // 16, generator=generator),
            "small": torch.arange(10)}


def test_populating_a_live_tensor_keeps_every_byte():
    if not prefault.supported():
        pytest.skip("this kernel (or OS) has no MADV_POPULATE_WRITE; populate() then does nothing")
    tensor = torch.randn(MiB // 4 + 13)
    before = tensor.clone()
    # unaligned at both ends: the pages it shares with its neighbours are populated whole, and left as they were
    assert prefault.populate(tensor.data_ptr() + 6, tensor.numel() * 4 - 9)
    assert torch.equal(tensor, before)


def test_nothing_is_populated_where_it_cannot_be(monkeypatch):
    assert prefault.populate(0, 0) is False  # an empty range
    monkeypatch.setattr(prefault, "_unsupported", True)
    assert prefault.supported() is False
    assert prefault.populate(torch.empty(10).data_ptr(), 40) is False


def blocks_populated(monkeypatch, targets) -> tuple[list[int], dict]:
    calls: list[int] = []
    real = prefault.populate
    monkeypatch.setattr(prefault, "populate", lambda address, length: calls.append(length) or real(address, length))
    sent = state(5)
    step, got = decode.decode_bytes(encode.encode_to_bytes(5, sent, block_bytes=512 << 10), targets)
    assert step == 5 and all(torch.equal(got[name], sent[name]) for name in sent)
    return calls, got


def test_each_block_of_a_fresh_tensor_is_populated_once(monkeypatch):
    if not prefault.supported():
        pytest.skip("this kernel (or OS) has no MADV_POPULATE_WRITE: nothing is populated")
    calls, _ = blocks_populated(monkeypatch, None)
    # a populating thread may still be inside the call it claimed a block for
    wait_until_sync(lambda: len(calls) >= 4, "four populated blocks", **POLL)
    # "a" is two 512 KiB blocks, "b" one of 512 KiB and one of 256 KiB; "small" (80 bytes) is left to fault
    assert sorted(calls) == [256 << 10] + [512 << 10] * 3


def test_tensors_received_in_place_are_not_populated(monkeypatch):
    mine = state(1)
    calls, got = blocks_populated(monkeypatch, decode.targets_of(mine))
    assert got["a"] is mine["a"] and calls == []


class GatedPopulate:
    """A stand-in for ``populate`` that records each block and holds the threads until ``release``."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.gate = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, address: int, length: int) -> bool:
        with self.lock:
            self.calls.append(address)
        self.gate.wait(30)
        return True


def test_the_threads_and_the_writes_populate_every_block_exactly_once(monkeypatch):
    fake = GatedPopulate()
    monkeypatch.setattr(prefault, "populate", fake)
    blocks = [(i, 1) for i in range(40)]
    blocks[3] = None  # a block left to fault
    populator = prefault.Populator(list(blocks), keep=object())
    wait_until_sync(lambda: len(fake.calls) == prefault.POPULATE_THREADS, "a block held by each thread", **POLL)
    claimed = [populator.claim(i) for i in range(40)]
    fake.gate.set()
    wait_until_sync(lambda: populator._pending == 0, "every block to be populated", **POLL)
    by_threads = set(fake.calls)
    by_writes = {block[0] for block in claimed if block is not None}
    assert not by_threads & by_writes and by_threads | by_writes == set(range(40)) - {3}
    assert populator.claim(5) is None and populator._keep is None  # nothing left, nothing kept alive


def test_the_threads_go_on_after_the_latest_write(monkeypatch):
    fake = GatedPopulate()
    monkeypatch.setattr(prefault, "populate", fake)
    populator = prefault.Populator([(i, 1) for i in range(100)], keep=object())
    wait_until_sync(lambda: len(fake.calls) == prefault.POPULATE_THREADS, "a block held by each thread", **POLL)
    assert sorted(fake.calls) == list(range(prefault.POPULATE_THREADS))  # from the start at first
    assert populator.claim(50) == (50, 1)  # a second stream writes at block 50: the threads move there
    fake.gate.set()
    wait_until_sync(lambda: len(fake.calls) >= 2 * prefault.POPULATE_THREADS, "the threads' second blocks", **POLL)
    threads = prefault.POPULATE_THREADS
    assert sorted(fake.calls[threads:2 * threads]) == list(range(51, 51 + threads))
    populator.stop()


def test_a_stopped_populator_takes_no_more_blocks(monkeypatch):
    fake = GatedPopulate()
    monkeypatch.setattr(prefault, "populate", fake)
    populator = prefault.Populator([(i, 1) for i in range(100)], keep=object())
    wait_until_sync(lambda: len(fake.calls) == prefault.POPULATE_THREADS, "a block held by each thread", **POLL)
    populator.stop()
    fake.gate.set()
    wait_until_sync(lambda: populator._keep is None, "the threads to leave and let go of the tensors", **POLL)
    assert len(fake.calls) == prefault.POPULATE_THREADS
