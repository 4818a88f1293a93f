"""Receiving the data section of an encoded state dict straight into its tensors.

A :class:`StateDictReader` owns the destination tensors. Bytes reach them two
ways: :meth:`~StateDictReader.write` copies a received buffer in, or a
network protocol asks for :meth:`~StateDictReader.buffer_at` (a writable view
of the destination memory) and reports :meth:`~StateDictReader.filled` after
the kernel has written into it, so nothing is copied in user space.

Either way the new bytes extend a run of that tensor's received bytes; once
a run reaches ``BATCH_BYTES`` (or the tensor's end) its crc32 is computed on
the crc thread pool, on another core while the event loop keeps receiving.
The runs' crcs (several per tensor when streams split it) are joined with
``crc32_combine``: :meth:`~StateDictReader.finish` never reads the data a
second time, it only waits for the last runs.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import zlib
from typing import Any, Mapping

import torch

from torchft_lite.checkpointing._crc import crc32_combine, executor
from torchft_lite.checkpointing._serialization import (
    DTYPES, PREFIX_SIZE, Header, Path, TensorEntry, byte_view, format_path, parse_header, unpack_prefix,
)
from torchft_lite.errors import CheckpointTransferError

__all__ = ["StateDictReader", "decode_bytes"]

BATCH_BYTES = 4 << 20  # a run this long is checksummed on the pool; shorter ones wait for more bytes
_INLINE_BYTES = 256 << 10  # a final run shorter than this is checksummed on the spot


class StateDictReader:
    """Receives the data section (in any order, in pieces) into preallocated tensors.

    ``targets`` maps a tensor's path to an existing tensor: when dtype and
    shape match, the bytes land in it (directly when it is a contiguous CPU
    tensor, else through a CPU buffer copied in by :meth:`finish`), and the
    result holds that very tensor. A failed transfer may leave such a target
    partly overwritten.
    """

    def __init__(self, header: Header, targets: Mapping[Path, torch.Tensor] | None = None) -> None:
        self.header = header
        self._tensors: list[torch.Tensor] = []
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for entry, path in zip(header.entries, header.paths):
                self._tensors.append(self._buffer_for(entry, (targets or {}).get(path)))
        except RuntimeError as exc:  # torch could not allocate what the header declared
            raise CheckpointTransferError(f"cannot allocate {header.data_bytes} bytes for the checkpoint") from exc
        self._views = [byte_view(tensor) for tensor in self._tensors]
        self._starts = [entry.offset for entry in header.entries]
        # per tensor: end of a run of received bytes not yet checksummed -> start of the run
        self._open: list[dict[int, int]] = [{} for _ in header.entries]
        # per tensor: (start, end, crc32 or its future) of each checksummed run
        self._runs: list[list[tuple[int, int, Any]]] = [[] for _ in header.entries]
        self.received_bytes = 0

    def _buffer_for(self, entry: TensorEntry, target: torch.Tensor | None) -> torch.Tensor:
        dtype = DTYPES[entry.dtype]
        if target is None or target.dtype != dtype or tuple(target.shape) != entry.shape:
            return torch.empty(entry.shape, dtype=dtype)
        if target.device.type == "cpu" and target.is_contiguous():
            return target
        buffer = torch.empty(entry.shape, dtype=dtype)
        self._copy_back.append((buffer, target))
        return buffer

    def _index(self, offset: int) -> int:
        """The tensor holding data byte ``offset`` (the first non-empty one starting there)."""
        index = bisect.bisect_right(self._starts, offset) - 1
        while self.header.entries[index].offset + self.header.entries[index].nbytes <= offset:
            index += 1
        return index

    def _check_range(self, offset: int, end: int) -> None:
        if offset < 0 or end > self.header.data_bytes:
            raise CheckpointTransferError(
                f"received bytes [{offset}, {end}) outside the declared {self.header.data_bytes} data bytes")

    def buffer_at(self, offset: int, limit: int) -> memoryview:
        """A writable view of the destination of data bytes ``[offset, min(limit, end of that tensor))``."""
        self._check_range(offset, limit)
        if offset >= limit:
            raise CheckpointTransferError(f"no room for data at byte {offset} (the range ends at {limit})")
        index = self._index(offset)
        entry = self.header.entries[index]
        return self._views[index][offset - entry.offset:min(limit, entry.offset + entry.nbytes) - entry.offset]

    def data_tensor(self, start: int, end: int) -> torch.Tensor:
        """A flat uint8 tensor aliasing the destination of data bytes ``[start, end)`` (within one tensor)."""
        self._check_range(start, end)
        index = self._index(start)
        entry = self.header.entries[index]
        if end > entry.offset + entry.nbytes:
            raise CheckpointTransferError(f"bytes [{start}, {end}) span more than tensor {index}")
        return self._tensors[index].reshape(-1).view(torch.uint8)[start - entry.offset:end - entry.offset]

    def filled(self, offset: int, count: int) -> None:
        """Account for ``count`` bytes written at ``offset`` through :meth:`buffer_at` (within one tensor)."""
        self._check_range(offset, offset + count)
        index = self._index(offset)
        entry = self.header.entries[index]
        first = offset - entry.offset
        if first + count > entry.nbytes:
            raise CheckpointTransferError(f"{count} bytes at {offset} overrun tensor {index}")
        self._account(index, first, first + count)

    def _account(self, index: int, first: int, stop: int) -> None:
        open_runs = self._open[index]
        start = open_runs.pop(first, first)
        if stop - start >= BATCH_BYTES or stop == self.header.entries[index].nbytes:
            self._checksum(index, start, stop)
        else:
            open_runs[stop] = start
        self.received_bytes += stop - first

    def _checksum(self, index: int, start: int, stop: int) -> None:
        view = self._views[index][start:stop]
        crc = zlib.crc32(view) if stop - start < _INLINE_BYTES else executor().submit(zlib.crc32, view)
        self._runs[index].append((start, stop, crc))

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Place ``data`` at ``offset`` of the data section."""
        data = memoryview(data).cast("B")
        end = offset + len(data)
        self._check_range(offset, end)
        position = offset
        while position < end:
            index = self._index(position)
            entry = self.header.entries[index]
            stop = min(end, entry.offset + entry.nbytes)
            self._views[index][position - entry.offset:stop - entry.offset] = data[position - offset:stop - offset]
            self._account(index, position - entry.offset, stop - entry.offset)
            position = stop

    def _verify(self, index: int) -> None:
        entry, path = self.header.entries[index], self.header.paths[index]
        crc, position = 0, 0
        for start, stop, run_crc in sorted(self._runs[index], key=lambda run: run[0]):
            if isinstance(run_crc, concurrent.futures.Future):
                run_crc = run_crc.result()
            if start != position:
                raise CheckpointTransferError(f"tensor {format_path(path)}: bytes [{min(start, position)}, "
                                              f"{max(start, position)}) were received twice or not at all")
            crc = crc32_combine(crc, run_crc, stop - start)
            position = stop
        if position != entry.nbytes:
            raise CheckpointTransferError(f"checkpoint truncated: tensor {format_path(path)} got {position} of "
                                          f"{entry.nbytes} bytes")
        if crc != entry.crc32:
            raise CheckpointTransferError(f"checksum mismatch in tensor {format_path(path)} (corrupted in transit)")

    def finish(self) -> Any:
        """Check that every byte arrived intact and return the state dict."""
        if self.received_bytes != self.header.data_bytes:
            what = "truncated" if self.received_bytes < self.header.data_bytes else "repeated bytes"
            raise CheckpointTransferError(
                f"checkpoint {what}: {self.received_bytes} of {self.header.data_bytes} data bytes received")
        for index, open_runs in enumerate(self._open):
            for stop, start in open_runs.items():
                self._checksum(index, start, stop)
            open_runs.clear()
        for index in range(len(self.header.entries)):
            self._verify(index)
        results = {id(buffer): target for buffer, target in self._copy_back}
        with torch.no_grad():
            for buffer, target in self._copy_back:
                target.copy_(buffer)
        return self.header.build([results.get(id(tensor), tensor) for tensor in self._tensors])


def decode_bytes(blob: bytes | memoryview, targets: Mapping[Path, torch.Tensor] | None = None) -> tuple[int, Any]:
    """``(step, state_dict)`` from one whole encoding, as ``encode_to_bytes`` makes."""
    blob = memoryview(blob).cast("B")
    length, crc = unpack_prefix(bytes(blob[:PREFIX_SIZE]))
    if len(blob) < PREFIX_SIZE + length:
        raise CheckpointTransferError(f"checkpoint truncated inside the {length}-byte header")
    header = parse_header(bytes(blob[PREFIX_SIZE:PREFIX_SIZE + length]), crc,
                          data_bytes=len(blob) - PREFIX_SIZE - length)
    reader = StateDictReader(header, targets)
    reader.write(0, blob[PREFIX_SIZE + length:])
    return header.step, reader.finish()
