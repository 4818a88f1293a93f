"""The wire format of a live checkpoint: a JSON header, then raw tensor bytes.

One encoded state dict is::

    prefix  20 bytes   b"TFTLSD01" | header length (uint64 LE) | crc32 of the header (uint32 LE)
    header  UTF-8 JSON {"format": 1, "byteorder": "little", "step": N, "data_bytes": D,
                        "tensors": [ENTRY, ...], "tree": NODE}
    data    D bytes    every tensor's bytes (in "byteorder"), contiguous, in ENTRY order, no padding

    ENTRY = {"dtype": "bfloat16", "shape": [2, 3], "offset": 0, "nbytes": 12, "crc32": 305419896}
    NODE  = [tag, value], tag one of
            none bool int str bytes(base64) float(float.hex) dtype size timedelta([d, s, us])
            tensor(index into "tensors") list tuple dict([[KEY, NODE], ...])
    KEY   = a none/bool/int/float/str node, or a tuple of keys

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
from typing import Any, Callable, Iterator, Sequence

import torch

from torchft_lite.checkpointing._crc import checksums
from torchft_lite.errors import CheckpointError, CheckpointTransferError

__all__ = [
    "DTYPES", "PREFIX_SIZE", "EncodedStateDict", "FlatStateDict", "Header", "StateDictReader", "TensorEntry",
    "byte_view", "decode_bytes", "encode", "encode_to_bytes", "flatten", "format_path", "parse_header",
    "targets_of", "unpack_prefix",
]

MAGIC = b"TFTLSD01"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sQI")
PREFIX_SIZE = _PREFIX.size
MAX_HEADER_BYTES = 256 << 20
MAX_DATA_BYTES = 1 << 50  # 1 PiB: a larger declaration is a corrupt or hostile header
MAX_DEPTH = 64
SLICE_BYTES = 8 << 20  # default size of the views iter_data yields

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
    paths: tuple[Path, ...]


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
    paths: list[Path] = []
    open_containers: set[int] = set()

    def node(value: Any, path: Path) -> list:
        if len(path) > MAX_DEPTH:
            raise CheckpointError(f"state dict nested deeper than {MAX_DEPTH} levels at {format_path(path)}")
        if isinstance(value, torch.Tensor):
            _check_tensor(value, path)
            tensors.append(value)
            paths.append(path)
            return ["tensor", len(tensors) - 1]
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
    return FlatStateDict(tree, tuple(tensors), tuple(paths))


def targets_of(state_dict: Any) -> dict[Path, torch.Tensor]:
    """Every tensor of ``state_dict`` by its path: where a receive may land in place."""
    flat = flatten(state_dict)
    return dict(zip(flat.paths, flat.tensors))


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes sit in the data section, and how to check them."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes,
                "crc32": self.crc32}


class EncodedStateDict:
    """A state dict ready to send: the header bytes plus views of every tensor's bytes.

    The views alias the CPU tensors (the caller's own, when already contiguous
    on CPU): they are valid only while the caller leaves the state dict alone.
    """

    def __init__(self, step: int, header: bytes, entries: Sequence[TensorEntry],
                 buffers: Sequence[torch.Tensor]) -> None:
        self.step = step
        self.header = header
        self.entries = tuple(entries)
        self.data_bytes = sum(entry.nbytes for entry in self.entries)
        self._buffers = list(buffers)
        self._views = [byte_view(buffer) for buffer in self._buffers]
        self._starts = [entry.offset for entry in self.entries]

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole encoding: prefix, header and data."""
        return len(self.header) + self.data_bytes

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

    def iter_data(self, start: int = 0, end: int | None = None,
                  slice_bytes: int = SLICE_BYTES) -> Iterator[memoryview]:
        """Views of the data section's bytes ``[start, end)``, at most ``slice_bytes`` each.

        The views alias tensor memory; copy what must outlive the snapshot.
        """
        for index, first, stop in self._ranges(start, end):
            for position in range(first, stop, slice_bytes):
                yield self._views[index][position:min(stop, position + slice_bytes)]

    def data_tensors(self, start: int = 0, end: int | None = None) -> list[torch.Tensor]:
        """Flat uint8 tensors aliasing the data section's bytes ``[start, end)``, one per tensor touched."""
        return [self._buffers[index].reshape(-1).view(torch.uint8)[first:stop]
                for index, first, stop in self._ranges(start, end)]

    def release(self) -> None:
        """Drop every reference to tensor memory."""
        self._views.clear()
        self._buffers.clear()


