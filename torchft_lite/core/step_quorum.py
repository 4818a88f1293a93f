"""The quorum half of a step, on the control-plane loop.

Ask the group for the step's quorum (sending this rank's process-group
handle), work out who takes part, reconfigure the process group from the
members' handles when the quorum id changed, then (while the training thread
runs its forward pass) receive the state dict if this replica is behind.
``step.ready`` is set as soon as collectives may start, before the heal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any, Callable

from torchft_lite.core.healer import Healer
from torchft_lite.core.step import Step, participation_of
from torchft_lite.errors import CheckpointError, ConfigError, QuorumError
from torchft_lite.group_server.manager_client import ManagerClient, quorum_in_thread
from torchft_lite.group_server.quorum_compute import QuorumResult

__all__ = ["StepQuorum"]


class StepQuorum:
    """Runs each step's quorum for one rank; remembers the quorum id the process group is configured for."""

    def __init__(self, client: ManagerClient, pg: Any, healer: Healer, *, group_rank: int,
                 reconfigure: Callable[[int, list[str]], None], init_sync: bool, use_async_quorum: bool,
                 spares_above: int | None, log: Callable[..., None], clock: Callable[[], float] = time.monotonic,
                 fingerprint: Callable[[int], str] = lambda step: "") -> None:
        """``reconfigure(quorum_id, handles)``: join the process group of a new quorum (``Manager._reconfigure_pg``,
        blocking); ``fingerprint(step)``: this rank's state fingerprint at ``step`` for its request, or ""."""
        self.quorum_id = -1
        self.init_sync = init_sync
        """Sent with every quorum request: at step 0 every replica heals from the primary (torchft's)."""
        self._fingerprint = fingerprint
        self._client, self._pg, self._healer = client, pg, healer
        self._group_rank, self._reconfigure_pg = group_rank, reconfigure
        self._use_async_quorum, self._spares_above = use_async_quorum, spares_above
        self._log, self._clock = log, clock

    async def run(self, step: Step, allow_heal: bool, shrink_only: bool, timeout: float, commit_failures: int) -> None:
        """The quorum, then the heal; ``step.ready`` is always resolved (with the error, if the quorum failed)."""
        try:
            await self._quorum_and_heal(step, allow_heal, shrink_only, timeout, commit_failures)
        except asyncio.CancelledError:
            # Abandoned (a preemption signal, or the Manager's backstop): the training thread records a
            # QuorumError like any other failed quorum; a CancelledError there would escape its handlers.
            if not step.ready.done():
                step.ready.set_exception(QuorumError(f"the quorum for step {step.number} was abandoned"))
            raise
        except BaseException as exc:
            if not step.ready.done():
                step.ready.set_exception(exc)
            raise
        finally:
            if not step.ready.done():
                step.ready.set_result(None)

    async def _quorum_and_heal(self, step: Step, allow_heal: bool, shrink_only: bool, timeout: float,
                               commit_failures: int) -> None:
        response = await quorum_in_thread(
            self._client, self._pg.get_reconfigure_handle, group_rank=self._group_rank, step=step.number,
            checkpoint_metadata=self._healer.transport.metadata(), shrink_only=shrink_only,
            timeout=timedelta(seconds=timeout), commit_failures=commit_failures, init_sync=self.init_sync,
            state_fingerprint=self._fingerprint(step.number),
        )
        step.participation = participation_of(response, counts_healing=allow_heal and not self._use_async_quorum,
                                              spares_above=self._spares_above)
        # From here, member-gone events (earlier ones too) count only for replicas of this quorum: one the
        # lighthouse already left out (the usual case) must not fail a step it has no part in.
        step.members, step.quorum_id = frozenset(response.replica_ids), response.quorum_id
        if response.quorum_id != self.quorum_id:
            await self._reconfigure(response)
        step.collectives_ready = True
        if self._healer.state.torn and not (allow_heal and response.heal):
            step.torn_at_max_step = True
            raise CheckpointError(
                f"this rank's state was left partly overwritten by a failed heal and quorum {response.quorum_id} does "
                f"not heal it (no peer ahead of step {response.max_step}, or allow_heal=False): it must not train on "
                f"or serve that state"
            )
        if allow_heal:
            # Both before collectives may start: a healing replica contributes
            # zeros, and a source may publish from its first allreduce.
            step.healing = response.heal
            if response.recover_dst_replica_ranks:
                step.send_to, step.send_step = list(response.recover_dst_replica_ranks), response.max_step
        step.ready.set_result(None)
        if allow_heal and response.heal:
            sources = list(zip(response.recover_src_replica_ranks, response.recover_src_manager_addresses))
            if not sources:  # a ManagerServer that predates striping: its single source
                sources = [(response.recover_src_replica_rank, response.recover_src_manager_address)]
            await self._healer.receive(step, sources, response.max_step, self._group_rank)

    async def _reconfigure(self, response: QuorumResult) -> None:
        # Set first: a communicator id is never rendezvoused on twice, even if this
        # configure fails (the failed commit then brings a new quorum id).
        self.quorum_id = response.quorum_id
        handles = list(response.reconfigure_handles)
        missing = [replica for replica, handle in zip(response.replica_ids, handles) if not handle]
        if missing:
            raise ConfigError(f"quorum {response.quorum_id}: {', '.join(missing)} sent no process-group handle for "
                              f"group rank {self._group_rank} (a Manager or ManagerServer that predates reconfigure "
                              f"handles?)")
        started = self._clock()
        await asyncio.to_thread(self._reconfigure_pg, response.quorum_id, handles)
        self._log(logging.INFO, "quorum %d: reconfigured as replica %d of %d (%d up to date, max step %d) in %.2fs",
                  response.quorum_id, response.replica_rank, response.replica_world_size,
                  response.max_world_size, response.max_step, self._clock() - started)
