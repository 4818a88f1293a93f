"""The wire format of a live checkpoint: a JSON header, raw tensor bytes, then block checksums.

One encoded state dict is::

    prefix   20 bytes   b"TFTLSD02" | header length (uint64 LE) | crc32 of the header (uint32 LE)
    header   UTF-8 JSON {"format": 2, "byteorder": "little", "step": N, "data_bytes": D,
                         "checksum": {"algorithm": "sum64", "block_bytes": B},
                         "tensors": [ENTRY, ...], "tree": NODE}
    data     D bytes    every tensor's bytes (in "byteorder"), contiguous, in ENTRY order, no padding
    trailer  8 bytes per block: each block's sum64 (uint64 LE), in data order

    ENTRY = {"dtype": "bfloat16", "shape": [2, 3], "offset": 0, "nbytes": 12}
    NODE  = [tag, value], tag one of
            none bool int str bytes(base64) float(float.hex) dtype size timedelta([d, s, us])
            tensor(index into "tensors") list tuple dict([[KEY, NODE], ...])
            dtensor([index of its local shard in "tensors", LAYOUT]: see ``_dtensor``)
    KEY   = a none/bool/int/float/str node, or a tuple of keys

Blocks cut each tensor every ``B`` bytes (see ``_checksum``). The trailer
comes last so the sender checksums each block as it goes out instead of
reading the whole state dict once more before the first byte; a transfer of
a block-aligned data range carries the sums of its own blocks after it.

The receiver only ever builds these plain types: nothing is unpickled or
evaluated, and every header field is validated before anything is allocated.
Tensors arrive on CPU (or in place into a matching target tensor).
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
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from torchft_lite.checkpointing import _checksum, _cuda, _dtensor
from torchft_lite.errors import CheckpointError, CheckpointTransferError

__all__ = [
    "DTYPES", "PREFIX_SIZE", "Blocks", "EncodedStateDict", "FlatStateDict", "Header", "StateDictReader", "TensorEntry",
    "byte_view", "decode_bytes", "encode", "encode_to_bytes", "flatten", "format_path", "header_difference",
    "parse_header", "targets_of", "unpack_prefix",
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
_DTYPE_NAME = {dtype: name for name, dtype in DTYPES.items()}

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


# ---------------------------------------------------------------- encoding


@dataclass(frozen=True)
class FlatStateDict:
    """A validated state dict: its JSON tree and the tensors it references (not yet read)."""

    tree: Any
    tensors: tuple[torch.Tensor, ...]
    """The tensors whose bytes travel: a DTensor's local shard stands for it."""
    paths: tuple[Path, ...]
    leaves: tuple[torch.Tensor, ...]
    """The state dict's own tensor values (DTensors as they are), one per entry of ``tensors``."""


def _unsupported(value: Any, path: Path, why: str = "unsupported type") -> CheckpointError:
    return CheckpointError(f"cannot send {type(value).__module__}.{type(value).__qualname__} at "
                           f"{format_path(path)}: {why}")


def _scalar_node(value: Any) -> list | None:
    """The node of a scalar that can also be a dict key, or None when ``value`` is not one."""
    if value is None:
        return ["none", None]
    kind = type(value)
    if kind is bool:
        return ["bool", value]
    if kind is int:
        return ["int", value]
    if kind is float:
        return ["float", value.hex()]
    if kind is str:
        return ["str", value]
    return None


def _key_node(key: Any, path: Path) -> list:
    node = _scalar_node(key)
    if node is not None:
        return node
    if type(key) is tuple:
        return ["tuple", [_key_node(part, path) for part in key]]
    raise _unsupported(key, path, "unsupported dict key type")


def _check_tensor(tensor: torch.Tensor, path: Path) -> None:
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise _unsupported(tensor, path, "tensor subclasses are not supported")
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise _unsupported(tensor, path, f"only dense tensors are supported, not {tensor.layout}")
    if tensor.dtype not in _DTYPE_NAME:
        raise _unsupported(tensor, path, f"unsupported dtype {tensor.dtype}")
    if tensor.device.type == "meta":
        raise _unsupported(tensor, path, "a meta tensor has no data")


