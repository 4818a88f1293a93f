"""Decoding a state dict in the heal format (``serialization.spec``): the receiving side, after the header.

Once a header has been validated (``spec.parse_header``), a :class:`TensorWriter`
allocates the destination tensors (or takes the receiver's own, see
:func:`targets_of`), writes the data section into them as it arrives, checks every
block's sum64, and builds the state dict. :func:`decode_bytes` decodes one whole
encoding held in memory.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import threading
from typing import Any, Iterable, Mapping, Sequence

import torch

from torchft_lite.errors import CheckpointTransferError
from torchft_lite.serialization import checksum, cuda, dtensor, prefault
from torchft_lite.serialization.encode import flatten
from torchft_lite.serialization.spec import (
    DTYPES, PREFIX_SIZE, Header, Path, TensorEntry, byte_view, format_path, parse_header, unpack_prefix,
)
from torchft_lite.serialization.staging import Stager

__all__ = ["TensorWriter", "decode_bytes", "targets_of"]

_POPULATE_MIN_BYTES = 64 << 10  # a smaller block's few page faults cost less than the call that spares them


def targets_of(state_dict: Any) -> dict[Path, torch.Tensor]:
    """Every tensor of ``state_dict`` (DTensors as they are) by its path: where a receive may land in place.

    The paths are the ones a sender's header declares for the same structure
    (both come from ``encode.flatten``).
    """
    flat = flatten(state_dict)
    return dict(zip(flat.paths, flat.leaves))


class TensorWriter:
    """Writes a data section (in any order, in pieces) into preallocated tensors, checks it, builds the state dict.

    ``targets`` maps a tensor's path to an existing tensor: when dtype and
    shape match, the bytes land in it (directly when it is a contiguous CPU
    tensor; through ``stager``'s ring of pinned slots, copied to the device
    while the rest arrives, when it is one the stager takes, see
    ``serialization.staging``; else through a CPU buffer, pinned for a GPU target, that
    :meth:`finish` copies in on the recovery stream), and the result holds
    that very tensor. A DTensor target receives into its local shard (see
    ``serialization.dtensor``). A failed transfer may leave such a target partly
    overwritten.

    Bytes reach the tensors two ways: :meth:`write` copies a received buffer in, or
    a network protocol asks for :meth:`buffer_at` (a writable view of the
    destination memory, never past the end of a checksum block) and reports
    :meth:`filled` after the kernel has written into it, so nothing is copied in
    user space. The pages of a tensor allocated here are populated in bulk just
    before its first bytes land (``serialization.prefault``), not faulted in one by
    one inside the socket's copy.

    Each block's sum64 is computed on the checksum thread as soon as its last byte
    has landed, while the event loop reads on. The sender's sums arrive after the
    data (:meth:`expect`); :meth:`finish` waits for the last sums, compares, and
    builds the state dict.

    A receiver striping one heal over several sources may have to take blocks
    again from another source (a stream that broke half-way, or bytes that differ
    from the primary source's): :meth:`blocks_differing_from` finds them and
    :meth:`receive_again` forgets what arrived for them, so that the next bytes are
    not refused as "received twice".
    """

    def __init__(self, header: Header, targets: Mapping[Path, torch.Tensor] | None = None,
                 stager: Stager | None = None) -> None:
        self.header = header
        self._targets = targets
        self._stager = stager
        self._tensors: list[torch.Tensor] = []
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._staged: dict[int, torch.Tensor] = {}  # tensor index -> its target's flat bytes (on the device)
        fresh: set[int] = set()  # the tensors allocated here (by index), whose pages do not exist yet
        try:
            for entry, path in zip(header.entries, header.paths):
                self._tensors.append(self._buffer_for(entry, (targets or {}).get(path), fresh))
        except RuntimeError as exc:  # torch could not allocate what the header declared
            raise CheckpointTransferError(f"cannot allocate {header.data_bytes} bytes for the checkpoint") from exc
        self._views = [None if index in self._staged else byte_view(tensor)
                       for index, tensor in enumerate(self._tensors)]
        blocks = header.blocks
        self._filled = [0] * len(blocks)  # bytes received into each block
        # each block's sum, computed on the checksum thread once the block is complete
        self._sums: list[concurrent.futures.Future[int] | None] = [None] * len(blocks)
        self._expected: list[int | None] = [None] * len(blocks)  # the sender's, from the trailers
        self.received_bytes = 0
        self._abandoned = threading.Event()
        # blocks of fresh tensors whose pages are populated in bulk ahead of their first bytes (serialization.prefault)
        self._populator = None
        if fresh and prefault.supported():
            spans = [(self._tensors[tensor].data_ptr() + start - header.entries[tensor].offset, end - start)
                     if tensor in fresh and end - start >= _POPULATE_MIN_BYTES else None
                     for start, end, tensor in blocks.spans]
            self._populator = prefault.Populator(spans, self._tensors)

    def _buffer_for(self, entry: TensorEntry, target: torch.Tensor | None, fresh: set[int]) -> torch.Tensor:
        dtype = DTYPES[entry.dtype]
        if target is not None:
            target = dtensor.local_of(target)  # a DTensor's shard is received into its local tensor
        if target is None or target.dtype != dtype or tuple(target.shape) != entry.shape:
            fresh.add(len(self._tensors))
            return torch.empty(entry.shape, dtype=dtype)
        if self._stager is not None and self._stager.takes(target):
            self._staged[len(self._tensors)] = target.reshape(-1).view(torch.uint8)
            return target
        if target.device.type == "cpu" and target.is_contiguous():
            return target
        buffer = cuda.host_buffer(target)  # pinned for a GPU target: finish() copies it on the recovery stream
        self._copy_back.append((buffer, target))
        return buffer

    def _block_at(self, offset: int) -> int:
        """The block holding data byte ``offset``."""
        if not 0 <= offset < self.header.data_bytes:
            raise CheckpointTransferError(f"data byte {offset} is outside [0, {self.header.data_bytes})")
        return bisect.bisect_right(self.header.blocks.starts, offset) - 1

    def _view(self, start: int, end: int, tensor: int) -> memoryview:
        offset = self.header.entries[tensor].offset
        return self._views[tensor][start - offset:end - offset]

    def _check_range(self, offset: int, end: int) -> None:
        if offset < 0 or end > self.header.data_bytes:
            raise CheckpointTransferError(
                f"received bytes [{offset}, {end}) outside the declared {self.header.data_bytes} data bytes")

    def buffer_at(self, offset: int, limit: int) -> memoryview:
        """A writable view of the destination of data bytes ``[offset, min(limit, end of that block))``."""
        self._check_range(offset, limit)
        if offset >= limit:
            raise CheckpointTransferError(f"no room for data at byte {offset} (the range ends at {limit})")
        block = self._block_at(offset)
        start, end, tensor = self.header.blocks.spans[block]
        if tensor in self._staged:
            entry_offset = self.header.entries[tensor].offset
            destination = self._staged[tensor][start - entry_offset:end - entry_offset]
            return self._stager.buffer_at(block, start, end, offset, limit, destination)
        unpopulated = self._populator.claim(block) if self._populator is not None else None
        if unpopulated is not None:  # the writes got here before the populating threads
            prefault.populate(*unpopulated)
        return self._view(offset, min(limit, end), tensor)

    def data_tensor(self, start: int, end: int) -> torch.Tensor:
        """A flat uint8 tensor aliasing the destination of data bytes ``[start, end)`` (within one tensor)."""
        self._check_range(start, end)
        _, _, index = self.header.blocks.spans[self._block_at(start)]
        if index in self._staged:
            raise CheckpointTransferError(f"tensor {format_path(self.header.paths[index])} is staged to its device: "
                                          f"its bytes land through buffer_at only")
        entry = self.header.entries[index]
        if end > entry.offset + entry.nbytes:
            raise CheckpointTransferError(f"bytes [{start}, {end}) span more than tensor {index}")
        return self._tensors[index].reshape(-1).view(torch.uint8)[start - entry.offset:end - entry.offset]

    def filled(self, offset: int, count: int) -> None:
        """Account for ``count`` bytes written at ``offset`` (through :meth:`buffer_at` or :meth:`data_tensor`)."""
        self._check_range(offset, offset + count)
        spans = self.header.blocks.spans
        position, end = offset, offset + count
        while position < end:
            block = self._block_at(position)
            block_start, block_end, tensor = spans[block]
            stop = min(end, block_end)
            if self._filled[block] + stop - position > block_end - block_start:  # refused before it is counted
                raise CheckpointTransferError(f"bytes of block [{block_start}, {block_end}) were received twice")
            staged = tensor in self._staged
            if staged:
                self._stager.filled(block_start, position, stop - position)
            self._filled[block] += stop - position
            self.received_bytes += stop - position
            if self._filled[block] == block_end - block_start:
                self._sums[block] = self._stager.block_sum(block) if staged else checksum.executor().submit(
                    checksum.sum64, self._view(block_start, block_end, tensor))
            position = stop

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Place ``data`` at ``offset`` of the data section."""
        data = memoryview(data).cast("B")
        end = offset + len(data)
        self._check_range(offset, end)
        position = offset
        while position < end:
            destination = self.buffer_at(position, end)
            destination[:] = data[position - offset:position - offset + len(destination)]
            self.filled(position, len(destination))
            position += len(destination)

    def expect(self, start: int, end: int, trailer: bytes | memoryview) -> None:
        """The sender's checksums of the blocks making up data bytes ``[start, end)``."""
        try:
            covered = self.header.blocks.covering(start, end)
            sums = checksum.unpack(trailer)
        except ValueError as exc:
            raise CheckpointTransferError(f"bad checksums for data bytes [{start}, {end}): {exc}") from exc
        if len(sums) != len(covered):
            raise CheckpointTransferError(f"{len(sums)} checksums for the {len(covered)} blocks of [{start}, {end})")
        for block, value in zip(covered, sums):
            if self._expected[block] is not None:
                raise CheckpointTransferError(f"the checksum of data block {block} arrived twice")
            self._expected[block] = value

    def expected_trailer_bytes(self, start: int, end: int) -> int:
        """How many checksum bytes follow the data range ``[start, end)`` on the wire."""
        try:
            return self.header.blocks.trailer_bytes(start, end)
        except ValueError as exc:
            raise CheckpointTransferError(str(exc)) from exc

    def blocks_differing_from(self, reference: Sequence[int], blocks: Iterable[int]) -> list[int]:
        """Those of ``blocks`` whose bytes as received, or whose sender's sum, differ from ``reference``.

        ``reference`` holds one sum per block: a striping receiver passes its
        primary source's, to keep a block another source served only when
        that source's bytes and its own sum both equal the primary's. A block
        still incomplete counts as differing. Waits for the checksum thread
        (call it off the event loop).
        """
        if len(reference) != len(self._filled):
            raise CheckpointTransferError(f"{len(reference)} reference checksums for {len(self._filled)} blocks")
        differing = []
        for block in blocks:
            start, end, _ = self.header.blocks.spans[block]
            computed = self._sums[block]
            if self._filled[block] != end - start or computed is None or self._expected[block] != reference[block] \
                    or computed.result() != reference[block]:
                differing.append(block)
        return differing

    def receive_again(self, blocks: Iterable[int]) -> None:
        """Forget the bytes, the sender's sums and the computed sums of ``blocks``, to receive them once more.

        For a striping receiver that takes these blocks from another source:
        the ones a broken stream left partly filled, or whose bytes differ
        from the primary's. Only the next bytes then count (nothing of the
        first delivery is checked or kept). The caller must have stopped
        every stream still writing into them.
        """
        blocks = list(blocks)
        for block in blocks:
            if not 0 <= block < len(self._filled):
                raise ValueError(f"no data block {block} (there are {len(self._filled)})")
            self.received_bytes -= self._filled[block]
            self._filled[block] = 0
            self._expected[block] = None
            computed = self._sums[block]
            if computed is not None:
                computed.cancel()  # its bytes are about to be replaced; when already running its result is dropped
            self._sums[block] = None
        if self._stager is not None:
            self._stager.forget(blocks)

    def describe_block(self, block: int) -> str:
        """``"tensor <path> bytes [a, b)"``: where data block ``block`` lies, for error messages."""
        start, end, tensor = self.header.blocks.spans[block]
        offset = self.header.entries[tensor].offset
        return f"tensor {format_path(self.header.paths[tensor])} bytes [{start - offset}, {end - offset})"

    def _verify(self) -> None:
        """Every block complete and equal to its sender's sum; waits for the checksum thread."""
        if self.received_bytes != self.header.data_bytes:
            what = "truncated" if self.received_bytes < self.header.data_bytes else "repeated bytes"
            raise CheckpointTransferError(
                f"checkpoint {what}: {self.received_bytes} of {self.header.data_bytes} data bytes received")
        for block, (start, end, _) in enumerate(self.header.blocks.spans):
            if self._filled[block] != end - start:
                raise CheckpointTransferError(f"checkpoint truncated: {self.describe_block(block)} got "
                                              f"{self._filled[block]} bytes")
            if self._expected[block] is None:
                raise CheckpointTransferError(
                    f"checkpoint truncated: the checksum of {self.describe_block(block)} never arrived")
            computed = self._sums[block]
            if computed is None or computed.result() != self._expected[block]:
                raise CheckpointTransferError(
                    f"checksum mismatch in {self.describe_block(block)} (corrupted in transit)")

    def abandon(self) -> None:
        """The receive has failed or timed out: a :meth:`finish` still running must not write into the targets.

        (Its thread can outlive the receive that started it, and copy an older
        step's bytes into GPU targets after a later heal has written them.)
        """
        self._abandoned.set()
        if self._populator is not None:
            self._populator.stop()
        if self._stager is not None:
            self._stager.abandon()

    def finish(self, meshes_from: Mapping[Path, torch.Tensor] | None = None) -> Any:
        """Check that every byte arrived intact and return the state dict.

        ``meshes_from``: tensors by path whose DTensors lend their meshes to the result's (default the
        targets): a durable resume reads into fresh tensors, yet its DTensors belong on the live meshes.
        """
        self._verify()
        if self._abandoned.is_set():
            raise CheckpointTransferError("the receive was abandoned (failed or timed out) before it was applied")
        results = {id(buffer): target for buffer, target in self._copy_back}
        cuda.to_device(self._copy_back)
        return self.header.build([results.get(id(tensor), tensor) for tensor in self._tensors],
                                 self._targets if meshes_from is None else meshes_from)


def decode_bytes(blob: bytes | memoryview, targets: Mapping[Path, torch.Tensor] | None = None) -> tuple[int, Any]:
    """``(step, state_dict)`` from one whole encoding, as ``encode_to_bytes`` makes."""
    blob = memoryview(blob).cast("B")
    length, crc = unpack_prefix(bytes(blob[:PREFIX_SIZE]))
    if len(blob) < PREFIX_SIZE + length:
        raise CheckpointTransferError(f"checkpoint truncated inside the {length}-byte header")
    header = parse_header(bytes(blob[PREFIX_SIZE:PREFIX_SIZE + length]), crc,
                          following=len(blob) - PREFIX_SIZE - length)
    writer = TensorWriter(header, targets)
    data_start = PREFIX_SIZE + length
    writer.write(0, blob[data_start:data_start + header.data_bytes])
    writer.expect(0, header.data_bytes, blob[data_start + header.data_bytes:])
    return header.step, writer.finish()
