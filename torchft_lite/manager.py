"""The Manager: per-step fault tolerance inside every training process.

Per step (see DESIGN.md): ``start_quorum`` (from ``Optimizer.zero_grad``) asks
the group's ManagerServer for a quorum on the control-plane loop while the
forward pass runs; on a new quorum id the process group is reconfigured on a
store prefix unique to (quorum id, group rank); a replica behind the max step
receives the state dict from its assigned peer; ``allreduce`` averages
gradients over the participants; ``should_commit`` (from ``Optimizer.step``)
applies a received state dict on the training thread, collects the group's
votes, and advances the step only on commit.

Failures never raise into the training loop: the first error of a step is
recorded (:meth:`Manager.report_error`), logged once, and the step is not
committed. Only exceeding ``max_retries`` consecutive failed commits raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import threading
import time
import uuid
from datetime import timedelta
from enum import Enum
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch.distributed import ReduceOp, TCPStore
from torch.distributed.distributed_c10d import AllreduceOptions

from lighthouse.protocol import torchft_pb2 as pb
from torchft_lite import _heal
from torchft_lite._control_plane import control_plane
from torchft_lite._manager_client import ManagerClient  # sets GRPC_ENABLE_FORK_SUPPORT before grpc loads

import grpc  # noqa: E402  (after the line above)
from torchft_lite._manager_settings import ManagerSettings
from torchft_lite.errors import (
    CheckpointError, CollectiveError, ManagerError, ManagerTimeout, QuorumError, QuorumTimeout, TorchFTError,
)
from torchft_lite.watchdog import EXIT_CODE_PREEMPTED, Watchdog, WatchdogConfig
from torchft_lite.manager_server import ManagerServer, ManagerServerConfig
from torchft_lite.work import DoneWork, ManagedWork, guard_future

__all__ = ["Manager", "WorldSizeMode"]

T = TypeVar("T")
logger = logging.getLogger(__name__)
MANAGER_ADDR_KEY = "manager_addr"
REPLICA_ID_KEY = "replica_id"
# A member that committed the step and exited can be reported gone while our end of
# the last collective is still completing (a busy CPU): give it this long to finish.
MEMBER_GONE_GRACE = 0.25


class WorldSizeMode(Enum):
    """How many replicas take part in a step.

    DYNAMIC: every up-to-date replica participates; gradients are averaged over them.
    FIXED_WITH_SPARES: exactly ``min_replica_size`` participate; spares contribute zeros.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


