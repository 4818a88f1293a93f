"""Stragglers on a real lighthouse (gRPC and HTTP on port 0): fake groups advertise compute_ms in their data."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest

from tests.conftest import WAIT, running_lighthouse
from tests.integration.helpers import http
from torchft_lite.rpc.lighthouse_client import LighthouseClient
from torchft_lite.rpc.protocol import torchft_pb2 as pb

pytestmark = pytest.mark.integration

FAST, SLOW = 100.0, 500.0


async def get(server, path: str) -> dict | str:
    """The body of ``path``, which must be served (200), as JSON under /api/."""
    status, body, headers = await http(server, "GET", path)
    assert status == 200, path
    if path.startswith("/api/"):
        assert headers["Content-Type"].startswith("application/json") and isinstance(body, dict), path
    return body


def metric(text: str, name: str, replica_id: str | None = None) -> float | None:
    labels = "" if replica_id is None else re.escape(f'{{replica_id="{replica_id}"}}')
    found = re.search(rf"^{name}{labels} (\S+)$", text, re.MULTILINE)
    return None if found is None else float(found.group(1))


class Groups:
    """Replica groups that heartbeat and join a quorum each round, advertising their compute time. A group whose
    call is still waiting (left out of the quorum) keeps heartbeating and makes no new call until it is answered."""

    def __init__(self, client: LighthouseClient, ids) -> None:
        self.client = client
        self.step = dict.fromkeys(ids, 0)
        self.calls: dict[str, asyncio.Task] = {}
        self.answers: dict[str, list[tuple[str, ...]]] = {rid: [] for rid in ids}

    async def round(self, times: dict[str, float | str], must_answer) -> None:
        """One step: every group in ``times`` (compute_ms, or raw data in a str) heartbeats and, unless its call
        still waits, joins; returns once every group in ``must_answer`` has its quorum."""
        for rid, ms in times.items():
            await self.client.heartbeat(rid, timeout=WAIT)
            if rid not in self.calls:
                data = ms if isinstance(ms, str) else json.dumps({"compute_ms": ms, "compute_step": self.step[rid],
                                                                  "heal_sources": []})
                self.calls[rid] = asyncio.create_task(self.client.quorum(rid, timeout=WAIT, step=self.step[rid],
                                                                         data=data))
        await asyncio.wait_for(asyncio.gather(*(asyncio.shield(self.calls[rid]) for rid in must_answer)), WAIT)
        for rid, call in list(self.calls.items()):
            if call.done():
                quorum: pb.Quorum = call.result()
                del self.calls[rid]
                self.answers[rid].append(tuple(m.replica_id for m in quorum.participants))
                self.step[rid] = max(m.step for m in quorum.participants) + 1  # behind: it healed, then committed

    async def close(self) -> None:
        for call in self.calls.values():
            call.cancel()
        await asyncio.gather(*self.calls.values(), return_exceptions=True)


def straggler(status: dict, rid: str) -> dict | None:
    """The ``straggler`` field of ``rid``'s row (None: no sample, or not seen at all)."""
    return next((r["straggler"] for r in status["replicas"] if r["replica_id"] == rid), None)


