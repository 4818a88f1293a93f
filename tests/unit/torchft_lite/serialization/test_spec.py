"""The heal format (serialization: spec, encode, decode): round trips, refusals, and hostile or damaged input."""

import datetime
import json
import struct
import sys
import zlib

import pytest
import torch

from tests.conftest import read_header
from torchft_lite.errors import CheckpointError, CheckpointTransferError
from torchft_lite.serialization import decode, encode, spec


def realistic_state_dict() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),  # int keys, 0-dim step tensors, nested lists of ints
        "extra": {
            "bf16": torch.randn(3, 5).to(torch.bfloat16),
            "scalar": torch.tensor(7, dtype=torch.int64),
            "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
            "empty": torch.zeros(0, 3),
            "flags": torch.tensor([True, False]),
            "grad": torch.ones(2, requires_grad=True),
            "numbers": [1, -2**70, 0.5, float("inf"), float("-inf"), -0.0, True, None],
            "text": ("héllo", b"\x00\xffraw", bytearray(b"ba")),
            "meta": {("a", 1): torch.float16, 3.5: torch.Size([2, 3]), None: datetime.timedelta(seconds=1.5)},
        },
        "step": 12,
    }


def assert_same(actual, expected, path="") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert actual.device.type == "cpu" and not actual.requires_grad, path
        assert torch.equal(actual, expected.detach()), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) or isinstance(expected, torch.Size), path
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}.{i}")
    elif isinstance(expected, bytearray):
        assert actual == bytes(expected), path
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual, path
    else:
        assert actual == expected and type(actual) is type(expected), path


def test_realistic_state_dict_round_trips():
    state = realistic_state_dict()
    state["extra"]["numbers"].append(float("nan"))
    step, decoded = decode.decode_bytes(encode.encode_to_bytes(12, state))
    assert step == 12
    assert_same(decoded, state)
    assert math_bits(decoded["extra"]["numbers"][5]) == math_bits(-0.0)
    assert list(decoded["optim"]["state"]) == [0, 1, 2, 3]  # int keys survive


def math_bits(value: float) -> bytes:
    return struct.pack("<d", value)


def test_non_contiguous_and_bfloat16_keep_their_values():
    base = torch.randn(6, 8).to(torch.bfloat16)
    view = base[::2, 1::3]
    assert not view.is_contiguous()
    _, decoded = decode.decode_bytes(encode.encode_to_bytes(0, {"v": view}))
    assert decoded["v"].is_contiguous() and torch.equal(decoded["v"], view)


def test_in_place_target_is_filled_and_returned():
    source = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    target_w = torch.nn.Parameter(torch.zeros(2, 3))
    target_b_wrong_shape = torch.zeros(4)
    _, decoded = decode.decode_bytes(encode.encode_to_bytes(3, source),
                                      targets={("w",): target_w, ("b",): target_b_wrong_shape})
    assert decoded["w"] is target_w and torch.equal(target_w.detach(), source["w"])
    assert decoded["b"] is not target_b_wrong_shape and torch.equal(decoded["b"], source["b"])


def test_non_contiguous_target_receives_through_a_buffer():
    target = torch.zeros(3, 2).t()  # shape (2, 3), not contiguous
    source = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    _, decoded = decode.decode_bytes(encode.encode_to_bytes(0, {"x": source}), targets={("x",): target})
    assert decoded["x"] is target and torch.equal(target, source)


class Opaque:
    pass


@pytest.mark.parametrize("value, path", [
    ({"user": {"optim": {"state": {0: {"foo": Opaque()}}}}}, "user.optim.state.0.foo"),
    ({"a": [1, {2, 3}]}, "a.1"),
    ({"k": {object(): 1}}, "k"),
    ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, "q"),
    ({"s": torch.ones(2, 2).to_sparse()}, "s"),
])
def test_unsupported_values_are_named_with_their_path(value, path):
    with pytest.raises(CheckpointError, match=rf"at {path}:"):
        encode.flatten(value)


def test_a_structure_that_contains_itself_is_refused():
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(CheckpointError, match="contains itself"):
        encode.flatten({"loop": loop})


def test_flatten_reads_no_tensor_data():
    flat = encode.flatten({"t": torch.ones(3)})
    assert flat.paths == (("t",),) and flat.tree == ["dict", [[["str", "t"], ["tensor", 0]]]]
    with pytest.raises(CheckpointError, match="meta tensor"):
        encode.flatten({"m": torch.empty(2, device="meta")})


