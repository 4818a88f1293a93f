"""The heal format: what one encoded state dict declares, and the checks a receiver makes before trusting it.

One encoded state dict is (the tree's grammar is on :func:`decode_tree`, the blocks on :class:`Blocks`)::

    prefix   20 bytes   b"TFTLSD02" | header length (uint64 LE) | crc32 of the header (uint32 LE)
    header   UTF-8 JSON {"format": 2, "byteorder": "little", "step": N, "data_bytes": D,
                         "checksum": {"algorithm": "sum64", "block_bytes": B},
                         "tensors": [ENTRY, ...], "tree": NODE}
    data     D bytes    every tensor's bytes (in "byteorder"), contiguous, in ENTRY order, no padding
    trailer  8 bytes per block: each block's sum64 (uint64 LE), in data order
    ENTRY  = {"dtype": "bfloat16", "shape": [2, 3], "offset": 0, "nbytes": 12}

:func:`parse_header` validates every field before anything is allocated; nothing is
unpickled or evaluated. Encoding is ``serialization.encode``, decoding ``serialization.decode``.
"""

from __future__ import annotations

import base64
import bisect
import ctypes
import datetime
import json
import math
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from torchft_lite.errors import CheckpointTransferError
from torchft_lite.serialization import checksum, dtensor

__all__ = [
    "DTYPES", "DTYPE_NAME", "FORMAT_VERSION", "MAX_DEPTH", "MAX_HEADER_BYTES", "MIN_BLOCK_BYTES", "PREFIX_SIZE",
    "Blocks", "Header", "Path", "TensorEntry", "byte_view", "decode_key", "decode_tree", "format_path",
    "pack_prefix", "parse_header", "unpack_prefix",
]

MAGIC = b"TFTLSD02"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sQI")
PREFIX_SIZE = _PREFIX.size
MAX_HEADER_BYTES = 256 << 20
MAX_DATA_BYTES = 1 << 50  # 1 PiB: a larger declaration is a corrupt or hostile header
MAX_DEPTH = 64
MIN_BLOCK_BYTES = 4096
MAX_BLOCKS = 1 << 24  # a larger count is a hostile header (16 TiB at the default 1 MiB blocks)

_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16", "int8",
    "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
"""The dtypes the format carries, by the name an entry declares."""
DTYPE_NAME = {dtype: name for name, dtype in DTYPES.items()}

Path = tuple[Any, ...]


def format_path(path: Path) -> str:
    """``("user", "optim", 0)`` -> ``"user.optim.0"``."""
    return ".".join(str(key) for key in path) or "<root>"


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of the bytes of a contiguous CPU tensor, without a copy; it keeps the tensor alive."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"byte_view needs a contiguous CPU tensor, got {tensor.device} {tuple(tensor.stride())}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    array.owner = tensor  # the memoryview holds the array, the array holds the tensor
    return memoryview(array).cast("B")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes sit in the data section, and how to check them."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes}


