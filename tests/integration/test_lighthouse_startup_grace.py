"""The startup grace over real gRPC: a first start answers at once, a restart known from its state dir waits.

The lighthouses here run on a frozen fake clock: a grace that applied would
never end on its own, so a first quorum that arrives proves there was none, and
one held back is released only by moving the clock.
"""

import asyncio

import pytest

from lighthouse.server import LighthouseServer
from tests.conftest import WAIT, FrozenClock, lighthouse_config, wait_until
from tests.integration.helpers import client_for

pytestmark = pytest.mark.integration

GRACE = 30.0


async def started(clock: FrozenClock, **overrides) -> LighthouseServer:
    settings = dict(startup_grace=None, heartbeat_timeout=GRACE)  # the default grace: the heartbeat timeout
    settings.update(overrides)
    server = LighthouseServer(lighthouse_config(**settings), clock=clock)
    await server.start()
    return server


@pytest.mark.parametrize("with_state_dir", [False, True], ids=["no-state-dir", "empty-state-dir"])
def test_a_first_start_answers_a_lone_replicas_first_quorum_at_once(tmp_path, with_state_dir):
    async def scenario():
        server = await started(FrozenClock(), state_dir=tmp_path / "state" if with_state_dir else None)
        try:
            async with client_for(server) as c:
                quorum = await c.quorum("only", timeout=WAIT, step=1)
            assert [m.replica_id for m in quorum.participants] == ["only"]
            assert server.statistics().quorums_issued == 1
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_a_restart_known_from_its_state_dir_waits_out_the_grace_and_says_why(tmp_path):
    state_dir = tmp_path / "state"

    async def scenario():
        first = await started(FrozenClock(), state_dir=state_dir)
        try:
            async with client_for(first) as c:
                earlier_id = (await c.quorum("veteran", timeout=WAIT, step=5)).quorum_id
        finally:
            await first.stop()

        clock = FrozenClock()
        # Heartbeats outlive the grace here: the joins are the only heartbeats this test sends.
        restarted = await started(clock, state_dir=state_dir, startup_grace=GRACE, heartbeat_timeout=4 * GRACE)
        try:
            async with client_for(restarted) as c:
                fresh = asyncio.create_task(c.quorum("fresh", timeout=WAIT, step=0))
                await wait_until(lambda: restarted.statistics().status == "startup_grace",
                                 "the restarted lighthouse to hold the first quorum")
                status = restarted.snapshot()["status"]
                assert f"quorum id {earlier_id}" in status["reason"], status
                assert "re-register" in status["reason"], status
                # The replica that was training re-registers within the grace.
                veteran = asyncio.create_task(c.quorum("veteran", timeout=WAIT, step=5))
                await wait_until(lambda: restarted.statistics().participants == 2, "the veteran to join")
                await asyncio.sleep(0.3)  # several quorum ticks: still held while the clock stands
                assert not fresh.done() and restarted.statistics().quorums_issued == 0

                clock.now += GRACE
                quorums = await asyncio.gather(fresh, veteran)
            assert [m.replica_id for m in quorums[0].participants] == ["fresh", "veteran"]
            assert quorums[0].quorum_id == quorums[1].quorum_id > earlier_id
        finally:
            await restarted.stop()

    asyncio.run(scenario())
