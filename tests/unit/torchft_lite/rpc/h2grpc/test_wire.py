"""HTTP/2 and gRPC framing helpers of the lighthouse's gRPC server."""

import hpack
import pytest

from torchft_lite.rpc.h2grpc import wire


def test_frame_round_trip():
    data = wire.frame(wire.HEADERS, wire.END_HEADERS | wire.END_STREAM, 0x7FFFFFFF, b"x" * 70000)
    assert wire.parse_frame_header(data) == (70000, wire.HEADERS, 5, 0x7FFFFFFF)
    assert data[9:] == b"x" * 70000


def test_reserved_bit_of_stream_id_is_ignored():
    data = bytearray(wire.frame(wire.DATA, 0, 3))
    data[5] |= 0x80
    assert wire.parse_frame_header(data)[3] == 3


@pytest.mark.parametrize("payload, flags, expected", [
    (b"\x02abcXY", wire.PADDED, b"abc"),
    (b"\x00abc", wire.PADDED, b"abc"),
    (b"abc", 0, b"abc"),
])
def test_strip_padding(payload, flags, expected):
    assert wire.strip_padding(payload, flags) == expected


@pytest.mark.parametrize("payload", [b"", b"\x05ab"])
def test_bad_padding_is_a_protocol_error(payload):
    with pytest.raises(wire.ProtocolError):
        wire.strip_padding(payload, wire.PADDED)


def test_settings_round_trip_and_bad_length():
    data = wire.settings_frame({wire.SETTINGS_INITIAL_WINDOW_SIZE: 1 << 20, wire.SETTINGS_MAX_FRAME_SIZE: 16384})
    assert wire.parse_settings(data[9:]) == [(4, 1 << 20), (5, 16384)]
    with pytest.raises(wire.ProtocolError) as info:
        wire.parse_settings(b"\x00\x01\x00")
    assert info.value.code == wire.FRAME_SIZE_ERROR


def test_encoded_headers_decode_with_a_standard_decoder():
    headers = [(b":status", b"200"), (b"grpc-message", b"m" * 300), (b"x" * 130, b"")]
    assert hpack.Decoder().decode(wire.encode_headers(headers), raw=True) == headers


def test_grpc_message_framing():
    body = wire.grpc_message(b"abc") + wire.grpc_message(b"")
    assert wire.split_grpc_messages(body) == [(False, b"abc"), (False, b"")]
    assert wire.split_grpc_messages(b"\x01\x00\x00\x00\x01z") == [(True, b"z")]
    for truncated in (b"\x00\x00\x00", b"\x00\x00\x00\x00\x05abc"):
        with pytest.raises(ValueError):
            wire.split_grpc_messages(truncated)


@pytest.mark.parametrize("value, seconds", [
    (b"100m", 0.1), (b"5S", 5.0), (b"2M", 120.0), (b"1H", 3600.0), (b"250u", 250e-6), (b"7n", 7e-9),
    (b"", None), (b"5", None), (b"5x", None), (b"-5S", None), (b"1234567890S", None),
])
def test_grpc_timeout(value, seconds):
    assert wire.parse_grpc_timeout(value) == (pytest.approx(seconds) if seconds is not None else None)


def test_percent_encoding_of_grpc_message():
    assert wire.percent_encode("ok 100%") == b"ok 100%25"
    assert wire.percent_encode("caf\u00e9\n") == b"caf%C3%A9%0A"
