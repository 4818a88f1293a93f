"""In-memory fakes: run Managers (and your own training loop) in one process, without sockets.

::

    from torchft_lite.testing import InMemoryLighthouse, InMemoryProcessGroup

    lighthouse = InMemoryLighthouse(min_replicas=2)
    a = lighthouse.manager("a", InMemoryProcessGroup(), load_state_dict=..., state_dict=..., min_replica_size=2)
    b = lighthouse.manager("b", InMemoryProcessGroup(), load_state_dict=..., state_dict=..., min_replica_size=2)
    # train a and b on two threads: quorums, heals and averaged gradients are real, in memory
    lighthouse.kill(a.replica_id)       # b's collectives in flight are aborted, as by a lost lease

Each replica group has one rank here. The quorum forms once every live
replica has asked (and at least ``min_replicas``), with the same result a
real ManagerServer computes (``group_server.quorum_compute``). Heals go through an
:class:`InMemoryTransport` (state dicts by reference, never copied: load
functions must copy, as ``load_state_dict`` does).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
from torch.distributed import ReduceOp

from torchft_lite.checkpointing.transport import CheckpointTransport
from torchft_lite.core.settings import ManagerSettings
from torchft_lite.core.wiring import ManagerParts
from torchft_lite.errors import CheckpointTimeout, CollectiveError, ConfigError, QuorumTimeout
from torchft_lite.group_server.manager_client import HANDOFF, seconds_of
from torchft_lite.group_server.quorum_compute import QuorumMember, QuorumResult, compute_quorum_result
from torchft_lite.health.fingerprint_vote import FINGERPRINT_KEY, group_fingerprint, parse_fingerprint
from torchft_lite.process_group.handles import make_handle, plan_rendezvous
from torchft_lite.process_group.tracked_work import CompletedWork
from torchft_lite.rpc.loop import ControlPlane
from torchft_lite.rpc.protocol import torchft_pb2 as pb
from torchft_lite.work import ManagedWork

__all__ = ["ConfiguredByHandles", "InMemoryLighthouse", "InMemoryProcessGroup", "InMemoryTransport", "InMemoryWiring"]


class InMemoryTransport(CheckpointTransport):
    """Checkpoints pass by reference through a dict shared by the transports of one lighthouse.

    As ``HTTPTransport`` does, a source that stops serving first waits (at
    most the send's timeout) for the receivers it was told of.
    """

    def __init__(self, shelf: dict, name: str, condition: threading.Condition) -> None:
        self.shelf, self.name, self._published = shelf, name, condition
        self.sends: list[tuple[list[int], int]] = []
        self.receives: list[tuple[int, int]] = []
        """(source rank, step) of every receive, for tests."""

    def metadata(self) -> str:
        return self.name

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        with self._published:
            self.sends.append((list(dst_ranks), step))
            # state, receivers still expected, how long to wait for them
            self.shelf[(self.name, step)] = [state_dict, len(dst_ranks), timeout.total_seconds()]
            self._published.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._published:
            for key in [key for key in self.shelf if key[0] == self.name]:
                entry = self.shelf[key]
                self._published.wait_for(lambda: entry[1] <= 0, entry[2])
                del self.shelf[key]

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self.receives.append((src_rank, step))
        with self._published:
            if not self._published.wait_for(lambda: (metadata, step) in self.shelf, timeout.total_seconds()):
                raise CheckpointTimeout(f"{metadata} did not publish step {step} within {timeout.total_seconds()}s")
            entry = self.shelf[(metadata, step)]
            entry[1] -= 1
            self._published.notify_all()
            return entry[0]

    def shutdown(self, wait: bool = True) -> None:
        with self._published:
            for key in [key for key in self.shelf if key[0] == self.name]:
                del self.shelf[key]


class ConfiguredByHandles:
    """torchft's handle API (``get_reconfigure_handle``, ``reconfigure``) for a fake process group that implements
    only ``configure(store_addr, replica_id, rank, world_size)``, as the Manager needs it.

    A handle names a store that does not exist (``in-memory-<id>:0``): the fake never dials it, and it keeps the
    store addresses of fakes of different tests apart.
    """

    supports_reconfigure = True

    def get_reconfigure_handle(self) -> str:
        handle_id = self.__dict__.setdefault("_fake_handle_id", uuid.uuid4().hex)
        return make_handle(handle_id, f"in-memory-{handle_id}", 0, None)

    def reconfigure(self, opts: Any) -> Any:
        self.get_reconfigure_handle()
        plan = plan_rendezvous(opts, self.__dict__["_fake_handle_id"])
        self.configure(plan.store_addr, self.__dict__["_fake_handle_id"], plan.rank, plan.world_size)
        return CompletedWork()


@dataclass
class _World:
    """The replicas that configured one store prefix, and their collectives in order."""

    size: int
    ops: dict[int, dict[int, Any]] = field(default_factory=dict)  # op number -> rank -> (tensor, future, op)
    aborted: str | None = None


class InMemoryProcessGroup(ConfiguredByHandles):
    """Allreduce across the in-memory replicas of the same quorum (sum, avg, min, max, product).

    ``fail_next`` makes the next allreduce fail; ``abort()`` fails what is in flight.
    """

    _worlds: dict[str, _World] = {}
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.fail_next = False
        self.aborts = 0
        self.configures: list[tuple[str, int, int]] = []
        self._world: _World | None = None
        self._rank = 0
        self._ops = itertools.count()

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        with self._lock:  # one world per communicator: the first member's store and the quorum id
            self._world = self._worlds.setdefault(store_addr, _World(world_size))
        self._rank, self._ops = rank, itertools.count()
        self.configures.append((store_addr, rank, world_size))

    def size(self) -> int:
        return self._world.size if self._world is not None else 0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        fut: torch.futures.Future = torch.futures.Future()
        op = getattr(opts, "reduceOp", ReduceOp.SUM)
        world, op = self._world, getattr(op, "op", op)  # a ReduceOp holds its RedOpType in .op
        if world is None:
            raise CollectiveError("allreduce before configure()")
        if self.fail_next:
            self.fail_next = False
            fut.set_exception(CollectiveError("injected allreduce failure"))
            return ManagedWork(fut)
        with self._lock:
            if world.aborted is not None:
                fut.set_exception(CollectiveError(f"aborted: {world.aborted}"))
                return ManagedWork(fut)
            number = next(self._ops)
            entries = world.ops.setdefault(number, {})
            entries[self._rank] = (tensors, fut, op)
            if len(entries) < world.size:
                return ManagedWork(fut)
            done = list(world.ops.pop(number).values())  # complete: hold no tensors past it
        _reduce(done)
        return ManagedWork(fut)

    def abort(self) -> None:
        self.aborts += 1
        with self._lock:
            world = self._world
            if world is None:
                return
            world.aborted = "aborted by a replica"
            pending = [fut for entries in world.ops.values() for _, fut, _ in entries.values() if not fut.done()]
        for fut in pending:
            fut.set_exception(CollectiveError("the collective was aborted"))

    def errored(self) -> None:
        return None


def _reduce(entries: list[Any]) -> None:
    op = entries[0][2]
    for i in range(len(entries[0][0])):
        stacked = torch.stack([tensors[i] for tensors, _, _ in entries])
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            result = stacked.sum(0) / (len(entries) if op == ReduceOp.AVG else 1)
        elif op == ReduceOp.MAX:
            result = stacked.max(0).values
        elif op == ReduceOp.MIN:
            result = stacked.min(0).values
        else:
            result = stacked.prod(0)
        for tensors, _, _ in entries:
            tensors[i].copy_(result)
    for tensors, fut, _ in entries:
        fut.set_result(tensors)


_LIGHTHOUSES = itertools.count()


class InMemoryLighthouse:
    """Forms quorums for the Managers of this process; see the module docstring."""

    def __init__(self, min_replicas: int = 1, clock: Callable[[], float] | None = None) -> None:
        """``clock``: seconds for the durations Managers report (default ``time.monotonic``)."""
        self.min_replicas = min_replicas
        self.clock = clock
        self.shelf: dict = {}
        self.published = threading.Condition()
        self._clients: dict[str, _Client] = {}  # live replicas
        self._asks: dict[str, QuorumMember] = {}
        self._waiting: dict[str, asyncio.Future] = {}
        self._last: tuple[str, ...] = ()
        self._quorum_id = 0
        self._ids = itertools.count()
        self.store_address = f"in-memory/{next(_LIGHTHOUSES)}"  # what members advertise as their TCPStore

    def wiring(self) -> "InMemoryWiring":
        return InMemoryWiring(self)

    def manager(self, replica_id: str, pg: Any, **kwargs: Any) -> Any:
        """A ``Manager`` wired to this lighthouse (group rank 0 of a one-rank group)."""
        from torchft_lite.manager import Manager

        settings = dict(rank=0, world_size=1, store_addr="in-memory", store_port=1, lighthouse_addr="in-memory",
                        hostname="in-memory", preemption_signals=())
        settings.update(kwargs)
        return Manager(pg=pg, replica_id=replica_id, wiring=self.wiring(), **settings)

    def kill(self, replica_id: str) -> None:
        """The replica's lease ends: it leaves, and the others hear it is gone."""
        self._control().run(self._leave(replica_id, "killed"), 10.0, f"{replica_id} to leave")

    @staticmethod
    def _control() -> ControlPlane:
        from torchft_lite.rpc.loop import control_plane

        return control_plane()

    # ------------------------------------------------------------ on the control-plane loop

    async def _join(self, client: "_Client") -> None:
        self._clients[client.replica_id] = client

    async def _leave(self, replica_id: str, why: str) -> None:
        client = self._clients.pop(replica_id, None)
        self._asks.pop(replica_id, None)
        waiter = self._waiting.pop(replica_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(QuorumTimeout(f"{replica_id} left while waiting for a quorum"))
        if client is not None:
            event = pb.LeaseEvent(kind=pb.LeaseEvent.MEMBER_GONE, replica_id=replica_id, quorum_id=self._quorum_id,
                                  reason=why)
            for other in self._clients.values():
                for listener in other.listeners:
                    listener(event)
        self._maybe_form()

    async def _ask(self, replica_id: str, member: QuorumMember, timeout: float) -> Any:
        self._asks[replica_id] = member
        waiter = self._waiting[replica_id] = asyncio.get_running_loop().create_future()
        self._maybe_form()
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            self._asks.pop(replica_id, None)
            raise QuorumTimeout(f"in-memory lighthouse: no quorum for {replica_id} within {timeout:.2f}s "
                                f"(status: Cancelled, message: Timeout expired)") from None

    def _maybe_form(self) -> None:
        if len(self._asks) < self.min_replicas or set(self._asks) != set(self._clients):
            return
        members = [self._asks[replica_id] for replica_id in sorted(self._asks)]
        ids = tuple(m.replica_id for m in members)
        if ids != self._last or any(m.commit_failures for m in members):
            self._quorum_id += 1
            self._last = ids
        asks, self._asks = self._asks, {}
        for replica_id in asks:
            waiter = self._waiting.pop(replica_id)
            if not waiter.done():
                waiter.set_result((self._quorum_id, members))


class _Client:
    """One replica's ``ManagerClient`` to an :class:`InMemoryLighthouse` (torchft's calls, for a group of one rank)."""

    def __init__(self, lighthouse: InMemoryLighthouse, replica_id: str, control: ControlPlane) -> None:
        self.lighthouse, self.replica_id, self._control = lighthouse, replica_id, control
        self.address = f"in-memory://{replica_id}"
        self.listeners: list[Callable[[pb.LeaseEvent], None]] = []
        self.metadata = ""
        self.advertised: dict[str, Any] = {}
        self.data = ""  # ``advertised`` as the last quorum request carried it
        self.watchers: list[Callable[[list[tuple[str, int, str]]], None]] = []

    def advertise(self, key: str, value: Any) -> None:
        """What the group would send in ``QuorumMember.data`` (kept for tests to read)."""
        if value is None:
            self.advertised.pop(key, None)
        else:
            self.advertised[key] = value

    def _quorum(self, group_rank: int, step: int, checkpoint_metadata: str, shrink_only: bool, timeout: timedelta,
                commit_failures: int, reconfigure_handle: str, init_sync: bool = True, *,
                state_fingerprint: str = "") -> QuorumResult:
        seconds = seconds_of(timeout, "timeout")
        return self._control.run(
            self._ask(group_rank, step, checkpoint_metadata, seconds, commit_failures, init_sync, state_fingerprint,
                      reconfigure_handle),
            seconds + HANDOFF, f"a quorum for {self.replica_id} from the in-memory lighthouse")

    async def _ask(self, group_rank: int, step: int, checkpoint_metadata: str, timeout: float, commit_failures: int,
                   init_sync: bool, state_fingerprint: str, reconfigure_handle: str) -> QuorumResult:
        self.metadata = checkpoint_metadata
        fingerprint = group_fingerprint(step, [state_fingerprint])  # a group of one rank
        data = self.advertised if fingerprint is None else {**self.advertised, FINGERPRINT_KEY: fingerprint}
        self.data = json.dumps(data, sort_keys=True) if data else ""
        member = QuorumMember(self.replica_id, self.address, self.lighthouse.store_address, step, 1,
                              commit_failures, fingerprint=parse_fingerprint(self.data),
                              reconfigure_handles=(reconfigure_handle,) if reconfigure_handle else ())
        quorum_id, members = await self.lighthouse._ask(self.replica_id, member, timeout)
        clients = self.lighthouse._clients
        for watch in self.watchers:
            watch([(m.replica_id, m.step, clients[m.replica_id].data if m.replica_id in clients else "")
                   for m in members])
        return compute_quorum_result(quorum_id, members, self.replica_id, group_rank, init_sync=init_sync)

    def watch_quorums(self, watch: Callable[[list[tuple[str, int, str]]], None]) -> None:
        self.watchers.append(watch)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        return should_commit  # a group of one rank votes alone

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        return self.metadata

    def follow_events(self, listener: Callable[[pb.LeaseEvent], None]) -> None:
        self.listeners.append(listener)

    def close(self) -> None:
        self._control.run(self.lighthouse._leave(self.replica_id, "shut down"), 10.0, f"{self.replica_id} to leave")


class _Peer:
    """A ``ManagerClient`` to another replica of an :class:`InMemoryLighthouse`, found by its address."""

    def __init__(self, lighthouse: InMemoryLighthouse, address: str) -> None:
        self.lighthouse, self.address = lighthouse, address

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:
        for client in list(self.lighthouse._clients.values()):
            if client.address == self.address:
                return client.metadata
        raise CheckpointTimeout(f"no live replica at {self.address}")

    def close(self) -> None:
        pass


class InMemoryWiring:
    """Builds a Manager's parts on an :class:`InMemoryLighthouse` (one-rank groups)."""

    def __init__(self, lighthouse: InMemoryLighthouse) -> None:
        self.lighthouse = lighthouse

    def build(self, settings: ManagerSettings, transport: Any, in_place_targets: Callable[[], Any],
              control: ControlPlane, connect: Any = None) -> ManagerParts:
        """``connect`` (the Manager's ``ManagerClient``) is not used: replicas reach one another in memory."""
        if settings.group_world_size != 1:
            raise ConfigError(f"the in-memory lighthouse runs one-rank groups, got world_size={settings.group_world_size}")
        lighthouse = self.lighthouse
        replica_id = f"{settings.replica_id}:{next(lighthouse._ids)}"
        client = _Client(lighthouse, replica_id, control)
        control.run(lighthouse._join(client), 10.0, f"{replica_id} to join the in-memory lighthouse")
        if transport is None:
            transport = InMemoryTransport(lighthouse.shelf, replica_id, lighthouse.published)
        parts = ManagerParts(client=client, connect=lambda address: _Peer(lighthouse, address), replica_id=replica_id,
                             transport=transport, heal_in_place=False)
        if lighthouse.clock is not None:
            parts.clock = lighthouse.clock
        return parts