class Blocks:
    """The checksum blocks of a data section: each tensor cut every ``block_bytes`` (see ``serialization.checksum``).

    Their sums travel in the trailer, after the data, so the sender checksums each block as it goes out instead
    of reading the whole state dict once more before the first byte; a transfer of a block-aligned data range
    carries the sums of its own blocks after it.
    """

    def __init__(self, entries: Sequence[TensorEntry], block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.spans = checksum.blocks([(entry.offset, entry.nbytes) for entry in entries], block_bytes)
        """``(start, end, tensor index)`` of each block, in data order."""
        self.starts = [start for start, _, _ in self.spans]
        self.data_bytes = sum(entry.nbytes for entry in entries)

    def __len__(self) -> int:
        return len(self.spans)

    def covering(self, start: int, end: int) -> range:
        """The blocks that make up data bytes ``[start, end)``; both must fall on block boundaries."""
        if not 0 <= start <= end <= self.data_bytes:
            raise ValueError(f"data range [{start}, {end}) outside [0, {self.data_bytes})")
        first = bisect.bisect_left(self.starts, start)
        last = bisect.bisect_left(self.starts, end)
        if (start < self.data_bytes and (first == len(self.starts) or self.starts[first] != start)) or \
                (end < self.data_bytes and (last == len(self.starts) or self.starts[last] != end)):
            raise ValueError(f"data range [{start}, {end}) does not fall on checksum block boundaries")
        return range(first, last)

    def split(self, parts: int) -> list[tuple[int, int]]:
        """At most ``parts`` non-empty, block-aligned ranges of about equal size covering the data."""
        bounds = {0, self.data_bytes}
        for i in range(1, parts):
            at = bisect.bisect_left(self.starts, self.data_bytes * i // parts)
            bounds.add(self.starts[at] if at < len(self.starts) else self.data_bytes)
        ordered = sorted(bounds)
        return [(a, b) for a, b in zip(ordered, ordered[1:]) if b > a]

    def trailer_bytes(self, start: int, end: int) -> int:
        return len(self.covering(start, end)) * checksum.SUM_BYTES

    def bytes_of(self, blocks: Iterable[int]) -> int:
        """How many data bytes the blocks ``blocks`` hold."""
        return sum(self.spans[block][1] - self.spans[block][0] for block in blocks)

    def ranges_of(self, blocks: Iterable[int]) -> list[tuple[int, int]]:
        """The fewest block-aligned data ranges covering exactly the blocks ``blocks`` (in ascending order).

        Blocks tile the data section (no gaps, in data order), so consecutive
        blocks make one range: a receiver fetching them again needs one request
        per run, not per block.
        """
        ranges: list[tuple[int, int]] = []
        previous = -2
        for block in blocks:
            start, end, _ = self.spans[block]
            if block == previous + 1:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
            previous = block
        return ranges


def pack_prefix(header_json: bytes) -> bytes:
    """The prefix declaring ``header_json``: magic, length, crc32."""
    return _PREFIX.pack(MAGIC, len(header_json), zlib.crc32(header_json))


# ---------------------------------------------------------------- validation (the receiving side)


def _bad(message: str) -> CheckpointTransferError:
    return CheckpointTransferError(f"invalid checkpoint header: {message}")


def _int(value: Any, what: str, minimum: int = 0, maximum: int = MAX_DATA_BYTES) -> int:
    if type(value) is not int or not minimum <= value <= maximum:
        raise _bad(f"{what} must be an integer in [{minimum}, {maximum}], got {str(value)[:40]!r}")
    return value


def _entry(raw: Any, index: int, offset: int) -> TensorEntry:
    if not isinstance(raw, dict):
        raise _bad(f"tensor {index} is not an object")
    dtype = raw.get("dtype")
    if dtype not in DTYPES:
        raise _bad(f"tensor {index} has unknown dtype {str(dtype)[:40]!r}")
    shape = raw.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DEPTH:
        raise _bad(f"tensor {index} has an invalid shape")
    shape = tuple(_int(dim, f"tensor {index} dimension") for dim in shape)
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if nbytes > MAX_DATA_BYTES or _int(raw.get("nbytes"), f"tensor {index} nbytes") != nbytes:
        raise _bad(f"tensor {index} declares {raw.get('nbytes')} bytes for shape {list(shape)} of {dtype}")
    if _int(raw.get("offset"), f"tensor {index} offset") != offset:
        raise _bad(f"tensor {index} starts at {raw.get('offset')}, expected {offset}")
    return TensorEntry(dtype, shape, offset, nbytes)


@dataclass(frozen=True)
class Header:
    """A validated header: the step, where each tensor's bytes are, and the tree."""

    step: int
    data_bytes: int
    entries: tuple[TensorEntry, ...]
    paths: tuple[Path, ...]
    tree: Any
    blocks: Blocks

    @property
    def trailer_bytes(self) -> int:
        """Bytes of the checksums that follow the whole data section."""
        return len(self.blocks) * checksum.SUM_BYTES

    def build(self, tensors: Sequence[torch.Tensor], targets: Mapping[Path, torch.Tensor] | None = None) -> Any:
        """The state dict, with ``tensors[i]`` in place of tensor ``i`` (wrapped again when it was a DTensor's).

        ``targets`` are the receiver's own tensors by path (see ``serialization.dtensor``).
        """
        meshes = dtensor.MeshResolver(targets)

        def leaf(index: int, path: Path, layout: dtensor.DTensorLayout | None = None) -> Any:
            if layout is None:
                return tensors[index]
            return dtensor.rebuild(tensors[index], layout, (targets or {}).get(path), meshes, format_path(path))

        return decode_tree(self.tree, (), leaf)


def unpack_prefix(prefix: bytes) -> tuple[int, int]:
    """``(header length, header crc32)`` from the first ``PREFIX_SIZE`` bytes."""
    if len(prefix) != PREFIX_SIZE:
        raise CheckpointTransferError(f"checkpoint truncated: {len(prefix)} of {PREFIX_SIZE} prefix bytes")
    magic, length, crc = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CheckpointTransferError(f"not a torchft_lite checkpoint (starts with {magic[:8]!r})")
    if length > MAX_HEADER_BYTES:
        raise _bad(f"declared length {length} exceeds {MAX_HEADER_BYTES}")
    return length, crc


def parse_header(header_json: bytes, crc: int, *, following: int | None = None) -> Header:
    """Validate a header; ``following``, when known, is how many bytes follow it (data and checksums)."""
    if zlib.crc32(header_json) != crc:
        raise CheckpointTransferError("checkpoint header checksum mismatch (corrupted in transit)")
    try:
        raw = json.loads(header_json, parse_constant=lambda name: _reject_constant(name))
    except (ValueError, RecursionError) as exc:
        raise _bad(f"not JSON ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_VERSION:
        raise _bad(f"unsupported format {str(raw.get('format') if isinstance(raw, dict) else raw)[:40]!r}")
    if raw.get("byteorder") != sys.byteorder:
        raise _bad(f"tensor bytes are {str(raw.get('byteorder'))[:20]!r}-endian, this machine is {sys.byteorder}")
    step = _int(raw.get("step"), "step", -(2**63), 2**63 - 1)
    declared = _int(raw.get("data_bytes"), "data_bytes")
    block_bytes = _block_bytes(raw.get("checksum"))
    raw_entries = raw.get("tensors")
    if not isinstance(raw_entries, list):
        raise _bad("'tensors' is not a list")
    entries: list[TensorEntry] = []
    offset = 0
    for index, raw_entry in enumerate(raw_entries):
        entries.append(_entry(raw_entry, index, offset))
        offset += entries[-1].nbytes
    if offset != declared:
        raise _bad(f"tensors hold {offset} bytes but data_bytes is {declared}")
    paths: list[Path | None] = [None] * len(entries)

    def record(index: Any, path: Path, layout: Any = None) -> None:
        if type(index) is not int or not 0 <= index < len(entries) or paths[index] is not None:
            raise _bad(f"bad or repeated tensor reference {str(index)[:20]!r} at {format_path(path)}")
        paths[index] = path

    tree = raw.get("tree")
    decode_tree(tree, (), record)
    if None in paths:
        raise _bad(f"tensor {paths.index(None)} is not referenced by the tree")
    count = sum(-(-entry.nbytes // block_bytes) for entry in entries)
    if count > MAX_BLOCKS:
        raise _bad(f"{count} checksum blocks of {block_bytes} bytes exceed {MAX_BLOCKS}")
    if following is not None and following != declared + count * checksum.SUM_BYTES:
        raise _bad(f"declares {declared} data bytes and {count} checksums but {following} bytes follow")
    return Header(step, declared, tuple(entries), tuple(paths), tree,  # type: ignore[arg-type]
                  Blocks(entries, block_bytes))


def _block_bytes(raw: Any) -> int:
    if not isinstance(raw, dict) or raw.get("algorithm") != checksum.ALGORITHM:
        algorithm = raw.get("algorithm") if isinstance(raw, dict) else raw
        raise _bad(f"unsupported checksum {str(algorithm)[:40]!r} (expected {checksum.ALGORITHM!r})")
    block_bytes = _int(raw.get("block_bytes"), "checksum block_bytes", MIN_BLOCK_BYTES, checksum.MAX_BLOCK_BYTES)
    if block_bytes % 8:
        raise _bad(f"checksum block_bytes must be a multiple of 8, got {block_bytes}")
    return block_bytes


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def decode_tree(node: Any, path: Path, on_tensor: Callable[..., Any]) -> Any:
    """Build ``node``; ``on_tensor(index, path[, layout])`` makes each tensor (a DTensor's with its layout).

    The tree's grammar::

        NODE  = [tag, value], tag one of
                none bool int str bytes(base64) float(float.hex) dtype size timedelta([d, s, us])
                tensor(index into "tensors") list tuple dict([[KEY, NODE], ...])
                dtensor([index of its local shard in "tensors", LAYOUT]: see ``serialization.dtensor``)
        KEY   = a none/bool/int/float/str node, or a tuple of keys

    The receiver only ever builds plain types from it.
    """
    if len(path) > MAX_DEPTH:
        raise _bad(f"nested deeper than {MAX_DEPTH} levels at {format_path(path)}")
    if not isinstance(node, list) or len(node) != 2 or not isinstance(node[0], str):
        raise _bad(f"malformed node at {format_path(path)}")
    tag, value = node
    try:
        if tag == "tensor":
            return on_tensor(value, path)
        if tag == "dtensor":
            index, layout = value
            return on_tensor(index, path, dtensor.parse(layout, format_path(path)))
        if tag == "dict":
            result: dict = {}
            for key_node, value_node in value:
                key = decode_key(key_node, path)
                if key in result:
                    raise _bad(f"duplicate key {key!r} at {format_path(path)}")
                result[key] = decode_tree(value_node, path + (key,), on_tensor)
            return result
        if tag in ("list", "tuple"):
            items = [decode_tree(item, path + (i,), on_tensor) for i, item in enumerate(value)]
            return items if tag == "list" else tuple(items)
        if tag == "bytes":
            return base64.b64decode(value, validate=True)
        if tag == "dtype":
            return DTYPES[value]
        if tag == "size":
            return torch.Size(_int(dim, "size dimension") for dim in value)
        if tag == "timedelta":
            days, seconds, microseconds = (_int(part, "timedelta part", -(2**31), 2**31) for part in value)
            return datetime.timedelta(days=days, seconds=seconds, microseconds=microseconds)
        return _decode_scalar(tag, value, path)
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise _bad(f"malformed {tag!r} node at {format_path(path)}") from exc


def _decode_scalar(tag: str, value: Any, path: Path) -> Any:
    expected = {"none": type(None), "bool": bool, "int": int, "str": str, "float": str}.get(tag)
    if expected is None:
        raise _bad(f"unknown tag {tag[:20]!r} at {format_path(path)}")
    if type(value) is not expected:
        raise _bad(f"{tag!r} node holds {type(value).__name__} at {format_path(path)}")
    return float.fromhex(value) if tag == "float" else value


def decode_key(node: Any, path: Path, depth: int = 0) -> Any:
    """A dict key from its node: a scalar, or a tuple of keys."""
    if depth > MAX_DEPTH:
        raise _bad(f"dict key nested deeper than {MAX_DEPTH} levels at {format_path(path)}")
    if isinstance(node, list) and len(node) == 2 and node[0] == "tuple" and isinstance(node[1], list):
        return tuple(decode_key(part, path, depth + 1) for part in node[1])
    if not isinstance(node, list) or len(node) != 2 or not isinstance(node[0], str):
        raise _bad(f"malformed key at {format_path(path)}")
    return _decode_scalar(node[0], node[1], path)
