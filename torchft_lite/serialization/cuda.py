"""Heal copies between GPU and host on a dedicated recovery stream, through pinned memory.

A heal must not queue its copies behind the training step's kernels, nor the
step's kernels behind its copies. Both directions therefore run on one *recovery*
CUDA stream per device (:func:`recovery_stream`), with non-blocking copies to and
from pinned host buffers, which torch's caching host allocator keeps for the next
heal: :func:`to_host` when serving, :func:`to_device` when receiving. Without CUDA
nothing here is used: CPU tensors never reach these functions.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

__all__ = ["host_buffer", "recovery_stream", "to_device", "to_host"]

_streams: dict[int, "torch.cuda.Stream"] = {}
_lock = threading.Lock()


def recovery_stream(device: torch.device) -> "torch.cuda.Stream":
    """The process's recovery stream on ``device`` (created once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
        return stream


def host_buffer(target: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor to receive ``target``'s bytes into: pinned when ``target`` is on a GPU."""
    return torch.empty(tuple(target.shape), dtype=target.dtype, pin_memory=target.device.type == "cuda")


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous CPU copies of ``tensors`` (CPU tensors that already are cost nothing).

    CUDA tensors are copied on their device's recovery stream into pinned
    buffers; this returns once those copies have finished. The recovery stream
    first waits for the work already queued on the caller's current stream, so it
    copies the values the state dict holds at publish time, not later ones. The
    calling thread (the encoder, never the training thread) waits for that stream
    alone.
    """
    results: list[torch.Tensor] = []
    events = []
    for tensor in tensors:
        tensor = tensor.detach().resolve_conj().resolve_neg()
        if tensor.device.type != "cuda":
            results.append(tensor.to("cpu").contiguous())
            continue
        stream = recovery_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            pinned = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)
            pinned.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # the caching allocator must not reuse it until the copy is done
            events.append(torch.cuda.Event())
            events[-1].record(stream)
        results.append(pinned)
    for event in events:
        event.synchronize()
    return results


def to_device(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(host buffer, target)`` into its target; returns once every copy has finished.

    CUDA targets are written on the recovery stream; the training thread's
    current stream is not blocked meanwhile. The bytes landed in pinned host
    buffers (:func:`host_buffer`) and were verified first; the calling thread (the
    heal, not the training thread) waits for these copies before the state dict is
    handed over, so ``should_commit`` sees finished tensors while the forward pass
    ran beside the copies.
    """
    events = []
    with torch.no_grad():
        for buffer, target in pairs:
            if target.device.type != "cuda":
                target.copy_(buffer)
                continue
            stream = recovery_stream(target.device)
            with torch.cuda.stream(stream):
                target.copy_(buffer, non_blocking=True)
                events.append(torch.cuda.Event())
                events[-1].record(stream)
    for event in events:
        event.synchronize()