def _prefix(header_json: bytes) -> bytes:
    return _PREFIX.pack(MAGIC, len(header_json), zlib.crc32(header_json))


def encode(step: int, flat: FlatStateDict, *, should_stop: Callable[[], bool] | None = None) -> EncodedStateDict:
    """Read every tensor of ``flat`` (to CPU, contiguous) and checksum it (slices in parallel).

    ``should_stop`` is polled between slices; when it turns true the encoding
    is abandoned with ``CheckpointError``.
    """
    buffers = [tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous() for tensor in flat.tensors]
    entries: list[TensorEntry] = []
    offset = 0
    for cpu, crc in zip(buffers, checksums([byte_view(cpu) for cpu in buffers], should_stop)):
        nbytes = cpu.numel() * cpu.element_size()
        entries.append(TensorEntry(_DTYPE_NAME[cpu.dtype], tuple(cpu.shape), offset, nbytes, crc))
        offset += nbytes
    header = {"format": FORMAT_VERSION, "byteorder": sys.byteorder, "step": step, "data_bytes": offset,
              "tensors": [entry.to_json() for entry in entries], "tree": flat.tree}
    header_json = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return EncodedStateDict(step, _prefix(header_json) + header_json, entries, buffers)


def encode_to_bytes(step: int, state_dict: Any) -> bytes:
    """The whole encoding as one bytes object (for small state dicts and tests)."""
    encoded = encode(step, flatten(state_dict))
    return encoded.header + b"".join(bytes(view) for view in encoded.iter_data())


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
    return TensorEntry(dtype, shape, offset, nbytes, _int(raw.get("crc32"), f"tensor {index} crc32", 0, 2**32 - 1))


@dataclass(frozen=True)
class Header:
    """A validated header: the step, where each tensor's bytes are, and the tree."""

    step: int
    data_bytes: int
    entries: tuple[TensorEntry, ...]
    paths: tuple[Path, ...]
    tree: Any

    def build(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The state dict, with ``tensors[i]`` in place of tensor ``i``."""
        return _decode(self.tree, (), lambda index, path: tensors[index])


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


def parse_header(header_json: bytes, crc: int, *, data_bytes: int | None = None) -> Header:
    """Validate a header; ``data_bytes``, when known, is how many data bytes follow it."""
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
    if data_bytes is not None and declared != data_bytes:
        raise _bad(f"declares {declared} data bytes but {data_bytes} follow")
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

    def record(index: Any, path: Path) -> None:
        if type(index) is not int or not 0 <= index < len(entries) or paths[index] is not None:
            raise _bad(f"bad or repeated tensor reference {str(index)[:20]!r} at {format_path(path)}")
        paths[index] = path

    tree = raw.get("tree")
    _decode(tree, (), record)
    if None in paths:
        raise _bad(f"tensor {paths.index(None)} is not referenced by the tree")
    return Header(step, declared, tuple(entries), tuple(paths), tree)  # type: ignore[arg-type]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def _decode(node: Any, path: Path, on_tensor: Callable[[int, Path], Any]) -> Any:
    if len(path) > MAX_DEPTH:
        raise _bad(f"nested deeper than {MAX_DEPTH} levels at {format_path(path)}")
    if not isinstance(node, list) or len(node) != 2 or not isinstance(node[0], str):
        raise _bad(f"malformed node at {format_path(path)}")
    tag, value = node
    try:
        if tag == "tensor":
            return on_tensor(value, path)
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


# The reader lives in its own module; re-exported here so the format has one import.
from torchft_lite.checkpointing._reader import StateDictReader, decode_bytes  # after the definitions it imports
