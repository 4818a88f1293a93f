"""Wire details of the benchmark's lean h2c client (benchmarks/_h2_wire.py)."""

import hpack
import pytest

from benchmarks._h2_wire import HeaderDecoder, grpc_timeout


def test_cached_header_blocks_follow_the_dynamic_table():
    """The same bytes (an indexed field) mean another header once the table changed."""
    decoder = HeaderDecoder()
    index_62 = b"\xbe"  # the newest dynamic-table entry
    assert decoder.decode(b"\x40\x01a\x011") == [(b"a", b"1")]  # literal, incremental indexing
    assert decoder.decode(index_62) == [(b"a", b"1")]
    assert decoder.decode(index_62) == [(b"a", b"1")]  # from the cache
    assert decoder.decode(b"\x40\x01b\x012") == [(b"b", b"2")]
    assert decoder.decode(index_62) == [(b"b", b"2")]
    index_63 = b"\xbf"
    assert decoder.decode(index_63) == [(b"a", b"1")]
    assert decoder.decode(b"\x3f\x09") == []  # table size update to 40 bytes: room for one 34-byte entry
    assert decoder.decode(b"\x40\x01c\x013") == [(b"c", b"3")]
    assert decoder.decode(index_62) == [(b"c", b"3")]
    with pytest.raises(hpack.HPACKDecodingError):  # evicted: not served from the cache
        decoder.decode(index_63)


def test_header_blocks_from_a_real_encoder_decode_as_hpack_does():
    encoder, decoder, reference = hpack.Encoder(), HeaderDecoder(), hpack.Decoder()
    for i in range(300):
        headers = [(b":status", b"200"), (b"content-type", b"application/grpc"), (b"date", b"t%d" % (i // 50))]
        block = encoder.encode(headers, huffman=True)
        assert decoder.decode(block) == reference.decode(block, raw=True) == headers


def test_grpc_timeout_uses_at_most_eight_digits():
    assert grpc_timeout(0.0001) == b"1m"
    assert grpc_timeout(5.0) == b"5000m"
    assert grpc_timeout(120.0) == b"120000m"
    assert grpc_timeout(10**6) == b"1000000S"
    assert grpc_timeout(10**9) == b"16666667M"
