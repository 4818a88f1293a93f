"""A quorum member is gone: abort the step's collectives now instead of at their timeout.

The lighthouse pushes a member-gone event when a lease ends. Collectives
still in flight ``grace`` seconds later are aborted and the step is not
committed; the next quorum, formed without the member, reconfigures. When
every collective of the step finishes, the member contributed to all of them
and the step may commit (a member that committed its last step and left must
not fail ours); a collective started after the event fails at once. An event
that comes before this step's quorum is known counts only if that quorum has
the member (usually the lighthouse has already left it out).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

from torchft_lite.core.capabilities import Abortable
from torchft_lite.core.step import Step
from torchft_lite.errors import CollectiveError
from torchft_lite.rpc.protocol import torchft_pb2 as pb

__all__ = ["MemberWatch"]


class MemberWatch:
    """Turns member-gone events into aborted collectives for the step under way."""

    def __init__(self, replica_id: str, current: Callable[[], Step], pg: Any,
                 record: Callable[[Step, BaseException], None], log: Callable[..., None], grace: float) -> None:
        self._replica_id, self._current, self._pg = replica_id, current, pg
        self._record, self._log, self._grace = record, log, grace

    def on_event(self, event: pb.LeaseEvent) -> None:
        """Runs on the control-plane loop."""
        step = self._current()
        if event.kind != pb.LeaseEvent.MEMBER_GONE or not step.open:
            return
        if event.replica_id == self._replica_id:
            # We were declared gone (hung, or cut off, for longer than the heartbeat timeout): our peers
            # abort this step's collectives, yet ours may still complete with the data they had sent.
            # Committing it alone would put us a step apart from them for good; behind, we heal instead.
            self._record(step, CollectiveError(f"the lighthouse declared this replica gone ({event.reason}): "
                                               f"its peers do not commit this step, so neither does it"))
            return
        step.gone[event.replica_id] = (event.quorum_id, f"replica {event.replica_id} left the quorum: {event.reason}")
        if event.replica_id not in step.members:
            return  # judged against this step's quorum once it is known
        if step.predates_quorum(event.quorum_id):
            self._log(logging.INFO, "%s left quorum %d (%s), before this step's quorum %d, which took it back: "
                      "not this step's concern", event.replica_id, event.quorum_id, event.reason, step.quorum_id)
            return
        started = list(step.work)
        in_flight = [work for work in started if not work.is_completed()]
        asyncio.get_running_loop().call_later(self._grace, self._abort_unfinished, step, in_flight, event,
                                              bool(started))

    def _abort_unfinished(self, step: Step, in_flight: list[Any], event: pb.LeaseEvent, started: bool) -> None:
        if not started:  # nothing had started when the event came (the process group may still be configuring)
            self._log(logging.INFO, "%s left the quorum (%s) before this rank started a collective of the step: "
                      "the step's collectives fail from here on", event.replica_id, event.reason)
            return
        if all(work.is_completed() for work in in_flight):
            self._log(logging.INFO, "%s left the quorum (%s) after this step's collectives finished",
                      event.replica_id, event.reason)
            return
        self._log(logging.INFO, "%s left the quorum (%s): aborting this step's collectives",
                  event.replica_id, event.reason)
        self.abort(step, CollectiveError(f"replica {event.replica_id} left the quorum: {event.reason}"))

    def abort(self, step: Step, error: CollectiveError) -> None:
        """Record ``error`` for ``step`` and abort the process group."""
        self._record(step, error)
        if isinstance(self._pg, Abortable):
            # Never on this loop: an abort can wait on the process group's lock, and a
            # blocked control plane stops heartbeats, the lease and every timeout (the
            # 200-fault chaos run hung a group this way).
            threading.Thread(target=self._pg.abort, name="torchft-abort", daemon=True).start()
