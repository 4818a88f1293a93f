"""Sharded (DTensor) state in durable checkpoints: who writes which shard, and when a resume fits.

A state file stores a DTensor the way a heal carries it (``serialization.dtensor``):
this rank's local shard as an ordinary tensor entry, its layout in the file's
header; the full tensor is never gathered. Ranks of a group hold different shards,
so each writes its own file (:func:`sharded_paths` finds what makes
``replicated_in_group=True`` refuse a save), and the manifest comes only after every
rank's file. A resume needs the layout it was written with: :func:`check_layout`
refuses another before anything is loaded. docs/large-models.md ("Sharded state").
"""

from __future__ import annotations

from typing import Any

import torch

from torchft_lite.errors import CheckpointMismatchError
from torchft_lite.serialization import dtensor
from torchft_lite.serialization.encode import FlatStateDict
from torchft_lite.serialization.spec import format_path

__all__ = ["check_layout", "describe_layout", "layout_of", "sharded_paths"]

_SHOWN_RANKS = 8


def layout_of(tensor: torch.Tensor, where: str) -> dict[str, Any] | None:
    """A DTensor's layout as plain data (the heal header's, without the describing rank, plus the local
    shape); None for a plain tensor. Reads no tensor data."""
    if not dtensor.is_dtensor(tensor):
        return None
    local, layout = dtensor.describe(tensor, where)
    mesh = {key: value for key, value in layout["mesh"].items() if key != "rank"}
    return {**layout, "mesh": mesh, "local_shape": list(local.shape)}


def _placement_text(placement: list) -> str:
    kind, *args = placement
    if kind == "shard":
        return f"Shard({args[0]})"
    if kind == "strided_shard":
        return f"_StridedShard({args[0]}, split_factor={args[1]})"
    if kind == "replicate":
        return "Replicate()"
    return f"Partial({args[0]})"


def describe_layout(layout: dict[str, Any] | None, with_order: bool = False) -> str:
    """``layout`` (from :func:`layout_of`) in words, for error messages (its shard order only ``with_order``)."""
    if layout is None:
        return "a plain tensor"
    mesh = layout["mesh"]
    ranks = mesh["ranks"]
    shown = ", ".join(map(str, ranks[:_SHOWN_RANKS])) + (", ..." if len(ranks) > _SHOWN_RANKS else "")
    names = "" if mesh["dim_names"] is None else f" {tuple(mesh['dim_names'])}"
    order = f", shard order {layout['shard_order']}" if with_order else ""
    return (f"a DTensor [{', '.join(map(_placement_text, layout['placements']))}] on a {mesh['device_type']} mesh "
            f"{mesh['shape']}{names} of ranks [{shown}], global shape {layout['shape']} stride {layout['stride']}, "
            f"local shape {layout['local_shape']}{order}")


def _per_rank(layout: dict[str, Any]) -> bool:
    """Whether ranks of the mesh hold different local tensors (anything but Replicate on a dimension)."""
    return any(placement[0] != "replicate" for placement in layout["placements"])


def sharded_paths(flat: FlatStateDict) -> list[str]:
    """The paths of ``flat``'s DTensors whose local tensors differ between ranks."""
    found = []
    for path, leaf in zip(flat.paths, flat.leaves):
        layout = layout_of(leaf, format_path(path))
        if layout is not None and _per_rank(layout):
            found.append(format_path(path))
    return found


def check_layout(where: str, live: torch.Tensor, loaded: torch.Tensor, step: int, per_rank: bool) -> None:
    """Raise ``CheckpointMismatchError`` unless ``loaded`` (from the checkpoint) fits ``live`` shard for shard.

    ``per_rank``: the checkpoint holds one file per group rank (else group rank 0's, which fits only a state
    that every rank holds whole).

    Group rank ``r`` loads file ``r``; its shards fit only when the mesh (device type, shape, ranks, dimension
    names), the placements and the global and local shapes are the ones the checkpoint holds. Another mesh,
    another placement, or a plain tensor where a DTensor was saved (or the other way round) would put shards
    on the wrong ranks. Resharding on resume is not supported.
    """
    mine, saved = layout_of(live, where), layout_of(loaded, where)
    if not per_rank and any(layout is not None and _per_rank(layout) for layout in (mine, saved)):
        raise CheckpointMismatchError(
            f"the checkpoint of step {step} holds group rank 0's state alone (written with "
            f"replicated_in_group=True), but {where} is {describe_layout(mine)}: every rank would load rank 0's "
            f"shard. Resume from a checkpoint written with replicated_in_group=False")
    if mine != saved:
        with_order = describe_layout(mine) == describe_layout(saved)  # they differ in the shard order alone
        raise CheckpointMismatchError(
            f"the checkpoint of step {step} holds {where} as {describe_layout(saved, with_order)}; this process "
            f"has it as {describe_layout(mine, with_order)}. Its shards would land on the wrong ranks: resume with "
            f"the mesh and placements it was written with (resharding on resume is not supported)")
