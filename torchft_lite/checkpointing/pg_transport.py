"""PGTransport: send a state dict over a process group's point-to-point send/recv.

Per destination rank, in order (tags keep the messages apart from other traffic)::

    tag 1   int64[3]  (_MAGIC, header bytes, bucket bytes)
    tag 2   uint8[n]  prefix + JSON header (see ``serialization.spec``)
    tag 3+i uint8[]   piece i: the data bytes of one tensor within one bucket (:func:`_pieces`)
    tag 3+n uint8[]   the block checksums (when the data section is not empty)

Nothing is pickled; the receiver validates the header and the step, and checks every block's checksum.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from typing import Any, Callable, Protocol, Sequence, TypeVar

import torch

from torchft_lite.checkpointing.transport import CheckpointTransport
from torchft_lite.errors import CheckpointError, CheckpointTimeout, CheckpointTransferError, ConfigError
from torchft_lite.serialization import checksum
from torchft_lite.serialization.decode import TensorWriter, targets_of
from torchft_lite.serialization.encode import encode, flatten
from torchft_lite.serialization.spec import (
    MAX_HEADER_BYTES, PREFIX_SIZE, Header, Path, TensorEntry, byte_view, parse_header, unpack_prefix,
)

__all__ = ["PGTransport"]

T = TypeVar("T")
logger = logging.getLogger(__name__)

_MAGIC = 0x54465450  # "TFTP"
_TAG_META, _TAG_HEADER, _TAG_DATA = 1, 2, 3
DEFAULT_BUCKET_BYTES = 256 << 20
_WINDOW = 16  # pieces in flight at once on each side


class _Work(Protocol):
    def wait(self, timeout: timedelta = ...) -> bool: ...


class PointToPoint(Protocol):
    """What PGTransport needs from a process group (a c10d ``ProcessGroupGloo`` has it)."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> _Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> _Work: ...


def _pieces(entries: Sequence[TensorEntry], bucket_bytes: int) -> list[tuple[int, int]]:
    """Data byte ranges ``[start, end)``, each within one tensor and at most ``bucket_bytes`` long.

    Both sides cut the data section this way, from the header, so a huge tensor travels as several pieces.
    Each piece is sent from the tensor's own memory and received straight into the destination tensor (on
    CPU): no staging copies."""
    return [(start, min(start + bucket_bytes, entry.offset + entry.nbytes))
            for entry in entries for start in range(entry.offset, entry.offset + entry.nbytes, bucket_bytes)]


