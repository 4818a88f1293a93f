"""8-bit block quantization (torchft_lite.quantization) and the quantized collectives' checks, in one process.

The bounds come from the format: a value quantized alone is within half a step, ``a / 254`` where ``a`` is
its block's largest magnitude; a quantized sum over W ranks is within ``sum_j a_j / 127`` (half a step of
each input, and half a step of the sum, whose magnitude is at most ``sum_j a_j``), ``/ W`` for AVG.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed import ReduceOp

from tests.conftest import block_amax
from torchft_lite.collectives import (
    UnsupportedProcessGroupError, UnsupportedReduceOpError, allocate_reduce_scatter_output, allreduce_quantized,
    check_quantized_reduction, get_padded_sizes,
)
from torchft_lite.process_group.dummy import ProcessGroupDummy
from torchft_lite.quantization import (
    BlockLayout, UnsupportedDtypeError, UnsupportedQuantization, dequantize_rows, fused_dequantize_from_fp8,
    fused_quantize_into_fp8, fused_reduce_fp8, quantize_rows,
)
from torchft_lite.testing import InMemoryProcessGroup

SLACK = 1e-5  # float32 rounding of the scale's reciprocal and of the sums, relative to the block's magnitude


def round_trip(tensors: list[torch.Tensor], world: int = 1, block: int = 1024) -> list[torch.Tensor]:
    layout = BlockLayout.of(tensors, world, block)
    out = [torch.empty_like(t) for t in tensors]
    dequantize_rows(out, quantize_rows(tensors, layout), layout)
    return out


def varied(numel: int, block: int, seed: int = 0) -> torch.Tensor:
    """Random values whose magnitude changes by orders from block to block (1e-4 .. 1e4)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    blocks = -(-numel // block)
    magnitude = 10.0 ** torch.empty(blocks).uniform_(-4, 4, generator=generator)
    return values * magnitude.repeat_interleave(block)[:numel]


@pytest.mark.parametrize("numel", [1, 3, 1023, 1024, 1025, 5000])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_value_comes_back_within_half_a_step_of_its_block(numel, world):
    x = varied(numel, 1024, seed=numel)
    (back,) = round_trip([x], world)
    amax = block_amax(x, 1024)
    assert bool(((back - x).abs() <= amax / 254 * (1 + SLACK)).all())
    assert bool((back != 0).any()) and back.shape == x.shape


def test_blocks_are_independent_and_never_mix_two_tensors():
    big, small = torch.full((10,), 1000.0), torch.linspace(-1e-3, 1e-3, 7)
    back_big, back_small = round_trip([big, small], world=2, block=16)
    # small has a block of its own: its error scales with 1e-3, not with big's 1000
    assert torch.equal(back_big, big)
    assert bool(((back_small - small).abs() <= 1e-3 / 254 * (1 + SLACK)).all())


def test_zeros_stay_exact_zeros_and_values_on_the_grid_are_exact():
    zeros = torch.zeros(3000)
    grid = torch.arange(-127, 128, dtype=torch.float32) * 0.5  # amax 63.5: scale 0.5, every value on the grid
    back_zeros, back_grid = round_trip([zeros, grid], world=3, block=256)
    assert torch.equal(back_zeros, zeros) and torch.equal(back_grid, grid)


def test_a_non_finite_value_makes_its_whole_block_nan_and_leaves_the_others_alone():
    x = torch.arange(1.0, 25.0)
    x[5], x[13] = float("nan"), float("inf")
    x[22] = -float("inf")
    (back,) = round_trip([x], world=2, block=8)
    assert bool(back[:16].isnan().all()) and bool(back[16:].isnan().all())  # every block had one
    y = torch.arange(1.0, 25.0)
    y[3] = float("nan")
    (back,) = round_trip([y], world=2, block=8)
    assert bool(back[:8].isnan().all()) and torch.isfinite(back[8:]).all()
    assert bool(((back[8:] - y[8:]).abs() <= block_amax(y[8:], 8) / 254 * (1 + SLACK)).all())


def test_extreme_magnitudes_stay_finite_and_within_the_bound():
    tiny = torch.tensor([1e-40, -3e-41, 0.0, 2e-45] * 4)  # subnormal: a naive 127 / amax would overflow
    huge = torch.tensor([3.0e38, -3.4e38, 1.0, 0.0] * 4)
    back_tiny, back_huge = round_trip([tiny, huge], block=16)
    assert torch.isfinite(back_tiny).all() and torch.isfinite(back_huge).all()
    # the smallest scale is float32's smallest normal: values this small come back within half of it
    assert bool(((back_tiny - tiny).abs() <= torch.finfo(torch.float32).tiny / 2).all())
    assert bool(((back_huge - huge).abs() <= 3.4e38 / 254 * (1 + SLACK)).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_round_trips_within_the_bound_plus_its_own_rounding(dtype):
    x = (torch.randn(4000, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    (back,) = round_trip([x], world=2)
    assert back.dtype == dtype
    error = (back.float() - x.float()).abs()
    own_rounding = back.float().abs() * torch.finfo(dtype).eps
    assert bool((error <= block_amax(x, 1024) / 254 * (1 + SLACK) + own_rounding).all())


def test_shapes_and_empty_tensors_keep_their_place():
    tensors = [torch.randn(3, 5, 7), torch.empty(0), torch.randn(1), torch.randn(2, 0), torch.tensor(2.5)]
    back = round_trip(tensors, world=3, block=32)
    for original, result in zip(tensors, back):
        assert result.shape == original.shape
        assert bool(((result - original).abs() <= block_amax(original, 32) / 254 * (1 + SLACK)).all())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64, torch.bool, torch.uint8])
def test_an_unsupported_dtype_is_named_with_what_to_do(dtype):
    tensor = torch.ones(4, dtype=dtype)
    with pytest.raises(UnsupportedDtypeError, match=str(dtype)) as raised:
        fused_quantize_into_fp8([tensor], 2)
    assert isinstance(raised.value, TypeError) and "should_quantize=False" in str(raised.value)
    with pytest.raises(TypeError, match=str(dtype)):
        allreduce_quantized([tensor], ReduceOp.SUM, ProcessGroupDummy(0, 1))


def test_mixed_dtypes_and_bad_block_sizes_are_refused():
    with pytest.raises(UnsupportedDtypeError, match="one dtype"):
        check_quantized_reduction([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)], ReduceOp.SUM,
                                  ProcessGroupDummy(0, 1))
    with pytest.raises(ValueError, match="multiple of 4"):
        BlockLayout((10,), 1, block_size=6)
    with pytest.raises(ValueError, match="at least one tensor"):
        allreduce_quantized([], ReduceOp.SUM, ProcessGroupDummy(0, 1))


@pytest.mark.parametrize("op", [ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT])
def test_only_sum_and_avg_can_be_quantized(op):
    with pytest.raises(UnsupportedReduceOpError, match="SUM or AVG") as raised:
        allreduce_quantized([torch.ones(4)], op, ProcessGroupDummy(0, 1))
    # a ValueError as the brief asks, and a NotImplementedError as torchft raises
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, NotImplementedError)