def flatten(state_dict: Any) -> FlatStateDict:
    """Validate ``state_dict`` and describe it, without reading any tensor data.

    Raises ``CheckpointError`` naming the type and path of the first value
    that the format cannot carry.
    """
    tensors: list[torch.Tensor] = []
    leaves: list[torch.Tensor] = []
    paths: list[Path] = []
    open_containers: set[int] = set()

    def node(value: Any, path: Path) -> list:
        if len(path) > MAX_DEPTH:
            raise CheckpointError(f"state dict nested deeper than {MAX_DEPTH} levels at {format_path(path)}")
        if isinstance(value, torch.Tensor):
            local, layout = _dtensor.describe(value, format_path(path)) if _dtensor.is_dtensor(value) else (value, None)
            _check_tensor(local, path)
            tensors.append(local)
            leaves.append(value)
            paths.append(path)
            return ["tensor", len(tensors) - 1] if layout is None else ["dtensor", [len(tensors) - 1, layout]]
        scalar = _scalar_node(value)
        if scalar is not None:
            return scalar
        if isinstance(value, (bytes, bytearray)):
            return ["bytes", base64.b64encode(value).decode("ascii")]
        if isinstance(value, torch.dtype):
            if value not in _DTYPE_NAME:
                raise _unsupported(value, path, f"unsupported dtype {value}")
            return ["dtype", _DTYPE_NAME[value]]
        if type(value) is torch.Size:
            return ["size", list(value)]
        if type(value) is datetime.timedelta:
            return ["timedelta", [value.days, value.seconds, value.microseconds]]
        if isinstance(value, (dict, list)) or type(value) is tuple:
            if id(value) in open_containers:
                raise _unsupported(value, path, "the structure contains itself")
            open_containers.add(id(value))
            try:
                if isinstance(value, dict):
                    return ["dict", [[_key_node(k, path), node(v, path + (k,))] for k, v in value.items()]]
                items = [node(item, path + (i,)) for i, item in enumerate(value)]
                return ["list" if isinstance(value, list) else "tuple", items]
            finally:
                open_containers.discard(id(value))
        raise _unsupported(value, path)

    tree = node(state_dict, ())
    return FlatStateDict(tree, tuple(tensors), tuple(paths), tuple(leaves))