class Manager:
    """Fault-tolerance manager for one rank of one replica group (torchft's API)."""

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[T], None] | None,
        state_dict: Callable[[], T] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str | None = None,
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: Any = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
        *,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        on_preemption: Callable[[], None] | None = None,
        watchdog: WatchdogConfig | None = None,
        heal_sources: int | None = None,
        heal_in_place: bool | None = None,
    ) -> None:
        """torchft's arguments, plus (keyword-only, ours):

        preemption_signals, on_preemption: see "Preemption" in the README.
        watchdog: per-section step timeouts (default: from the environment).
        heal_sources: up-to-date peers a heal may pull disjoint parts from at once
            (default 1, torchft's single source, or ``$TORCHFT_LITE_HEAL_SOURCES``).
            Used only when every quorum member advertises at least as many and the
            checkpoint transport stripes (``recv_checkpoint_striped`` of its own).
        heal_in_place: the default ``HTTPTransport`` receives a heal straight into
            the matching live tensors (default True, or ``$TORCHFT_LITE_HEAL_IN_PLACE``);
            see :meth:`_in_place_targets` for why that is safe.
        """
        # Everything is validated before anything starts.
        s = self._settings = ManagerSettings.resolve(
            min_replica_size=min_replica_size, timeout=timeout, quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout, rank=rank, world_size=world_size, store_addr=store_addr,
            store_port=store_port, lighthouse_addr=lighthouse_addr, replica_id=replica_id, port=port,
            hostname=hostname, heartbeat_interval=heartbeat_interval, max_retries=max_retries,
            quorum_retries=quorum_retries, heal_sources=heal_sources, heal_in_place=heal_in_place,
        )
        self._pg = pg
        self._on_preemption = on_preemption
        self._leave_signal: int | None = None
        self._in_step = False
        self._quorum_members: frozenset[str] = frozenset()
        self._gone_this_step: dict[str, str] = {}  # replica id -> why, every member-gone event since start_quorum
        self._closed = False
        self._events_future: concurrent.futures.Future | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._min_replica_size = s.min_replica_size
        self._use_async_quorum = use_async_quorum
        self._world_size_mode = world_size_mode
        self._init_sync = init_sync
        self._group_rank = s.group_rank
        self._timeout = s.timeout
        self._quorum_timeout = s.quorum_timeout
        self._load_state_dict_fns: dict[str, Callable[[Any], None]] = {}
        self._user_state_dict_fns: dict[str, Callable[[], Any]] = {}
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._quorum_id = -1
        self._errored: BaseException | None = None
        self._healing = False
        self._pending_state_dict: dict[str, Any] | None = None
        self._pending_send: tuple[list[int], int] | None = None
        self._published = False
        self._served_before: int | None = None  # the transport's bytes_served when we published
        self._pending_work: list[ManagedWork] = []
        self._quorum_future = None  # the whole quorum step, heal included (should_commit waits for it)
        self._ready_future: concurrent.futures.Future | None = None  # quorum + process group (allreduce waits)
        self._participating_rank: int | None = None
        self._participating_world_size = 0
        self._training_thread: int | None = None
        self._heal_stats: tuple[float, int, list[int]] | None = None  # seconds, bytes, source replica ranks
        self._pre_heal_state: dict[str, int] | None = None
        # The registered state may mix two steps: an in-place receive or a load
        # failed part-way. Cleared only by a heal applied in full.
        self._state_torn = False
        self._torn_at_max_step = False  # ... and this quorum makes it up to date: fail stop
        self._collectives_ready = False  # the process group is configured for this step's quorum

        self._control = control_plane()
        self._server: ManagerServer | None = None
        self._heal_in_place = checkpoint_transport is None and s.heal_in_place
        if checkpoint_transport is None:
            from torchft_lite.checkpointing import HTTPTransport

            checkpoint_transport = HTTPTransport(
                timeout=timedelta(seconds=s.timeout), num_chunks=0, hostname=s.hostname,
                state_dict=self._in_place_targets if self._heal_in_place else None,
            )
        self._checkpoint_transport = checkpoint_transport
        # Advertised to the quorum: a source waits for every receiver it is told
        # of, so a group must not offer to stripe unless its transport does.
        advertised_sources = s.heal_sources if _heal.stripes(checkpoint_transport) else 1
        if advertised_sources < s.heal_sources:
            logger.warning("heal_sources=%d, but the checkpoint transport %s does not stripe: healing from one source",
                           s.heal_sources, type(checkpoint_transport).__name__)

        self._store = TCPStore(
            s.store_host, s.store_port, is_master=False, wait_for_workers=False,
            timeout=timedelta(seconds=s.connect_timeout),
        )
        prefix = f"torchft_lite/{s.restart_count}/"
        if s.group_rank == 0:
            suffix = uuid.uuid4().hex[:12]
            incarnation_id = f"{s.replica_id}:{suffix}" if s.replica_id else suffix
            self._server = ManagerServer(ManagerServerConfig(
                replica_id=incarnation_id, lighthouse_addr=s.lighthouse_addr or "", hostname=s.hostname,
                store_address=s.store_address, world_size=s.group_world_size, bind=f"[::]:{s.port}",
                heartbeat_interval=s.heartbeat_interval, connect_timeout=s.connect_timeout,
                quorum_timeout=s.quorum_timeout, quorum_retries=s.quorum_retries, heal_sources=advertised_sources,
            ))
            self._control.run(self._server.start(), s.connect_timeout, "the ManagerServer to start")
            self._store.set(prefix + MANAGER_ADDR_KEY, self._server.address())
            self._store.set(prefix + REPLICA_ID_KEY, incarnation_id)
        try:
            manager_addr = self._store.get(prefix + MANAGER_ADDR_KEY).decode()
            self._replica_id = self._store.get(prefix + REPLICA_ID_KEY).decode()
        except RuntimeError as exc:  # the store's own timeout (DistStoreError)
            raise TorchFTError(
                f"group rank {s.group_rank}: group rank 0 did not publish its ManagerServer address in the "
                f"TCPStore at {s.store_address} within {s.connect_timeout:.0f}s"
            ) from exc
        self._client = ManagerClient(manager_addr)
        defaults = WatchdogConfig(quorum=s.quorum_timeout + s.timeout + 60.0, heal=3 * s.timeout + 60.0,
                                  step=s.quorum_timeout + 5 * s.timeout + 300.0)
        self.watchdog = Watchdog(watchdog or WatchdogConfig.from_env(os.environ, defaults),
                                 label=f"[{self._replica_id}/{s.group_rank}]")
        if self._server is not None:
            self._server.add_event_listener(self._on_lighthouse_event)
        else:
            self._events_future = self._control.submit(self._follow_events())
        self._install_signal_handlers(preemption_signals)
        # A process group that keeps its communicator in a child process starts that child now; join the
        # first quorum once it can configure, not with a rendezvous that waits for an interpreter to start.
        wait_warm = getattr(pg, "wait_warm", None)
        if wait_warm is not None:
            wait_warm(timedelta(seconds=s.connect_timeout))
        self._log(logging.INFO, "manager ready (group rank %d of %d, ManagerServer %s)",
                  s.group_rank, s.group_world_size, manager_addr)

    # ------------------------------------------------------------ state dicts

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]) -> None:
        """Add a piece of user state that heals carry (e.g. "model", "optim")."""
        if key in self._user_state_dict_fns:
            raise ValueError(f"state dict fn {key!r} is already registered")
        self._load_state_dict_fns[key] = load_state_dict
        self._user_state_dict_fns[key] = state_dict

    def state_dict(self) -> dict[str, int]:
        """The Manager's own state, for durable checkpoints: step and batches committed."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def _manager_state_dict(self) -> dict[str, Any]:
        return {"user": {key: fn() for key, fn in self._user_state_dict_fns.items()}, "torchft": self.state_dict()}

    def _in_place_targets(self) -> Any:
        """Where a heal may land: the tensors of the state dict a source sends, same paths.

        The default ``HTTPTransport`` calls this on the heal thread when a
        receive starts and writes each received tensor whose path, dtype and
        shape match straight into the live one. Safe, because:

        * Only a replica behind the max step heals, and the training thread
          only reads the parameters between ``start_quorum`` and
          ``should_commit`` (forward, backward); the optimizer, which writes
          them, steps after ``should_commit``, which first waits for the heal.
          Optimizer state is likewise untouched until then.
        * While healing, ``is_participating()`` is False: its gradients from
          half-received weights are zeroed before the allreduce, and it steps
          with the peers' average, as an allocating heal would.
        * The received state is applied on the training thread in
          ``should_commit``, before the vote (``load`` copies each tensor onto
          itself).
        * The tensors returned are ``.data`` aliases: they share the storage
          but not autograd's version counter, so a ``copy_`` into them (GPU or
          non-contiguous targets) cannot fail the backward pass already
          recorded on the training thread with "modified by an inplace
          operation".
        * A receive that fails part-way leaves the tensors torn. The step does
          not commit (the error is recorded) and the replica stays at its old
          step, so the next quorum heals it again; ``_state_torn`` makes it
          fail stop rather than train on or serve that state should a quorum
          make it up to date (no peer ahead of it left).

        Not covered: state the training thread itself writes during the step,
        such as BatchNorm running statistics in a train-mode forward. A write
        racing the receive can fail the heal's checksum (retried at the next
        quorum) or blend one local batch into those statistics, which replicas
        already keep apart (they are never averaged). ``heal_in_place=False``
        receives into fresh tensors instead.

        The user's ``state_dict`` functions run on the heal thread here, as
        they do on torchft's quorum thread; if they fail, this heal allocates.
        """
        try:
            return _heal.alias_tensors(self._manager_state_dict())
        except Exception as exc:
            self._log(logging.WARNING, "receiving this heal into fresh tensors: the state dict functions failed: "
                      "%s: %s", type(exc).__name__, exc)
            return {}

    # ------------------------------------------------------------ quorum

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None) -> None:
        """Begin this step's quorum in the background (``wait_quorum`` waits for it)."""
        self._maybe_leave()
        if self._quorum_future is not None:
            self._await(self._quorum_future, "the previous quorum")
        if self._published:  # should_commit was skipped: stop serving before the state changes
            self._checkpoint_transport.disallow_checkpoint()
        self._errored = None
        self._healing = False
        self._pending_state_dict = None
        self._pending_send = None
        self._published = False
        self._pending_work = []
        self._heal_stats = None
        self._pre_heal_state = None
        self._torn_at_max_step = False
        self._gone_this_step = {}
        self._quorum_members = frozenset()  # this step's quorum is not known yet
        self._collectives_ready = False
        self._training_thread = threading.get_ident()
        self._in_step = True
        self.watchdog.begin("step", f"step {self._step} (start_quorum to the end of should_commit)")
        self.watchdog.begin("quorum", f"the quorum for step {self._step}")
        quorum_timeout = timeout.total_seconds() if timeout is not None else self._quorum_timeout
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._ready_future = ready
        self._quorum_future = self._control.submit(self._async_quorum(allow_heal, shrink_only, quorum_timeout, ready))
        if not self._use_async_quorum:
            self._raise_quorum_failure()
            self.wait_quorum()
            # torchft: a synchronous quorum returns with the heal applied (the
            # forward pass then never overlaps the receive), and the healed
            # replica takes part in this step's collectives.
            self._await(self._quorum_future, "the quorum and heal")
            if self._healing:
                self._healing = not self._apply_pending_state_dict()

    def _raise_quorum_failure(self) -> None:
        """Synchronous quorum: a failed or timed-out Quorum call raises, as torchft's does.

        Only the quorum itself: a failed reconfigure or heal is recorded and the
        step does not commit, as with an asynchronous quorum.
        """
        limit = self._quorum_timeout + 3 * self._timeout + 20.0
        try:
            self._ready_future.result(timeout=limit)
        except QuorumError as exc:
            self.report_error(exc)
            self._in_step = False
            self.watchdog.end("quorum")
            self.watchdog.end("step")
            raise
        except Exception:
            pass  # recorded by wait_quorum

    def wait_quorum(self) -> None:
        """Wait until this step's quorum is known and the process group is ready.

        A heal may still be in flight (``should_commit`` waits for it), so a
        healing replica can take part in the step's collectives meanwhile.
        Errors are recorded, not raised.
        """
        if self._ready_future is None:
            raise RuntimeError("wait_quorum() called before start_quorum()")
        self._await(self._ready_future, "the quorum")
        self.watchdog.end("quorum")

    def _await(self, future: concurrent.futures.Future, what: str) -> None:
        # The coroutine bounds each of its own waits; this is the backstop.
        limit = self._quorum_timeout + 3 * self._timeout + 20.0
        try:
            future.result(timeout=limit)
        except Exception as exc:
            if not future.done():  # our backstop fired, not an error from the quorum itself
                self._quorum_future.cancel()
                exc = QuorumTimeout(f"{what} did not finish within {limit:.0f}s")
            self.report_error(exc)

    async def _async_quorum(self, allow_heal: bool, shrink_only: bool, quorum_timeout: float,
                            ready: concurrent.futures.Future) -> None:
        try:
            await self._quorum_and_heal(allow_heal, shrink_only, quorum_timeout, ready)
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise
        finally:
            if not ready.done():
                ready.set_result(None)

    async def _quorum_and_heal(self, allow_heal: bool, shrink_only: bool, quorum_timeout: float,
                               ready: concurrent.futures.Future) -> None:
        request = dict(group_rank=self._group_rank, step=self._step,
                       checkpoint_metadata=self._checkpoint_transport.metadata(), shrink_only=shrink_only,
                       init_sync=self._init_sync, commit_failures=self._commit_failures)
        if self._server is not None:  # group rank 0: the ManagerServer is in this process
            response = await self._server.local_quorum(pb.ManagerQuorumRequest(**request), quorum_timeout)
        else:
            response = await self._client.quorum(**request, timeout=quorum_timeout)
        if self._use_async_quorum or not allow_heal:
            # A replica behind the max step heals during the step: only those at it take part.
            rank = response.max_replica_rank if response.HasField("max_replica_rank") else None
            size = response.max_world_size
        else:
            # torchft: a synchronous quorum applies the heal before the forward pass, so every member takes part.
            rank, size = response.replica_rank, response.replica_world_size
        if self._world_size_mode is WorldSizeMode.FIXED_WITH_SPARES:
            rank = rank if rank is not None and rank < self._min_replica_size else None
            size = min(size, self._min_replica_size)
        self._participating_rank, self._participating_world_size = rank, size

        # From here, member-gone events (earlier ones too) count only for replicas of this quorum: one the
        # lighthouse already left out (the usual case) must not fail a step it has no part in.
        self._quorum_members = frozenset(response.replica_ids)
        if response.quorum_id != self._quorum_id:
            store = f"{response.store_address}/torchft/{response.quorum_id}/{self._group_rank}"
            # Set first: a store prefix is never rendezvoused on twice, even if this
            # configure fails (the failed commit then brings a new quorum id).
            self._quorum_id = response.quorum_id
            started = time.monotonic()
            await asyncio.to_thread(
                self._pg.configure, store, self._replica_id, response.replica_rank, response.replica_world_size
            )
            self._log(logging.INFO, "quorum %d: reconfigured as replica %d of %d (%d up to date, max step %d) in %.2fs",
                      response.quorum_id, response.replica_rank, response.replica_world_size,
                      response.max_world_size, response.max_step, time.monotonic() - started)
        self._collectives_ready = True
        if self._state_torn and not (allow_heal and response.heal):
            self._torn_at_max_step = True
            raise CheckpointError(
                f"this rank's state was left partly overwritten by a failed heal and quorum {response.quorum_id} does "
                f"not heal it (no peer ahead of step {response.max_step}, or allow_heal=False): it must not train on "
                f"or serve that state"
            )
        if allow_heal:
            # Both before collectives may start: a healing replica contributes
            # zeros, and a source may publish from its first allreduce.
            self._healing = response.heal
            if response.recover_dst_replica_ranks:
                self._pending_send = (list(response.recover_dst_replica_ranks), response.max_step)
        ready.set_result(None)

        if allow_heal and response.heal:
            await self._heal(response)

    async def _heal(self, response: pb.ManagerQuorumResponse) -> None:
        """Receive the state dict of the max step from this rank's source(s); leaves it pending."""
        sources = list(zip(response.recover_src_replica_ranks, response.recover_src_manager_addresses))
        if not sources:  # a ManagerServer that predates striping: its single source
            sources = [(response.recover_src_replica_rank, response.recover_src_manager_address)]
        self.watchdog.begin("heal", f"the state dict of step {response.max_step} from "
                                    f"{', '.join(address for _, address in sources)}")
        self._log(logging.INFO, "healing from %s to step %d", _heal.describe(sources), response.max_step)
        answered = await _heal.checkpoint_metadata_of(sources, self._group_rank, self._timeout,
                                                      warn=lambda msg, *args: self._log(logging.WARNING, msg, *args))
        if self._heal_in_place:
            self._state_torn = True  # bytes may land in the live tensors from here on
        result = await _heal.receive(self._checkpoint_transport, answered, response.max_step,
                                     timedelta(seconds=self._timeout))
        self._heal_stats = (result.seconds, result.tensor_bytes, result.sources)
        self._pending_state_dict = result.state

    def _apply_pending_state_dict(self) -> bool:
        """Load a received state dict; runs on the training thread only. True when it was loaded in full."""
        state, self._pending_state_dict = self._pending_state_dict, None
        if state is None:
            return False  # the heal failed; the error is recorded and the step won't commit
        self._pre_heal_state = self.state_dict()
        try:
            user = state["user"]
            missing = set(self._load_state_dict_fns) - set(user)
            if missing:
                raise CheckpointError(f"received checkpoint lacks registered state {sorted(missing)}")
            self._state_torn = True  # until every piece is loaded
            for key, load in self._load_state_dict_fns.items():
                load(user[key])
            self.load_state_dict(state["torchft"])
            self._state_torn = False
        except Exception as exc:
            self.report_error(exc)
            return False
        seconds, nbytes, sources = self._heal_stats or (0.0, 0, [])
        self.watchdog.end("heal")
        self._log(logging.INFO, "healed: %.3f MB in %.2fs (%.1f MB/s) from replica(s) %s", nbytes / 1e6, seconds,
                  nbytes / 1e6 / seconds if seconds > 0 else 0.0, ", ".join(map(str, sources)))
        return True

    def _maybe_publish_checkpoint(self) -> None:
        """Serve our state to the replicas healing from us; training thread only."""
        if self._pending_send is None or self._published:
            return
        if threading.get_ident() != self._training_thread:
            return
        self._published = True
        dst_ranks, step = self._pending_send
        self._served_before = _heal.bytes_served(self._checkpoint_transport)
        try:
            if step != self._step:
                raise CheckpointError(f"asked to serve step {step} but this replica is at step {self._step}")
            self._checkpoint_transport.send_checkpoint(
                dst_ranks, step, self._manager_state_dict(), timedelta(seconds=self._timeout)
            )
        except Exception as exc:
            self.report_error(exc)

    # ------------------------------------------------------------ collectives

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: ReduceOp = ReduceOp.AVG) -> ManagedWork:
        """Allreduce ``tensor`` across replica groups in place (AVG over participants).

        Never raises: on error the step is marked failed and the returned work
        resolves with ``tensor`` as it is.
        """
        self.wait_quorum()
        self._maybe_publish_checkpoint()
        if not self._collectives_ready:
            # No process group for this quorum: peers can't be in step with us.
            return DoneWork(tensor)
        participants = self.num_participants()
        gone = self._member_gone()
        if gone is not None:  # its contribution will never come: don't wait for it
            self.report_error(CollectiveError(gone))
            return DoneWork(tensor)
        if self._errored is not None and self._participating_rank is not None:
            # The peers count us in the average, and our contribution would be
            # wrong (zeros would mis-scale it): fail the peers' collective now
            # rather than at its timeout.
            abort = getattr(self._pg, "abort", None)
            if abort is not None:
                abort()
            return DoneWork(tensor)
        if not self.is_participating():
            tensor.zero_()  # healing or a spare: take part with zeros so the peers' collective completes
        average = reduce_op == ReduceOp.AVG
        try:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM if average else reduce_op
            fut = self._pg.allreduce([tensor], opts).get_future()
            if average:
                def divide(f: torch.futures.Future) -> torch.Tensor:
                    f.value()  # re-raises a failed collective
                    return tensor.div_(participants)

                fut = fut.then(divide)
            else:
                fut = fut.then(lambda f: (f.value(), tensor)[1])
        except Exception as exc:
            self.report_error(exc)
            return DoneWork(tensor)
        return ManagedWork(self.wrap_future(fut, tensor))

    def wrap_future(self, fut: torch.futures.Future, default: T, timeout: timedelta | None = None) -> torch.futures.Future:
        """``fut``, except that an error or timeout is recorded and yields ``default``."""
        seconds = timeout.total_seconds() if timeout is not None else self._timeout
        guarded = guard_future(fut, default, self.report_error, seconds, "a collective",
                               schedule_timeout=self._schedule_timeout)
        self._pending_work.append(ManagedWork(guarded))
        gone = self._member_gone()
        if gone is not None and not guarded.done():  # the event came while this one started
            self._abort_collectives(CollectiveError(gone))
        return guarded

    # ------------------------------------------------------------ failures pushed by the lighthouse

    async def _follow_events(self) -> None:
        """Group ranks > 0: the lighthouse's events, relayed by the group's ManagerServer."""
        backoff = 0.1
        while True:
            call = self._client.events(self._group_rank)
            try:
                async for event in call:
                    backoff = 0.1
                    self._on_lighthouse_event(event)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return
            finally:
                call.cancel()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _on_lighthouse_event(self, event: pb.LeaseEvent) -> None:
        """A quorum member is gone: abort this step's collectives now instead of at their timeout.

        Runs on the control-plane loop. Collectives still in flight
        ``MEMBER_GONE_GRACE`` seconds later are aborted and the step is not
        committed (the error is recorded); the next quorum, formed without the
        member, reconfigures. When every collective of the step finishes, the
        member contributed to all of them and the step may commit (a member
        that committed its last step and left must not fail ours); a
        collective started after the event fails at once. An event that comes
        before this step's quorum is known counts only if that quorum has the
        member (usually the lighthouse has already left it out).
        """
        if event.kind != pb.LeaseEvent.MEMBER_GONE or not self._in_step or event.replica_id == self._replica_id:
            return
        why = f"replica {event.replica_id} left the quorum: {event.reason}"
        self._gone_this_step[event.replica_id] = why  # judged against this step's quorum once it is known
        if event.replica_id not in self._quorum_members:
            return
        in_flight = [work for work in list(self._pending_work) if not work.is_completed()]
        asyncio.get_running_loop().call_later(MEMBER_GONE_GRACE, self._abort_unfinished, in_flight, event)

    def _member_gone(self) -> str | None:
        """Why a member of this step's quorum left, if one did (an event recorded this step)."""
        members = self._quorum_members
        return next((why for replica_id, why in list(self._gone_this_step.items()) if replica_id in members), None)

    def _abort_unfinished(self, in_flight: list[ManagedWork], event: pb.LeaseEvent) -> None:
        if all(work.is_completed() for work in in_flight):
            self._log(logging.INFO, "%s left the quorum (%s) after this step's collectives finished",
                      event.replica_id, event.reason)
            return
        self._log(logging.INFO, "%s left the quorum (%s): aborting this step's collectives",
                  event.replica_id, event.reason)
        self._abort_collectives(CollectiveError(f"replica {event.replica_id} left the quorum: {event.reason}"))

    def _abort_collectives(self, error: CollectiveError) -> None:
        self.report_error(error)
        abort = getattr(self._pg, "abort", None)
        if abort is not None:
            # Never on this loop: an abort can wait on the process group's lock, and a
            # blocked control plane stops heartbeats, the lease and every timeout (the
            # 200-fault chaos run hung a group this way).
            threading.Thread(target=abort, name="torchft-abort", daemon=True).start()

    # ------------------------------------------------------------ graceful leave

    def _install_signal_handlers(self, signals: Sequence[int]) -> None:
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            self._log(logging.WARNING, "not on the main thread: preemption signals %s are not handled",
                      [signal.Signals(sig).name for sig in signals])
            return
        for sig in signals:
            self._previous_handlers[sig] = signal.signal(sig, self._on_preemption_signal)

    def _on_preemption_signal(self, signum: int, frame: Any) -> None:
        # Only note it here; the training thread leaves at the next safe point.
        if self._leave_signal is None:
            self._leave_signal = signum
            self._log(logging.WARNING, "received %s: leaving after this step", signal.Signals(signum).name)
            future = self._quorum_future
            if future is not None and not future.done():
                # Abandon a quorum still in flight (it may never form without
                # the groups that are leaving too): the step won't commit.
                future.cancel()

    def _maybe_leave(self) -> None:
        """At a safe point (between steps): leave if a preemption signal arrived."""
        if self._leave_signal is None or self._closed:
            return
        name = signal.Signals(self._leave_signal).name
        self._log(logging.WARNING, "leaving on %s at step %d (%d batches committed)", name, self._step,
                  self._batches_committed)
        if self._on_preemption is not None:
            try:
                with self.watchdog.section("checkpoint", "the on_preemption checkpoint callback"):
                    self._on_preemption()
            except Exception:  # still leave: the survivors must not wait for us
                logger.exception("on_preemption callback failed")
        self.shutdown()
        raise SystemExit(EXIT_CODE_PREEMPTED)

    def _schedule_timeout(self, delay: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Run ``fn`` after ``delay`` s on the control-plane loop; returns a thread-safe cancel."""
        loop = self._control.loop
        handle: list[asyncio.TimerHandle] = []
        loop.call_soon_threadsafe(lambda: handle.append(loop.call_later(delay, fn)))
        # FIFO on the loop: the cancel always runs after the timer was armed.
        return lambda: loop.call_soon_threadsafe(lambda: handle and handle[0].cancel())

    def report_error(self, e: BaseException) -> None:
        """Record an error for this step: the step will not be committed."""
        if self._errored is None:
            self._errored = e
            self._log(logging.WARNING, "step failed, will not commit: %s: %s", type(e).__name__, e,
                      exc_info=(type(e), e, e.__traceback__))

    def errored(self) -> BaseException | None:
        return self._errored

    # ------------------------------------------------------------ commit

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Vote with the group's other ranks; True means step the optimizer now.

        Raises ``RuntimeError`` only after more than ``max_retries`` consecutive failed commits.
        """
        if self._quorum_future is None:
            raise RuntimeError("should_commit() called before start_quorum()")
        self._await(self._quorum_future, "the quorum and heal")
        self.watchdog.end("quorum")
        if self._healing:
            self._apply_pending_state_dict()
        self._maybe_publish_checkpoint()
        for work in self._pending_work:
            work.wait()
        self._pending_work = []
        pg_error = self._pg.errored() if hasattr(self._pg, "errored") else None
        if pg_error is not None:
            self.report_error(pg_error)
        # Every rank of the group has the same quorum, so the same ``enough``: the
        # group votes on errors alone, and learns whether every rank of it got
        # through the step cleanly (a heal it keeps even when too few replicas
        # took part to commit).
        enough = self._participating_world_size >= self._min_replica_size
        if not enough:
            self._log(logging.WARNING, "only %d replica(s) participate, min_replica_size is %d",
                      self._participating_world_size, self._min_replica_size)
        seconds = timeout.total_seconds() if timeout is not None else self._timeout
        try:
            # A group of one rank votes alone: no round trip to its own ManagerServer.
            group_clean = self._errored is None if self._settings.group_world_size == 1 else self._control.run(
                self._client.should_commit(group_rank=self._group_rank, step=self._step,
                                           should_commit=self._errored is None, timeout=seconds),
                seconds + 5.0, "the group's commit vote",
            )
        except Exception as exc:
            # The other ranks of the group may have committed; carrying on could
            # leave this rank a step apart from them for good. Fail stop (as
            # torchft does): a restarted group is healed from a peer.
            self._checkpoint_transport.disallow_checkpoint()
            self._in_step = False
            error = ManagerTimeout if isinstance(exc, TimeoutError) else ManagerError
            raise error(f"group rank {self._group_rank}: the commit vote for step {self._step} failed ({exc}); "
                        f"this rank can't know whether its group committed") from exc
        decision = enough and group_clean
        self._checkpoint_transport.disallow_checkpoint()
        if self._published and self._pending_send is not None:
            served = _heal.bytes_served(self._checkpoint_transport)
            if served is not None and self._served_before is not None:
                self._log(logging.INFO, "served step %d to replica(s) %s: %.3f MB", self._pending_send[1],
                          ", ".join(map(str, self._pending_send[0])), (served - self._served_before) / 1e6)
        self._published = False
        if decision:
            self._step += 1
            self._batches_committed += self._participating_world_size
            self._commit_failures = 0
            self._healing = False
        else:
            if self._pre_heal_state is not None and not group_clean:
                # A rank of this group failed (its heal, or anything else this
                # step): the heal is undone with the step, so no rank ends up at
                # another step than the rest (the weights loaded stay; the next
                # quorum heals again over them). A heal that every rank applied
                # in full is kept, as torchft keeps it: the group is then up to
                # date, and a step that only lacked replicas (the healing one
                # did not count) commits at the next quorum.
                self.load_state_dict(self._pre_heal_state)
            self._commit_failures += 1
            self._log(logging.INFO, "step not committed (%d consecutive)", self._commit_failures)
            if self._settings.max_retries is not None and self._commit_failures > self._settings.max_retries:
                raise RuntimeError(f"{self._commit_failures} consecutive steps failed to commit "
                                   f"(max_retries={self._settings.max_retries}); last error: {self._errored!r}")
        self._in_step = False
        self.watchdog.end("step")
        self.watchdog.end("heal")
        if self._torn_at_max_step:
            # Nobody can heal it and its state mixes two steps: stop (the group is
            # restarted from a durable checkpoint, or healed once a peer is ahead).
            raise ManagerError(f"group rank {self._group_rank}: the state left by a failed heal was not repaired "
                               f"at step {self._step}: {self._errored}")
        self._maybe_leave()
        return decision

    # ------------------------------------------------------------ accessors

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        return self._batches_committed

    def participating_rank(self) -> int | None:
        return self._participating_rank

    def num_participants(self) -> int:
        return self._participating_world_size

    def is_participating(self) -> bool:
        return self._participating_rank is not None and not self._healing

    @property
    def replica_id(self) -> str:
        """This incarnation's replica id as the lighthouse knows it."""
        return self._replica_id

    def shutdown(self, wait: bool = True) -> None:
        """Leave: close the lease (the lighthouse drops this group at once), stop serving. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.watchdog.close()
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)  # the process's own handling again
        if self._events_future is not None:
            self._events_future.cancel()
        if self._quorum_future is not None:
            self._quorum_future.cancel()
        try:
            self._checkpoint_transport.shutdown(wait=wait)
        except Exception as exc:  # still stop the server below; the failure is logged
            self._log(logging.WARNING, "checkpoint transport shutdown failed: %s", exc)

        async def close() -> None:
            await self._client.close()
            if self._server is not None:
                await self._server.stop()

        try:
            self._control.run(close(), 10.0, "the ManagerServer to stop")
        except TimeoutError as exc:
            self._log(logging.WARNING, "shutdown incomplete: %s", exc)

    def _log(self, level: int, msg: str, *args: Any, exc_info: Any = None) -> None:
        if logger.isEnabledFor(level):
            replica = getattr(self, "_replica_id", self._settings.replica_id)
            logger.log(level, "[%s/%d step=%d quorum=%d] " + msg, replica, self._group_rank,
                       self._step, self._quorum_id, *args, exc_info=exc_info)
