"""One fragment of a model under (Streaming) DiLoCo: its global copy, pseudo-gradients and outer step.

:class:`~torchft_lite.local_sgd.DiLoCo` owns one :class:`StreamingDiLoCoFragment`
per model fragment and decides when each one syncs; the fragment does the work:

* ``original_parameters`` holds the fragment's *global* parameters (the value
  every replica group agreed on at its last sync), on ``backup_device``.
* :meth:`prepare_sync` computes the pseudo-gradients ``global - local`` and
  starts averaging them across replica groups through the Manager, without
  waiting (the inner steps go on meanwhile when ``fragment_sync_delay > 0``).
* :meth:`perform_sync` waits for that average, puts the global parameters back
  into the model and, if the Manager commits, steps the outer optimizer with
  the averaged pseudo-gradients as gradients; the result is the new global
  copy. If the step does not commit, the model stays at the old global
  parameters: the local steps since the last sync are discarded.

The global copy and the outer optimizer's state are registered with the
Manager under ``StreamingDiLoCoFragment_{i}`` (torchft's key), so a group that
joins heals them from a peer, including a peer running torchft.

Tensor helpers shared with :class:`~torchft_lite.local_sgd.LocalSGD` live here
too: they read and write the local shard of a ``DTensor`` parameter.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, ContextManager, Iterator

import torch
from torch import nn, optim
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_CAP_BYTES = 1024 * 1024 * 1024


def extract_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` (of its local shard when ``t`` is a ``DTensor``), with no ``.grad``."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach().clone()


def _local_view(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a value for ``p``: a ``DTensor`` with ``p``'s layout when ``p`` is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local


@torch.no_grad()
def write_local(p: torch.Tensor, local: torch.Tensor) -> None:
    """Overwrite parameter ``p`` (its local shard for a ``DTensor``) with ``local``."""
    p.data.copy_(_like_param(p, local))


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``tensors`` of one dtype and device, each at most ``cap_bytes`` (or one tensor)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > cap_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor], _fut: torch.futures.Future) -> None:
    """Copy the reduced ``flat`` buffer back into the tensors it was packed from."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class StreamingDiLoCoFragment:
    """The DiLoCo state and sync of one model fragment; see the module docstring."""

    # torchft's attribute names: ``bucket_cap_mb`` holds bytes, as torchft's does.
    bucket_cap_mb: int = DEFAULT_BUCKET_CAP_BYTES
    use_bucketization: bool = False

    def __init__(
        self,
        manager: Any,
        model_fragment: nn.Module,
        fragment_id: int,
        outer_optimizer: optim.Optimizer,
        *,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: float | None = None,
        should_quantize: bool = False,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        self._manager = manager
        self._model_fragment = model_fragment
        self._fragment_id = fragment_id
        self._outer_optimizer = outer_optimizer
        self._fragment_update_alpha = fragment_update_alpha
        self.use_bucketization = use_bucketization
        if bucket_cap_mb is not None:
            self.bucket_cap_mb = int(bucket_cap_mb * 1024 * 1024)
        self.should_quantize = should_quantize

        accelerator = torch.accelerator.is_available()
        # Pseudo-gradients are averaged on a side stream so the inner steps' kernels go on meanwhile.
        self._stream: torch.Stream | None = torch.Stream(torch.accelerator.current_accelerator()) if accelerator else None
        self._pending: list[torch.futures.Future] = []  # the averaging started by prepare_sync
        self._grads: dict[str, torch.Tensor] = {}  # pseudo-gradients, by parameter name

        device = backup_device if backup_device is not None else torch.device("cpu")
        self.original_parameters: dict[str, torch.Tensor] = {}
        for name, p in model_fragment.named_parameters():
            local = _local_view(p)
            backup = torch.empty(local.shape, dtype=local.dtype, device=device)
            if pin_memory and accelerator and backup.device.type == "cpu":
                backup = backup.pin_memory()
            self.original_parameters[name] = backup

    @property
    def state_dict_key(self) -> str:
        """The key this fragment's state is healed under (torchft's, so mixed fleets heal each other)."""
        return f"StreamingDiLoCoFragment_{self._fragment_id}"

    def register_state_dict_fn(self) -> None:
        """Let heals carry this fragment's global parameters and outer optimizer state."""
        self._manager.register_state_dict_fn(self.state_dict_key, self._load_state_dict, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        # By reference: the global copy changes only after should_commit, once
        # the Manager has stopped serving this step's checkpoint.
        return {"outer_optimizer": self._outer_optimizer.state_dict(),
                "original_parameters": dict(self.original_parameters)}

    @torch.no_grad()
    def _load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state["original_parameters"].items():
            if name in self.original_parameters:
                self.original_parameters[name].copy_(value)
        self._outer_optimizer.load_state_dict(state["outer_optimizer"])

    # ------------------------------------------------------------ global copy

    @torch.no_grad()
    def save_parameters(self) -> None:
        """Make the model's current parameters the global copy."""
        for name, p in self._model_fragment.named_parameters():
            self.original_parameters[name].copy_(_local_view(p.data))

    @torch.no_grad()
    def restore_parameters(self) -> None:
        """Put the global copy back into the model."""
        for name, p in self._model_fragment.named_parameters():
            write_local(p, self.original_parameters[name].to(_local_view(p).device))

    # ------------------------------------------------------------ sync

    def _on_stream(self) -> ContextManager[Any]:
        return self._stream if self._stream is not None else contextlib.nullcontext()

    @torch.no_grad()
    def _save_grads(self) -> None:
        """Pseudo-gradients: global copy minus local parameters."""
        for name, p in self._model_fragment.named_parameters():
            local = _local_view(p)
            self._grads[name] = self.original_parameters[name].to(local.device) - local

    def prepare_sync(self) -> None:
        """Compute the pseudo-gradients and start averaging them; returns without waiting."""
        if self._pending:
            raise RuntimeError(f"fragment {self._fragment_id}: the previous sync was never performed")
        self._save_grads()
        if self._stream is not None:
            self._stream.wait_stream(torch.accelerator.current_stream())
        with self._on_stream():
            self._average_grads()

    def _average_grads(self) -> None:
        if self.use_bucketization:
            self._allreduce_bucketized()
        else:
            for grad in self._grads.values():
                work = self._manager.allreduce(grad, should_quantize=self.should_quantize)
                self._pending.append(work.get_future())

    def _allreduce_bucketized(self) -> None:
        """Average the pseudo-gradients packed into flat buffers of at most ``bucket_cap_mb`` bytes."""
        for bucket in _buckets(list(self._grads.values()), self.bucket_cap_mb):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            work = self._manager.allreduce(flat, should_quantize=self.should_quantize)
            self._pending.append(work.get_future().then(functools.partial(_unflatten, flat, bucket)))

    def wait(self) -> None:
        """Wait for the averaging started by :meth:`prepare_sync` (bounded by the Manager's timeout)."""
        if not self._pending:
            return
        with self._on_stream():
            for fut in self._pending:
                fut.wait()
        self._pending = []
        if self._stream is not None:
            self._stream.synchronize()

    @torch.no_grad()
    def _set_grads(self) -> None:
        """Hand the averaged pseudo-gradients to the outer optimizer as the parameters' gradients."""
        for name, p in self._model_fragment.named_parameters():
            p.grad = _like_param(p, self._grads.pop(name))

    def _clear_other_grads(self) -> None:
        """An outer optimizer shared by several fragments steps only this one's parameters."""
        mine = {id(p) for p in self._model_fragment.parameters()}
        for group in self._outer_optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in mine:
                    p.grad = None

    def perform_sync(self) -> bool:
        """Finish the sync :meth:`prepare_sync` started; True when the Manager committed it."""
        self.wait()
        alpha = self._fragment_update_alpha
        local = {name: extract_local_tensor(p) for name, p in self._model_fragment.named_parameters()} \
            if alpha > 0 else {}
        self.restore_parameters()
        committed = self._manager.should_commit()
        if committed:
            self._set_grads()
            self._clear_other_grads()
            self._outer_optimizer.step()
            self.save_parameters()
            if local:  # Streaming DiLoCo: mix the local parameters into the new global ones
                with torch.no_grad():
                    for name, p in self._model_fragment.named_parameters():
                        p.data.lerp_(_like_param(p, local[name]), alpha)
        else:
            logger.info("fragment %d: sync not committed at step %s; local steps since the last sync discarded",
                        self._fragment_id, self._manager.current_step())
        self._grads.clear()
        self._outer_optimizer.zero_grad()
        return committed
