"""LocalSGD and DiLoCo: fault-tolerant training that syncs replica groups every few steps.

Both are context managers around a training loop's (inner) optimizer, with
torchft's constructor arguments::

    with DiLoCo(manager, [model], inner_optimizer, outer_optimizer, sync_every=100):
        for batch in data:
            ...
            inner_optimizer.step()   # every 100th step also syncs through the Manager

:class:`LocalSGD` averages the parameters; :class:`DiLoCo` averages pseudo-gradients
and steps an outer optimizer, one :class:`StreamingDiLoCoFragment` per model fragment.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from types import TracebackType
from typing import Any, ContextManager, Iterator

import torch
from torch import nn, optim
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

__all__ = ["DiLoCo", "LocalSGD", "extract_local_tensor"]

logger = logging.getLogger(__name__)

# torchft's switch: "True" turns bucketized averaging on whatever the argument says.
USE_BUCKETIZATION_ENV = "TORCHFT_USE_BUCKETIZATION"

class _InnerStepHooks:
    """Runs :meth:`_after_inner_step` after every step of the inner optimizer, inside ``with``."""

    def __init__(self, manager: Any, optimizer: optim.Optimizer) -> None:
        self._manager = manager
        self._local_optimizer = optimizer
        self._hooks: list[RemovableHandle] = []
        # Between syncs every group trains on its own, so the state a user registers (the model) differs
        # across groups when a sync's quorum is asked for: replica fingerprints would call that corruption.
        fingerprints = getattr(manager, "_fingerprints", None)
        if fingerprints is not None:
            fingerprints.pause(f"{type(self).__name__} trains each group on its own between syncs")

    def __enter__(self):
        self._hooks = [
            self._local_optimizer.register_step_pre_hook(self._step_pre_hook),
            self._local_optimizer.register_step_post_hook(self._step_post_hook),
        ]
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return False

    def _step_pre_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        # The optimizer is about to write the parameters: a heal this step has
        # served them (from its first collective on) must be received first
        # (DiLoCo's fragment_sync_delay > 0 runs inner steps in that window).
        _call_if_present(self._manager, "disallow_state_dict_read")

    def _step_post_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        _call_if_present(self._manager, "allow_state_dict_read")
        self._after_inner_step()

    def _after_inner_step(self) -> None:
        raise NotImplementedError


def _call_if_present(obj: Any, name: str) -> None:
    method = getattr(obj, name, None)
    if method is not None:
        method()


class LocalSGD(_InnerStepHooks):
    """Average the model's parameters across replica groups every ``sync_every`` optimizer steps.

    https://arxiv.org/abs/1805.09767. Each sync is ``start_quorum``, one
    ``allreduce`` per parameter, ``should_commit``; the quorum is formed at each
    sync. If it fails or the step does not commit, the local parameters are kept
    and the next ``sync_every`` steps end in another attempt. With an asynchronous
    quorum a joining group takes part in a sync only after the heal it
    receives there (its first ``sync_every`` local steps count for nothing).
    """

    def __init__(self, manager: Any, model: nn.Module, optimizer: optim.Optimizer, sync_every: int) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {sync_every}")
        super().__init__(manager, optimizer)
        self._model = model
        self._sync_every = sync_every
        self._local_step = 0

    def __enter__(self) -> "LocalSGD":
        return super().__enter__()

    def _after_inner_step(self) -> None:
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> None:
        """Average the parameters across the replica groups now."""
        self._manager.start_quorum()
        self._perform_sync()
        self._local_step = 0

    def _perform_sync(self) -> None:
        averaged = self._average()
        if self._manager.should_commit():
            for p, value in zip(self._model.parameters(), averaged):
                write_local(p, value)

    @torch.no_grad()
    def _average(self) -> list[torch.Tensor]:
        copies = [extract_local_tensor(p) for p in self._model.parameters()]
        works = [self._manager.allreduce(t) for t in copies]
        for work in works:
            work.wait()  # the Manager bounds each by its timeout
        return copies


class DiLoCo(_InnerStepHooks):
    """DiLoCo (https://arxiv.org/abs/2311.08105) and Streaming DiLoCo (https://arxiv.org/abs/2501.18512).

    Keeps a backup of the *global* parameters, averages the pseudo-gradients
    (global - local) every ``sync_every`` inner steps and steps an outer optimizer
    on the global parameters with them; a step that does not commit puts the
    global parameters back (the local steps are discarded). With several model
    fragments (Streaming DiLoCo) one fragment syncs every
    ``sync_every / len(model_fragments)`` steps, in turn (chosen from the
    Manager's step, so every group syncs the same one); its averaging overlaps
    the next ``fragment_sync_delay`` inner steps, and ``fragment_update_alpha``
    mixes the local parameters into the new global ones. The per-fragment work
    is :class:`StreamingDiLoCoFragment`'s.

    It needs a Manager with ``use_async_quorum=False``: the quorum (and any heal,
    which carries each fragment's global copy under torchft's key
    ``StreamingDiLoCoFragment_{i}``) is settled before the pseudo-gradients are
    computed.

    Args (torchft's):
        manager: a Manager with ``use_async_quorum=False``.
        model_fragments: the model's parts that sync in turn (one for plain DiLoCo).
        inner_optimizer: the optimizer the training loop steps every step.
        outer_optimizer: one optimizer over every fragment, or one per fragment.
        sync_every: inner steps between two syncs of the same fragment; a
            multiple of ``len(model_fragments)``.
        backup_device: where the global parameters are kept (default CPU).
        pin_memory: pin a CPU backup when an accelerator is present.
        use_bucketization: average the pseudo-gradients in flat buffers of
            ``bucket_cap_mb`` MiB each instead of one collective per parameter
            (also on when ``$TORCHFT_USE_BUCKETIZATION`` is ``True``).
        should_quantize: passed on to ``Manager.allreduce``.
        fragment_sync_delay: inner steps a fragment's averaging overlaps before
            the sync waits for it (the paper's tau); less than
            ``sync_every / len(model_fragments)``.
        fragment_update_alpha: in [0, 1]; the new parameters are
            ``lerp(global, local, alpha)``.

    Note on ``fragment_sync_delay > 0`` with torchft_lite's Manager: a replica
    that serves a heal serves it from the step's first collective to
    ``should_commit``, by reference; the inner steps in between write the
    parameters it serves, so the receiver's checksum can reject the heal (it
    is retried at the next sync).
    """

    def __init__(
        self,
        manager: Any,
        model_fragments: list[nn.Module],
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer | list[optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: float | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        n = len(model_fragments)
        if n < 1:
            raise ValueError("DiLoCo needs at least one model fragment")
        if isinstance(outer_optimizer, list):
            if len(outer_optimizer) != n:
                raise ValueError(f"{len(outer_optimizer)} outer optimizers for {n} model fragments")
            outer_optimizers = list(outer_optimizer)
        else:
            outer_optimizers = [outer_optimizer] * n
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("DiLoCo needs a synchronous quorum: create the Manager with use_async_quorum=False")
        if sync_every < n:
            raise ValueError(f"sync_every={sync_every} is less than the {n} fragments: only one syncs at a time")
        if sync_every % n != 0:
            raise ValueError(f"sync_every={sync_every} must be a multiple of the number of fragments ({n})")
        if not 0 <= fragment_sync_delay < sync_every // n:
            raise ValueError(f"fragment_sync_delay={fragment_sync_delay} must be in [0, {sync_every // n}): "
                             f"a fragment must be synced before its next averaging starts")
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha={fragment_update_alpha} must be between 0 and 1")
        if should_quantize:
            _check_quantizable(model_fragments)
        if os.getenv(USE_BUCKETIZATION_ENV, "False") == "True":
            use_bucketization = True
        super().__init__(manager, inner_optimizer)

        # Inner steps between two fragment syncs (torchft's name for it).
        self._sync_every = sync_every // n
        self._fragment_sync_delay = fragment_sync_delay
        self._local_step = 0  # inner steps since the last fragment sync
        self._in_flight: int | None = None  # the fragment whose averaging prepare_sync started
        self._fragments = [
            StreamingDiLoCoFragment(
                manager, fragment, i, outer_optimizers[i], backup_device=backup_device, pin_memory=pin_memory,
                use_bucketization=use_bucketization, bucket_cap_mb=bucket_cap_mb, should_quantize=should_quantize,
                fragment_update_alpha=fragment_update_alpha,
            )
            for i, fragment in enumerate(model_fragments)
        ]
        # The model as it is now is the first global copy.
        for fragment in self._fragments:
            fragment.save_parameters()
        for fragment in self._fragments:
            fragment.register_state_dict_fn()

    def __enter__(self) -> "DiLoCo":
        return super().__enter__()

    def _current_fragment(self) -> int:
        """The fragment to sync now: from the Manager's step, so that every replica group picks the same one."""
        return self._manager.current_step() % len(self._fragments)

    def _after_inner_step(self) -> None:
        self._local_step += 1
        if self._local_step == self._sync_every - self._fragment_sync_delay:
            self._prepare()
        if self._local_step == self._sync_every:
            self._local_step = 0
            fragment, self._in_flight = self._in_flight, None
            if fragment is None:  # cannot happen unless the quorum raised at prepare and the loop carried on
                raise RuntimeError("DiLoCo: no fragment sync was prepared (did start_quorum fail?)")
            committed = self._fragments[fragment].perform_sync()
            logger.debug("fragment %d synced (committed=%s), manager step %s",
                         fragment, committed, self._manager.current_step())

    def _prepare(self) -> None:
        try:
            # A synchronous quorum: any heal is applied when this returns.
            self._manager.start_quorum()
        except BaseException:
            self._local_step -= 1  # try again at the next inner step
            raise
        self._in_flight = self._current_fragment()
        logger.debug("preparing fragment %d at manager step %s", self._in_flight, self._manager.current_step())
        self._fragments[self._in_flight].prepare_sync()

    def _wait(self) -> None:
        """Wait for every fragment's averaging in flight."""
        for fragment in self._fragments:
            fragment.wait()

    def _save_parameters(self) -> None:
        for fragment in self._fragments:
            fragment.save_parameters()

    def _restore_parameters(self) -> None:
        for fragment in self._fragments:
            fragment.restore_parameters()


def _check_quantizable(fragments: list[nn.Module]) -> None:
    """``should_quantize=True`` with a parameter 8 bits can't carry fails here, not at the first sync H steps in."""
    from torchft_lite.quantization import check_quantizable

    for i, fragment in enumerate(fragments):
        for name, param in fragment.named_parameters():
            try:
                check_quantizable([param.detach()])
            except TypeError as exc:  # UnsupportedDtypeError: the same type, naming the parameter
                raise type(exc)(f"DiLoCo model fragment {i}, parameter {name!r}: {exc}") from exc


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
    """The DiLoCo state and sync of one model fragment; see :class:`DiLoCo`."""

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


# torchft's private name, for scripts that reach for it.
_StreamingDiLoCoFragment = StreamingDiLoCoFragment
