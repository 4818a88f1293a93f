"""New epochs of the job over real gRPC and HTTP: the stale-quorum guard gives way, and replicas from before are fenced.

The first test runs the lighthouse on a frozen fake clock, so the holder
timeout passes exactly when the test moves the clock, never on its own.
"""

import asyncio
import logging

import grpc
import pytest

from lighthouse.fencing import QuorumIdStore
from lighthouse.server import LighthouseServer
from tests.conftest import WAIT, FrozenClock, lighthouse_config, wait_until
from tests.integration.helpers import client_for, http
from torchft_lite.rpc.lighthouse_client import LighthouseError

pytestmark = pytest.mark.integration

ADMIN = {"Authorization": "Bearer s3cret"}


def earlier_job_reached(state_dir, step: int, quorum_id: int = 17) -> None:
    """The state dir a lighthouse leaves behind after serving a job up to ``step``."""
    store = QuorumIdStore(state_dir)
    store.save(quorum_id)
    store.save_max_step(step)


def test_a_new_job_at_step_0_starts_an_epoch_after_the_holder_timeout_and_the_state_dir_keeps_it(tmp_path):
    earlier_job_reached(tmp_path, 300)

    async def scenario():
        clock = FrozenClock()
        config = lighthouse_config(state_dir=tmp_path, holder_timeout=0.5, heartbeat_timeout=0.5)
        server = LighthouseServer(config, clock=clock)
        await server.start()
        try:
            async with client_for(server) as c:
                fresh = asyncio.ensure_future(c.quorum("fresh", timeout=WAIT, step=0))
                await wait_until(lambda: server.statistics().status == "behind_committed", "the guard to hold")
                reason = server.statistics().reason
                assert "no participant holds step 300" in reason and "in 0.5s unless one comes back" in reason
                await asyncio.sleep(0.3)  # several quorum ticks: still held while the clock stands
                assert not fresh.done() and server.statistics().quorums_issued == 0

                clock.now += 0.5
                await c.heartbeat("fresh", timeout=WAIT)  # its manager's heartbeat, at the new time
                quorum = await fresh
            assert [m.replica_id for m in quorum.participants] == ["fresh"] and quorum.quorum_id > 17
            epoch = server.snapshot()["epoch"]
            assert (epoch["number"], epoch["from_step"], epoch["to_step"]) == (1, 300, 0)
            assert "no holder of step 300 seen in the 0.5s since the lighthouse started" in epoch["reason"]
            assert epoch["age_s"] == 0.0  # the clock stood still since
            assert (server.statistics().max_step, server.statistics().epochs) == (0, 1)
            assert QuorumIdStore(tmp_path).initial_max_step() == 0, "the lower step must be on disk at once"
        finally:
            await server.stop()

        # Restarted after the epoch: nothing to wait for any more.
        again = LighthouseServer(lighthouse_config(state_dir=tmp_path, holder_timeout=3600.0))
        await again.start()
        try:
            async with client_for(again) as c:
                quorum = await c.quorum("next", timeout=WAIT, step=0)
            assert [m.replica_id for m in quorum.participants] == ["next"]
            assert again.snapshot()["epoch"] is None  # epochs are counted per process
        finally:
            await again.stop()

    asyncio.run(scenario())


def test_post_api_epoch_needs_the_admin_token_and_a_blocked_guard(tmp_path):
    earlier_job_reached(tmp_path, 300)

    async def scenario():
        # Only the operator can lift the guard here: the holder timeout is an hour.
        config = lighthouse_config(state_dir=tmp_path, holder_timeout=3600.0, heartbeat_timeout=60.0,
                                   admin_token="s3cret")
        server = LighthouseServer(config)
        await server.start()
        try:
            status, body, headers = await http(server, "POST", "/api/epoch")
            assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
            status, body, _ = await http(server, "POST", "/api/epoch", headers={"Authorization": "Bearer wrong"})
            assert status == 403 and "wrong admin token" in body["error"]
            status, body, _ = await http(server, "POST", "/api/epoch", headers=ADMIN)
            assert status == 409 and "nothing to do" in body["error"] and "no_participants" in body["error"]

            async with client_for(server) as c:
                fresh = asyncio.ensure_future(c.quorum("fresh", timeout=WAIT, step=0))
                await wait_until(lambda: server.statistics().status == "behind_committed", "the guard to hold")
                status, body, _ = await http(server, "POST", "/api/epoch", headers={"Authorization": "Bearer wrong"})
                assert status == 403 and server.statistics().epochs == 0 and not fresh.done()

                status, body, _ = await http(server, "POST", "/api/epoch", headers=ADMIN)
                assert status == 202, body
                assert (body["epoch"]["number"], body["epoch"]["from_step"], body["epoch"]["to_step"]) == (1, 300, 0)
                assert "an operator asked for it (POST /api/epoch from 127.0.0.1)" == body["epoch"]["reason"]
                quorum = await fresh
            assert [m.replica_id for m in quorum.participants] == ["fresh"]
            status, body, _ = await http(server, "POST", "/api/epoch", headers=ADMIN)
            assert status == 409  # nothing blocked any more

            status, text, _ = await http(server, "GET", "/metrics")
            assert "lighthouse_epochs_total 1.0" in text and "lighthouse_max_step 0.0" in text
            status, page, _ = await http(server, "GET", "/")
            assert 'id="epoch"' in page and "/api/epoch" in page
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_post_api_epoch_is_disabled_without_an_admin_token():
    async def scenario():
        server = LighthouseServer(lighthouse_config())
        await server.start()
        try:
            status, body, _ = await http(server, "POST", "/api/epoch", headers=ADMIN)
            assert status == 403 and "disabled" in body["error"]
        finally:
            await server.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("engine", ["native", "grpcio"])
