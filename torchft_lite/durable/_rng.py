"""The random-number generator states of one process, as plain data the heal format carries.

torch's CPU generator and every initialized CUDA device's, Python's ``random``
and NumPy's global generator (only when NumPy is already imported: the
process uses it). Nothing is pickled: torch states are uint8 tensors,
Python's is a tuple of ints, NumPy's a tensor of its key plus plain numbers.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["capture", "restore"]


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, key, position, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = {"kind": str(kind), "key": torch.from_numpy(key.astype("uint32").view("int32").copy()),
                          "position": int(position), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def restore(state: dict[str, Any]) -> list[str]:
    """Set the generators ``state`` holds; returns the names of those it set."""
    restored = []
    if "torch" in state:
        torch.set_rng_state(state["torch"])
        restored.append("torch")
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        restored.append("python")
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
            restored.append("cuda")
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        saved = state["numpy"]
        key = saved["key"].numpy().view("uint32")
        numpy.random.set_state((saved["kind"], key, saved["position"], saved["has_gauss"], saved["cached_gaussian"]))
        restored.append("numpy")
    return restored
