"""DTensors in the heal format: the local shard travels, the layout is rebuilt on the receiver's mesh.

Meshes are built without process groups (``_init_backend=False``) and DTensors
with ``from_local``: nothing here needs a process group or a socket.
"""

import json
import struct
import sys
import zlib

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

from tests.conftest import cpu_mesh, dtensor, read_header
from torchft_lite.checkpointing import _http_receive
from torchft_lite.errors import CheckpointError, CheckpointTransferError
from torchft_lite.serialization import decode, encode, spec


def sharded_state() -> dict:
    torch.manual_seed(0)
    flat, grid = cpu_mesh([0, 1, 2, 3], ("fsdp",)), cpu_mesh([[0, 1], [2, 3]], ("dp", "tp"))
    return {
        "w": dtensor(torch.randn(2, 5), flat, [Shard(0)], (8, 5)),
        "b": dtensor(torch.randn(5), flat, [Replicate()], (5,)),
        "grid": dtensor(torch.randn(3, 2).bfloat16(), grid, [Shard(0), Shard(1)], (6, 4)),
        "partial": dtensor(torch.ones(4), flat, [Partial("sum")], (4,)),
        "strided": dtensor(torch.arange(2.0), flat, [_StridedShard(0, split_factor=2)], (8,)),
        "plain": torch.arange(3),
        "step": 7,
    }


def assert_same_dtensor(got, sent) -> None:
    assert isinstance(got, DTensor)
    assert got._spec == sent._spec  # mesh, placements, shard order, global shape, stride and dtype
    assert torch.equal(got.to_local(), sent.to_local()) and not got.requires_grad


def round_trip(state, targets=None):
    step, got = decode.decode_bytes(encode.encode_to_bytes(3, state), targets)
    assert step == 3
    return got


def header_of(blob: bytes) -> dict:
    length, _ = spec.unpack_prefix(blob[:spec.PREFIX_SIZE])
    return json.loads(blob[spec.PREFIX_SIZE:spec.PREFIX_SIZE + length])


def test_dtensors_round_trip_as_their_local_shards_with_their_layouts():
    sent = sharded_state()
    got = round_trip(sent)
    for key in ("w", "b", "grid", "partial", "strided"):
        assert_same_dtensor(got[key], sent[key])
    assert torch.equal(got["plain"], sent["plain"]) and got["step"] == 7
    assert got["w"].device_mesh is got["b"].device_mesh  # one mesh per layout, shared like the sender's


def test_only_the_local_shards_travel():
    sent = sharded_state()
    header = header_of(encode.encode_to_bytes(3, sent))
    local_bytes = sum(t.numel() * t.element_size() for t in encode.flatten(sent).tensors)
    assert header["data_bytes"] == local_bytes == (10 + 5 + 4 + 2) * 4 + 6 * 2 + 3 * 8  # not (40 + 5 + 24 ...)
    assert [entry["shape"] for entry in header["tensors"][:3]] == [[2, 5], [5], [3, 2]]


def test_a_dtensor_of_the_receivers_own_layout_is_received_in_place():
    sent = sharded_state()
    own_mesh = cpu_mesh([0, 1, 2, 3], ("fsdp",))
    target = dtensor(torch.zeros(2, 5), own_mesh, [Shard(0)], (8, 5))
    with torch.no_grad():  # to_local() returns the local tensor itself only outside autograd
        local = target.to_local()
    targets = decode.targets_of({"w": target, "b": dtensor(torch.zeros(5), own_mesh, [Replicate()], (5,))})
    got = round_trip(sent, targets)
    assert got["w"] is target and got["w"]._local_tensor is local
    assert torch.equal(local, sent["w"].to_local())
    assert got["b"].device_mesh is own_mesh  # received in place too, onto the receiver's own mesh


def test_dtensors_land_on_a_mesh_the_receiver_already_has():
    sent = sharded_state()
    own_mesh = cpu_mesh([0, 1, 2, 3], ("fsdp",))
    elsewhere = {"other": dtensor(torch.zeros(1), own_mesh, [Shard(0)], (4,))}
    got = round_trip(sent, decode.targets_of(elsewhere))
    assert got["w"].device_mesh is own_mesh and got["strided"].device_mesh is own_mesh
    assert got["grid"].device_mesh is not own_mesh  # another layout: a mesh is built for it
    assert_same_dtensor(got["w"], sent["w"])


def test_a_target_of_another_layout_is_not_used_for_the_layout():
    sent = {"w": dtensor(torch.randn(2, 5), cpu_mesh([0, 1, 2, 3]), [Shard(0)], (8, 5))}
    replicated = dtensor(torch.zeros(2, 5), cpu_mesh([0, 1, 2, 3]), [Replicate()], (2, 5))
    got = round_trip(sent, decode.targets_of({"w": replicated}))
    assert got["w"] is not replicated and got["w"].placements == (Shard(0),)
    assert_same_dtensor(got["w"], sent["w"])


