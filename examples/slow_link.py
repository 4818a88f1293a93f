"""A replica process group behind a metered (and optionally slow) link between replica groups.

``examples/train_diloco.py`` wraps the Manager's process group in a
:class:`MeteredLink` so that every run reports how many bytes it sent to the
other replica groups, and, with ``--link-mb-per-s``/``--link-latency-ms``,
behaves as if the groups were joined by a slow network (groups in different
buildings or clouds: what DiLoCo is for). ``benchmarks/diloco_bench.py``
compares per-step DDP with DiLoCo this way on one machine.

What is counted: the bytes this rank puts on the wire for each collective,
as a bandwidth-optimal (ring) algorithm sends them among ``n`` participants:
an allreduce of B bytes sends ``2 (n - 1) / n * B``, a reduce-scatter,
all-gather or all-to-all ``(n - 1) / n * B``. That is the figure a WAN
link bills, whatever gloo does on loopback.

How a slow link is modelled: the link sends one collective at a time, at
``bytes_per_s``; a collective's data leaves when the ones before it have
left, and arrives ``latency_s`` later. Its work completes when both the real
collective and the modelled transfer are done, so the training thread is
slowed exactly where it waits for the result (DiLoCo's overlap of a
fragment's sync with inner steps still overlaps). Nothing sleeps on the
training thread.

Imports neither torch nor the library at module level (the process group
it wraps brings torch).
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["MeteredLink"]


def _nbytes(tensors: Any) -> int:
    """Bytes in a tensor, or in (nested) lists of tensors."""
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return tensors.numel() * tensors.element_size()


class _DelayedWork:
    """A collective's work that completes no earlier than ``deadline`` (``time.monotonic()`` seconds)."""

    def __init__(self, work: Any, deadline: float) -> None:
        import torch

        self._future: Any = torch.futures.Future()
        self._deadline = deadline
        work.get_future().add_done_callback(self._inner_done)

    def _inner_done(self, inner: Any) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            self._forward(inner)
            return
        timer = threading.Timer(left, self._forward, args=(inner,))
        timer.daemon = True  # a process that exits mid-transfer is not kept alive by the model of a link
        timer.start()

    def _forward(self, inner: Any) -> None:
        try:
            value = inner.value()
        except Exception as exc:  # the collective failed: so does this work, with the same error
            self._future.set_exception(exc)
            return
        self._future.set_result(value)

    def get_future(self) -> Any:
        return self._future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()  # bounded by the Manager's own timeout on the future, as for the real work
        return True


class MeteredLink:
    """Wraps a replica process group (torchft_lite's or torchft's): counts the bytes of every collective
    and, when ``bytes_per_s`` is set, delays its completion as a link of that bandwidth and ``latency_s``
    would. Everything else goes to the wrapped group unchanged."""

    def __init__(self, pg: Any, bytes_per_s: float | None = None, latency_s: float = 0.0) -> None:
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be positive (or None for an unthrottled link), got {bytes_per_s}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self._pg = pg
        self._bytes_per_s = bytes_per_s
        self._latency_s = latency_s
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the modelled link has sent everything queued so far
        self.bytes_sent = 0
        """Bytes this rank sent to the other replica groups (see the module docstring)."""
        self.collectives = 0

    # The Manager's capability checks look for these on the object itself.
    def configure(self, *args: Any, **kwargs: Any) -> Any:
        return self._pg.configure(*args, **kwargs)

    def abort(self, *args: Any, **kwargs: Any) -> Any:
        return self._pg.abort(*args, **kwargs)

    def errored(self) -> Any:
        return self._pg.errored()

    def shutdown(self) -> Any:
        return self._pg.shutdown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pg, name)

    def _send(self, work: Any, payload: int, fraction: float) -> Any:
        """Count ``fraction`` of ``payload`` bytes as sent and delay ``work`` by the modelled transfer."""
        sent = int(payload * fraction)
        with self._lock:
            self.bytes_sent += sent
            self.collectives += 1
            if self._bytes_per_s is None:
                return work
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + sent / self._bytes_per_s
            deadline = self._free_at + self._latency_s
        return _DelayedWork(work, deadline)

    def _share(self) -> float:
        """(n - 1) / n for the group's current size n: the part of a buffer a ring sends once."""
        n = self._pg.size()
        return (n - 1) / n if n > 1 else 0.0

    def allreduce(self, tensors: Any, *rest: Any) -> Any:
        return self._send(self._pg.allreduce(tensors, *rest), _nbytes(tensors), 2 * self._share())

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, *rest: Any) -> Any:
        return self._send(self._pg.reduce_scatter(output_tensors, input_tensors, *rest), _nbytes(input_tensors),
                          self._share())

    def reduce_scatter_tensor_coalesced(self, output_tensors: Any, input_tensors: Any, *rest: Any) -> Any:
        return self._send(self._pg.reduce_scatter_tensor_coalesced(output_tensors, input_tensors, *rest),
                          _nbytes(input_tensors), self._share())

    def allgather(self, output_tensors: Any, input_tensor: Any, *rest: Any) -> Any:
        return self._send(self._pg.allgather(output_tensors, input_tensor, *rest), _nbytes(output_tensors),
                          self._share())

    def allgather_into_tensor_coalesced(self, output_tensors: Any, input_tensors: Any, *rest: Any) -> Any:
        return self._send(self._pg.allgather_into_tensor_coalesced(output_tensors, input_tensors, *rest),
                          _nbytes(output_tensors), self._share())

    def alltoall_base(self, output_buffer: Any, input_buffer: Any, *rest: Any) -> Any:
        return self._send(self._pg.alltoall_base(output_buffer, input_buffer, *rest), _nbytes(input_buffer),
                          self._share())

    def __repr__(self) -> str:
        return f"MeteredLink({self._pg!r}, bytes_per_s={self._bytes_per_s}, latency_s={self._latency_s})"
