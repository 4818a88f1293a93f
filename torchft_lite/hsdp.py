"""HSDP: FSDP2 shards the model inside a replica group, the Manager averages the shards across groups.

Each replica group is an ordinary torchrun job whose ranks shard the model with
FSDP2 over a 1-D mesh of their own (:func:`init_group_mesh`). After FSDP's
reduce-scatter, group rank ``r`` holds shard ``r`` of its group's averaged gradient;
the hook :func:`average_across_groups` sets averages it with group rank ``r`` of
every other live group through the Manager. :class:`ShardedState` hands the
Manager shards only, so heals move shards, never the whole model. The three lines
to add to an FSDP2 script are in docs/large-models.md ("HSDP").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn
from torch.distributed import ReduceOp

from torchft_lite.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchft_lite.manager import Manager

__all__ = ["GroupEnv", "ShardedState", "average_across_groups", "init_group_mesh"]

logger = logging.getLogger(__name__)

DEFAULT_MESH_TIMEOUT = timedelta(minutes=10)
"""Bounds the in-group collectives. Far above the Manager's timeout on purpose: a rank may spend that long
serving a heal after its group's vote while its partner already waits in the next step's all-gather, and a
dead partner is found at once anyway (its connection closes)."""


@dataclass(frozen=True)
class GroupEnv:
    """Where this process stands in its replica group: what torchrun puts in the environment."""

    rank: int
    """The rank within the replica group (``RANK``)."""
    world_size: int
    """Ranks in the replica group (``WORLD_SIZE``)."""
    local_rank: int
    """The rank on this machine (``LOCAL_RANK``; ``RANK`` when unset): picks the CUDA device."""
    store_host: str
    """The group's TCPStore (``MASTER_ADDR``), hosted by torchrun's agent."""
    store_port: int
    """Its port (``MASTER_PORT``)."""
    restart_count: int = 0
    """torchrun's ``TORCHELASTIC_RESTART_COUNT``: keys this incarnation's keys in a store that outlives it."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK={self.rank} must be in [0, WORLD_SIZE={self.world_size})")
        if not 0 < self.store_port < 65536:
            raise ConfigError(f"MASTER_PORT must be in 1..65535, got {self.store_port}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "GroupEnv":
        env = os.environ if env is None else env

        def number(name: str, default: str | None = None) -> int:
            raw = env.get(name, default)
            if raw is None:
                raise ConfigError(f"{name} is not set: start each replica group with torchrun (it sets RANK, "
                                  f"WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name} must be an integer, got {raw!r}") from None

        host = env.get("MASTER_ADDR")
        if not host:
            raise ConfigError("MASTER_ADDR is not set: start each replica group with torchrun")
        rank = number("RANK")
        return cls(rank=rank, world_size=number("WORLD_SIZE"), local_rank=number("LOCAL_RANK", str(rank)),
                   store_host=host, store_port=number("MASTER_PORT"),
                   restart_count=number("TORCHELASTIC_RESTART_COUNT", "0"))


def init_group_mesh(device_type: str | None = None, *, timeout: timedelta = DEFAULT_MESH_TIMEOUT,
                    dim_name: str = "dp_shard", env: GroupEnv | None = None) -> "DeviceMesh":
    """The 1-D DeviceMesh of this replica group's ranks, for ``fully_shard(..., mesh=...)``.

    Initialises the default process group when nobody has: NCCL on CUDA (gloo
    beside it for CPU tensors), gloo on CPU, over the group's own TCPStore (the
    one torchrun hosts and the Manager uses, under a key prefix of its own),
    so it never competes with torchrun for ``MASTER_PORT``. On CUDA the
    device is ``cuda:LOCAL_RANK``. The mesh spans this group only: the
    Manager, not the mesh, joins the groups.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``; default ``"cuda"`` when CUDA is available.
        timeout: bounds the rendezvous and every in-group collective; keep it well above the Manager's
            ``timeout`` (see :data:`DEFAULT_MESH_TIMEOUT`).
        dim_name: the mesh dimension's name.
        env: this process's place in its group; default :meth:`GroupEnv.from_env`.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type not in ("cuda", "cpu"):
        raise ConfigError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        env = env or GroupEnv.from_env()
        world = env.world_size
        device_id = None
        if device_type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("device_type='cuda' but CUDA is not available: use device_type='cpu' (gloo)")
            torch.cuda.set_device(env.local_rank)
            device_id = torch.device("cuda", env.local_rank)
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        store = dist.TCPStore(env.store_host, env.store_port, world_size=world, is_master=False, timeout=timeout,
                              wait_for_workers=False)
        store = dist.PrefixStore(f"torchft_lite/hsdp/{env.restart_count}/", store)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=world, timeout=timeout,
                                device_id=device_id)
        logger.info("group rank %d of %d: default process group up (%s)", env.rank, world, backend)
    return init_device_mesh(device_type, (world,), mesh_dim_names=(dim_name,))


class _CrossGroupAverage:
    """An FSDPModule's all-reduce hook: the shard averaged with the same shard of every other live group.

    It waits for the Manager's allreduce, as FSDP reads the tensor right after
    the hook returns. A failure never raises here: the Manager records it, the
    tensor keeps this group's own average, and the step does not commit.

    Why AVG is right whatever FSDP divides by: FSDP leaves the hook's tensor at
    the group's mean (reduce-scatter AVG for fp32/bf16), or for fp16 at the sum
    over a pre-divide factor and divides the rest after the hook; either way the
    final gradient is (cross-group average of the hook's tensor) / (what FSDP
    still divides), and averaging is linear, so the result is the mean over every
    rank of every participating group. The hook's tensor is the flat
    reduce-scatter output the sharded gradients are views of, so reducing it in
    place is enough.
    """

    def __init__(self, manager: "Manager", should_quantize: bool) -> None:
        self.manager = manager
        self.should_quantize = should_quantize

    def __call__(self, tensor: torch.Tensor) -> None:
        if self.should_quantize:
            work = self.manager.allreduce(tensor, should_quantize=True, reduce_op=ReduceOp.AVG)
        else:  # leave the argument out: a Manager without quantization (torchft's on CPU) still takes it
            work = self.manager.allreduce(tensor, reduce_op=ReduceOp.AVG)
        work.wait()


def average_across_groups(model: nn.Module, manager: "Manager", *, should_quantize: bool = False) -> int:
    """Set the cross-group averaging hook on every FSDPModule in ``model``; returns how many.

    Call it after ``fully_shard``. ``should_quantize`` reduces in 8 bits
    (where the Manager supports it). Raises ``ConfigError`` when ``model``
    has no FSDPModule.

    torchft's way (``m.set_all_reduce_hook(lambda t: dist.all_reduce(t,
    group=ManagedProcessGroup(manager), op=ReduceOp.AVG))``) works as well: this
    only saves the loop and the wait.
    """
    from torch.distributed.fsdp import FSDPModule

    hook = _CrossGroupAverage(manager, should_quantize)
    hooked = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)
            hooked += 1
    if not hooked:
        raise ConfigError("average_across_groups: the model has no FSDPModule; call "
                          "torch.distributed.fsdp.fully_shard(module, mesh=init_group_mesh()) first")
    return hooked


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if _is_dtensor(value) else value


class ShardedState:
    """The Manager's ``state_dict``/``load_state_dict`` for an FSDP2 model and its optimizer: shards only.

    Build it after ``fully_shard`` and before training. The model's sharded
    state dict is taken once, here: FSDP2's sharded parameters live for the
    whole run (the optimizer updates them in place), whereas
    ``model.state_dict()`` during forward or backward (when the Manager
    serves a heal, from its first allreduce) would reshard modules in the
    middle of their use. Buffers are taken the same way, so a module that
    reassigns a buffer (rather than updating it in place) is not covered.

    ``load_state_dict`` copies each received shard into the live one (no
    collective, no gathering) and loads the optimizer's state with every
    DTensor placed on its parameter's own mesh. Keys are the optimizer's
    parameter indices, so both groups must build the optimizer alike.

    A heal carries the DTensors' local shards (``torchft_lite.serialization.dtensor``),
    so group rank ``r`` of a healing group takes shard ``r`` from group rank ``r`` of
    its source. Both groups must shard the same way (same group size and
    ``fully_shard`` calls), which a mismatch in any shard's shape reports.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._model_state = model.state_dict()
        self._params = [p for group in optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        return {"model": dict(self._model_state), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        model_state = state["model"]
        missing = sorted(set(self._model_state) - set(model_state))
        if missing:
            raise CheckpointError(f"the received model state lacks {missing[:5]} (of {len(missing)})")
        with torch.no_grad():
            for key, live in self._model_state.items():
                got = model_state[key]
                if _is_dtensor(live) != _is_dtensor(got):
                    raise CheckpointError(f"{key}: this rank's is {'' if _is_dtensor(live) else 'not '}sharded, the "
                                          f"source's is {'' if _is_dtensor(got) else 'not '}: shard both groups alike")
                mine, theirs = _local(live), _local(got)
                if mine.shape != theirs.shape:
                    raise CheckpointError(f"{key}: the source's shard is {list(theirs.shape)}, this rank's "
                                          f"{list(mine.shape)}: replica groups must have the same size and the "
                                          f"same fully_shard calls")
                if mine.data_ptr() != theirs.data_ptr():  # a heal received in place already landed here
                    mine.copy_(theirs)
        self.optimizer.load_state_dict(self._on_own_meshes(state["optim"]))

    def _on_own_meshes(self, optim_state: dict[str, Any]) -> dict[str, Any]:
        """``optim_state`` with each DTensor rebuilt around its local shard on its parameter's mesh.

        A heal into fresh tensors rebuilds a DTensor on a stand-in mesh
        without process groups (see ``serialization.dtensor``). Pointwise optimizer steps
        would not notice (the meshes compare equal), but any collective on
        that state would fail (``full_tensor()``, a full-state checkpoint).
        """
        from torch.distributed.tensor import DTensor

        per_param = {}
        for index, values in optim_state.get("state", {}).items():
            if not isinstance(index, int) or not 0 <= index < len(self._params):
                raise CheckpointError(f"the received optimizer state names parameter {index!r}; this optimizer "
                                      f"has {len(self._params)}")
            param = self._params[index]
            rebuilt = {}
            for name, value in values.items():
                if _is_dtensor(value) and _is_dtensor(param) and value.device_mesh is not param.device_mesh:
                    if value.shape != param.shape or _local(value).shape != _local(param).shape:
                        raise CheckpointError(f"optimizer state {name!r} of parameter {index}: shard "
                                              f"{list(_local(value).shape)} of {list(value.shape)} does not match "
                                              f"the parameter's {list(_local(param).shape)} of {list(param.shape)}")
                    value = DTensor.from_local(_local(value), param.device_mesh, param.placements,
                                               shape=param.shape, stride=param.stride(), run_check=False)
                rebuilt[name] = value
            per_param[index] = rebuilt
        return {**optim_state, "state": per_param}
