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


def watch_event(work: list[Any]) -> tuple[list[str], list[BaseException]]:
    """A member-gone event for ``b`` during a step whose started collectives are ``work``: the lines logged and
    the errors recorded."""
    step = Step(number=3)
    step.open, step.members, step.work = True, frozenset({"a", "b"}), list(work)
    logged: list[str] = []
    recorded: list[BaseException] = []
    watch = MemberWatch("a", lambda: step, pg=None, record=lambda s, e: recorded.append(e),
                        log=lambda level, fmt, *args: logged.append(fmt % args), grace=0.0)

    async def run() -> None:
        watch.on_event(pb.LeaseEvent(kind=pb.LeaseEvent.MEMBER_GONE, replica_id="b", reason="lease expired"))
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