def test_a_group_without_the_collectives_needed_is_named():
    with pytest.raises(UnsupportedProcessGroupError, match="InMemoryProcessGroup has no alltoall_base"):
        allreduce_quantized([torch.ones(4)], ReduceOp.SUM, InMemoryProcessGroup())
    assert issubclass(UnsupportedProcessGroupError, UnsupportedQuantization)


def simulated_allreduce(inputs: list[list[torch.Tensor]], op: ReduceOp) -> list[list[torch.Tensor]]:
    """Every rank's result of a quantized allreduce through torchft's three functions, the collectives done
    by hand: rank r's all-to-all output is row r of every rank's buffer, its all-gather output every
    rank's reduced row r."""
    world = len(inputs)
    buffers = [fused_quantize_into_fp8(tensors, world).view(world, -1) for tensors in inputs]
    received = [torch.stack([buffers[j][r] for j in range(world)]) for r in range(world)]
    for r in range(world):
        fused_reduce_fp8(inputs[r], received[r].view(-1), world, r, op)
    gathered = torch.stack([received[r][r] for r in range(world)]).view(-1)
    results = []
    for tensors in inputs:
        out = [torch.empty_like(t) for t in tensors]
        fused_dequantize_from_fp8(out, gathered, world)
        results.append(out)
    return results


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
def test_a_quantized_sum_is_within_the_derived_bound_and_the_same_on_every_rank(world, op):
    inputs = [[varied(3001, 1024, seed=10 * r), varied(17, 1024, seed=10 * r + 1)] for r in range(world)]
    results = simulated_allreduce(inputs, op)
    for i in range(2):
        exact = sum(tensors[i] for tensors in inputs)
        bound = sum(block_amax(tensors[i], 1024) for tensors in inputs) / 127
        if op == ReduceOp.AVG:
            exact, bound = exact / world, bound / world
        for rank in range(world):
            assert torch.equal(results[rank][i], results[0][i])  # identical bytes: identical parameters
        assert bool(((results[0][i] - exact).abs() <= bound * (1 + SLACK)).all())


def test_allreduce_quantized_on_a_group_of_one_returns_a_finished_work():
    x = varied(2500, 1024)
    original = x.clone()
    work = allreduce_quantized([x], ReduceOp.AVG, ProcessGroupDummy(0, 1))
    assert work.wait() and work.is_completed() and work.get_future().value()[0] is x
    assert bool(((x - original).abs() <= block_amax(original, 1024) / 127 * (1 + SLACK)).all())
    empty = torch.empty(0)
    assert allreduce_quantized([empty], ReduceOp.SUM, ProcessGroupDummy(0, 1)).wait()


def test_torchft_padding_helpers():
    sizes = get_padded_sizes([torch.ones(5), torch.ones(3, 4)], 2)
    assert sizes == [torch.Size((6, 1)), torch.Size((4, 4))]
    output, padded = allocate_reduce_scatter_output([torch.ones(5), torch.ones(3, 4)], 2)
    assert padded == sizes and output.numel() == 3 + 8 and output.dtype == torch.float32


def test_the_wire_format_is_a_quarter_of_float32_plus_the_scales():
    layout = BlockLayout((10_000_000,), 2)
    assert layout.total_bytes == 2 * math.ceil(10_000_000 / 1024 / 2) * (1024 + 4)
    assert 0.25 < layout.total_bytes / (4 * 10_000_000) < 0.252
