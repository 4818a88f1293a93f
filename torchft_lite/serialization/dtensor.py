"""DTensors in the heal format: the local shard travels, its layout rides in the header.

A DTensor is sent as its local tensor (an ordinary tensor entry: only this rank's
shard is ever read) plus a ``dtensor`` node in the tree::

    ["dtensor", [TENSOR_INDEX, {"mesh": MESH, "placements": [PLACEMENT, ...],
                                "shape": [...], "stride": [...], "shard_order": null | [[dim, [mesh_dim, ...]], ...]}]]
    MESH      = {"device_type": "cuda", "shape": [2, 4], "ranks": [0, 1, ...], "dim_names": ["dp", "tp"] | null,
                 "rank": SENDER_GLOBAL_RANK}
    PLACEMENT = ["shard", dim] | ["strided_shard", dim, split_factor] | ["replicate"] | ["partial", reduce_op]

Every field is plain data, validated (:func:`parse`) before use; the receiver
rebuilds the DTensor on a mesh of its own (:class:`MeshResolver`, :func:`rebuild`).
"""

from __future__ import annotations

import logging
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from torchft_lite.errors import CheckpointError, CheckpointTransferError

__all__ = ["DTensorLayout", "MeshResolver", "describe", "is_dtensor", "local_of", "parse", "rebuild"]

logger = logging.getLogger(__name__)

MAX_MESH_DIMS = 16
MAX_MESH_RANKS = 1 << 20
MAX_TENSOR_DIMS = 64
_MAX_INT = 2**62
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,256}")
_REDUCE_OP = re.compile(r"[a-z_]{1,32}")