def test_unsupported_placements_are_refused_naming_the_path():
    masked = dtensor(torch.ones(2), cpu_mesh([0, 1]), [_MaskPartial()], (2,))
    with pytest.raises(CheckpointError, match="at model.m: unsupported placement"):
        encode.flatten({"model": {"m": masked}})


def test_other_tensor_subclasses_are_still_refused():
    class Marked(torch.Tensor):
        pass

    with pytest.raises(CheckpointError, match="tensor subclasses are not supported"):
        encode.flatten({"x": torch.ones(2).as_subclass(Marked)})


GOOD_LAYOUT = {"mesh": {"device_type": "cpu", "shape": [2], "ranks": [0, 1], "dim_names": ["dp"], "rank": 0},
               "placements": [["shard", 0]], "shape": [4], "stride": [1], "shard_order": None}


def with_layout(layout: dict) -> bytes:
    raw = json.dumps({"format": 2, "byteorder": sys.byteorder, "step": 1, "data_bytes": 8,
                      "tensors": [{"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}],
                      "checksum": {"algorithm": "sum64", "block_bytes": 1 << 20},
                      "tree": ["dict", [[["str", "w"], ["dtensor", [0, layout]]]]]}).encode()
    return struct.pack("<8sQI", b"TFTLSD02", len(raw), zlib.crc32(raw)) + raw + b"\0" * 16


def changed(path: str, value) -> dict:
    layout = json.loads(json.dumps(GOOD_LAYOUT))
    *parents, last = path.split(".")
    node = layout
    for key in parents:
        node = node[key]
    node[last] = value
    return layout


def test_the_good_layout_is_good():
    got = decode.decode_bytes(with_layout(GOOD_LAYOUT))[1]["w"]
    assert got.placements == (Shard(0),) and got.shape == (4,) and got.device_mesh.mesh.tolist() == [0, 1]


@pytest.mark.parametrize("layout, message", [
    (changed("placements", [["shard", 0], ["replicate"]]), "needs 1 placements"),
    (changed("placements", [["shard", 1]]), "shard dim must be"),
    (changed("placements", [["pickle", "os.system"]]), "unknown placement"),
    (changed("placements", [["partial", "SUM; rm"]]), "unknown placement"),
    (changed("placements", [["strided_shard", 0, 0]]), "split factor must be"),
    (changed("mesh.ranks", [0, 0]), "distinct ranks"),
    (changed("mesh.ranks", [0, 1, 2]), "needs 2 distinct ranks"),
    (changed("mesh.shape", [0]), "mesh shape must be"),
    (changed("mesh.device_type", "cuda; evil"), "bad mesh device type"),
    (changed("mesh.dim_names", ["dp", "tp"]), "dim_names must be 1"),
    (changed("stride", [1, 1]), "do not describe a tensor"),
    (changed("shape", [1]), "larger than the whole tensor"),
    (changed("shard_order", [[0, []]]), "at least one mesh dim"),
    (changed("mesh", "cpu"), "mesh is not an object"),
    ("layout", "layout is not an object"),
])
def test_hostile_layouts_are_rejected(layout, message):
    with pytest.raises(CheckpointTransferError, match=message):
        decode.decode_bytes(with_layout(layout))


def test_a_malformed_dtensor_node_is_rejected():
    blob = with_layout(GOOD_LAYOUT).replace(b'["dtensor", [0, ', b'["dtensor", [0, 1, ')
    raw_length = len(blob) - spec.PREFIX_SIZE - 16
    raw = blob[spec.PREFIX_SIZE:spec.PREFIX_SIZE + raw_length]
    blob = struct.pack("<8sQI", b"TFTLSD02", raw_length, zlib.crc32(raw)) + raw + b"\0" * 16
    with pytest.raises(CheckpointTransferError, match="malformed 'dtensor' node at w"):
        decode.decode_bytes(blob)


def test_a_layout_difference_between_two_replicas_headers_is_described():
    def header(placement):
        state = {"w": dtensor(torch.ones(2, 5), cpu_mesh([0, 1, 2, 3], ("fsdp",)), [placement], (8, 5))}
        return read_header(encode.encode_to_bytes(3, state))[0]

    difference = _http_receive.header_difference(header(Shard(0)), header(Replicate()))
    assert difference == ("value at w: '<DTensor [8, 5] (shard:0) on cpu mesh [4]>' vs "
                          "'<DTensor [8, 5] (replicate) on cpu mesh [4]>'")
