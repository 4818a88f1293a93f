"""``OptimizerWrapper(manager, optim)``: the per-step protocol from the optimizer's calls.

``zero_grad()`` starts the quorum (so it runs during the forward pass) and
``step()`` steps the wrapped optimizer only when ``manager.should_commit()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer as TorchOptimizer

if TYPE_CHECKING:
    from torchft_lite.manager import Manager

__all__ = ["OptimizerWrapper", "Optimizer"]


class OptimizerWrapper(TorchOptimizer):
    """Wraps a torch optimizer; same ``param_groups``, ``state`` and state dict."""

    def __init__(self, manager: "Manager", optim: TorchOptimizer) -> None:
        # Deliberately not calling TorchOptimizer.__init__: the wrapped optimizer owns the state.
        self.optim = optim
        self.manager = manager

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("closure is not supported: the step may be skipped when it is not committed")
        if self.manager.should_commit():
            self.optim.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r})"


Optimizer = OptimizerWrapper  # torchft's older name
