"""StateDictReader: pieces written in place, crc32 chained per run, damage and gaps named."""

import pytest
import torch

from torchft_lite.checkpointing import _serialization as wire
from torchft_lite.errors import CheckpointTransferError


def header_and_data(state: dict) -> tuple[wire.Header, bytes]:
    blob = wire.encode_to_bytes(3, state)
    length, crc = wire.unpack_prefix(blob[:wire.PREFIX_SIZE])
    header = wire.parse_header(blob[wire.PREFIX_SIZE:wire.PREFIX_SIZE + length], crc)
    return header, blob[wire.PREFIX_SIZE + length:]


STATE = {"a": torch.arange(1000, dtype=torch.float32), "empty": torch.empty(0), "b": torch.arange(7, dtype=torch.int64)}


def fill_in_place(reader: wire.StateDictReader, data: bytes, start: int, end: int, piece: int) -> None:
    """What the HTTP client does: ask for a view of the destination, let "the kernel" write, report."""
    position = start
    while position < end:
        view = reader.buffer_at(position, end)[:piece]
        view[:] = data[position:position + len(view)]
        reader.filled(position, len(view))
        position += len(view)


@pytest.mark.parametrize("piece", [1, 333, 1 << 20])
def test_ranges_split_inside_tensors_and_filled_in_place_verify(piece):
    header, data = header_and_data(STATE)
    reader = wire.StateDictReader(header)
    bounds = [0, 1001, 2500, len(data)]  # ranges that cut tensor "a" twice, fetched out of order
    for start, end in [(bounds[2], bounds[3]), (bounds[0], bounds[1]), (bounds[1], bounds[2])]:
        fill_in_place(reader, data, start, end, piece)
    state = reader.finish()
    assert torch.equal(state["a"], STATE["a"]) and torch.equal(state["b"], STATE["b"])
    assert state["empty"].numel() == 0


def test_a_buffer_never_spans_two_tensors():
    header, _ = header_and_data(STATE)
    reader = wire.StateDictReader(header)
    assert len(reader.buffer_at(0, header.data_bytes)) == 4000
    assert len(reader.buffer_at(3990, header.data_bytes)) == 10
    assert len(reader.buffer_at(4000, header.data_bytes)) == 56


def test_a_damaged_piece_fails_the_tensors_checksum():
    header, data = header_and_data(STATE)
    reader = wire.StateDictReader(header)
    damaged = bytearray(data)
    damaged[1500] ^= 1
    fill_in_place(reader, bytes(damaged), 0, len(data), 512)
    with pytest.raises(CheckpointTransferError, match="checksum mismatch in tensor a"):
        reader.finish()


def test_a_gap_and_a_repeat_are_named():
    header, data = header_and_data(STATE)
    gap = wire.StateDictReader(header)
    gap.write(0, data[:100])
    gap.write(200, data[200:])
    with pytest.raises(CheckpointTransferError, match="truncated"):
        gap.finish()
    repeat = wire.StateDictReader(header)
    repeat.write(0, data)
    repeat.write(0, data[:8])
    with pytest.raises(CheckpointTransferError, match="repeated"):
        repeat.finish()


def test_bytes_outside_the_data_section_are_refused():
    header, data = header_and_data(STATE)
    reader = wire.StateDictReader(header)
    with pytest.raises(CheckpointTransferError, match="outside"):
        reader.buffer_at(len(data), len(data) + 10)
    with pytest.raises(CheckpointTransferError, match="outside"):
        reader.write(len(data) - 2, b"abcd")