def test_an_old_holder_coming_back_after_an_epoch_gets_failed_precondition(tmp_path, engine, caplog):
    earlier_job_reached(tmp_path, 300)

    async def scenario():
        clock = FrozenClock()
        config = lighthouse_config(state_dir=tmp_path, holder_timeout=3600.0, heartbeat_timeout=10.0,
                                   admin_token="s3cret", grpc_engine=engine)
        server = LighthouseServer(config, clock=clock)
        await server.start()
        try:
            async with client_for(server) as c:
                resumed = '{"heal_sources": 2, "resumed_from": 120}'  # what a job restarted from a checkpoint says
                first = asyncio.gather(c.quorum("a", timeout=WAIT, step=120, data=resumed),
                                       c.quorum("b", timeout=WAIT, step=120, data=resumed))
                await wait_until(lambda: server.statistics().status == "behind_committed", "the guard to hold")
                assert "as every participant resumed from a checkpoint" in server.statistics().reason
                # A holder of step 300 (unknown after the restart) may be healthy until a heartbeat timeout
                # after the start; then the resumed job need not wait out the hour.
                clock.now += 10.0
                await asyncio.gather(c.heartbeat("a", timeout=WAIT), c.heartbeat("b", timeout=WAIT))
                first = await first
                assert [m.replica_id for m in first[0].participants] == ["a", "b"]
                assert "resumed from a durable checkpoint" in server.snapshot()["epoch"]["reason"]

                with pytest.raises(LighthouseError, match="from before the job's current epoch \\(number 1 ") as info:
                    await c.quorum("old-holder", timeout=WAIT, step=300)
                assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert "must restart" in str(info.value) and "above step 120" in str(info.value)
                assert server.statistics().fenced_requests == 1

                # The epoch's own members committed a step: above max_step, but not from before the epoch.
                second = await asyncio.gather(c.quorum("a", timeout=WAIT, step=121),
                                              c.quorum("b", timeout=WAIT, step=121))
                assert second[0].quorum_id == first[0].quorum_id
                # The old holder restarted from a checkpoint the epoch has passed: welcome back, it heals.
                back = asyncio.ensure_future(c.quorum("old-holder", timeout=WAIT, step=100))
                await wait_until(lambda: server.statistics().participants == 1, "the old holder to wait")
                third = await asyncio.gather(c.quorum("a", timeout=WAIT, step=122),
                                             c.quorum("b", timeout=WAIT, step=122), back)
                assert [m.replica_id for m in third[0].participants] == ["a", "b", "old-holder"]
            status, text, _ = await http(server, "GET", "/metrics")
            assert "lighthouse_fenced_requests_total 1.0" in text and "lighthouse_epochs_total 1.0" in text
        finally:
            await server.stop()

    with caplog.at_level(logging.WARNING, logger="lighthouse"):
        asyncio.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("a new epoch of the job starts (number 1 since this lighthouse started)" in m and "from 300 down to 120" in m for m in warnings), warnings
    assert any("refused replica old-holder at step 300" in m for m in warnings), warnings


def test_a_restarted_lighthouse_waits_for_a_saved_holder_whose_group_did_not_restart(tmp_path):
    """The state dir keeps who held the step: after a lighthouse restart, a job whose every participant resumed
    from a checkpoint still waits while a holder's group never came back (it may be hung, holding step 300)."""
    async def scenario():
        clock = FrozenClock()
        config = lighthouse_config(state_dir=tmp_path, holder_timeout=3600.0, heartbeat_timeout=10.0, min_replicas=2)
        first = LighthouseServer(config, clock=clock)
        await first.start()
        try:
            async with client_for(first) as c:
                await asyncio.gather(c.quorum("g0:a", timeout=WAIT, step=300), c.quorum("g1:b", timeout=WAIT, step=300))
        finally:
            await first.stop()
        assert QuorumIdStore(tmp_path).initial_holders() == {"g0:a", "g1:b"}

        again = LighthouseServer(config, clock=clock)
        await again.start()
        try:
            async with client_for(again) as c:
                resumed = '{"resumed_from": 120}'
                waiting = [asyncio.ensure_future(c.quorum(rid, timeout=WAIT, step=120, data=resumed))
                           for rid in ("g0:new", "g2:new")]
                await wait_until(lambda: again.statistics().status == "behind_committed", "the guard to hold")
                clock.now += 10.0  # no holder seen for a heartbeat timeout
                await asyncio.gather(c.heartbeat("g0:new", timeout=WAIT), c.heartbeat("g2:new", timeout=WAIT))
                await asyncio.sleep(0.3)  # several quorum ticks
                assert not any(w.done() for w in waiting), "rewound while g1's holder may be hung"
                assert "not every holder's replica group restarted" in again.statistics().reason

                waiting.append(asyncio.ensure_future(c.quorum("g1:new", timeout=WAIT, step=120, data=resumed)))
                quorums = await asyncio.gather(*waiting)
            assert [m.replica_id for m in quorums[0].participants] == ["g0:new", "g1:new", "g2:new"]
            epoch = again.snapshot()["epoch"]
            assert (epoch["from_step"], epoch["to_step"]) == (300, 120)
            assert "every holder's replica group restarted" in epoch["reason"]
        finally:
            await again.stop()
        assert QuorumIdStore(tmp_path).initial_holders() == {"g0:new", "g1:new", "g2:new"}

    asyncio.run(scenario())
