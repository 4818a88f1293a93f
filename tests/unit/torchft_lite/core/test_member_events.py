"""MemberWatch: a member-gone event aborts the step's unfinished collectives, and its log line says which case it
was (the line once misled a chaos diagnosis into reading "collectives finished" where none had started)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from torchft_lite.core.member_events import MemberWatch
from torchft_lite.core.step import Step
from torchft_lite.rpc.protocol import torchft_pb2 as pb
from torchft_lite.work import DoneWork, ManagedWork


class Pending(ManagedWork):
    """A collective still in flight."""

    def __init__(self) -> None:
        super().__init__(torch.futures.Future())


def watch_event(work: list[Any], left_in: int = 0, quorum_id: int | None = None) -> tuple[list[str], list[BaseException]]:
    """A member-gone event for ``b`` (sent when quorum ``left_in`` was the lighthouse's last; 0: no id) during a
    step of quorum ``quorum_id`` whose started collectives are ``work``: the lines logged and the errors recorded."""
    step = Step(number=3)
    step.open, step.members, step.work = True, frozenset({"a", "b"}), list(work)
    step.quorum_id = quorum_id
    logged: list[str] = []
    recorded: list[BaseException] = []
    watch = MemberWatch("a", lambda: step, pg=None, record=lambda s, e: recorded.append(e),
                        log=lambda level, fmt, *args: logged.append(fmt % args), grace=0.0)

    async def run() -> None:
        watch.on_event(pb.LeaseEvent(kind=pb.LeaseEvent.MEMBER_GONE, replica_id="b", quorum_id=left_in,
                                     reason="lease expired"))
        await asyncio.sleep(0.05)  # the grace (0) passes; call_later runs the check

    asyncio.run(run())
    return logged, recorded


def test_an_event_before_any_collective_says_so_and_aborts_nothing():
    logged, recorded = watch_event([])
    assert logged == ["b left the quorum (lease expired) before this rank started a collective of the step: the "
                      "step's collectives fail from here on"] and recorded == []


def test_an_event_after_every_collective_finished_lets_the_step_commit():
    logged, recorded = watch_event([DoneWork(1)])
    assert logged == ["b left the quorum (lease expired) after this step's collectives finished"] and recorded == []


def test_an_event_with_a_collective_in_flight_aborts_the_step():
    logged, recorded = watch_event([DoneWork(1), Pending()])
    assert logged == ["b left the quorum (lease expired): aborting this step's collectives"]
    assert [str(e) for e in recorded] == ["replica b left the quorum: lease expired"]


# A chaos run (seed 3) lost 9 s so: b was cut off (its event named the lighthouse's last quorum then), came back,
# and a later quorum (a higher id) took it in with a; the event, heard while a waited for that quorum, failed a's
# step and a skipped its collectives, while b waited in its own until a's next quorum.


def test_an_event_from_before_the_steps_quorum_aborts_nothing():
    logged, recorded = watch_event([Pending()], left_in=831, quorum_id=832)
    assert logged == ["b left quorum 831 (lease expired), before this step's quorum 832, which took it back: not "
                      "this step's concern"] and recorded == []


def test_an_event_of_the_steps_own_quorum_or_without_an_id_aborts_the_step():
    for left_in in (832, 833, 0):
        logged, recorded = watch_event([Pending()], left_in=left_in, quorum_id=832)
        assert [str(e) for e in recorded] == ["replica b left the quorum: lease expired"], left_in


def test_an_event_heard_before_the_quorum_was_known_is_judged_by_the_quorums_id():
    step = Step(number=3)
    step.gone["b"] = (831, "replica b left the quorum: no heartbeat for 2.0s")  # heard while the quorum was pending
    step.members = frozenset({"a", "b"})
    for quorum_id, gone in ((832, None), (831, "replica b left the quorum: no heartbeat for 2.0s")):
        step.quorum_id = quorum_id
        assert step.member_gone() == gone, quorum_id
    step.gone["b"] = (0, "replica b left the quorum: killed")  # a lighthouse that sends no id: it counts
    assert step.member_gone() == "replica b left the quorum: killed"
