"""The staging ring's bookkeeping on CPU: a plain copy stands in for the copy to the GPU.

The stager here takes every target (a GPU run stages contiguous CUDA tensors
only); the copier records what it was asked to copy and when. What a CPU
checks: the bytes land in the targets, through slots that all come back; a
block's sum is its chunks' sums; the copies start while later bytes are
still arriving; receiving blocks again, abandoning, and a ring too small for
the streams neither lose bytes nor hang.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from tests.unit.helpers import MIXED_STATE as STATE, encoded, fill_in_place
from torchft_lite.errors import CheckpointTransferError
from torchft_lite.serialization import decode, staging


class RecordingCopier:
    """Copies at once, as a finished GPU copy would have; notes each copy's bytes and how much had arrived."""

    def __init__(self) -> None:
        self.copies: list[int] = []
        self.arrived_at_copy: list[int] = []
        self.writer: decode.TensorWriter | None = None

    def start(self, source: torch.Tensor, target: torch.Tensor):
        assert source.numel() == target.numel()
        target.copy_(source)
        self.copies.append(source.numel())
        self.arrived_at_copy.append(self.writer.received_bytes if self.writer is not None else -1)
        return lambda: None


def targets_like(state: dict) -> dict:
    return {(name,): torch.zeros_like(tensor) for name, tensor in state.items()}


class Staging:
    """A stager over a CPU ring, with a checksum thread of its own (``settle()`` waits for its jobs)."""

    def __init__(self, slots: int, slot_bytes: int, copier: RecordingCopier) -> None:
        self.ring = staging.StagingRing(slots, slot_bytes, lambda n: torch.empty(n, dtype=torch.uint8))
        self._executor = concurrent.futures.ThreadPoolExecutor(1)
        self.stager = staging.Stager(self.ring, copier, takes=lambda tensor: True, executor=self._executor,
                                      slot_wait=5.0)

    def settle(self) -> int:
        """Slots free once every job queued so far has run."""
        self._executor.submit(lambda: None).result(30)
        return self.ring.free()

    def writer(self, data_of: dict = STATE) -> tuple[decode.TensorWriter, bytes, bytes]:
        """A writer of ``data_of``'s encoding into zeroed targets, staged here; and that encoding's data and sums."""
        header, data, trailer = encoded(data_of)
        self.targets = targets_like(data_of)
        return decode.TensorWriter(header, self.targets, self.stager), data, trailer


def begun(writer: decode.TensorWriter, data: bytes, start: int, count: int) -> None:
    """A stream that wrote ``count`` bytes of its range at ``start`` and stopped there (it holds a slot)."""
    view = writer.buffer_at(start, start + 4096)
    view[:count] = data[start:start + count]
    writer.filled(start, count)


def receive(state: dict, slots: int, slot_bytes: int, piece: int) -> tuple[dict, RecordingCopier, Staging]:
    copier = RecordingCopier()
    staging = Staging(slots, slot_bytes, copier)
    writer, data, trailer = staging.writer(state)
    copier.writer = writer
    fill_in_place(writer, data, 0, len(data), piece)
    writer.expect(0, len(data), trailer)
    return writer.finish(), copier, staging


def test_bytes_land_in_the_targets_through_slots_that_all_come_back():
    result, copier, staging = receive(STATE, slots=3, slot_bytes=1024, piece=700)
    for name, tensor in STATE.items():
        assert result[name] is staging.targets[(name,)] and torch.equal(result[name], tensor)
    assert sum(copier.copies) == sum(t.numel() * t.element_size() for t in STATE.values())
    assert staging.settle() == 3


def test_a_block_longer_than_a_slot_is_summed_from_its_chunks():
    # blocks of 4096 bytes (test_decode's), slots of 1024: each full block is four chunks, its sum theirs added
    result, copier, _ = receive(STATE, slots=2, slot_bytes=1024, piece=4096)
    assert torch.equal(result["a"], STATE["a"])
    assert max(copier.copies) == 1024


def test_copies_start_while_later_bytes_are_still_arriving():
    _, copier, _ = receive(STATE, slots=4, slot_bytes=1024, piece=512)
    total = sum(t.numel() * t.element_size() for t in STATE.values())
    assert copier.arrived_at_copy[0] < total // 2  # the first chunk went to the device early on


def test_damaged_bytes_fail_the_checksum_of_their_block():
    staging = Staging(2, 1024, RecordingCopier())
    writer, data, trailer = staging.writer()
    damaged = bytearray(data)
    damaged[5000] ^= 0xFF
    fill_in_place(writer, bytes(damaged), 0, len(data), 1000)
    writer.expect(0, len(data), trailer)
    with pytest.raises(CheckpointTransferError, match="checksum mismatch"):
        writer.finish()
    assert staging.settle() == 2


def test_more_streams_than_slots_take_an_overflow_slot_instead_of_waiting_forever():
    staging = Staging(1, 1024, RecordingCopier())
    writer, data, trailer = staging.writer()
    begun(writer, data, 0, 512)  # stream 1 holds the only slot, half filled
    fill_in_place(writer, data, 4096, len(data), 300)  # stream 2: no slot of the ring can come back
    fill_in_place(writer, data, 512, 4096, 300)
    writer.expect(0, len(data), trailer)
    assert torch.equal(writer.finish()["a"], STATE["a"])
    assert staging.settle() == 1


def test_blocks_received_again_give_their_slots_back_and_take_the_new_bytes():
    staging = Staging(2, 1024, RecordingCopier())
    writer, data, trailer = staging.writer()
    garbage = bytes(len(data))
    fill_in_place(writer, garbage, 0, 4096, 1024)  # block 0 complete, with wrong bytes
    begun(writer, garbage, 4096, 100)  # block 1 half read when its stream broke
    writer.receive_again([0, 1])
    fill_in_place(writer, data, 0, len(data), 1000)
    writer.expect(0, len(data), trailer)
    assert torch.equal(writer.finish()["a"], STATE["a"])
    assert staging.settle() == 2


def test_an_abandoned_receive_copies_nothing_more_and_gives_its_slots_back():
    # The receiver abandons its stager when a heal fails, whether after every byte or half-way
    copier = RecordingCopier()
    staging = Staging(2, 1024, copier)
    writer, data, _ = staging.writer()
    fill_in_place(writer, data, 4096, 8192, 1024)  # block 1 full: its four chunks are queued or copied
    begun(writer, data, 0, 10)
    writer.abandon()
    with pytest.raises(CheckpointTransferError, match="after its receive was abandoned"):
        fill_in_place(writer, data, 8192, 12288, 1024)  # a stream that had not stopped yet takes no slot
    assert staging.settle() == 2
    assert len(copier.copies) <= 4  # block 2's four would make eight


def test_a_ring_with_every_slot_held_names_what_it_waited_for():
    ring = staging.StagingRing(1, 64, lambda n: torch.empty(n, dtype=torch.uint8))
    held = ring.acquire(1.0)
    with pytest.raises(CheckpointTransferError, match="no staging slot came free within 0.05s"):
        ring.acquire(0.05)
    ring.release(held)
    assert ring.free() == 1


def test_slots_must_be_whole_words():
    with pytest.raises(ValueError, match="multiple of 8"):
        staging.StagingRing(2, 1020, lambda n: torch.empty(n, dtype=torch.uint8))


def test_only_gpu_targets_are_staged_by_default():
    assert staging.stager_for({("a",): torch.zeros(3)}) is None
    assert staging.stager_for({}) is None
