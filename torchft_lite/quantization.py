"""8-bit block quantization with plain torch ops: what the quantized cross-group reduction sends.

The reduction across replica groups is what crosses the slow links between them;
8 bits a value instead of 32 cut its bytes to about a quarter. torchft quantizes
with Triton kernels (fp8, CUDA only); these are ordinary tensor operations, so
they run on CPU, and on CUDA too (slower than fused kernels, same format). A block
is int8 values and one float32 scale (:func:`quantize_blocks`); blocks are laid out
one row per rank (:class:`BlockLayout`), the rows the collectives
(``torchft_lite.collectives``) exchange. ``fused_quantize_into_fp8``,
``fused_dequantize_from_fp8`` and ``fused_reduce_fp8`` keep torchft's names and
signatures ("fp8" there means 8 bits; torchft itself falls back to int8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed import ReduceOp

__all__ = [
    "BLOCK_SIZE",
    "BlockLayout",
    "SCALE_DTYPE",
    "SUPPORTED_DTYPES",
    "UnsupportedDtypeError",
    "UnsupportedQuantization",
    "check_quantizable",
    "dequantize_blocks",
    "fused_dequantize_from_fp8",
    "fused_quantize_into_fp8",
    "fused_reduce_fp8",
    "quantize_blocks",
]

BLOCK_SIZE = 1024
"""Elements per float32 scale: 4 bytes of scale per 1024 of values (0.4%)."""
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
QUANTIZED_MAX = 127
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TINY = torch.finfo(torch.float32).tiny  # the smallest scale: 1 / scale stays finite


class UnsupportedQuantization(Exception):
    """Base of the errors a quantized reduction raises for input it can never take (a programming error).

    The Manager raises these to its caller instead of failing the step: every step would fail the same way."""


class UnsupportedDtypeError(UnsupportedQuantization, TypeError):
    """A tensor's dtype can't be quantized (only float32, bfloat16 and float16 can)."""


def check_quantizable(tensors: list[torch.Tensor]) -> None:
    """Raise unless ``tensors`` is a non-empty list of float32/bfloat16/float16 tensors of one dtype and device."""
    if not tensors:
        raise ValueError("a quantized reduction needs at least one tensor")
    for tensor in tensors:
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedDtypeError(
                f"should_quantize=True can't reduce a {tensor.dtype} tensor: 8-bit quantization takes float32, "
                f"bfloat16 or float16 only; pass should_quantize=False for this tensor (or cast it)")
    first = tensors[0]
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        found = sorted({f"{t.dtype} on {t.device}" for t in tensors})
        raise UnsupportedDtypeError(f"a quantized reduction takes tensors of one dtype on one device, got {found}")


@dataclass(frozen=True)
class BlockLayout:
    """Where each tensor's blocks lie, and how they are split into one row per rank.

    Each tensor of a list is flattened and cut into blocks of ``block_size`` elements (its last block padded
    with zeros; a block never mixes two tensors, whose magnitudes may differ by orders). The blocks are then
    split into ``world_size`` equal chunks, one per rank (the last padded with empty blocks), and each chunk is
    one row of a uint8 buffer: ``[float32 scale of each block][int8 values of each block]``. Row ``r`` is what
    rank ``r`` reduces.
    """

    numels: tuple[int, ...]
    world_size: int
    block_size: int = BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.block_size < SCALE_BYTES or self.block_size % SCALE_BYTES:
            # rows must stay 4-byte aligned so each rank's scales can be read as float32 in place
            raise ValueError(f"block_size must be a positive multiple of {SCALE_BYTES}, got {self.block_size}")

    @classmethod
    def of(cls, tensors: list[torch.Tensor], world_size: int, block_size: int = BLOCK_SIZE) -> "BlockLayout":
        return cls(tuple(t.numel() for t in tensors), world_size, block_size)

    @property
    def tensor_blocks(self) -> tuple[int, ...]:
        return tuple(-(-n // self.block_size) for n in self.numels)

    @property
    def blocks(self) -> int:
        """Blocks of all tensors, before the rows are padded."""
        return sum(self.tensor_blocks)

    @property
    def blocks_per_rank(self) -> int:
        return -(-self.blocks // self.world_size)

    @property
    def row_bytes(self) -> int:
        return self.blocks_per_rank * (SCALE_BYTES + self.block_size)

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole quantized buffer (every rank's row)."""
        return self.row_bytes * self.world_size

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        """The float32 scales inside ``rows`` (uint8, ``(n, row_bytes)``), as a ``(n, blocks_per_rank)`` view."""
        return rows[:, :SCALE_BYTES * self.blocks_per_rank].view(SCALE_DTYPE)

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        """The int8 values inside ``rows``, as a ``(n, blocks_per_rank, block_size)`` view."""
        return rows[:, SCALE_BYTES * self.blocks_per_rank:].view(torch.int8).view(
            rows.shape[0], self.blocks_per_rank, self.block_size)


