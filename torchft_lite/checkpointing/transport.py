"""The interface every live-checkpoint transport implements (torchft's ``CheckpointTransport``).

A healthy replica *sends* (publishes) its state dict for one step; a replica
that is behind *receives* it. The Manager drives both sides::

    source (up to date)                         destination (healing)
    send_checkpoint(dst_ranks, step, sd, t)     recv_checkpoint(src_rank, metadata, step, t)
    ... forward / backward ...
    disallow_checkpoint()   # before the optimizer mutates sd

Errors derive from what torchft raises (``CheckpointError`` is a
``RuntimeError``, ``CheckpointTimeout`` also a ``TimeoutError``; see
``torchft_lite.errors``). ``HTTPTransport`` and ``PGTransport`` also take
``timeout=None`` (their constructor's), as torchft's ``PGTransport`` does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, Sequence, TypeVar

__all__ = ["CheckpointTransport"]

T = TypeVar("T")


class CheckpointTransport(Generic[T], ABC):
    """Moves one step's state dict from a healthy replica to the replicas that are behind."""

    @abstractmethod
    def metadata(self) -> str:
        """What a peer needs to find this transport (for HTTP, the URL to fetch from).

        The Manager passes it through the quorum to the receivers, which hand
        it to :meth:`recv_checkpoint`.
        """

    @abstractmethod
    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        """Offer ``state_dict`` as the snapshot of ``step`` to ``dst_ranks``.

        ``state_dict`` is referenced, not copied: from this call until
        :meth:`disallow_checkpoint` returns, the caller must not mutate it.
        A transport may send before returning (process-group transports) or
        serve in the background (HTTP). ``timeout`` bounds the whole send.
        Raises ``CheckpointError`` when the state dict holds a value the wire
        format cannot carry, ``CheckpointTransferError`` when sending fails.
        """

    def disallow_checkpoint(self) -> None:
        """Stop serving the state dict published by :meth:`send_checkpoint`.

        Blocks until the expected receivers have finished (or the send's
        timeout has passed); once it returns, no byte of the state dict is
        read again and the caller may mutate it. Returns at once when nothing
        is published.
        """

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Receive the state dict of exactly ``step`` from ``src_rank``.

        ``metadata`` is the source's :meth:`metadata`. Blocks until the whole
        state dict has arrived and been verified, at most ``timeout``. Raises
        ``CheckpointTransferError`` when the transfer fails (including a step
        mismatch) and ``CheckpointTimeout`` when ``timeout`` passes.
        """

    def recv_checkpoint_striped(self, sources: Sequence[tuple[int, str]], step: int, timeout: timedelta) -> T:
        """Receive the state dict of ``step`` from several up-to-date replicas at once.

        ``sources`` are ``(src_rank, metadata)`` pairs, the primary source
        first; a transport that can stripe pulls disjoint parts from each.
        Every source must have been told (through its ``dst_ranks``) to
        expect this receiver. This default receives everything from the
        first source, which keeps torchft's single-source behaviour.
        """
        if not sources:
            raise ValueError("recv_checkpoint_striped needs at least one source")
        src_rank, metadata = sources[0]
        return self.recv_checkpoint(src_rank, metadata, step, timeout)

    def shutdown(self, wait: bool = True) -> None:
        """Release the transport's resources (servers, sockets); idempotent.

        With ``wait`` the call returns once they are released.
        """