def _module() -> Any:
    """``torch.distributed.tensor`` when something has imported it: no DTensor can exist before that."""
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(value: Any) -> bool:
    module = _module()
    return module is not None and isinstance(value, module.DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor; any other tensor as it is."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MeshLayout:
    device_type: str
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    """Global ranks, row-major over ``shape``."""
    dim_names: tuple[str, ...] | None
    rank: int
    """The sender's global rank: the receiver's stand-in when it has no default process group."""

    @property
    def key(self) -> tuple:
        """What makes two meshes the same mesh for a heal (the sender's own rank does not)."""
        return self.device_type, self.shape, self.ranks, self.dim_names


@dataclass(frozen=True)
class DTensorLayout:
    """Everything about a DTensor except its local data."""

    mesh: MeshLayout
    placements: tuple[tuple, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    shard_order: tuple[tuple[int, tuple[int, ...]], ...] | None


# ---------------------------------------------------------------- sending


def _mesh_layout(mesh: Any) -> MeshLayout:
    import torch.distributed as dist

    ranks = mesh.mesh
    names = mesh.mesh_dim_names
    rank = dist.get_rank() if dist.is_initialized() else getattr(mesh, "_rank", 0)  # a mesh built without a group
    return MeshLayout(mesh.device_type, tuple(ranks.shape), tuple(int(r) for r in ranks.flatten().tolist()),
                      None if names is None else tuple(names), int(rank))


def _placement(placement: Any, where: str) -> list:
    module = _module()
    kind = type(placement)
    if kind is module.Shard:
        return ["shard", placement.dim]
    if kind is module.placement_types._StridedShard:
        return ["strided_shard", placement.dim, int(placement.split_factor)]
    if kind is module.Replicate:
        return ["replicate"]
    if kind is module.Partial:
        return ["partial", placement.reduce_op]
    raise CheckpointError(f"cannot send the DTensor at {where}: unsupported placement {placement!r}")


def describe(value: Any, where: str) -> tuple[torch.Tensor, dict]:
    """``(local tensor, layout JSON)`` of the DTensor ``value``; reads no tensor data."""
    spec = value._spec
    order = None if getattr(spec, "use_strided_shard_as_shard_order", False) else getattr(spec, "shard_order", None)
    mesh = _mesh_layout(value.device_mesh)
    return local_of(value), {
        "mesh": {"device_type": mesh.device_type, "shape": list(mesh.shape), "ranks": list(mesh.ranks),
                 "dim_names": None if mesh.dim_names is None else list(mesh.dim_names), "rank": mesh.rank},
        "placements": [_placement(p, where) for p in value.placements],
        "shape": list(value.shape), "stride": list(value.stride()),
        "shard_order": None if order is None else [[entry.tensor_dim, list(entry.mesh_dims)] for entry in order],
    }


# ---------------------------------------------------------------- receiving: validation


class _Invalid(ValueError):
    pass


def _int(value: Any, what: str, minimum: int = 0, maximum: int = _MAX_INT) -> int:
    if type(value) is not int or not minimum <= value <= maximum:
        raise _Invalid(f"{what} must be an integer in [{minimum}, {maximum}], got {str(value)[:40]!r}")
    return value


def _ints(value: Any, what: str, limit: int, minimum: int = 0, maximum: int = _MAX_INT) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > limit:
        raise _Invalid(f"{what} must be a list of at most {limit} integers")
    return tuple(_int(item, what, minimum, maximum) for item in value)


def _parse_mesh(raw: Any) -> MeshLayout:
    if not isinstance(raw, dict):
        raise _Invalid("the mesh is not an object")
    device_type = raw.get("device_type")
    if not isinstance(device_type, str) or not _NAME.fullmatch(device_type):
        raise _Invalid(f"bad mesh device type {str(device_type)[:40]!r}")
    shape = _ints(raw.get("shape"), "mesh shape", MAX_MESH_DIMS, minimum=1, maximum=MAX_MESH_RANKS)
    ranks = _ints(raw.get("ranks"), "mesh ranks", MAX_MESH_RANKS, maximum=2**31 - 1)
    if math.prod(shape) != len(ranks) or len(set(ranks)) != len(ranks):
        raise _Invalid(f"a mesh of shape {list(shape)} needs {math.prod(shape)} distinct ranks, got {len(ranks)}")
    names = raw.get("dim_names")
    if names is not None:
        if not isinstance(names, list) or len(names) != len(shape) or len(set(map(str, names))) != len(names) \
                or not all(isinstance(name, str) and _NAME.fullmatch(name) for name in names):
            raise _Invalid(f"mesh dim_names must be {len(shape)} distinct names")
        names = tuple(names)
    return MeshLayout(device_type, shape, ranks, names, _int(raw.get("rank"), "mesh rank", maximum=2**31 - 1))


def _parse_placement(raw: Any, tensor_dims: int) -> tuple:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise _Invalid(f"malformed placement {str(raw)[:40]!r}")
    kind, args = raw[0], raw[1:]
    if kind == "replicate" and not args:
        return ("replicate",)
    if kind == "shard" and len(args) == 1:
        return ("shard", _int(args[0], "shard dim", maximum=max(tensor_dims - 1, 0)))
    if kind == "strided_shard" and len(args) == 2:
        return ("strided_shard", _int(args[0], "shard dim", maximum=max(tensor_dims - 1, 0)),
                _int(args[1], "split factor", minimum=1, maximum=2**31 - 1))
    if kind == "partial" and len(args) == 1 and isinstance(args[0], str) and _REDUCE_OP.fullmatch(args[0]):
        return ("partial", args[0])
    raise _Invalid(f"unknown placement {str(raw)[:40]!r}")


def parse(raw: Any, where: str) -> DTensorLayout:
    """Validate a layout JSON object; raises ``CheckpointTransferError`` naming ``where``."""
    try:
        if not isinstance(raw, dict):
            raise _Invalid("the layout is not an object")
        mesh = _parse_mesh(raw.get("mesh"))
        shape = _ints(raw.get("shape"), "shape", MAX_TENSOR_DIMS)
        stride = _ints(raw.get("stride"), "stride", MAX_TENSOR_DIMS)
        if len(stride) != len(shape) or math.prod(shape) > _MAX_INT:
            raise _Invalid(f"shape {list(shape)[:8]} and stride {list(stride)[:8]} do not describe a tensor")
        placements = raw.get("placements")
        if not isinstance(placements, list) or len(placements) != len(mesh.shape):
            raise _Invalid(f"a {len(mesh.shape)}-dimensional mesh needs {len(mesh.shape)} placements")
        parsed = tuple(_parse_placement(p, len(shape)) for p in placements)
        order = raw.get("shard_order")
        if order is not None:
            if not isinstance(order, list) or len(order) > len(shape):
                raise _Invalid("shard_order must be a list of [tensor dim, [mesh dims]]")
            order = tuple(_parse_order_entry(entry, len(shape), len(mesh.shape)) for entry in order)
        return DTensorLayout(mesh, parsed, shape, stride, order)
    except _Invalid as exc:
        raise CheckpointTransferError(f"invalid checkpoint header: the DTensor at {where}: {exc}") from None


def _parse_order_entry(entry: Any, tensor_dims: int, mesh_dims: int) -> tuple[int, tuple[int, ...]]:
    if not isinstance(entry, list) or len(entry) != 2:
        raise _Invalid("a shard_order entry must be [tensor dim, [mesh dims]]")
    dims = _ints(entry[1], "shard_order mesh dims", mesh_dims, maximum=mesh_dims - 1)
    if not dims:
        raise _Invalid("a shard_order entry needs at least one mesh dim")
    return _int(entry[0], "shard_order tensor dim", maximum=max(tensor_dims - 1, 0)), dims


# ---------------------------------------------------------------- receiving: rebuilding


class MeshResolver:
    """Finds the receiver's own DeviceMesh for a layout; builds one (without process groups) when it has none.

    ``targets`` are the receiver's own state dict's tensors by path (DTensors
    among them bring their meshes).

    As torchft's receiver binds the sender's mesh to its own process groups:
    replica groups have the same layout, so group rank ``r`` of the sender and of
    the receiver hold the same shard. The mesh is, in order of preference:

    1. the mesh of a DTensor in the receiver's own state dict (``state_dict=`` of
       the transport) with the same device type, ranks and dimension names (a
       DTensor at the same path with the same layout is also received in place,
       and is itself the result);
    2. otherwise a new ``DeviceMesh`` of those ranks, built without process groups
       (nothing collective happens inside a receive): enough to load the local
       shard into a model, not to run collectives on the received DTensor.
    """

    def __init__(self, targets: Mapping[Any, torch.Tensor] | None) -> None:
        self._targets = targets or {}
        self._meshes: dict[tuple, Any] | None = None

    def mesh(self, layout: MeshLayout, where: str) -> Any:
        if self._meshes is None:
            self._meshes = {}
            seen: set[int] = set()
            for tensor in self._targets.values():
                if is_dtensor(tensor) and id(tensor.device_mesh) not in seen:
                    seen.add(id(tensor.device_mesh))
                    self._meshes.setdefault(_mesh_layout(tensor.device_mesh).key, tensor.device_mesh)
        mesh = self._meshes.get(layout.key)
        if mesh is None:
            mesh = self._meshes[layout.key] = _build_mesh(layout, where)
        return mesh


def _build_mesh(layout: MeshLayout, where: str) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else layout.rank
    ranks = torch.tensor(layout.ranks, dtype=torch.int).reshape(layout.shape)
    try:
        mesh = DeviceMesh(layout.device_type, ranks, mesh_dim_names=layout.dim_names, _init_backend=False,
                          _rank=rank)
    except (TypeError, ValueError, RuntimeError, AssertionError) as exc:
        raise CheckpointTransferError(f"cannot rebuild the DeviceMesh of the DTensor at {where} "
                                      f"({layout.device_type} {list(layout.shape)}): {exc}") from exc
    logger.info("no DeviceMesh of this process matches the sender's %s mesh %s (names %s): the DTensor at %s and "
                "others of that mesh are rebuilt on a new mesh without process groups; pass the transport your "
                "state_dict to receive onto your own", layout.device_type, list(layout.shape), layout.dim_names, where)
    return mesh


def _placements(layout: DTensorLayout) -> tuple:
    import torch.distributed.tensor as module

    made = []
    for kind, *args in layout.placements:
        if kind == "shard":
            made.append(module.Shard(args[0]))
        elif kind == "strided_shard":
            made.append(module.placement_types._StridedShard(args[0], split_factor=args[1]))
        elif kind == "replicate":
            made.append(module.Replicate())
        else:
            made.append(module.Partial(args[0]))
    return tuple(made)


def _same_layout(target: Any, layout: DTensorLayout, placements: tuple) -> bool:
    return (_mesh_layout(target.device_mesh).key == layout.mesh.key and tuple(target.placements) == placements
            and tuple(target.shape) == layout.shape and tuple(target.stride()) == layout.stride)


def rebuild(local: torch.Tensor, layout: DTensorLayout, target: Any, meshes: MeshResolver, where: str) -> Any:
    """The DTensor of ``layout`` around the received ``local``; ``target`` is the receiver's tensor at its path.

    The local tensor stays where the receive put it (on CPU, or in the target's own local tensor), as torchft's
    receiver leaves it."""
    import torch.distributed.tensor as module

    if local.numel() > math.prod(layout.shape):
        raise CheckpointTransferError(f"the DTensor at {where}: a local shard of {local.numel()} elements is larger "
                                      f"than the whole tensor {list(layout.shape)}")
    try:
        placements = _placements(layout)
        if is_dtensor(target) and target._local_tensor is local and _same_layout(target, layout, placements):
            return target  # received in place into the receiver's own DTensor
        mesh = meshes.mesh(layout.mesh, where)
        order = None if layout.shard_order is None else tuple(
            module._ShardOrderEntry(dim, mesh_dims) for dim, mesh_dims in layout.shard_order)
        meta = module._TensorMeta(torch.Size(layout.shape), layout.stride, local.dtype)
        spec = module._DTensorSpec(mesh, placements, tensor_meta=meta, shard_order=order)
        return module.DTensor(local, spec, requires_grad=False)
    except CheckpointTransferError:
        raise
    except (TypeError, ValueError, RuntimeError, AssertionError) as exc:
        raise CheckpointTransferError(f"cannot rebuild the DTensor at {where}: {exc}") from exc