def targets_of(state_dict: Any) -> dict[Path, torch.Tensor]:
    """Every tensor of ``state_dict`` (DTensors as they are) by its path: where a receive may land in place."""
    flat = flatten(state_dict)
    return dict(zip(flat.paths, flat.leaves))


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
    """The checksum blocks of a data section: each tensor cut every ``block_bytes``."""

    def __init__(self, entries: Sequence[TensorEntry], block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.spans = _checksum.blocks([(entry.offset, entry.nbytes) for entry in entries], block_bytes)
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
        return len(self.covering(start, end)) * _checksum.SUM_BYTES

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


class EncodedStateDict:
    """A state dict ready to send: the header bytes plus views of every tensor's bytes.

    The views alias the CPU tensors (the caller's own, when already contiguous
    on CPU): they are valid only while the caller leaves the state dict alone.
    Block checksums are computed as blocks are first read and kept.
    """

    def __init__(self, step: int, header: bytes, entries: Sequence[TensorEntry],
                 buffers: Sequence[torch.Tensor], block_bytes: int) -> None:
        self.step = step
        self.header = header
        self.entries = tuple(entries)
        self.data_bytes = sum(entry.nbytes for entry in self.entries)
        self.blocks = Blocks(self.entries, block_bytes)
        self._sums: list[int | None] = [None] * len(self.blocks)
        self._buffers = list(buffers)
        self._views = [byte_view(buffer) for buffer in self._buffers]
        self._starts = [entry.offset for entry in self.entries]

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole encoding: prefix, header, data and checksums."""
        return len(self.header) + self.data_bytes + len(self.blocks) * _checksum.SUM_BYTES

    def _ranges(self, start: int, end: int | None) -> Iterator[tuple[int, int, int]]:
        """``(tensor index, first byte, end byte)`` within each tensor covering data bytes ``[start, end)``."""
        end = self.data_bytes if end is None else end
        if not 0 <= start <= end <= self.data_bytes:
            raise ValueError(f"data range [{start}, {end}) outside [0, {self.data_bytes})")
        index = max(bisect.bisect_right(self._starts, start) - 1, 0)
        position = start
        while position < end:
            entry = self.entries[index]
            stop = min(end, entry.offset + entry.nbytes)
            if stop > position:
                yield index, position - entry.offset, stop - entry.offset
                position = stop
            index += 1

    def data_tensors(self, start: int = 0, end: int | None = None) -> list[torch.Tensor]:
        """Flat uint8 tensors aliasing the data section's bytes ``[start, end)``, one per tensor touched."""
        return [self._buffers[index].reshape(-1).view(torch.uint8)[first:stop]
                for index, first, stop in self._ranges(start, end)]

    def _block(self, index: int) -> memoryview:
        start, end, tensor = self.blocks.spans[index]
        offset = self.entries[tensor].offset
        return self._views[tensor][start - offset:end - offset]

    def checksum(self, index: int) -> int:
        """Block ``index``'s sum64 (computed on first use)."""
        value = self._sums[index]
        if value is None:
            value = self._sums[index] = _checksum.sum64(self._block(index))
        return value

    def packed_checksums(self, should_stop: Callable[[], bool] | None = None) -> bytes:
        """Every block's sum64 in data order, packed as in a trailer: what a striping receiver compares.

        Blocks already sent were summed then and are not read again. Meant for
        a worker thread: ``should_stop`` is polled between blocks, so a release
        waits for one block at most, and a true answer abandons the pass with
        ``CheckpointError``.
        """
        sums = []
        for index in range(len(self.blocks)):
            if should_stop is not None and should_stop():
                raise CheckpointError("checksums abandoned: the state dict was released")
            sums.append(self.checksum(index))
        return _checksum.pack(sums)

    def body(self, start: int = 0, end: int | None = None) -> tuple[Iterator[memoryview | bytes], int]:
        """The block-aligned data range ``[start, end)`` then its blocks' checksums, and its length in bytes.

        Each block is checksummed just before it is yielded (while its bytes
        are still in the cache for the send); the checksums come last.
        """
        end = self.data_bytes if end is None else end
        covered = self.blocks.covering(start, end)

        def pieces() -> Iterator[memoryview | bytes]:
            for index in covered:
                self.checksum(index)
                yield self._block(index)
            yield _checksum.pack([self.checksum(index) for index in covered])

        return pieces(), end - start + len(covered) * _checksum.SUM_BYTES

    def release(self) -> None:
        """Drop every reference to tensor memory."""
        self._views.clear()
        self._buffers.clear()


def _prefix(header_json: bytes) -> bytes:
    return _PREFIX.pack(MAGIC, len(header_json), zlib.crc32(header_json))


def encode(step: int, flat: FlatStateDict, *, should_stop: Callable[[], bool] | None = None,
           block_bytes: int = _checksum.BLOCK_BYTES) -> EncodedStateDict:
    """Read every tensor of ``flat`` to CPU (contiguous; CPU tensors that already are cost nothing).

    GPU tensors are copied on the recovery stream (see ``_cuda``). When
    ``should_stop`` is already true the encoding is abandoned with
    ``CheckpointError``.
    """
    if block_bytes % 8 or not MIN_BLOCK_BYTES <= block_bytes <= _checksum.MAX_BLOCK_BYTES:
        raise ValueError(f"block_bytes must be a multiple of 8 in [{MIN_BLOCK_BYTES}, {_checksum.MAX_BLOCK_BYTES}]")
    if should_stop is not None and should_stop():
        raise CheckpointError("encoding abandoned: the state dict was released")
    buffers = _cuda.to_host(flat.tensors)
    entries: list[TensorEntry] = []
    offset = 0
    for cpu in buffers:
        nbytes = cpu.numel() * cpu.element_size()
        entries.append(TensorEntry(_DTYPE_NAME[cpu.dtype], tuple(cpu.shape), offset, nbytes))
        offset += nbytes
    header = {"format": FORMAT_VERSION, "byteorder": sys.byteorder, "step": step, "data_bytes": offset,
              "checksum": {"algorithm": _checksum.ALGORITHM, "block_bytes": block_bytes},
              "tensors": [entry.to_json() for entry in entries], "tree": flat.tree}
    header_json = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return EncodedStateDict(step, _prefix(header_json) + header_json, entries, buffers, block_bytes)


def encode_to_bytes(step: int, state_dict: Any, *, block_bytes: int = _checksum.BLOCK_BYTES) -> bytes:
    """The whole encoding as one bytes object (for small state dicts and tests)."""
    encoded = encode(step, flatten(state_dict), block_bytes=block_bytes)
    pieces, _ = encoded.body()
    return encoded.header + b"".join(bytes(piece) for piece in pieces)


# ---------------------------------------------------------------- decoding


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
        return len(self.blocks) * _checksum.SUM_BYTES

    def build(self, tensors: Sequence[torch.Tensor], targets: Mapping[Path, torch.Tensor] | None = None) -> Any:
        """The state dict, with ``tensors[i]`` in place of tensor ``i`` (wrapped again when it was a DTensor's).

        ``targets`` are the receiver's own tensors by path (see ``_dtensor``).
        """
        meshes = _dtensor.MeshResolver(targets)

        def leaf(index: int, path: Path, layout: _dtensor.DTensorLayout | None = None) -> Any:
            if layout is None:
                return tensors[index]
            return _dtensor.rebuild(tensors[index], layout, (targets or {}).get(path), meshes, format_path(path))

        return _decode(self.tree, (), leaf)


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
    _decode(tree, (), record)
    if None in paths:
        raise _bad(f"tensor {paths.index(None)} is not referenced by the tree")
    count = sum(-(-entry.nbytes // block_bytes) for entry in entries)
    if count > MAX_BLOCKS:
        raise _bad(f"{count} checksum blocks of {block_bytes} bytes exceed {MAX_BLOCKS}")
    if following is not None and following != declared + count * _checksum.SUM_BYTES:
        raise _bad(f"declares {declared} data bytes and {count} checksums but {following} bytes follow")
    return Header(step, declared, tuple(entries), tuple(paths), tree,  # type: ignore[arg-type]
                  Blocks(entries, block_bytes))


def _block_bytes(raw: Any) -> int:
    if not isinstance(raw, dict) or raw.get("algorithm") != _checksum.ALGORITHM:
        algorithm = raw.get("algorithm") if isinstance(raw, dict) else raw
        raise _bad(f"unsupported checksum {str(algorithm)[:40]!r} (expected {_checksum.ALGORITHM!r})")
    block_bytes = _int(raw.get("block_bytes"), "checksum block_bytes", MIN_BLOCK_BYTES, _checksum.MAX_BLOCK_BYTES)
    if block_bytes % 8:
        raise _bad(f"checksum block_bytes must be a multiple of 8, got {block_bytes}")
    return block_bytes


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def _decode(node: Any, path: Path, on_tensor: Callable[..., Any]) -> Any:
    """Build ``node``; ``on_tensor(index, path[, layout])`` makes each tensor (a DTensor's with its layout)."""
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
            return on_tensor(index, path, _dtensor.parse(layout, format_path(path)))
        if tag == "dict":
            result: dict = {}
            for key_node, value_node in value:
                key = _decode_key(key_node, path)
                if key in result:
                    raise _bad(f"duplicate key {key!r} at {format_path(path)}")
                result[key] = _decode(value_node, path + (key,), on_tensor)
            return result
        if tag in ("list", "tuple"):
            items = [_decode(item, path + (i,), on_tensor) for i, item in enumerate(value)]
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


def _decode_key(node: Any, path: Path, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise _bad(f"dict key nested deeper than {MAX_DEPTH} levels at {format_path(path)}")
    if isinstance(node, list) and len(node) == 2 and node[0] == "tuple" and isinstance(node[1], list):
        return tuple(_decode_key(part, path, depth + 1) for part in node[1])
    if not isinstance(node, list) or len(node) != 2 or not isinstance(node[0], str):
        raise _bad(f"malformed key at {format_path(path)}")
    return _decode_scalar(node[0], node[1], path)


# The reader and the header comparison live in their own modules; re-exported here so the format has one import.
from torchft_lite.checkpointing._header_difference import header_difference  # after the definitions it imports
from torchft_lite.checkpointing._reader import StateDictReader, decode_bytes  # noqa: E402
