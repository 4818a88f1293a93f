"""Populating a fresh receive's pages: it never changes a byte, and only fresh tensors are populated."""

import pytest
import torch

from torchft_lite.checkpointing import _decode, _encode, _prefault

MiB = 1 << 20


def state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(MiB // 4, generator=generator), "b": torch.randn(3 * MiB // 16, generator=generator),
            "small": torch.arange(10)}


def test_populating_a_live_tensor_keeps_every_byte():
    if not _prefault.supported():
        pytest.skip("this kernel (or OS) has no MADV_POPULATE_WRITE; populate() then does nothing")
    tensor = torch.randn(MiB // 4 + 13)
    before = tensor.clone()
    # unaligned at both ends: the pages it shares with its neighbours are populated whole, and left as they were
    assert _prefault.populate(tensor.data_ptr() + 6, tensor.numel() * 4 - 9)
    assert torch.equal(tensor, before)


def test_nothing_is_populated_where_it_cannot_be(monkeypatch):
    assert _prefault.populate(0, 0) is False  # an empty range
    monkeypatch.setattr(_prefault, "_unsupported", True)
    assert _prefault.supported() is False
    assert _prefault.populate(torch.empty(10).data_ptr(), 40) is False


def blocks_populated(monkeypatch, targets) -> tuple[list[int], dict]:
    calls: list[int] = []
    real = _prefault.populate
    monkeypatch.setattr(_prefault, "populate", lambda address, length: calls.append(length) or real(address, length))
    sent = state(5)
    step, got = _decode.decode_bytes(_encode.encode_to_bytes(5, sent, block_bytes=512 << 10), targets)
    assert step == 5 and all(torch.equal(got[name], sent[name]) for name in sent)
    return calls, got


def test_each_block_of_a_fresh_tensor_is_populated_once(monkeypatch):
    if not _prefault.supported():
        pytest.skip("this kernel (or OS) has no MADV_POPULATE_WRITE: nothing is populated")
    calls, _ = blocks_populated(monkeypatch, None)
    # "a" is two 512 KiB blocks, "b" one of 512 KiB and one of 256 KiB; "small" (80 bytes) is left to fault
    assert sorted(calls) == [256 << 10] + [512 << 10] * 3


def test_tensors_received_in_place_are_not_populated(monkeypatch):
    mine = state(1)
    calls, got = blocks_populated(monkeypatch, _decode.targets_of(mine))
    assert got["a"] is mine["a"] and calls == []