class PGTransport(CheckpointTransport[T]):
    """Moves a state dict over ``pg`` with blocking sends and receives.

    Args:
        pg: a process group with ``send``/``recv`` of tensor lists (see :class:`PointToPoint`).
        timeout: default bound for a whole send or receive; a call's own ``timeout``, omitted or None,
            takes this one. ``timedelta(0)`` sets no deadline of the transport's own: each wait is then
            bounded by the process group's own timeout (torchft hands the zero to ``Work.wait``, which reads
            it the same way).
        device: where the buckets travel (``cpu`` for gloo, a CUDA device for NCCL).
        state_dict: when given, returns the local state dict; a received tensor
            whose path, dtype and shape match one of its tensors is written into
            that tensor (which the result then holds) instead of a new one. A
            failed receive may leave such tensors partly overwritten.
        bucket_bytes: the most data bytes sent in one message.
    """

    def __init__(self, pg: PointToPoint, timeout: timedelta, device: torch.device = torch.device("cpu"),
                 state_dict: Callable[[], T] | None = None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self._pg = pg
        self._timeout = timeout
        self._device = torch.device(device)
        self._state_dict = state_dict
        self._bucket_bytes = bucket_bytes

    def metadata(self) -> str:
        return "<n/a>"  # the process group already knows every peer

    def disallow_checkpoint(self) -> None:
        """Nothing to do: :meth:`send_checkpoint` has finished reading the state dict when it returns."""

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T,
                        timeout: timedelta | None = None) -> None:
        """Send ``state_dict`` as step ``step`` to every rank in ``dst_ranks``; blocks until sent.

        ``timeout`` defaults to the constructor's (see the class's Args for zero).
        """
        deadline = self._deadline(timeout)
        started = time.monotonic()
        encoded = encode(step, flatten(state_dict))
        try:
            meta = torch.tensor([_MAGIC, len(encoded.header), self._bucket_bytes], dtype=torch.int64)
            header = torch.frombuffer(bytearray(encoded.header), dtype=torch.uint8)
            works = []
            for dst in dst_ranks:
                works.append(self._pg.send([meta.to(self._device)], dst, _TAG_META))
                works.append(self._pg.send([header.to(self._device)], dst, _TAG_HEADER))
            pieces = _pieces(encoded.entries, self._bucket_bytes)
            for index, (start, end) in enumerate(pieces):
                (piece,) = encoded.data_tensors(start, end)
                piece = piece.to(self._device)
                works.extend(self._pg.send([piece], dst, _TAG_DATA + index) for dst in dst_ranks)
                if index % _WINDOW == _WINDOW - 1 or index == len(pieces) - 1:  # a window in flight at once
                    _wait(works, deadline, f"piece {index} of step {step} to reach ranks {dst_ranks}")
                    works = []
            if pieces:
                sums = checksum.pack([encoded.checksum(block) for block in range(len(encoded.blocks))])
                trailer = torch.frombuffer(bytearray(sums), dtype=torch.uint8).to(self._device)
                works.extend(self._pg.send([trailer], dst, _TAG_DATA + len(pieces)) for dst in dst_ranks)
            _wait(works, deadline, f"the header and checksums of step {step} to reach ranks {dst_ranks}")
        finally:
            encoded.release()
        logger.info("sent step %d (%d bytes) to ranks %s in %.2fs", step, encoded.total_bytes, dst_ranks,
                    time.monotonic() - started)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None) -> T:
        """Receive the state dict of ``step`` from ``src_rank``; blocks until it is verified.

        ``timeout`` defaults to the constructor's (see the class's Args for zero).
        """
        deadline = self._deadline(timeout)
        started = time.monotonic()
        meta = self._recv(torch.zeros(3, dtype=torch.int64), src_rank, _TAG_META, deadline,
                          f"the checkpoint announcement from rank {src_rank}")
        magic, header_len, bucket_bytes = (int(v) for v in meta)
        if magic != _MAGIC or not PREFIX_SIZE <= header_len <= PREFIX_SIZE + MAX_HEADER_BYTES or bucket_bytes <= 0:
            raise CheckpointTransferError(f"rank {src_rank} sent a malformed checkpoint announcement {meta.tolist()}")
        blob = bytes(byte_view(self._recv(torch.empty(header_len, dtype=torch.uint8), src_rank, _TAG_HEADER,
                                          deadline, f"the checkpoint header from rank {src_rank}")))
        length, crc = unpack_prefix(blob[:PREFIX_SIZE])
        if PREFIX_SIZE + length != header_len:
            raise CheckpointTransferError(f"rank {src_rank} announced {header_len} header bytes but sent {length}")
        header = parse_header(blob[PREFIX_SIZE:], crc)
        pieces = _pieces(header.entries, bucket_bytes)
        if header.step != step:
            self._drain(header, pieces, src_rank, deadline)  # keep the pair in step for the next transfer
            raise CheckpointTransferError(f"rank {src_rank} sent step {header.step}, expected step {step}")
        writer = TensorWriter(header, self._targets())
        for first in range(0, len(pieces), _WINDOW):
            window = list(enumerate(pieces))[first:first + _WINDOW]
            what = f"pieces {first}-{first + len(window) - 1} of {len(pieces)} of step {step} from rank {src_rank}"
            if self._device.type == "cpu":  # straight into the destination tensors, a window posted at once
                _wait([self._pg.recv([writer.data_tensor(start, end)], src_rank, _TAG_DATA + index)
                       for index, (start, end) in window], deadline, what)
            else:
                for index, (start, end) in window:
                    writer.data_tensor(start, end).copy_(self._recv(
                        torch.empty(end - start, dtype=torch.uint8), src_rank, _TAG_DATA + index, deadline, what))
            for _, (start, end) in window:
                writer.filled(start, end - start)
        if pieces:
            what = f"the checksums of step {step} from rank {src_rank}"
            trailer = self._recv(torch.empty(header.trailer_bytes, dtype=torch.uint8), src_rank,
                                 _TAG_DATA + len(pieces), deadline, what)
            writer.expect(0, header.data_bytes, bytes(byte_view(trailer)))
        state = writer.finish()
        logger.info("received step %d (%d bytes) from rank %d in %.2fs", step, header.data_bytes, src_rank,
                    time.monotonic() - started)
        return state

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to release: the process group belongs to the caller."""

    def _deadline(self, timeout: timedelta | None) -> float:
        """When a transfer must be done, on ``time.monotonic()``; ``math.inf`` leaves it to the process group."""
        seconds = (self._timeout if timeout is None else timeout).total_seconds()
        return time.monotonic() + seconds if seconds > 0 else math.inf

    def _targets(self) -> dict[Path, torch.Tensor]:
        return {} if self._state_dict is None else targets_of(self._state_dict())

    def _recv(self, buffer: torch.Tensor, src_rank: int, tag: int, deadline: float, what: str) -> torch.Tensor:
        """Receive into ``buffer`` (travelling on the transport's device) and return it on CPU."""
        on_device = buffer.to(self._device)
        _wait([self._pg.recv([on_device], src_rank, tag)], deadline, what)
        return on_device.cpu()

    def _drain(self, header: Header, pieces: Sequence[tuple[int, int]], src_rank: int, deadline: float) -> None:
        sizes = [end - start for start, end in pieces] + ([header.trailer_bytes] if pieces else [])
        scratch = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=self._device)
        for index, size in enumerate(sizes):
            _wait([self._pg.recv([scratch[:size]], src_rank, _TAG_DATA + index)], deadline,
                  f"piece {index} of an unwanted checkpoint from rank {src_rank}")


def _wait(works: Sequence[Any], deadline: float, what: str) -> None:
    """Wait for every work until ``deadline`` (``math.inf``: the group's own timeout bounds each wait).

    Errors become checkpoint errors naming ``what``.
    """
    for work in works:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CheckpointTimeout(f"timed out waiting for {what}")
        try:
            finished = work.wait() if math.isinf(remaining) else work.wait(timedelta(seconds=remaining))
        except CheckpointError:
            raise
        except (RuntimeError, TimeoutError) as exc:  # torch's DistBackendError is a RuntimeError
            if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise CheckpointTimeout(f"timed out waiting for {what}: {exc}") from exc
            raise CheckpointTransferError(f"failed waiting for {what}: {exc}") from exc
        if finished is False:
            raise CheckpointTimeout(f"timed out waiting for {what}")
