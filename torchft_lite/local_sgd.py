"""LocalSGD and DiLoCo: fault-tolerant training that syncs replica groups every few steps.

Both are context managers around a training loop's (inner) optimizer, with
torchft's constructor arguments::

    with DiLoCo(manager, [model], inner_optimizer, outer_optimizer, sync_every=100):
        for batch in data:
            ...
            inner_optimizer.step()   # every 100th step also syncs through the Manager

* :class:`LocalSGD` averages the model's parameters across replica groups
  every ``sync_every`` inner steps (``start_quorum``, one ``allreduce`` per
  parameter, ``should_commit``); a step that does not commit keeps the local
  parameters.
* :class:`DiLoCo` keeps a backup of the *global* parameters, averages the
  pseudo-gradients (global - local) every ``sync_every`` inner steps and steps
  an outer optimizer on the global parameters with them; a step that does not
  commit puts the global parameters back (the local steps are discarded).
  With several model fragments (Streaming DiLoCo) one fragment syncs every
  ``sync_every / len(model_fragments)`` steps, in turn (chosen from the
  Manager's step, so every group syncs the same one); its averaging overlaps
  the next ``fragment_sync_delay`` inner steps, and ``fragment_update_alpha``
  mixes the local parameters into the new global ones. The per-fragment work
  is in :mod:`torchft_lite._diloco_fragment`.

DiLoCo needs a Manager with ``use_async_quorum=False``: the quorum (and any
heal, which carries each fragment's global copy under torchft's key
``StreamingDiLoCoFragment_{i}``) is settled before the pseudo-gradients are
computed.
"""

from __future__ import annotations

import logging
import os
from types import TracebackType
from typing import Any

import torch
from torch import nn, optim
from torch.utils.hooks import RemovableHandle

from torchft_lite._diloco_fragment import StreamingDiLoCoFragment, extract_local_tensor, write_local

__all__ = ["DiLoCo", "LocalSGD", "extract_local_tensor"]

logger = logging.getLogger(__name__)

# torchft's switch: "True" turns bucketized averaging on whatever the argument says.
USE_BUCKETIZATION_ENV = "TORCHFT_USE_BUCKETIZATION"

# torchft's private name, for scripts that reach for it.
_StreamingDiLoCoFragment = StreamingDiLoCoFragment


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

    https://arxiv.org/abs/1805.09767. The quorum is formed at each sync; if it
    fails or the step does not commit, the local parameters are kept and the
    next ``sync_every`` steps end in another attempt. With an asynchronous
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