def test_a_5x_slower_group_is_flagged_after_patience_and_only_reported_without_eviction(caplog):
    caplog.set_level(logging.INFO, logger="lighthouse")

    async def scenario():
        async with running_lighthouse(min_replicas=1) as server:
            async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as client:
                groups = Groups(client, "abx")
                try:
                    for n in range(1, 13):
                        await groups.round({"a": FAST, "b": FAST, "x": SLOW}, must_answer="abx")
                        flagged = straggler(await get(server, "/api/status"), "x")["flagged"]
                        assert flagged == (n >= 5), n  # 3 samples to smooth, then patience=3 quorums
                finally:
                    await groups.close()
                assert all(q == ("a", "b", "x") for q in groups.answers["x"])  # only reported: never left out
                status = await get(server, "/api/status")
                x, a = straggler(status, "x"), straggler(status, "a")
                assert x["relative_score"] == pytest.approx(5.0) and x["quorum_median_ms"] == FAST
                assert x["individual_score"] == pytest.approx(1.0)  # always this slow: it has not slowed down
                assert (x["flagged"], x["evicted"], x["slow_streak"], x["samples"]) == (True, False, 10, 12)
                assert a["relative_score"] == pytest.approx(1.0) and a["flagged"] is False
                member_x = next(m for m in status["quorum"]["members"] if m["replica_id"] == "x")
                assert member_x["straggler"]["flagged"] is True
                summary = status["stragglers"]
                assert (summary["threshold"], summary["patience"], summary["evict"]) == (2.0, 3, False)
                assert (summary["flagged"], summary["evicted"], summary["evictions"]) == (["x"], [], 0)

                text = await get(server, "/metrics")
                assert metric(text, "lighthouse_straggler_relative_score", "x") == pytest.approx(5.0)
                assert metric(text, "lighthouse_straggler_relative_score", "a") == pytest.approx(1.0)
                assert metric(text, "lighthouse_straggler_individual_score", "x") == pytest.approx(1.0)
                assert metric(text, "lighthouse_straggler_compute_seconds", "x") == pytest.approx(0.5)
                assert metric(text, "lighthouse_straggler_flagged", "x") == 1.0
                assert metric(text, "lighthouse_straggler_flagged", "b") == 0.0
                assert metric(text, "lighthouse_straggler_evicted", "x") == 0.0
                assert metric(text, "lighthouse_straggler_evictions_total") == 0.0

                # A group the lighthouse forgets (its heartbeat expired) leaves no series behind.
                server._state.forget("x")
                text = await get(server, "/metrics")
                assert 'replica_id="x"' not in text and 'replica_id="a"' in text

    asyncio.run(scenario())
    assert "straggler x flagged" in caplog.text and "only reported" in caplog.text


def test_with_eviction_a_straggler_is_left_out_then_readmitted_behind_after_the_cooldown(caplog):
    caplog.set_level(logging.INFO, logger="lighthouse")

    async def scenario():
        async with running_lighthouse(min_replicas=1, evict_stragglers=True) as server:
            async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as client:
                groups = Groups(client, "abx")
                try:
                    rounds = 0
                    while not (straggler(await get(server, "/api/status"), "x") or {}).get("evicted"):
                        await groups.round({"a": FAST, "b": FAST, "x": SLOW}, must_answer="abx")
                        rounds += 1
                        assert rounds <= 5
                    assert rounds == 5
                    status = await get(server, "/api/status")
                    assert status["stragglers"]["evicted"] == ["x"]
                    assert straggler(status, "x")["evicted_until"] == "readmitted after 3 more quorums"
                    text = await get(server, "/metrics")
                    assert metric(text, "lighthouse_straggler_evicted", "x") == 1.0
                    assert metric(text, "lighthouse_straggler_evictions_total") == 1.0

                    # Left out: a and b form quorums of two; x's call waits, x keeps heartbeating.
                    for _ in range(3):
                        await groups.round({"a": FAST, "b": FAST, "x": SLOW}, must_answer="ab")
                        assert groups.answers["a"][-1] == ("a", "b")
                    # The cooldown's 3rd quorum readmitted x: its waiting call is in the next quorum, behind.
                    x_step = groups.step["x"]
                    await groups.round({"a": FAST, "b": FAST, "x": FAST}, must_answer="abx")
                    assert groups.answers["x"][-1] == ("a", "b", "x") == groups.answers["a"][-1]
                    assert x_step < groups.step["a"] - 1  # it joined behind and healed
                    status = await get(server, "/api/status")
                    assert "left out" not in status["status"]["reason"]
                    assert (status["stragglers"]["evictions"], status["stragglers"]["readmissions"]) == (1, 1)
                    text = await get(server, "/metrics")
                    assert metric(text, "lighthouse_straggler_readmissions_total") == 1.0
                    assert metric(text, "lighthouse_straggler_evicted", "x") == 0.0
                    # Back at speed: it stays in.
                    for _ in range(6):
                        await groups.round({"a": FAST, "b": FAST, "x": FAST}, must_answer="abx")
                    assert not straggler(await get(server, "/api/status"), "x")["flagged"]
                finally:
                    await groups.close()

    asyncio.run(scenario())
    assert "evicting straggler x" in caplog.text and "readmitting straggler x on probation" in caplog.text
    assert "passed its probation" in caplog.text
    assert re.search(r"quorum \d+ issued with 2 members \(a, b; left x\).*left out as stragglers: x", caplog.text)


