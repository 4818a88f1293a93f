"""TensorWriter: pieces written in place, a sum64 per block, damage, gaps and missing checksums named."""

import pytest
import torch

from tests.unit.helpers import MIXED_STATE as STATE, SMALL_BLOCK as BLOCK, encoded, fill_in_place
from torchft_lite.errors import CheckpointTransferError
from torchft_lite.serialization import checksum, decode


def test_blocks_cut_every_tensor_and_the_trailer_has_one_sum_each():
    header, data, trailer = encoded()
    spans = header.blocks.spans
    assert [(s, e) for s, e, t in spans if t == 0] == [(0, 4096), (4096, 8192), (8192, 12288), (12288, 16384),
                                                      (16384, 20000)]
    assert spans[5:] == [(20000, 20056, 2), (20056, 20062, 3)]  # the empty tensor has no block
    assert checksum.unpack(trailer) == [checksum.sum64(memoryview(data)[s:e]) for s, e, _ in spans]


@pytest.mark.parametrize("piece", [1, 333, 1 << 20])
def test_block_aligned_ranges_filled_in_place_out_of_order_verify(piece):
    header, data, trailer = encoded()
    writer = decode.TensorWriter(header)
    ranges = header.blocks.split(3)
    assert len(ranges) == 3 and all(header.blocks.covering(*r) for r in ranges)
    for start, end in reversed(ranges):
        fill_in_place(writer, data, start, end, piece)
        sums = checksum.unpack(trailer)
        covered = header.blocks.covering(start, end)
        writer.expect(start, end, checksum.pack(sums[covered.start:covered.stop]))
    state = writer.finish()
    for name in STATE:
        assert torch.equal(state[name], STATE[name])


def test_a_buffer_never_spans_two_blocks_or_tensors():
    header, _, _ = encoded()
    writer = decode.TensorWriter(header)
    assert len(writer.buffer_at(0, header.data_bytes)) == BLOCK
    assert len(writer.buffer_at(4000, header.data_bytes)) == 96
    assert len(writer.buffer_at(19990, header.data_bytes)) == 10
    assert len(writer.buffer_at(20000, header.data_bytes)) == 56


def test_a_damaged_byte_fails_its_blocks_checksum_naming_the_tensor_and_bytes():
    header, data, trailer = encoded()
    writer = decode.TensorWriter(header)
    damaged = bytearray(data)
    damaged[5000] ^= 1
    fill_in_place(writer, bytes(damaged), 0, len(data), 512)
    writer.expect(0, len(data), trailer)
    with pytest.raises(CheckpointTransferError, match=r"checksum mismatch in tensor a bytes \[4096, 8192\)"):
        writer.finish()


def test_swapped_blocks_are_caught():
    """Bytes placed at the wrong block: every block has its own sum."""
    header, data, trailer = encoded()
    writer = decode.TensorWriter(header)
    swapped = data[BLOCK:2 * BLOCK] + data[:BLOCK] + data[2 * BLOCK:]
    writer.write(0, swapped)
    writer.expect(0, len(data), trailer)
    with pytest.raises(CheckpointTransferError, match="checksum mismatch in tensor a"):
        writer.finish()


def test_a_gap_a_repeat_and_a_missing_trailer_are_named():
    header, data, trailer = encoded()
    gap = decode.TensorWriter(header)
    gap.write(0, data[:100])
    gap.write(200, data[200:])
    gap.expect(0, len(data), trailer)
    with pytest.raises(CheckpointTransferError, match="truncated"):
        gap.finish()
    repeat = decode.TensorWriter(header)
    repeat.write(0, data)
    with pytest.raises(CheckpointTransferError, match="received twice"):
        repeat.write(0, data[:8])
    no_sums = decode.TensorWriter(header)
    no_sums.write(0, data)
    with pytest.raises(CheckpointTransferError, match="checksum of tensor a bytes \\[0, 4096\\) never arrived"):
        no_sums.finish()
    twice = decode.TensorWriter(header)
    twice.expect(0, len(data), trailer)
    with pytest.raises(CheckpointTransferError, match="arrived twice"):
        twice.expect(0, BLOCK, trailer[:8])


def test_checksums_for_a_range_off_block_boundaries_or_of_the_wrong_count_are_refused():
    header, data, trailer = encoded()
    writer = decode.TensorWriter(header)
    with pytest.raises(CheckpointTransferError, match="block boundaries"):
        writer.expect(0, 1000, trailer[:8])
    with pytest.raises(CheckpointTransferError, match="2 checksums for the 1 blocks"):
        writer.expect(0, BLOCK, trailer[:16])
    with pytest.raises(CheckpointTransferError, match="whole number"):
        writer.expect(0, BLOCK, trailer[:5])