def quantize_blocks(blocks: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize float32 ``blocks`` (``(..., block_size)``; overwritten, used as scratch) into int8 ``values``
    and float32 ``scales`` (``(...)``).

    A block is stored as int8 values ``round(x / scale)`` and one float32 ``scale = max|x| / 127``, so a value
    comes back within half a step: at most ``max|x| / 254`` of its block. (The scale is at least float32's
    smallest normal number, 1.2e-38, so that its reciprocal stays finite: a block of magnitudes below 1.5e-36
    comes back within 6e-39, tiny values flushed toward zero.)

    Non-finite input: a block holding NaN or Inf gets a NaN scale and zero values, so it comes back NaN in
    full, and a sum it enters is NaN too. A non-finite gradient is never turned into a finite one; the
    Manager's non-finite guard (``torchft_lite.health.nonfinite``) zeroes such a bucket before it is quantized,
    as it does unquantized.
    """
    # amax and amin, not aminmax (4x slower here) nor abs().amax (a full copy); NaN propagates through both
    amax = torch.maximum(blocks.amax(dim=-1), blocks.amin(dim=-1).neg_())
    finite = torch.isfinite(amax)
    scale = (amax / QUANTIZED_MAX).clamp_(min=_TINY)  # an all-zero block keeps a usable scale and zero values
    quantized = blocks.mul_(scale.reciprocal().unsqueeze(-1))
    # NaN would not cast to int8: zero the non-finite blocks (on CPU only when there are any: the usual
    # all-finite case saves a pass; on an accelerator always, rather than wait for the device)
    if blocks.device.type != "cpu" or not bool(finite.all()):
        quantized.masked_fill_(finite.logical_not().unsqueeze(-1), 0.0)
    values.copy_(quantized.round_().clamp_(-QUANTIZED_MAX, QUANTIZED_MAX))
    scales.copy_(scale.masked_fill_(finite.logical_not(), math.nan))


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 blocks from int8 ``values`` (``(..., block_size)``) and their ``scales`` (``(...)``)."""
    return values.to(torch.float32).mul_(scales.unsqueeze(-1))


def _blocks_of(inputs: list[torch.Tensor], layout: BlockLayout) -> torch.Tensor:
    """The inputs as float32 blocks, ``(world_size, blocks_per_rank, block_size)``, zero-padded."""
    size = layout.world_size * layout.blocks_per_rank * layout.block_size
    flat = torch.zeros(size, dtype=torch.float32, device=inputs[0].device)
    start = 0
    for tensor, blocks in zip(inputs, layout.tensor_blocks):
        flat[start:start + tensor.numel()].view(tensor.shape).copy_(tensor)
        start += blocks * layout.block_size
    return flat.view(layout.world_size, layout.blocks_per_rank, layout.block_size)


def _copy_out(blocks: torch.Tensor, outputs: list[torch.Tensor], layout: BlockLayout) -> None:
    """Copy float32 ``blocks`` (in the layout's order) back into ``outputs`` (cast to their dtype)."""
    flat, start = blocks.reshape(-1), 0
    for tensor, count in zip(outputs, layout.tensor_blocks):
        tensor.copy_(flat[start:start + tensor.numel()].view(tensor.shape))
        start += count * layout.block_size


def quantize_rows(inputs: list[torch.Tensor], layout: BlockLayout) -> torch.Tensor:
    """The quantized buffer of ``inputs``: uint8, ``(world_size, row_bytes)``, row ``r`` is rank ``r``'s chunk."""
    rows = torch.empty(layout.world_size, layout.row_bytes, dtype=torch.uint8, device=inputs[0].device)
    quantize_blocks(_blocks_of(inputs, layout), layout.values(rows), layout.scales(rows))
    return rows


def dequantize_rows(outputs: list[torch.Tensor], rows: torch.Tensor, layout: BlockLayout) -> None:
    """Write the quantized buffer ``rows`` (every rank's chunk) into ``outputs``."""
    _copy_out(dequantize_blocks(layout.values(rows), layout.scales(rows)), outputs, layout)


def reduce_rows(received: torch.Tensor, out: torch.Tensor, layout: BlockLayout, reduce_op: ReduceOp) -> None:
    """Dequantize every rank's copy of one chunk (``received``: one row per rank), sum them in float32
    (and divide by the number of ranks for AVG), and quantize the result into the row ``out``
    (``(1, row_bytes)``; it may be one of ``received``'s rows)."""
    values, scales = layout.values(received), layout.scales(received)
    total = dequantize_blocks(values[0], scales[0])
    for peer in range(1, received.shape[0]):
        total.add_(dequantize_blocks(values[peer], scales[peer]))
    if reduce_op == ReduceOp.AVG:
        total.div_(received.shape[0])
    elif reduce_op != ReduceOp.SUM:
        raise ValueError(f"a quantized reduction sums or averages, got {reduce_op}")
    quantize_blocks(total, layout.values(out)[0], layout.scales(out)[0])


# torchft's names ------------------------------------------------------------


def _layout(inputs: list[torch.Tensor], all_reduce_group_size: int) -> BlockLayout:
    check_quantizable(inputs)
    return BlockLayout.of(inputs, all_reduce_group_size)


def fused_quantize_into_fp8(inputs: list[torch.Tensor], all_reduce_group_size: int) -> torch.Tensor:
    """torchft's name: the quantized buffer of ``inputs`` (flat uint8; one row per rank of the group)."""
    return quantize_rows(inputs, _layout(inputs, all_reduce_group_size)).view(-1)


def fused_dequantize_from_fp8(inputs: list[torch.Tensor], output: torch.Tensor, all_reduce_group_size: int) -> None:
    """torchft's name: write the quantized buffer ``output`` back into ``inputs`` (same shapes as quantized)."""
    layout = _layout(inputs, all_reduce_group_size)
    dequantize_rows(inputs, _rows(output, layout), layout)


def fused_reduce_fp8(inputs: list[torch.Tensor], output: torch.Tensor, all_reduce_group_size: int,
                     all_reduce_rank: int, reduce_op: ReduceOp = ReduceOp.SUM) -> None:
    """torchft's name: ``output`` holds every rank's copy of chunk ``all_reduce_rank`` (after an all-to-all);
    reduce them in float32 and quantize the result into row ``all_reduce_rank``."""
    layout = _layout(inputs, all_reduce_group_size)
    rows = _rows(output, layout)
    reduce_rows(rows, rows[all_reduce_rank:all_reduce_rank + 1], layout, reduce_op)


def _rows(buffer: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    if buffer.dtype != torch.uint8 or buffer.numel() != layout.total_bytes:
        raise ValueError(f"expected the quantized buffer of these inputs (uint8, {layout.total_bytes} bytes), got "
                         f"{buffer.dtype} with {buffer.numel()} elements")
    return buffer.view(layout.world_size, layout.row_bytes)