def test_eviction_respects_min_replicas_and_never_takes_one_of_two(caplog):
    caplog.set_level(logging.WARNING, logger="lighthouse")

    async def scenario():
        async with running_lighthouse(min_replicas=3, evict_stragglers=True, straggler_patience=1) as server:
            async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as client:
                groups = Groups(client, "abx")
                try:
                    for _ in range(6):
                        await groups.round({"a": FAST, "b": FAST, "x": SLOW}, must_answer="abx")
                finally:
                    await groups.close()
                assert groups.answers["x"][-1] == ("a", "b", "x")
                x = straggler(await get(server, "/api/status"), "x")
                assert x["flagged"] and not x["evicted"] and "below min_replicas=3" in x["kept_in"]
        async with running_lighthouse(min_replicas=1, evict_stragglers=True, straggler_patience=1,
                                      straggler_threshold=1.2) as server:
            async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as client:
                groups = Groups(client, "ax")
                try:
                    for _ in range(6):  # 500 vs a median of 300: 1.67 > 1.2, flagged, but one of two stays
                        await groups.round({"a": FAST, "x": SLOW}, must_answer="ax")
                finally:
                    await groups.close()
                x = straggler(await get(server, "/api/status"), "x")
                assert x["flagged"] and not x["evicted"] and "only 2 healthy groups" in x["kept_in"]

    asyncio.run(scenario())
    assert "straggler x is flagged but stays in the quorum" in caplog.text


GARBAGE = [
    '{"compute_ms": "fast", "compute_step": 1}', '{"compute_ms": NaN, "compute_step": 1}',
    '{"compute_ms": Infinity, "compute_step": 1}', '{"compute_ms": -5, "compute_step": 1}',
    '{"compute_ms": 1e300, "compute_step": 1}', '{"compute_ms": true, "compute_step": 1}',
    '{"compute_ms": 5, "compute_step": -1}', '{"compute_ms": 5, "compute_step": 1.5}',
    '{"compute_ms": 5, "compute_step": 1' + "0" * 30 + "}", '{"compute_ms": [1], "compute_step": {"a": 1}}',
]


def test_garbage_compute_fields_are_ignored_and_counted_and_data_without_them_still_forms_quorums(caplog):
    caplog.set_level(logging.WARNING, logger="lighthouse")

    async def scenario():
        async with running_lighthouse(min_replicas=1, evict_stragglers=True) as server:
            async with LighthouseClient(f"127.0.0.1:{server.grpc_port}") as client:
                groups = Groups(client, ["ours", "evil", "torchft", "old"])
                try:
                    for n, garbage in enumerate(GARBAGE):
                        await groups.round({"ours": FAST, "evil": garbage, "torchft": "",
                                            "old": '{"resumed_from": 3}' if n % 2 else "compute_ms {"},
                                           must_answer=["ours", "evil", "torchft", "old"])
                        assert len(groups.answers["evil"][-1]) == 4
                finally:
                    await groups.close()
                status = await get(server, "/api/status")
                assert status["stragglers"]["refused_samples"] == len(GARBAGE)
                assert [straggler(status, rid) for rid in ("evil", "torchft", "old")] == [None, None, None]
                assert straggler(status, "ours")["samples"] == len(GARBAGE)
                text = await get(server, "/metrics")
                assert metric(text, "lighthouse_straggler_refused_samples_total") == len(GARBAGE)
                assert 'replica_id="evil"' not in text

    asyncio.run(scenario())
    lines = [r for r in caplog.records if "ignored the compute time that replica evil" in r.getMessage()]
    assert 1 <= len(lines) < len(GARBAGE)  # rate-limited