def test_bytes_outside_the_data_section_are_refused():
    header, data, _ = encoded()
    writer = decode.TensorWriter(header)
    with pytest.raises(CheckpointTransferError, match="outside"):
        writer.buffer_at(len(data), len(data) + 10)
    with pytest.raises(CheckpointTransferError, match="outside"):
        writer.write(len(data) - 2, b"abcd")


def test_sum64_is_the_wrapping_word_sum_with_a_zero_padded_tail():
    words = [2**64 - 1, 5, 2**63]
    raw = b"".join(w.to_bytes(8, "little") for w in words) + b"\x01\x02\x03"
    assert checksum.sum64(memoryview(raw)) == (sum(words) + 0x030201) % 2**64
    assert checksum.sum64(memoryview(bytearray(raw))[1:]) == checksum.sum64(memoryview(raw[1:]))  # unaligned
    assert checksum.sum64(memoryview(b"")) == 0


def test_blocks_differing_from_a_reference_are_named_by_their_bytes_or_their_senders_sum():
    header, data, trailer = encoded()
    truth = checksum.unpack(trailer)
    writer = decode.TensorWriter(header)
    damaged = bytearray(data)
    damaged[5000] ^= 1  # block 1 (tensor a bytes [4096, 8192))
    writer.write(0, bytes(damaged[:20000]))  # tensor a, whole; b and c not yet
    sums = list(truth)
    sums[3] ^= 1  # block 3's bytes are right, but its sender vouched for others
    writer.expect(0, 20000, checksum.pack(sums[:5]))
    assert writer.blocks_differing_from(truth, range(len(truth))) == [1, 3, 5, 6]  # 5 and 6 are incomplete
    assert writer.blocks_differing_from(truth, [0, 2, 4]) == []
    with pytest.raises(CheckpointTransferError, match="2 reference checksums for 7 blocks"):
        writer.blocks_differing_from(truth[:2], [0])


def test_blocks_received_again_replace_the_first_delivery_whole_or_partial():
    header, data, trailer = encoded()
    truth = checksum.unpack(trailer)
    writer = decode.TensorWriter(header)
    damaged = bytearray(data)
    damaged[5000] ^= 1
    writer.write(0, bytes(damaged[:2 * BLOCK]))  # blocks 0 and 1: block 1 wrong
    writer.expect(0, 2 * BLOCK, trailer[:16])
    writer.write(2 * BLOCK, data[2 * BLOCK:2 * BLOCK + 100])  # block 2: a stream that broke after 100 bytes
    with pytest.raises(CheckpointTransferError, match="received twice"):
        writer.write(BLOCK, data[BLOCK:2 * BLOCK])  # without receive_again, a second delivery is refused
    writer.receive_again([1, 2])
    assert writer.received_bytes == BLOCK
    writer.write(BLOCK, data[BLOCK:])
    writer.expect(BLOCK, len(data), trailer[8:])
    assert writer.blocks_differing_from(truth, range(len(truth))) == []
    state = writer.finish()
    for name in STATE:
        assert torch.equal(state[name], STATE[name])


def test_a_block_received_again_must_arrive_again_with_its_sum():
    header, data, trailer = encoded()
    writer = decode.TensorWriter(header)
    writer.write(0, data)
    writer.expect(0, len(data), trailer)
    writer.receive_again([0])
    with pytest.raises(CheckpointTransferError, match=r"truncated: 15966 of 20062"):
        writer.finish()
    writer.write(0, data[:BLOCK])
    with pytest.raises(CheckpointTransferError, match=r"checksum of tensor a bytes \[0, 4096\) never arrived"):
        writer.finish()
    with pytest.raises(ValueError, match="no data block 7"):
        writer.receive_again([7])


def test_blocks_to_fetch_again_travel_as_the_fewest_block_aligned_ranges():
    header, _, _ = encoded()
    blocks = header.blocks
    assert blocks.ranges_of([0, 1, 3, 4, 5, 6]) == [(0, 8192), (12288, 20062)]  # across tensors too: no gaps
    assert blocks.ranges_of([2]) == [(8192, 12288)] and blocks.ranges_of([]) == []
    assert all(blocks.covering(*r) for r in blocks.ranges_of([0, 1, 3, 4, 5, 6]))
    assert blocks.bytes_of([4, 5, 6]) == (20000 - 16384) + 56 + 6


def test_an_abandoned_writer_does_not_hand_over_its_state_dict():
    # Its finish() can run on a thread that outlives a timed-out receive: it must not copy into the targets then.
    header, data, trailer = encoded()
    writer = decode.TensorWriter(header)
    writer.write(0, data)
    writer.expect(0, len(data), trailer)
    writer.abandon()
    with pytest.raises(CheckpointTransferError, match="abandoned"):
        writer.finish()
