"""The receiving half of a live heal, apart from the Manager's step bookkeeping.

The Manager decides *when* to heal (a quorum says this replica is behind) and
what to do with the result (apply it on the training thread in
``should_commit``). Here: ask each assigned source for its checkpoint
metadata, then receive the state dict of the max step from the sources that
answered, striped across them when the transport can, single-source (as
torchft) otherwise.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from torchft_lite._manager_client import ManagerClient
from torchft_lite.errors import CheckpointError

__all__ = ["HealResult", "alias_tensors", "bytes_served", "checkpoint_metadata_of", "describe", "receive", "stripes"]


@dataclass(frozen=True)
class HealResult:
    """A received (not yet applied) state dict and how it came."""

    state: Any
    seconds: float
    tensor_bytes: int
    sources: list[int]
    """The replica ranks it was received from."""


async def checkpoint_metadata_of(sources: Sequence[tuple[int, str]], group_rank: int, timeout: float,
                                 warn: Callable[..., None]) -> list[tuple[int, str, str]]:
    """``(rank, address, metadata)`` of the sources whose ManagerServer answered, asked at once.

    The first source (the primary, torchft's single source) is required: its
    failure raises. A secondary that fails is left out, with a warning
    through ``warn(msg, *args)``, and the heal stripes over the others.
    """
    async def ask(address: str) -> str:
        peer = ManagerClient(address)
        try:
            return await peer.checkpoint_metadata(group_rank, timeout=timeout)
        finally:
            await peer.close()

    answers = await asyncio.gather(*(ask(address) for _, address in sources), return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, Exception):
            raise answer  # cancelled: the step is being abandoned
    if isinstance(answers[0], Exception):
        raise answers[0]
    answered = []
    for (rank, address), answer in zip(sources, answers):
        if isinstance(answer, Exception):
            warn("healing without replica %d (%s): no checkpoint metadata: %s", rank, address, answer)
        else:
            answered.append((rank, address, answer))
    return answered


async def receive(transport: Any, answered: Sequence[tuple[int, str, str]], step: int,
                  timeout: timedelta) -> HealResult:
    """The state dict of ``step`` from ``answered`` sources (on a worker thread: transports block)."""
    striped = getattr(transport, "recv_checkpoint_striped", None)  # torchft's transports have none
    if striped is None:
        answered = answered[:1]
    started = time.monotonic()
    if len(answered) > 1:
        state = await asyncio.to_thread(striped, sources=[(rank, metadata) for rank, _, metadata in answered],
                                        step=step, timeout=timeout)
    else:
        rank, _, metadata = answered[0]
        state = await asyncio.to_thread(transport.recv_checkpoint, src_rank=rank, metadata=metadata, step=step,
                                        timeout=timeout)
    got = state.get("torchft", {}).get("step") if isinstance(state, dict) else None
    if got != step:
        raise CheckpointError(f"healing expected a checkpoint of step {step}, got step {got}")
    return HealResult(state, time.monotonic() - started, tensor_bytes(state), [rank for rank, _, _ in answered])


def stripes(transport: Any) -> bool:
    """Whether ``transport`` has a ``recv_checkpoint_striped`` of its own (the base one takes one source)."""
    from torchft_lite.checkpointing.transport import CheckpointTransport

    method = getattr(type(transport), "recv_checkpoint_striped", None)
    return method is not None and method is not CheckpointTransport.recv_checkpoint_striped


def bytes_served(transport: Any) -> int | None:
    """The transport's ``statistics().bytes_served`` (HTTPTransport's), else None."""
    statistics = getattr(transport, "statistics", None)
    return getattr(statistics(), "bytes_served", None) if statistics is not None else None


def alias_tensors(obj: Any) -> Any:
    """``obj``'s containers with each tensor as a ``.data`` alias (own version counter) and other leaves None."""
    if isinstance(obj, torch.Tensor):
        return obj.data
    if isinstance(obj, dict):
        return {key: alias_tensors(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [alias_tensors(value) for value in obj]
    return None


def describe(sources: Sequence[tuple[int, str]]) -> str:
    return ", ".join(f"replica {rank} ({address})" for rank, address in sources)


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