def sample_blob() -> bytes:
    return encode.encode_to_bytes(5, {"a": torch.arange(100, dtype=torch.float32), "b": [torch.ones(2, 2), "x"]})


def test_a_flipped_data_byte_fails_the_checksum_naming_the_tensor():
    blob = bytearray(sample_blob())
    blob[-2 * 8 - 10] ^= 0x01  # inside b.0, the last tensor (two 8-byte checksums follow the data)
    with pytest.raises(CheckpointTransferError, match=r"checksum mismatch in tensor b\.0"):
        decode.decode_bytes(bytes(blob))


def test_a_flipped_header_byte_fails_the_header_checksum():
    blob = bytearray(sample_blob())
    blob[spec.PREFIX_SIZE + 5] ^= 0x01
    with pytest.raises(CheckpointTransferError, match="header checksum"):
        decode.decode_bytes(bytes(blob))


@pytest.mark.parametrize("cut", [0, 7, spec.PREFIX_SIZE, spec.PREFIX_SIZE + 10, -1, -400])
def test_truncated_input_is_a_transfer_error(cut):
    blob = sample_blob()
    with pytest.raises(CheckpointTransferError, match="truncated|declares"):
        decode.decode_bytes(blob[:cut])


def test_a_writer_missing_data_reports_truncation():
    blob = sample_blob()
    header, data_start = read_header(blob)
    writer = decode.TensorWriter(header)
    writer.write(0, blob[data_start:-header.trailer_bytes - 8])
    with pytest.raises(CheckpointTransferError, match="truncated"):
        writer.finish()
    with pytest.raises(CheckpointTransferError, match="outside"):
        writer.write(header.data_bytes - 4, b"12345678")


def test_data_written_in_ranges_out_of_order_assembles():
    state = {"a": torch.randn(1000), "b": torch.arange(77, dtype=torch.int16), "c": torch.zeros(0)}
    encoded = encode.encode(9, encode.flatten(state))
    length, crc = spec.unpack_prefix(encoded.header[:spec.PREFIX_SIZE])
    writer = decode.TensorWriter(spec.parse_header(encoded.header[spec.PREFIX_SIZE:], crc))
    bounds = [0, 1, 999, 3000, 4001, encoded.data_bytes]
    for start, end in reversed(list(zip(bounds, bounds[1:]))):
        writer.write(start, b"".join(bytes(spec.byte_view(t)) for t in encoded.data_tensors(start, end)))
    body, _ = encoded.body()
    writer.expect(0, encoded.data_bytes, list(body)[-1])
    assert_same(writer.finish(), state)


