"""Quantized collectives: allreduce and reduce-scatter in 8 bits, reduced in full precision (torchft's names).

:func:`allreduce_quantized` (its steps, bytes and error bound are on it) and
:func:`reduce_scatter_quantized` exchange rows of int8 blocks
(:mod:`torchft_lite.quantization`) with an all-to-all and an all-gather; the
Manager's ``should_quantize=True`` goes through :func:`start_quantized_allreduce`.
The group needs ``alltoall_base`` and ``allgather_into_tensor_coalesced`` (ours and
c10d's have both); one without them raises :class:`UnsupportedProcessGroupError`.
What a user sees is in docs/large-models.md ("Quantized reduction").
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceScatterOptions

from torchft_lite.quantization import (
    BlockLayout, UnsupportedQuantization, check_quantizable, dequantize_rows, quantize_rows, reduce_rows,
)
from torchft_lite.work import cuda_devices, device_future

__all__ = [
    "UnsupportedProcessGroupError",
    "UnsupportedReduceOpError",
    "allocate_reduce_scatter_output",
    "allreduce_quantized",
    "check_quantized_reduction",
    "get_padded_sizes",
    "reduce_scatter_quantized",
    "start_quantized_allreduce",
]

_NEEDED = ("alltoall_base", "allgather_into_tensor_coalesced")
_DEFAULT_WAIT = timedelta(seconds=60)  # when the options set no timeout: the process groups' default


class UnsupportedReduceOpError(UnsupportedQuantization, ValueError, NotImplementedError):
    """A quantized reduction sums or averages; other reduce ops can't be done on quantized values.

    Also a ``NotImplementedError``, which torchft raises here."""


class UnsupportedProcessGroupError(UnsupportedQuantization, NotImplementedError):
    """The process group lacks a collective the quantized reduction exchanges its rows with."""


def _reduce_op(opts: Any) -> tuple[ReduceOp, timedelta | None]:
    op = opts.reduceOp if isinstance(opts, (AllreduceOptions, ReduceScatterOptions)) else opts
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise UnsupportedReduceOpError(f"a quantized reduction can only SUM or AVG, got {op}; use "
                                       f"should_quantize=False for other reduce ops")
    timeout = getattr(opts, "timeout", None)
    return ReduceOp(op), (timeout if timeout is not None and timeout >= timedelta(0) else None)


def check_quantized_reduction(tensors: list[torch.Tensor], reduce_op: Any, process_group: Any) -> None:
    """Raise (an :class:`UnsupportedQuantization`) if this reduction can never be quantized; sends nothing."""
    _reduce_op(reduce_op)
    check_quantizable(tensors)
    if tensors[0].device.type not in ("cpu", "cuda"):
        raise UnsupportedQuantization(f"quantized reductions run on CPU or CUDA tensors, got {tensors[0].device}")
    missing = [name for name in _NEEDED if not callable(getattr(process_group, name, None))]
    if missing:
        raise UnsupportedProcessGroupError(
            f"{type(process_group).__name__} has no {' or '.join(missing)}, which should_quantize=True exchanges "
            f"its 8-bit chunks with; use ProcessGroupGloo/ProcessGroupNCCL/ProcessGroupBaby*, or "
            f"should_quantize=False")


def _start(process_group: Any, op: str, *args: Any) -> dist.Work:
    try:
        return getattr(process_group, op)(*args)
    except NotImplementedError as exc:  # a group that has the method but not the collective
        raise UnsupportedProcessGroupError(f"{type(process_group).__name__}.{op} is not implemented: "
                                           f"should_quantize=True needs it ({exc})") from exc


def _options(factory: Any, timeout: timedelta | None) -> Any:
    options = factory()
    if timeout is not None:
        options.timeout = timeout
    return options


class _QuantizedWork(dist.Work):
    """The Work of a quantized collective: done when its tensors hold the result."""

    def __init__(self, future: torch.futures.Future, timeout: timedelta | None) -> None:
        super().__init__()
        self._future = future
        self._timeout = timeout or _DEFAULT_WAIT
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: timedelta | None = None) -> bool:
        limit = timeout or self._timeout
        if not self._done.wait(limit.total_seconds()):
            raise TimeoutError(f"a quantized collective did not finish within {limit.total_seconds():g} seconds")
        self._future.wait()  # raises the collective's error; on CUDA the caller's streams wait for the result
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as exc:  # the failure, handed back rather than raised (c10d's Work.exception)
            return exc
        return None


def _stream_of(tensors: list[torch.Tensor], sync_stream: Any) -> Any:
    """The CUDA stream the quantized ops run on, after the work already queued on the current one; None on CPU."""
    if tensors[0].device.type != "cuda":
        return None
    stream = sync_stream if sync_stream is not None else torch.cuda.Stream(device=tensors[0].device)
    stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
    return stream


def _exchange(rows: torch.Tensor, layout: BlockLayout, op: ReduceOp, timeout: timedelta | None,
              process_group: Any) -> torch.Tensor:
    """Steps 2-3: all-to-all of ``rows``, then reduce this rank's chunk; returns the received rows, the
    reduced chunk in the row of this rank."""
    received = torch.empty_like(rows)
    _start(process_group, "alltoall_base", received, rows, [], [], _options(AllToAllOptions, timeout)).wait()
    rank = process_group.rank()
    reduce_rows(received, received[rank:rank + 1], layout, op)
    return received


def allreduce_quantized(tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp, process_group: Any,
                        sync_stream: Any = None) -> dist.Work:
    """Allreduce ``tensors`` in place, exchanging 8-bit blocks; SUM or AVG (over the group).

    Returns a Work whose future yields ``tensors``. Raises :class:`UnsupportedQuantization` (a ``TypeError``
    for a dtype other than float32/bfloat16/float16, a ``ValueError`` for another reduce op) before sending
    anything; a failed collective raises from here (the all-to-all) or fails the future (the all-gather).

    On a group of W ranks:

    1. quantize the tensors into one row per rank (``torchft_lite.quantization``: int8, one float32 scale per
       block of 1024 values);
    2. all-to-all: rank ``r`` receives every rank's copy of chunk ``r``;
    3. dequantize those W copies, sum them in float32 (AVG: divide by W), quantize the sum into one row;
    4. all-gather the reduced rows, and dequantize all of them into the tensors.

    Each rank sends ``2 (W-1)`` rows of about ``N (1 + 4/1024) / W`` bytes for N values, where a float32 ring
    allreduce sends ``2 (W-1) / W * 4N``: about a quarter of the bytes. The error of a value is at most
    ``(sum over ranks of a_j) / 127`` for SUM (``/ W`` for AVG), where ``a_j`` is the largest magnitude in the
    value's block on rank ``j``: half a step when each rank quantizes its input, and half a step of the sum
    (whose magnitude is at most the sum of the ``a_j``) when it is quantized again.

    Why the all-to-all is waited for in the calling thread (as torchft does): the all-gather needs its result,
    and it must be issued from the caller too, so that every rank issues its collectives in the same order
    (gloo and NCCL pair them by order; an all-gather started from a completion callback could overtake another
    collective the caller starts meanwhile). The wait is bounded by the group's timeout; the all-gather and the
    dequantization then run in the background. On CUDA both phases are stream-ordered (``sync_stream``), and
    the host never waits. The returned work follows the stream rule (``torchft_lite.work``): its future is
    CUDA-aware and set on the stream the quantized ops ran on, so ``wait()``, ``then()`` (the Manager's
    division) and DDP order themselves after the dequantization.
    """
    check_quantized_reduction(tensors, opts, process_group)
    op, timeout = _reduce_op(opts)
    layout = BlockLayout.of(tensors, process_group.size())
    done = device_future(cuda_devices(tensors))
    if layout.blocks == 0:
        done.set_result(tensors)
        return _QuantizedWork(done, timeout)
    stream = _stream_of(tensors, sync_stream)
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        rows = quantize_rows(tensors, layout)
        received = _exchange(rows, layout, op, timeout, process_group)
        rank = process_group.rank()
        gathered = _start(process_group, "allgather_into_tensor_coalesced", [rows], [received[rank:rank + 1]],
                          _options(AllgatherOptions, timeout))
        if stream is not None:  # stream-ordered: no host wait
            gathered.wait()
            dequantize_rows(tensors, rows, layout)
            done.set_result(tensors)  # on ``stream``: its event orders every consumer after the dequantization
            return _QuantizedWork(done, timeout)

    def finish(fut: torch.futures.Future) -> list[torch.Tensor]:
        fut.value()  # re-raises a failed all-gather
        dequantize_rows(tensors, rows, layout)
        return tensors

    return _QuantizedWork(gathered.get_future().then(finish), timeout)


def start_quantized_allreduce(pg: Any, tensor: torch.Tensor, reduce_op: Any, participants: int) -> Any:
    """The Manager's quantized allreduce of ``tensor`` (in place); its future yields ``tensor``.

    As ``core.step.start_allreduce``: AVG is a SUM divided by ``participants`` (the replicas the peers count)."""
    average = reduce_op == ReduceOp.AVG
    fut = allreduce_quantized([tensor], ReduceOp.SUM if average else reduce_op, pg).get_future()
    return fut.then(lambda f: (f.value(), tensor.div_(participants) if average else tensor)[1])


def get_padded_sizes(tensors: list[torch.Tensor], world_size: int) -> list[torch.Size]:
    """torchft's: each tensor's size with its first dimension rounded up to a multiple of ``world_size``
    (a 1-D tensor counts as ``(n, 1)``), so its rows split evenly across ranks."""
    sizes = []
    for tensor in tensors:
        shape = tuple(tensor.shape) if tensor.dim() > 1 else (tensor.numel(), 1)
        sizes.append(torch.Size((-(-shape[0] // world_size) * world_size, *shape[1:])))
    return sizes


def allocate_reduce_scatter_output(tensors: list[torch.Tensor], world_size: int
                                   ) -> tuple[torch.Tensor, list[torch.Size]]:
    """torchft's: one flat tensor for this rank's share of every input, and the inputs' padded sizes."""
    check_quantizable(tensors)
    padded = get_padded_sizes(tensors, world_size)
    numel = sum(size.numel() // world_size for size in padded)
    return torch.empty(numel, dtype=tensors[0].dtype, device=tensors[0].device), padded


def reduce_scatter_quantized(output: torch.Tensor, inputs: list[torch.Tensor],
                             opts: ReduceScatterOptions | ReduceOp, process_group: Any,
                             sync_stream: Any = None) -> dist.Work:
    """Reduce ``inputs`` across the group in 8 bits, and write this rank's rows of the result into ``output``.

    As torchft: each input's first dimension is padded to a multiple of W and split in W slices of rows;
    rank ``r`` receives slice ``r`` of every input, reduced, one after the other in ``output``
    (see :func:`allocate_reduce_scatter_output`). Steps 1-3 of the allreduce, then dequantize."""
    check_quantized_reduction(inputs, opts, process_group)
    op, timeout = _reduce_op(opts)
    world, rank = process_group.size(), process_group.rank()
    padded_sizes = get_padded_sizes(inputs, world)
    shares = [size.numel() // world for size in padded_sizes]
    if output.numel() != sum(shares):
        raise ValueError(f"output has {output.numel()} elements; this rank's share of the inputs is {sum(shares)} "
                         f"(allocate it with allocate_reduce_scatter_output)")
    outputs = [part.view(size[0] // world, *size[1:]) for part, size in zip(output.split(shares), padded_sizes)]
    slices = []  # per input: its padded rows as (world, share), row r for rank r
    for tensor, size in zip(inputs, padded_sizes):
        padded = torch.zeros(size, dtype=tensor.dtype, device=tensor.device)
        padded.view(-1)[:tensor.numel()].copy_(tensor.reshape(-1))
        slices.append(padded.view(world, -1))
    row_layout = BlockLayout(tuple(shares), 1)  # one rank's share of every input
    done = device_future(cuda_devices([output]))
    if row_layout.blocks == 0:
        done.set_result([output])
        return _QuantizedWork(done, timeout)
    stream = _stream_of(inputs, sync_stream)
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        rows = torch.cat([quantize_rows([s[r] for s in slices], row_layout) for r in range(world)])
        received = _exchange(rows, row_layout, op, timeout, process_group)
        dequantize_rows(outputs, received[rank:rank + 1], row_layout)
        done.set_result([output])  # on ``stream`` (the stream rule)
    return _QuantizedWork(done, timeout)

