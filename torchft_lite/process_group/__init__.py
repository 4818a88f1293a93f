"""Process groups across replica groups, rebuilt whenever the quorum changes.

``ProcessGroupGloo`` (CPU) and ``ProcessGroupNCCL`` (CUDA) wrap a fresh c10d
backend per ``configure()`` (or ``reconfigure()``, torchft's handle API);
``ProcessGroupBabyGloo`` and ``ProcessGroupBabyNCCL`` run that backend in a
child process, so an abort is a kill; ``ProcessGroupDummy`` exchanges nothing;
the wrappers (``ProcessGroupWrapper``, ``ErrorSwallowingProcessGroupWrapper``,
``FakeProcessGroupWrapper``, ``ManagedProcessGroup``) forward to another group.
All of them subclass :class:`torch.distributed.ProcessGroup`.

``create_store_client`` and ``reconfigure_with_store`` are defined here rather
than in a submodule: they look up ``TCPStore``, ``PrefixStore`` and
``create_store_client`` in this package's namespace, where tests written for
torchft substitute them.

The child-process groups, NCCL, the dummy and the wrappers load on first use
(:data:`_LAZY`): a restarted trainer on gloo pays for none of them before its
first step.
"""

from __future__ import annotations

import importlib
import uuid
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore

from .base import ProcessGroup, ProcessGroupClosed
from .gloo import ProcessGroupGloo
from .handles import ReconfigureOptions, Rendezvous, plan_rendezvous
from .reconfigurable import ReconfigurableProcessGroup
from .store import StoreAddress, parse_store_addr
from .tracked_work import CompletedWork, TrackedWork

_LAZY = {
    "ProcessGroupBaby": "child_process",
    "ProcessGroupBabyGloo": "child_process",
    "ProcessGroupBabyNCCL": "child_process",
    "ProcessGroupDummy": "dummy",
    "ProcessGroupNCCL": "nccl",
    "ErrorSwallowingProcessGroupWrapper": "wrappers",
    "FakeProcessGroupWrapper": "wrappers",
    "ManagedProcessGroup": "wrappers",
    "ProcessGroupWrapper": "wrappers",
    "_ErrorSwallowingWork": "wrappers",
}
"""Names loaded from their submodule on first access (``__getattr__``)."""

__all__ = [
    "CompletedWork",
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ManagedProcessGroup",
    "ProcessGroup",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupClosed",
    "ProcessGroupDummy",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupWrapper",
    "ReconfigurableProcessGroup",
    "ReconfigureOptions",
    "Rendezvous",
    "StoreAddress",
    "TrackedWork",
    "create_store_client",
    "parse_store_addr",
    "plan_rendezvous",
    "reconfigure_with_store",
]

# torchft's private name, for code written against torchft (as is _ErrorSwallowingWork, in _LAZY).
_rendezvous = plan_rendezvous


def __getattr__(name: str) -> Any:
    submodule = _LAZY.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

_RECONFIGURE_TIMEOUT = timedelta(seconds=60)


def create_store_client(store_addr: str, timeout: timedelta) -> Store:
    """A client of the TCPStore at ``host:port/prefix``, scoped to the prefix.

    The host may be a hostname, an IPv4 address or an IPv6 address, bare or
    in brackets (see :func:`parse_store_addr`); connecting is bounded by
    ``timeout``.
    """
    address = parse_store_addr(store_addr)
    store = TCPStore(host_name=address.host, port=address.port, is_master=False, wait_for_workers=False,
                     timeout=timeout)
    return PrefixStore(address.prefix, store)


def reconfigure_with_store(pg: ProcessGroup, store_addr: str, rank: int, world_size: int,
                           timeout: timedelta = _RECONFIGURE_TIMEOUT) -> None:
    """Form a new communicator of ``world_size`` members through a store, without a Manager.

    Every member calls this with its ``rank`` and the same ``store_addr``,
    whose prefix must be unique to this reconfiguration. Each publishes its
    ``get_reconfigure_handle()``; rank 0 picks the communicator id; once all
    handles are there (waiting at most ``timeout``: a store error names the
    missing keys) each calls ``pg.reconfigure()`` with the ordered handles.
    """
    store = create_store_client(store_addr, timeout)
    store.set(f"handle/{rank}", pg.get_reconfigure_handle())
    if rank == 0:
        store.set("uuid", str(uuid.uuid4().int >> 65))  # 63 bits: fits a signed 64-bit id
    keys = ["uuid", *(f"handle/{member}" for member in range(world_size))]
    store.wait(keys, timeout)
    communicator_id, *handles = store.multi_get(keys)
    opts = ReconfigureOptions()
    opts.uuid = int(communicator_id)
    opts.handles = [handle.decode("utf-8") if isinstance(handle, bytes) else handle for handle in handles]
    opts.timeout = timeout
    pg.reconfigure(opts).wait()