def hostile(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<8sQI", b"TFTLSD02", len(raw), zlib.crc32(raw)) + raw + data


GOOD_ENTRY = {"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
GOOD_TREE = ["list", [["tensor", 0]]]
GOOD_HEADER = {"format": 2, "byteorder": sys.byteorder, "step": 1, "data_bytes": 8, "tensors": [GOOD_ENTRY],
               "checksum": {"algorithm": "sum64", "block_bytes": 1 << 20}, "tree": GOOD_TREE}
GOOD_DATA = b"\0" * 16  # 8 data bytes, then their block's sum (0)


@pytest.mark.parametrize("changes, message", [
    ({"format": 1}, "unsupported format"),
    ({"checksum": {"algorithm": "crc32", "block_bytes": 1 << 20}}, "unsupported checksum 'crc32'"),
    ({"checksum": {"algorithm": "sum64", "block_bytes": 8}}, "block_bytes must be an integer in"),
    ({"checksum": {"algorithm": "sum64", "block_bytes": 4100}}, "multiple of 8"),
    ({"checksum": "sum64"}, "unsupported checksum"),
    ({"byteorder": "big" if sys.byteorder == "little" else "little"}, "-endian"),
    ({"step": "7"}, "step must be an integer"),
    ({"data_bytes": -1}, "data_bytes must be"),
    ({"tensors": [dict(GOOD_ENTRY, dtype="torch.evil")]}, "unknown dtype"),
    ({"tensors": [dict(GOOD_ENTRY, shape=[-2])]}, "dimension must be"),
    ({"tensors": [dict(GOOD_ENTRY, nbytes=9)]}, "declares 9 bytes"),
    ({"tensors": [dict(GOOD_ENTRY, offset=4)]}, "starts at 4"),
    ({"tree": ["list", [["tensor", 0], ["tensor", 0]]]}, "repeated tensor reference"),
    ({"tree": ["list", []]}, "not referenced"),
    ({"tree": ["pickle", "cos\nsystem"]}, "unknown tag"),
    ({"tree": ["list", [["tensor", 0], ["dict", [[["list", []], ["none", None]]]]]]}, "malformed key|unknown tag"),
    ({"tree": ["list", [["tensor", 0], ["int", 1.5]]]}, "holds float"),
    ({"tree": ["list", [["tensor", 0], ["bytes", "!!"]]]}, "malformed 'bytes'"),
])
def test_hostile_headers_are_rejected(changes, message):
    header = dict(GOOD_HEADER)
    header.update(changes)
    with pytest.raises(CheckpointTransferError, match=message):
        decode.decode_bytes(hostile(header, GOOD_DATA))


def test_the_good_hostile_header_is_good():
    """The baseline the refusals above change one field of."""
    assert decode.decode_bytes(hostile(GOOD_HEADER, GOOD_DATA))[1][0].tolist() == [0.0, 0.0]


def test_huge_declared_sizes_are_rejected_before_allocating(monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated for a hostile header")

    monkeypatch.setattr(torch, "empty", no_allocation)
    huge = {"dtype": "float64", "shape": [1 << 20, 1 << 20, 1 << 20], "offset": 0, "nbytes": 8 << 60}
    blob = hostile(dict(GOOD_HEADER, data_bytes=8 << 60, tensors=[huge]))
    with pytest.raises(CheckpointTransferError, match="must be an integer|declares"):
        decode.decode_bytes(blob)
    # Consistent with itself but not with what actually follows.
    big = {"dtype": "uint8", "shape": [1 << 40], "offset": 0, "nbytes": 1 << 40}
    with pytest.raises(CheckpointTransferError, match="follow"):
        decode.decode_bytes(hostile(dict(GOOD_HEADER, data_bytes=1 << 40, tensors=[big])))
    # More checksum blocks than any real checkpoint has: refused before the block table is built.
    many = dict(GOOD_HEADER, data_bytes=1 << 40, tensors=[big], checksum={"algorithm": "sum64", "block_bytes": 4096})
    with pytest.raises(CheckpointTransferError, match="checksum blocks"):
        decode.decode_bytes(hostile(many))
    too_long = struct.pack("<8sQI", b"TFTLSD02", 1 << 62, 0)
    with pytest.raises(CheckpointTransferError, match="exceeds"):
        decode.decode_bytes(too_long)


def test_garbage_and_deep_nesting_are_rejected():
    with pytest.raises(CheckpointTransferError, match="not a torchft_lite checkpoint"):
        decode.decode_bytes(b"\x80\x04pickle" + b"\0" * 40)
    raw = b"{" * 100_000
    with pytest.raises(CheckpointTransferError, match="not JSON"):
        spec.parse_header(raw, zlib.crc32(raw))
    deep = ["list", [["tensor", 0]]]
    for _ in range(spec.MAX_DEPTH + 2):
        deep = ["list", [deep]]
    with pytest.raises(CheckpointTransferError, match="deeper"):
        decode.decode_bytes(hostile(dict(GOOD_HEADER, tree=deep), GOOD_DATA))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_arrive_on_cpu_or_in_their_cuda_target():
    source = {"w": torch.randn(3, 4, device="cuda"), "b": torch.randn(4, device="cuda").bfloat16()}
    target = torch.zeros(3, 4, device="cuda")
    _, decoded = decode.decode_bytes(encode.encode_to_bytes(1, source), targets={("w",): target})
    assert decoded["w"] is target and torch.equal(target, source["w"])
    assert decoded["b"].device.type == "cpu" and torch.equal(decoded["b"], source["b"].cpu())


def test_the_package_exports_the_transports():
    import torchft_lite.checkpointing as checkpointing

    assert checkpointing.__all__ == ["CheckpointTransport", "HTTPTransport"]
    assert issubclass(checkpointing.HTTPTransport, checkpointing.CheckpointTransport)
