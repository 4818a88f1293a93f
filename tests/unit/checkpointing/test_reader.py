"""StateDictReader: pieces written in place, a sum64 per block, damage, gaps and missing checksums named."""

import pytest
import torch

from torchft_lite.checkpointing import _checksum
from torchft_lite.checkpointing import _serialization as wire
from torchft_lite.errors import CheckpointTransferError

BLOCK = 4096
STATE = {"a": torch.arange(5000, dtype=torch.float32), "empty": torch.empty(0),
         "b": torch.arange(7, dtype=torch.int64), "c": torch.arange(3, dtype=torch.bfloat16)}


def encoded(state: dict = STATE) -> tuple[wire.Header, bytes, bytes]:
    """``(header, data, trailer)`` of ``state`` with small blocks, so tensors span several."""
    blob = wire.encode_to_bytes(3, state, block_bytes=BLOCK)
    length, crc = wire.unpack_prefix(blob[:wire.PREFIX_SIZE])
    header = wire.parse_header(blob[wire.PREFIX_SIZE:wire.PREFIX_SIZE + length], crc)
    data_start = wire.PREFIX_SIZE + length
    return header, blob[data_start:data_start + header.data_bytes], blob[data_start + header.data_bytes:]


def fill_in_place(reader: wire.StateDictReader, data: bytes, start: int, end: int, piece: int) -> None:
    """What the HTTP client does: ask for a view of the destination, let "the kernel" write, report."""
    position = start
    while position < end:
        view = reader.buffer_at(position, end)[:piece]
        view[:] = data[position:position + len(view)]
        reader.filled(position, len(view))
        position += len(view)


def test_blocks_cut_every_tensor_and_the_trailer_has_one_sum_each():
    header, data, trailer = encoded()
    spans = header.blocks.spans
    assert [(s, e) for s, e, t in spans if t == 0] == [(0, 4096), (4096, 8192), (8192, 12288), (12288, 16384),
                                                      (16384, 20000)]
    assert spans[5:] == [(20000, 20056, 2), (20056, 20062, 3)]  # the empty tensor has no block
    assert _checksum.unpack(trailer) == [_checksum.sum64(memoryview(data)[s:e]) for s, e, _ in spans]


@pytest.mark.parametrize("piece", [1, 333, 1 << 20])
def test_block_aligned_ranges_filled_in_place_out_of_order_verify(piece):
    header, data, trailer = encoded()
    reader = wire.StateDictReader(header)
    ranges = header.blocks.split(3)
    assert len(ranges) == 3 and all(header.blocks.covering(*r) for r in ranges)
    for start, end in reversed(ranges):
        fill_in_place(reader, data, start, end, piece)
        sums = _checksum.unpack(trailer)
        covered = header.blocks.covering(start, end)
        reader.expect(start, end, _checksum.pack(sums[covered.start:covered.stop]))
    state = reader.finish()
    for name in STATE:
        assert torch.equal(state[name], STATE[name])


def test_a_buffer_never_spans_two_blocks_or_tensors():
    header, _, _ = encoded()
    reader = wire.StateDictReader(header)
    assert len(reader.buffer_at(0, header.data_bytes)) == BLOCK
    assert len(reader.buffer_at(4000, header.data_bytes)) == 96
    assert len(reader.buffer_at(19990, header.data_bytes)) == 10
    assert len(reader.buffer_at(20000, header.data_bytes)) == 56


def test_a_damaged_byte_fails_its_blocks_checksum_naming_the_tensor_and_bytes():
    header, data, trailer = encoded()
    reader = wire.StateDictReader(header)
    damaged = bytearray(data)
    damaged[5000] ^= 1
    fill_in_place(reader, bytes(damaged), 0, len(data), 512)
    reader.expect(0, len(data), trailer)
    with pytest.raises(CheckpointTransferError, match=r"checksum mismatch in tensor a bytes \[4096, 8192\)"):
        reader.finish()


def test_swapped_blocks_are_caught():
    """Bytes placed at the wrong block: every block has its own sum."""
    header, data, trailer = encoded()
    reader = wire.StateDictReader(header)
    swapped = data[BLOCK:2 * BLOCK] + data[:BLOCK] + data[2 * BLOCK:]
    reader.write(0, swapped)
    reader.expect(0, len(data), trailer)
    with pytest.raises(CheckpointTransferError, match="checksum mismatch in tensor a"):
        reader.finish()


def test_a_gap_a_repeat_and_a_missing_trailer_are_named():
    header, data, trailer = encoded()
    gap = wire.StateDictReader(header)
    gap.write(0, data[:100])
    gap.write(200, data[200:])
    gap.expect(0, len(data), trailer)
    with pytest.raises(CheckpointTransferError, match="truncated"):
        gap.finish()
    repeat = wire.StateDictReader(header)
    repeat.write(0, data)
    with pytest.raises(CheckpointTransferError, match="received twice"):
        repeat.write(0, data[:8])
    no_sums = wire.StateDictReader(header)
    no_sums.write(0, data)
    with pytest.raises(CheckpointTransferError, match="checksum of tensor a bytes \\[0, 4096\\) never arrived"):
        no_sums.finish()
    twice = wire.StateDictReader(header)
    twice.expect(0, len(data), trailer)
    with pytest.raises(CheckpointTransferError, match="arrived twice"):
        twice.expect(0, BLOCK, trailer[:8])


def test_checksums_for_a_range_off_block_boundaries_or_of_the_wrong_count_are_refused():
    header, data, trailer = encoded()
    reader = wire.StateDictReader(header)
    with pytest.raises(CheckpointTransferError, match="block boundaries"):
        reader.expect(0, 1000, trailer[:8])
    with pytest.raises(CheckpointTransferError, match="2 checksums for the 1 blocks"):
        reader.expect(0, BLOCK, trailer[:16])
    with pytest.raises(CheckpointTransferError, match="whole number"):
        reader.expect(0, BLOCK, trailer[:5])


def test_bytes_outside_the_data_section_are_refused():
    header, data, _ = encoded()
    reader = wire.StateDictReader(header)
    with pytest.raises(CheckpointTransferError, match="outside"):
        reader.buffer_at(len(data), len(data) + 10)
    with pytest.raises(CheckpointTransferError, match="outside"):
        reader.write(len(data) - 2, b"abcd")


def test_sum64_is_the_wrapping_word_sum_with_a_zero_padded_tail():
    words = [2**64 - 1, 5, 2**63]
    raw = b"".join(w.to_bytes(8, "little") for w in words) + b"\x01\x02\x03"
    assert _checksum.sum64(memoryview(raw)) == (sum(words) + 0x030201) % 2**64
    assert _checksum.sum64(memoryview(bytearray(raw))[1:]) == _checksum.sum64(memoryview(raw[1:]))  # unaligned
    assert _checksum.sum64(memoryview(b"")) == 0
