"""Encoding a state dict in the heal format (``serialization.spec``): the sending side.

Three steps, each cheaper to undo than the next:

1. :func:`flatten` validates a state dict and describes it as a JSON tree
   plus the tensors it references, reading no tensor data (a value the format
   cannot carry fails here, on the caller's thread);
2. :func:`encode` reads those tensors to host memory (a contiguous CPU tensor
   costs nothing: its own memory is sent) and writes the header;
3. :meth:`EncodedStateDict.body` yields the data section, or a block-aligned
   range of it, as views of tensor memory, each block checksummed just before
   it goes out, then the blocks' sums.

A transport publishes the :class:`FlatStateDict` and encodes only when a
receiver asks (see ``_http_snapshot``, ``pg_transport``).
"""

from __future__ import annotations

import base64
import bisect
import datetime
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from torchft_lite.errors import CheckpointError
from torchft_lite.serialization import checksum, cuda, dtensor
from torchft_lite.serialization.spec import (
    DTYPE_NAME, FORMAT_VERSION, MAX_DEPTH, MIN_BLOCK_BYTES, Blocks, Path, TensorEntry, byte_view, format_path,
    pack_prefix,
)

__all__ = ["EncodedStateDict", "FlatStateDict", "encode", "encode_to_bytes", "flatten"]


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
    if tensor.dtype not in DTYPE_NAME:
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
            local, layout = dtensor.describe(value, format_path(path)) if dtensor.is_dtensor(value) else (value, None)
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
            if value not in DTYPE_NAME:
                raise _unsupported(value, path, f"unsupported dtype {value}")
            return ["dtype", DTYPE_NAME[value]]
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
        return len(self.header) + self.data_bytes + len(self.blocks) * checksum.SUM_BYTES

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
            value = self._sums[index] = checksum.sum64(self._block(index))
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
        return checksum.pack(sums)

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
            yield checksum.pack([self.checksum(index) for index in covered])

        return pieces(), end - start + len(covered) * checksum.SUM_BYTES

    def release(self) -> None:
        """Drop every reference to tensor memory."""
        self._views.clear()
        self._buffers.clear()


def encode(step: int, flat: FlatStateDict, *, should_stop: Callable[[], bool] | None = None,
           block_bytes: int = checksum.BLOCK_BYTES) -> EncodedStateDict:
    """Read every tensor of ``flat`` to CPU (contiguous; CPU tensors that already are cost nothing).

    GPU tensors are copied on the recovery stream (see ``serialization.cuda``). When
    ``should_stop`` is already true the encoding is abandoned with
    ``CheckpointError``.
    """
    if block_bytes % 8 or not MIN_BLOCK_BYTES <= block_bytes <= checksum.MAX_BLOCK_BYTES:
        raise ValueError(f"block_bytes must be a multiple of 8 in [{MIN_BLOCK_BYTES}, {checksum.MAX_BLOCK_BYTES}]")
    if should_stop is not None and should_stop():
        raise CheckpointError("encoding abandoned: the state dict was released")
    buffers = cuda.to_host(flat.tensors)
    entries: list[TensorEntry] = []
    offset = 0
    for cpu in buffers:
        nbytes = cpu.numel() * cpu.element_size()
        entries.append(TensorEntry(DTYPE_NAME[cpu.dtype], tuple(cpu.shape), offset, nbytes))
        offset += nbytes
    header = {"format": FORMAT_VERSION, "byteorder": sys.byteorder, "step": step, "data_bytes": offset,
              "checksum": {"algorithm": checksum.ALGORITHM, "block_bytes": block_bytes},
              "tensors": [entry.to_json() for entry in entries], "tree": flat.tree}
    header_json = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return EncodedStateDict(step, pack_prefix(header_json) + header_json, entries, buffers, block_bytes)


def encode_to_bytes(step: int, state_dict: Any, *, block_bytes: int = checksum.BLOCK_BYTES) -> bytes:
    """The whole encoding as one bytes object (for small state dicts and tests)."""
    encoded = encode(step, flatten(state_dict), block_bytes=block_bytes)
    pieces, _ = encoded.body()
    return encoded.header + b"".join(bytes(piece) for piece in pieces)
