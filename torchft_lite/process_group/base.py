"""The process group contract: a :class:`torch.distributed.ProcessGroup` whose membership changes at runtime.

A replica process group spans one rank of every replica group (say group rank 0
of each) and is rebuilt whenever the quorum changes, in one of two ways:

- ``configure(store_addr, replica_id, rank, world_size)``: the Manager names
  the store and this rank;
- ``reconfigure(opts)`` (torchft's handle API): every member is handed the
  same ordered list of ``get_reconfigure_handle()`` strings; see
  :mod:`torchft_lite.process_group.handles`.

Classes here subclass :class:`torch.distributed.ProcessGroup`, so an instance
can be handed to torch APIs that take a process group (``dist.all_reduce(t,
group=pg)`` dispatches to the Python methods), and ``register()`` makes it
resolvable by name for torch's functional collectives.
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
)

from torchft_lite.errors import CollectiveError, ConfigError, ProcessGroupClosed

from .handles import RankInfo, ReconfigureOptions, advertised_host, make_handle, plan_rendezvous
from .tracked_work import CompletedWork, translate_error

__all__ = ["DEFAULT_TIMEOUT", "ProcessGroup", "ProcessGroupClosed"]

DEFAULT_TIMEOUT = timedelta(seconds=60)
# Bounds the hosted handle store's own client (it only serves peers).
_HANDLE_STORE_TIMEOUT = timedelta(seconds=60)


def _check_timeout(timeout: timedelta) -> timedelta:
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ConfigError(f"process group timeout must be a positive timedelta, got {timeout!r}")
    return timeout


def _check_rank(rank: int, world_size: int) -> None:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int, got {value!r}")
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank}")


class ProcessGroup(dist.ProcessGroup):
    """A process group whose membership can change at runtime.

    The rank and size change with every ``configure()``: never cache them.
    Collectives take and return what c10d's do (lists of tensors in, a
    ``Work`` out); one a subclass does not support raises
    ``NotImplementedError`` ("... does not support <op>").
    """

    def __init__(self) -> None:
        # The C++ base wants a fixed rank and size; ours change with every
        # configure(), so rank() and size() are overridden.
        super().__init__(0, 1)
        self._handle_id_value = uuid.uuid4().hex
        self._handle_lock = threading.Lock()
        self._handle_store: tuple[str, dist.TCPStore] | None = None
        self._rank_info: RankInfo | None = None
        self._registered_name: str | None = None

    # -- membership ----------------------------------------------------------

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  timeout: timedelta | None = None) -> None:
        """Tear down the current communicator and join a new one.

        Args:
            store_addr: ``host:port/prefix`` of an existing TCPStore; the
                prefix must be unique to this configuration (quorum).
            replica_id: this replica group's id, for logs.
            rank: this process's rank in the new group.
            world_size: the number of ranks in the new group.
            timeout: bounds this rendezvous; None: the group's timeout.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support configure")

    @property
    def supports_reconfigure(self) -> bool:
        """Whether ``reconfigure()`` works (torchft's Manager checks)."""
        return True

    def set_rank_info(self, replica_id: str, group_rank: int, group_world_size: int,
                      global_rank: int | None = None) -> None:
        """Say who this process is: used in logs, and the global rank goes into the handle."""
        self._rank_info = RankInfo(replica_id, group_rank, group_world_size, global_rank)

    def _handle_id(self) -> str:
        """This group's id in handles: fixed for the life of the object."""
        return self._handle_id_value

    def get_reconfigure_handle(self) -> str:
        """This member's handle (JSON): its id, a TCPStore it hosts, its global rank.

        The store is started on the first call (port 0; advertised as
        ``TORCHFT_LITE_HOSTNAME`` or the hostname) and kept for the life of
        the group: when this member is the first in a reconfigure, everyone
        rendezvouses on it.
        """
        with self._handle_lock:
            if self._handle_store is None:
                host = advertised_host()
                try:
                    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                          timeout=_HANDLE_STORE_TIMEOUT)
                except Exception as exc:
                    raise translate_error(exc, f"hosting the reconfigure store on {host}",
                                          _HANDLE_STORE_TIMEOUT) from exc
                self._handle_store = (host, store)
            host, store = self._handle_store
        info = self._rank_info
        return make_handle(self._handle_id(), host, store.port, info.global_rank if info else None)

    def reconfigure(self, opts: ReconfigureOptions) -> dist.Work:
        """Join the communicator described by ``opts`` (ordered handles and a uuid); blocks until joined.

        This member's rank is the position of its own handle; everyone
        rendezvouses on the first handle's store. Raises what ``configure()``
        raises; returns a completed ``Work``.
        """
        plan = plan_rendezvous(opts, self._handle_id())
        info = self._rank_info
        replica_id = info.replica_id if info is not None else self._handle_id()
        self.configure(plan.store_addr, replica_id, plan.rank, plan.world_size, timeout=opts.timeout)
        return CompletedWork()

    # -- state ---------------------------------------------------------------

    def rank(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not support rank")

    def size(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not support size")

    def getBackendName(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} does not support getBackendName")

    def errored(self) -> Exception | None:
        """The first collective error since the last ``configure()``, or None."""
        return None

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the timeout of later collectives and configures."""
        raise NotImplementedError(f"{type(self).__name__} does not support set_timeout")

    def abort(self) -> None:
        """Abort the communicator; the group is errored until the next ``configure()``."""

    def shutdown(self) -> None:
        """Release the communicator; collectives fail until the next ``configure()``."""

    # -- registration with torch ---------------------------------------------

    def register(self, name: str) -> "ProcessGroup":
        """Register this group with torch, so functional collectives and DeviceMesh can resolve it by name.

        Needs torch's default process group (``dist.init_process_group``).
        Registers a backend ``<backend name>:<name>`` that hands out this very
        object, and makes a one-rank torch group of it: the group torch
        returns *is* ``self``, with ``group_name`` set. Call once per name;
        ``unregister()`` undoes it.
        """
        if not dist.is_initialized():
            raise ConfigError("register() needs torch's default process group: call dist.init_process_group first")
        backend_name = f"{self.getBackendName()}:{name}"
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        dist.Backend.register_backend(backend_name, lambda store, rank, world_size, timeout: self, devices=devices)
        group = dist.new_group(ranks=[dist.get_rank()], backend=backend_name, group_desc=backend_name,
                               timeout=DEFAULT_TIMEOUT)  # unused: this group keeps its own timeouts
        if group is not self:
            raise CollectiveError(f"registering {backend_name}: torch made a new group instead of using this one")
        return self

    def unregister(self) -> None:
        """Remove this group from torch's registry (it must be registered)."""
        dist.destroy_process_group(self)

    @property
    def group_name(self) -> str:
        """The name torch resolves this group by; set by ``register()``."""
        if self._registered_name is None:
            raise ValueError(f"{type(self).__name__} has no group name: register() it first")
        return self._registered_name

    def _set_group_name(self, name: str) -> None:
        self._registered_name = name  # torch calls this while registering; the C++ base has no backend to name

    # -- collectives ---------------------------------------------------------

    def _unsupported(self, op: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} does not support {op}")

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions | ReduceOp = ReduceOp.SUM) -> dist.Work:
        raise self._unsupported("allreduce")

    def allreduce_coalesced(self, tensors: list[torch.Tensor],
                            opts: AllreduceCoalescedOptions | ReduceOp | None = None) -> dist.Work:
        """Allreduce several tensors as one operation."""
        raise self._unsupported("allreduce_coalesced")

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensor: list[torch.Tensor],
                  opts: AllgatherOptions | None = None) -> dist.Work:
        raise self._unsupported("allgather")

    def allgather_into_tensor_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                        opts: AllgatherOptions | None = None) -> dist.Work:
        """For each input, gather every rank's copy into the matching output (``world_size`` times as long)."""
        raise self._unsupported("allgather_into_tensor_coalesced")

    def alltoall_base(self, output_buffer: torch.Tensor, input_buffer: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: AllToAllOptions | None = None) -> dist.Work:
        raise self._unsupported("alltoall_base")

    def broadcast(self, tensor_list: list[torch.Tensor], opts: BroadcastOptions | int = 0) -> dist.Work:
        raise self._unsupported("broadcast")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """Broadcast one tensor from ``root``."""
        return self.broadcast([tensor], root)

    def barrier(self, opts: BarrierOptions | None = None) -> dist.Work:
        raise self._unsupported("barrier")

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: ReduceScatterOptions | ReduceOp | None = None) -> dist.Work:
        raise self._unsupported("reduce_scatter")

    def reduce_scatter_tensor_coalesced(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                                        opts: ReduceScatterOptions | ReduceOp | None = None) -> dist.Work:
        """For each input (``world_size`` times as long as its output), reduce it and scatter the parts."""
        raise self._unsupported("reduce_scatter_tensor_coalesced")

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int = 0) -> dist.Work:
        raise self._unsupported("send")

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int = 0) -> dist.Work:
        raise self._unsupported("recv")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

