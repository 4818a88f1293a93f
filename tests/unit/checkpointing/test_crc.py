"""crc32_combine and the parallel checksums against zlib."""

import os
import zlib

import pytest

from torchft_lite.checkpointing import _crc
from torchft_lite.errors import CheckpointError


@pytest.mark.parametrize(("first", "second"), [(b"", b""), (b"a", b""), (b"", b"b"), (b"hello ", b"world"),
                                               (os.urandom(1000), os.urandom(70_001))])
def test_combine_matches_the_crc_of_the_concatenation(first, second):
    assert _crc.crc32_combine(zlib.crc32(first), zlib.crc32(second), len(second)) == zlib.crc32(first + second)


def test_parallel_checksums_match_zlib_across_slice_boundaries():
    data = memoryview(os.urandom(2 * _crc.SLICE_BYTES + 12345))
    views = [data, data[:3], data[7:_crc.SLICE_BYTES + 9], data[:0]]
    assert _crc.checksums(views) == [zlib.crc32(view) for view in views]


def test_checksums_stop_when_asked():
    data = memoryview(bytes(3 * _crc.SLICE_BYTES))
    with pytest.raises(CheckpointError, match="abandoned"):
        _crc.checksums([data], should_stop=lambda: True)
