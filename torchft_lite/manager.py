"""The Manager: per-step fault tolerance inside every training process (torchft's API).

Per step (docs/training.md, "How a step works"): ``start_quorum`` (from ``Optimizer.zero_grad``) asks
the group's ManagerServer for a quorum while the forward pass runs, reconfigures the process group on a
new quorum id (from the members' handles, torchft's ``_reconfigure_pg``) and heals a replica behind the max step; ``allreduce`` averages gradients over the
participants; ``should_commit`` (from ``Optimizer.step``) applies a received state dict, collects the
group's votes, and advances the step only on commit. Failures never raise into the training loop: the
first error of a step is recorded (:meth:`Manager.report_error`), logged once, and the step does not
commit. Only more than ``max_retries`` consecutive failed commits raise.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch.distributed import ReduceOp

from torchft_lite.checkpointing._rwlock import RWLock
from torchft_lite.coordination import ManagerClient
from torchft_lite.core.capabilities import Abortable, ReportsErrors, StepListener, WarmsUp
from torchft_lite.core.context import ManagerContext
from torchft_lite.core.healer import Healer, RegisteredState
from torchft_lite.core.listeners import StepListeners, metrics_from_env
from torchft_lite.core.member_events import MemberWatch
from torchft_lite.core.preemption import PreemptionSignals
from torchft_lite.core.report import report_of
from torchft_lite.core.settings import ManagerSettings
from torchft_lite.core.step import Participation, Step, WorldSizeMode
from torchft_lite.core.step_quorum import StepQuorum
from torchft_lite.core.wiring import MANAGER_ADDR_KEY, REPLICA_ID_KEY, DefaultWiring, ManagerWiring
from torchft_lite.errors import (
    CollectiveError, ConfigError, ExceptionWithTraceback, LeavingError, ManagerError, ManagerTimeout, QuorumError,
    QuorumTimeout,
)
from torchft_lite.group_server.manager_client import checkpoint_metadata_in_thread
from torchft_lite.health.nonfinite import HealthConfig, health_checks
from torchft_lite.health.watchdog import Watchdog, WatchdogConfig
from torchft_lite.process_group.handles import ReconfigureOptions
from torchft_lite.rpc.loop import control_plane
from torchft_lite.work import (  # noqa: F401  (torchft's name)
    DoneWork, ManagedWork, WorkWait, _ManagedWork, guard_future,
)

__all__ = ["ExceptionWithTraceback", "MANAGER_ADDR_KEY", "Manager", "ManagerClient", "REPLICA_ID_KEY", "WorldSizeMode"]

T = TypeVar("T")
logger = logging.getLogger(__name__)
# A member that committed the step and exited can be reported gone while our end of
# the last collective is still completing (a busy CPU): give it this long to finish.
MEMBER_GONE_GRACE = 0.25


class Manager:
    """Fault-tolerance manager for one rank of one replica group (torchft's API).

    The quorum is asked for on the control-plane loop; a new quorum id reconfigures the process group on a
    store prefix unique to (quorum id, group rank); a replica behind the max step receives the state dict from
    its assigned peer and applies it on the training thread in ``should_commit``.

    Where its parts live: a step's state is a ``core.step.Step`` (replaced by each ``start_quorum``); what a
    heal carries is a ``core.healer.RegisteredState`` and heals are the ``core.healer.Healer``'s; the
    ManagerServer is reached through torchft's ``ManagerClient`` (this module's name for it, so a test can
    substitute it as torchft's do) that a wiring connects (``core.wiring.DefaultWiring``, or
    ``testing.InMemoryWiring``).
    """

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
        wiring: ManagerWiring | None = None,
        health: HealthConfig | None = None,
    ) -> None:
        """torchft's arguments, plus (keyword-only, ours): preemption_signals, on_preemption: see docs/training.md;
        watchdog: per-section step timeouts (default: from the environment).
        heal_sources: up-to-date peers a heal may pull disjoint parts from at once (default 1, or
            ``$TORCHFT_LITE_HEAL_SOURCES``; only when every member advertises as many and the transport stripes).
        heal_in_place: the default ``HTTPTransport`` receives a heal into the live tensors (default True, or
            ``$TORCHFT_LITE_HEAL_IN_PLACE``); :meth:`Healer.in_place_targets` says why that is safe.
        wiring: what the Manager connects to (default: TCPStore, ManagerServer, HTTP heals; or ``testing``'s).
        health: the non-finite guard and fingerprints (default: on, from the environment; ``torchft_lite.health.nonfinite``).
        """
        if not getattr(pg, "supports_reconfigure", False):
            raise ConfigError("the process group must support reconfigure (get_reconfigure_handle and reconfigure, as "
                              "torchft_lite's do); a native torch group must be created with enable_reconfigure=True")
        s = self._settings = ManagerSettings.resolve(  # everything is validated before anything starts
            min_replica_size=min_replica_size, timeout=timeout, quorum_timeout=quorum_timeout,
            connect_timeout=connect_timeout, rank=rank, world_size=world_size, store_addr=store_addr,
            store_port=store_port, lighthouse_addr=lighthouse_addr, replica_id=replica_id, port=port,
            hostname=hostname, heartbeat_interval=heartbeat_interval, max_retries=max_retries,
            quorum_retries=quorum_retries, heal_sources=heal_sources, heal_in_place=heal_in_place,
        )
        self._pg = pg
        self._min_replica_size = s.min_replica_size
        self._use_async_quorum = use_async_quorum
        self._group_rank = s.group_rank
        self._timeouts = s.timeouts
        self._timeout = s.timeouts.step  # torchft's name: bounds a reconfigure (_reconfigure_pg)
        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._state_quorum: int | None = None  # see state_quorum_id()
        self._closed = False
        self._current = Step(number=0)  # the step under way, or the last one
        self._on_preemption = on_preemption
        self._listeners = StepListeners(self._log)

        self._control = control_plane()
        # torchft's: held for writing between disallow_state_dict_read and allow_state_dict_read.
        self._state_dict_lock = RWLock(timeout=s.timeouts.step.total_seconds())
        self._is_state_dict_read_allowed = True
        self._state = RegisteredState(self.state_dict, self.load_state_dict, self._log)
        parts = (wiring or DefaultWiring()).build(s, checkpoint_transport, self._state.in_place_targets,
                                                  self._control, self._connect)
        self._parts = parts  # keeps the store client alive as long as the Manager
        self._replica_id, self._client = parts.replica_id, parts.client
        self.watchdog = Watchdog(watchdog or WatchdogConfig.from_env(os.environ,
                                                                     WatchdogConfig(**s.timeouts.watchdog_defaults())),
                                 label=f"[{self._replica_id}/{s.group_rank}]")
        peer_metadata = functools.partial(checkpoint_metadata_in_thread, parts.connect)
        self._healer = Healer(self._state, parts.transport, peer_metadata, in_place=parts.heal_in_place,
                              timeout=s.timeouts.step, log=self._log, record=self._record, watchdog=self.watchdog,
                              clock=parts.clock)
        advertise = self._client.advertise if s.group_rank == 0 else None  # group rank 0 speaks for the group
        self._guard, self._fingerprints = health_checks(
            health or HealthConfig.from_env(os.environ), self._state.user_state, advertise, self._client,
            self._listeners, self._log, self._record)
        self.context = ManagerContext(settings=s, client=self._client,
                                      store=parts.store, state=self._state, fingerprinter=self._fingerprints)
        """What durable checkpoints and metrics see of this Manager (ours; see :class:`ManagerContext`)."""
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)
        set_rank_info = getattr(pg, "set_rank_info", None)
        if set_rank_info is not None:  # named in its handle and its logs
            set_rank_info(self._replica_id, s.group_rank, s.group_world_size)
        self._step_quorum = StepQuorum(
            self._client, pg, self._healer, group_rank=s.group_rank,
            # looked up at each call, as torchft's is (its tests replace it)
            reconfigure=lambda quorum_id, handles: self._reconfigure_pg(quorum_id, handles), init_sync=init_sync,
            use_async_quorum=use_async_quorum, log=self._log, clock=parts.clock, fingerprint=self._fingerprints.for_step,
            spares_above=s.min_replica_size if world_size_mode is WorldSizeMode.FIXED_WITH_SPARES else None,
        )
        self._members = MemberWatch(self._replica_id, lambda: self._current, pg, self._record, self._log,
                                    MEMBER_GONE_GRACE)
        self._client.follow_events(self._members.on_event)
        self._preemption = PreemptionSignals(preemption_signals, lambda: self._current.quorum)
        # A child-process group starts its child now: join the first quorum once it can configure.
        if isinstance(pg, WarmsUp):
            pg.wait_warm(s.timeouts.connect)
        self._log(logging.INFO, "manager ready (group rank %d of %d, ManagerServer %s)", s.group_rank,
                  s.group_world_size, getattr(self._client, "address", "?"))
        self.metrics = metrics_from_env(self)  # TORCHFT_LITE_METRICS_PORT: /metrics (torchft_lite.metrics.registry)

    def _connect(self, address: str) -> ManagerClient:
        """A ``ManagerClient`` to the ManagerServer at ``address``: this module's ``ManagerClient``, looked up at
        each call, so a substituted one (``patch("torchft.manager.ManagerClient")``) is the one used."""
        return ManagerClient(address, connect_timeout=self._timeouts.connect)

    def _reconfigure_pg(self, communicator_id: int, handles: list[str]) -> None:
        """torchft's: join the process group of a new quorum: ``handles`` are the members' process-group handles
        for this group rank in replica-rank order (from the quorum), ``communicator_id`` the quorum id. Blocks,
        bounded by ``timeout``; raises what the group's ``reconfigure`` raises."""
        opts = ReconfigureOptions()
        opts.uuid = communicator_id
        opts.handles = handles
        opts.timeout = self._timeout
        self._pg.reconfigure(opts).wait()

    # ------------------------------------------------------------ state dicts

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]) -> None:
        """Add a piece of user state that heals carry (e.g. "model", "optim")."""
        self._state.register(key, load_state_dict, state_dict)

    def state_dict(self) -> dict[str, int]:
        """The Manager's own state, for durable checkpoints: step and batches committed."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def _manager_state_dict(self) -> dict[str, Any]:
        """What a heal carries (torchft's name, which its tests and tools read): user state and ours. Waits
        (bounded by ``timeout``) while the training loop has disallowed reads (``disallow_state_dict_read``)."""
        with self._state_dict_lock.r_lock():
            return self._state.state_dict()

    def add_step_listener(self, listener: StepListener) -> None:
        """Tell ``listener`` where each step stands (see ``torchft_lite.core.capabilities.StepListener``)."""
        self._listeners.add(listener)

    def remove_step_listener(self, listener: StepListener) -> None:
        self._listeners.remove(listener)

    # ------------------------------------------------------------ quorum

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None) -> None:
        """Begin this step's quorum in the background (``wait_quorum`` waits for it)."""
        self._maybe_leave()
        previous = self._current
        if previous.quorum is not None:
            self._await(previous, previous.quorum, "the previous quorum")
        if previous.published:  # should_commit was skipped: stop serving before the state changes
            self._healer.stop_serving(previous)
        self._listeners.notify("step_starting", self._step)
        step = self._current = Step(number=self._step, training_thread=threading.get_ident(), open=True)
        self.watchdog.begin("step", f"step {self._step} (start_quorum to the end of should_commit)")
        self.watchdog.begin("quorum", f"the quorum for step {self._step}")
        quorum_timeout = (timeout if timeout is not None else self._timeouts.quorum).total_seconds()
        step.ready = concurrent.futures.Future()
        step.quorum = self._control.submit(self._step_quorum.run(step, allow_heal, shrink_only, quorum_timeout,
                                                            self._commit_failures))
        if not self._use_async_quorum:
            self._raise_quorum_failure(step)
            self.wait_quorum()
            # torchft: a synchronous quorum returns with the heal applied (the forward pass never
            # overlaps the receive), and the healed replica takes part in this step's collectives.
            self._await(step, step.quorum, "the quorum and heal")
            if step.healing:
                step.healing = not self._healer.apply(step)  # a healed replica takes part
        step.compute_from = time.monotonic()

    def _raise_quorum_failure(self, step: Step) -> None:
        """Synchronous quorum: a failed Quorum call raises, as torchft's does (a failed heal is only recorded)."""
        try:
            step.ready.result(timeout=self._backstop())
        except QuorumError as exc:
            self._record(step, exc)
            step.open = False
            self.watchdog.end("quorum")
            self.watchdog.end("step")
            self._maybe_leave()  # a preemption signal abandoned this quorum: leave (143) rather than raise
            raise
        except Exception:
            pass  # recorded by wait_quorum

    def wait_quorum(self) -> None:
        """Wait until this step's quorum is known and the process group is ready; errors are recorded.

        A heal may still be in flight (``should_commit`` waits for it): a healing replica takes part in the
        step's collectives meanwhile. A replica the quorum names as a heal's source serves its state from here
        on (on the training thread, whose state is the last committed step's), as torchft's does from its
        quorum: a receiver in a synchronous quorum must not wait for this replica's first collective.
        """
        step = self._current
        if step.ready is None:
            raise RuntimeError("wait_quorum() called before start_quorum()")
        began = time.monotonic()
        self._await(step, step.ready, "the quorum")
        if step.compute_from is not None:  # blocked after start_quorum returned (StepReport.quorum_s)
            step.late_quorum_wait += time.monotonic() - began
        self.watchdog.end("quorum")
        self._healer.publish(step, self._step)

    def _backstop(self) -> float:
        return self._timeouts.quorum_backstop.total_seconds()

    def _await(self, step: Step, future: concurrent.futures.Future, what: str) -> None:
        limit = self._backstop()
        try:
            future.result(timeout=limit)
        except Exception as exc:
            if not future.done():  # our backstop fired, not an error from the quorum itself
                step.quorum.cancel()
                exc = QuorumTimeout(f"{what} did not finish within {limit:.0f}s")
            self._record(step, exc)

    def disallow_state_dict_read(self) -> None:
        """torchft's: the state is about to change. This step's heal receivers are waited for (bounded) and its
        state is served no more; reads of the state (``_manager_state_dict``) wait until ``allow_state_dict_read``.
        Raises ``TimeoutError`` when a read holds the state longer than ``timeout``. A no-op while disallowed."""
        if self._current.published and threading.get_ident() == self._current.training_thread:
            self._healer.stop_serving(self._current)  # served no more this step
        if not self._is_state_dict_read_allowed:
            return
        self._state_dict_lock.w_acquire()
        self._is_state_dict_read_allowed = False

    def allow_state_dict_read(self) -> None:
        """torchft's: the state may be read again (a step still serves its state at most once). A no-op while
        allowed."""
        if self._is_state_dict_read_allowed:
            return
        self._is_state_dict_read_allowed = True
        self._state_dict_lock.w_release()

    # ------------------------------------------------------------ collectives

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: ReduceOp = ReduceOp.AVG) -> ManagedWork:
        """Allreduce ``tensor`` across replica groups in place (AVG over participants).

        Raises only what should_quantize=True can never take (UnsupportedQuantization); on any other error
        the step is marked failed and the returned work resolves with ``tensor`` as it is.
        """
        step = self._current
        step.first_allreduce_at = step.first_allreduce_at or time.monotonic()
        self.wait_quorum()  # a heal's source serves from here
        if not step.collectives_ready:
            # No process group for this quorum: peers can't be in step with us.
            return DoneWork(tensor)
        participants = step.participation.world_size
        gone = step.member_gone()
        if gone is not None:  # its contribution will never come: don't wait for it
            self._record(step, CollectiveError(gone))
            return DoneWork(tensor)
        if step.error is not None and step.participation.rank is not None:
            # The peers count us in the average, and our contribution would be wrong (zeros would
            # mis-scale it): fail the peers' collective now rather than at its timeout.
            if isinstance(self._pg, Abortable):
                self._pg.abort()
            return DoneWork(tensor)
        if not self.is_participating():
            tensor.zero_()  # healing or a spare: take part with zeros so the peers' collective completes
        waits: list[WorkWait] = []  # the process group's works that have no future of their own
        try:
            fut = self._guard.start(self._pg, tensor, reduce_op, participants, step, step.participation.rank is not None,
                                    waits, quantize=should_quantize)
        except Exception as exc:
            self._guard.failed_to_start(step, exc)  # fails the step; raises a dtype/op should_quantize never takes
            return DoneWork(tensor)
        return self._managed(fut, tensor, None, waits)

    def wrap_future(self, fut: torch.futures.Future, default: T, timeout: timedelta | None = None) -> torch.futures.Future:
        """``fut``, except that an error or timeout is recorded and yields ``default``."""
        return self._managed(fut, default, timeout).get_future()

    def _managed(self, fut: torch.futures.Future, default: T, timeout: timedelta | None,
                 waits: list[WorkWait] | None = None) -> ManagedWork:
        """This step's work for ``fut`` (which ``should_commit`` waits for): an error or timeout is recorded
        and yields ``default``. ``waits``: works ``fut`` depends on that have no future of their own."""
        step = self._current
        seconds = (timeout if timeout is not None else self._timeouts.step).total_seconds()
        guarded = guard_future(fut, default, lambda exc: self._record(step, exc), seconds, "a collective's future",
                               schedule_timeout=self._control.call_later)
        work = ManagedWork(guarded, waits or (), seconds)
        step.work.append(work)
        gone = step.member_gone()
        if gone is not None and not guarded.done():  # the event came while this one started
            self._members.abort(step, CollectiveError(gone))
        return work

    # ------------------------------------------------------------ graceful leave

    def _maybe_leave(self) -> None:
        """At a safe point (between steps): leave if a preemption signal arrived."""
        if self._preemption.pending is not None and not self._closed:
            self._log(logging.WARNING, "leaving on %s at step %d (%d batches committed)", self._preemption.pending,
                      self._step, self._batches_committed)
            self._listeners.notify("leaving")
            self._preemption.leave(self._on_preemption, self.watchdog, self.shutdown)

    # ------------------------------------------------------------ errors

    def report_error(self, e: BaseException) -> None:
        """Record an error for this step: the step will not be committed."""
        self._record(self._current, e)

    def _record(self, step: Step, e: BaseException) -> None:
        if step.record(e):
            self._log(logging.WARNING, "step failed, will not commit: %s: %s", type(e).__name__, e,
                      exc_info=(type(e), e, e.__traceback__))

    def errored(self) -> ExceptionWithTraceback | None:
        """This step's first error (torchft's ``ExceptionWithTraceback``: the error is ``.original_exception``), or
        None while the step can commit."""
        return self._current.error_with_traceback()

    # ------------------------------------------------------------ commit

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """Vote with the group's other ranks; True means step the optimizer now.

        Raises ``RuntimeError`` only after > ``max_retries`` failed commits; ``timeout`` bounds the vote."""
        step = self._current
        if step.quorum is None:
            raise RuntimeError("should_commit() called before start_quorum()")
        step.commit_from = time.monotonic()
        self._await(step, step.quorum, "the quorum and heal")
        self.watchdog.end("quorum")
        self._listeners.notify("state_changing")
        healed = step.healing
        if step.healing:
            self._healer.apply(step)
        self._healer.publish(step, self._step)
        for work in step.work:
            work.wait()
        pg_error = self._pg.errored() if isinstance(self._pg, ReportsErrors) else None
        if pg_error is not None:
            self._record(step, pg_error)
        # Every rank has the same quorum, so the same ``enough``: the group votes on errors alone (a heal
        # is kept only if every rank got through cleanly). A peer can vote one rendezvous or timed-out
        # collective (``timeout``, plus the process group's 5 s grace) after this rank: the default waits that.
        if self._preemption.pending is not None:
            # A group on its way out votes no. Committed, the step could exist only here: a peer that stays may
            # redo it without us (the only other participant was healing, say), and the checkpoint saved on the
            # way out would then hold a step the job never had. Not committed, the group leaves at a step every
            # group that stays holds too. (A signal that comes after the vote leaves after the commit.)
            self._record(step, LeavingError(f"leaving on {self._preemption.pending}: this group does not commit "
                                            f"step {self._step}, so that it leaves at a step its peers hold too"))
        enough = step.participation.world_size >= self._min_replica_size
        if not enough:
            self._log(logging.WARNING, "only %d replica(s) participate, min_replica_size is %d",
                      step.participation.world_size, self._min_replica_size)
        try:
            group_clean = self._client.should_commit(self._group_rank, self._step, step.error is None,
                                                     timeout=timeout if timeout is not None else self._timeouts.commit_vote)
        except Exception as exc:
            # The other ranks may have committed; carrying on could leave this rank a step apart from
            # them for good. Fail stop (as torchft does): a restarted group is healed from a peer.
            self._healer.transport.disallow_checkpoint()
            step.open = False
            error = ManagerTimeout if isinstance(exc, TimeoutError) else ManagerError
            raise error(f"group rank {self._group_rank}: the commit vote for step {self._step} failed ({exc}); "
                        f"this rank can't know whether its group committed") from exc
        self._healer.stop_serving(step)
        decision = enough and group_clean
        if decision or (group_clean and healed):
            self._state_quorum = self._step_quorum.quorum_id
        if decision:
            self._step += 1
            self._batches_committed += step.participation.world_size
            self._commit_failures = 0
            step.healing = False
            self._listeners.notify("step_committed", self._step, step.participation.rank)
        else:
            if not group_clean:
                # A rank of the group failed: undo the heal with the step, so no rank ends up at another
                # step than the rest. A heal every rank applied is kept (as torchft does): the group is up
                # to date, and a step that only lacked replicas commits at the next quorum.
                self._healer.undo(step)
            self._commit_failures += 1
            self._log(logging.INFO, "step not committed (%d consecutive)", self._commit_failures)
            if (self._settings.max_retries is not None and self._commit_failures > self._settings.max_retries
                    and self._preemption.pending is None):  # leaving: the vote was no on purpose
                raise RuntimeError(f"should_commit failed {self._commit_failures} times consecutively, exceeding "
                                   f"max_retries={self._settings.max_retries}; last error: {step.error!r}")
        step.open = False
        self.watchdog.end("step")
        self.watchdog.end("heal")
        self._listeners.notify("step_finished", report_of(step, decision, self._step_quorum.quorum_id))
        if step.torn_at_max_step:
            # Nobody can heal it and its state mixes two steps: stop (restart it from a durable
            # checkpoint, or heal it once a peer is ahead).
            raise ManagerError(f"group rank {self._group_rank}: the state left by a failed heal was not repaired "
                               f"at step {self._step}: {step.error}")
        self._guard.judge(step, decision)  # after the vote: too many non-finite steps in a row leave
        if not decision:  # a committed step leaves at the next start_quorum, once the optimizer has stepped
            self._maybe_leave()
        return decision

    # ------------------------------------------------------------ accessors

    def current_step(self) -> int:
        return self._step

    def state_quorum_id(self) -> int | None:
        """The id of the quorum under which this rank's state was last committed or healed (ours); None before
        the first. A durable checkpoint records it, so a lighthouse can tell a checkpoint of the job's current
        lineage from one of before a new epoch (see ``lighthouse.epochs``)."""
        return self._state_quorum

    def batches_committed(self) -> int:
        return self._batches_committed

    def participating_rank(self) -> int | None:
        """This replica's rank among the step's participants (None when it sits the step out); waits for the
        step's quorum, as torchft's does."""
        self._wait_for_participation()
        return self._current.participation.rank

    def num_participants(self) -> int:
        """How many replicas take part in the step (0 before the first quorum); waits for the step's quorum, as
        torchft's does."""
        self._wait_for_participation()
        return self._current.participation.world_size

    def _wait_for_participation(self) -> None:
        step = self._current
        if step.ready is not None:  # at once when done (a failed quorum was recorded when it failed)
            self._await(step, step.ready, "the quorum")

    def is_participating(self) -> bool:
        return self._current.participation.rank is not None and not self._current.healing

    # torchft's private names for the Manager's state, which torchft's tests and tools read. Some can be set,
    # as torchft's tests set them: _init_sync and _checkpoint_transport; and, to fake a step's quorum without
    # running one, _quorum_future, _participating_replica_rank, _participating_replica_world_size and _healing
    # (they change the current step only: the next start_quorum starts from a real quorum again).

    @property
    def _quorum_id(self) -> int:
        """The quorum the process group is configured for (-1 before the first)."""
        return self._step_quorum.quorum_id

    @property
    def _errored(self) -> ExceptionWithTraceback | None:
        return self.errored()

    @property
    def _healing(self) -> bool:
        """This step receives the state dict (it contributes zeros until it is applied)."""
        return self._current.healing

    @_healing.setter
    def _healing(self, value: bool) -> None:
        self._current.healing = bool(value)

    @property
    def _quorum_future(self) -> concurrent.futures.Future | None:
        """The step's quorum and heal (None before the first ``start_quorum``).

        Set, it stands in for the step's quorum (torchft's tests fake one so): the step waits on it where it
        would wait on its quorum, and its collectives go to the process group as it is configured, among the
        participants set through ``_participating_replica_rank`` and ``_participating_replica_world_size``."""
        return self._current.quorum

    @_quorum_future.setter
    def _quorum_future(self, future: concurrent.futures.Future | None) -> None:
        step = self._current
        step.quorum = step.ready = future
        step.collectives_ready = future is not None

    @property
    def _participating_replica_rank(self) -> int | None:
        """This replica's rank among the step's participants (``participating_rank()`` without the wait)."""
        return self._current.participation.rank

    @_participating_replica_rank.setter
    def _participating_replica_rank(self, rank: int | None) -> None:
        self._current.participation = Participation(rank, self._current.participation.world_size)

    @property
    def _participating_replica_world_size(self) -> int:
        """How many replicas take part in the step (``num_participants()`` without the wait)."""
        return self._current.participation.world_size

    @_participating_replica_world_size.setter
    def _participating_replica_world_size(self, size: int) -> None:
        self._current.participation = Participation(self._current.participation.rank, int(size))

    @property
    def _init_sync(self) -> bool:
        """Sent with each quorum request: at step 0, every replica heals from the primary."""
        return self._step_quorum.init_sync

    @_init_sync.setter
    def _init_sync(self, value: bool) -> None:
        self._step_quorum.init_sync = bool(value)

    @property
    def _checkpoint_transport(self) -> Any:
        """The transport heals go through (the default ``HTTPTransport``, or the user's)."""
        return self._healer.transport

    @_checkpoint_transport.setter
    def _checkpoint_transport(self, transport: Any) -> None:
        self._healer.transport = transport

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
        self._preemption.restore()
        if self._current.quorum is not None:
            self._current.quorum.cancel()
        self._parts.close(self._log, wait)

    def _log(self, level: int, msg: str, *args: Any, exc_info: Any = None) -> None:
        if logger.isEnabledFor(level):
            replica = getattr(self, "_replica_id", self._settings.replica_id)
            step_quorum = getattr(self, "_step_quorum", None)
            logger.log(level, "[%s/%d step=%d quorum=%d] " + msg, replica, self._group_rank,
                       self._step, step_quorum.quorum_id if step_quorum is not None else -1, *args, exc_info=exc_info)
