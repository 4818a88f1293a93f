"""The attack suite: floods against a real lighthouse, on each gRPC engine, while two legitimate replica
groups heartbeat and form quorums against it.

Each test shows, for one attack (issue 16):

* every legitimate call made during the attack succeeds, and their p99 latency stays under
  :data:`P99_BOUND` (1 s, the issue's bar); only the legitimate client's calls are timed;
* the lighthouse's memory stays bounded: its peak RSS (VmHWM of its process) grows by less than
  :data:`MEMORY_BOUND` over its RSS before the attack;
* where the engine has the limit, the attacker is cut off (GOAWAY, or the connection closed), and the
  native engine counts the hits (``GrpcServer.limits_hit``, read from the lighthouse process).

grpcio lacks some limits (a budget of reset streams, SETTINGS frames per window, a deadline for a
trickling request body, a header cap before its SETTINGS are acknowledged:
``torchft_lite.rpc.limits.grpcio_options`` lists them); for those its test asserts the first two points
only (measured on 2 cores, its legitimate p99 stayed under 40 ms through all of them). The lighthouse runs in its own process (tests/integration/flood_lighthouse.py, with
the idle and request deadlines shortened to seconds); the attacker runs on this test's event loop and the
legitimate client on a thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from tests.conftest import WAIT, wait_until_sync
from tests.integration.flood_lighthouse import IDLE_TIMEOUT, REQUEST_TIMEOUT
from tests.integration.h2_raw import RawH2, call_frames, request_headers
from torchft_lite.rpc.access import Access
from torchft_lite.rpc.h2grpc import wire
from torchft_lite.rpc.lighthouse_client import LighthouseClient, LighthouseError
from torchft_lite.rpc.protocol import torchft_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
ENGINES = ["native", "grpcio"]
P99_BOUND = 1.0  # seconds
MEMORY_BOUND = 150 * 1024 * 1024  # bytes of peak RSS growth
MIN_ATTACK_SECONDS = 3.0  # an attack that its target cuts quickly keeps coming back for at least this long
CALL_TIMEOUT = 30.0
GET_CONFIG = b"/torchft.LighthouseService/GetConfig"


# ------------------------------------------------------------------ the lighthouse, in its own process


@dataclass
class Lighthouse:
    process: subprocess.Popen
    port: int
    status_path: Path

    def memory(self) -> dict[str, int]:
        """VmRSS and VmHWM (peak) of the lighthouse process, in bytes."""
        values = {}
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
        return values

    def status(self) -> dict:
        """What the native engine holds and counts (written by the process every 0.2 s)."""
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def status_written_after(self, moment: float) -> dict:
        """The first status the process writes after ``moment`` (wall clock): one read just after an attack
        can be the one written while its last connections were still being cut, and miss their counts."""
        def fresh() -> bool:
            try:
                return self.status_path.stat().st_mtime > moment
            except OSError:
                return False

        wait_until_sync(fresh, "a status written after the attack")
        return self.status()


@contextlib.contextmanager
def lighthouse_process(engine: str, tmp_path: Path):
    log = open(tmp_path / "lighthouse.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.flood_lighthouse", "--engine", engine,
         "--status", str(tmp_path / "status.json")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], WAIT)
        line = process.stdout.readline() if ready else ""
        if not line.startswith("port "):
            raise AssertionError(f"the lighthouse did not start within {WAIT:.0f}s: {line!r}; its log: "
                                 f"{(tmp_path / 'lighthouse.log').read_text()[-2000:]}")
        yield Lighthouse(process, int(line.split()[1]), tmp_path / "status.json")
    finally:
        process.terminate()
        try:
            process.wait(WAIT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(WAIT)
        process.stdout.close()
        log.close()


# ------------------------------------------------------------------ the legitimate client


class LegitimateClient:
    """Two replica groups on a thread and event loop of their own: each heartbeats, then joins the quorum
    of the next step, over and over; every call's latency and every failure is recorded."""

    def __init__(self, port: int) -> None:
        self.address = f"127.0.0.1:{port}"
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.quorums = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="legitimate-client")

    def __enter__(self) -> "LegitimateClient":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(CALL_TIMEOUT + WAIT)

    def snapshot(self) -> tuple[int, int, int]:
        """(calls, errors, quorums) so far: a mark to take the calls of an attack from."""
        with self._lock:
            return len(self.latencies), len(self.errors), self.quorums

    def since(self, mark: tuple[int, int, int]) -> tuple[list[float], list[str], int]:
        with self._lock:
            return self.latencies[mark[0]:], self.errors[mark[1]:], self.quorums - mark[2]

    async def _run(self) -> None:
        clients = [LighthouseClient(self.address, access=Access()) for _ in range(2)]
        try:
            await asyncio.gather(*(self._replica(client, f"legit-{i}") for i, client in enumerate(clients)))
        finally:
            for client in clients:
                await client.close()

    async def _replica(self, client: LighthouseClient, replica_id: str) -> None:
        step = 0
        while not self._stop.is_set():
            for call in (lambda: client.heartbeat(replica_id, timeout=CALL_TIMEOUT),
                         lambda: client.quorum(replica_id, timeout=CALL_TIMEOUT, step=step)):
                started = time.perf_counter()
                try:
                    await call()
                except LighthouseError as exc:
                    with self._lock:
                        self.errors.append(f"{replica_id}: {exc}")
                    continue
                with self._lock:
                    self.latencies.append(time.perf_counter() - started)
            with self._lock:
                self.quorums += replica_id == "legit-0"
            step += 1


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


# ------------------------------------------------------------------ the attacks


@dataclass
class Attack:
    """What an attack saw: connections made, and how each ended."""

    connections: int = 0
    goaways: dict[int, int] = field(default_factory=dict)  # GOAWAY error code -> connections that got it
    closed: int = 0  # connections the server closed
    refused_streams: int = 0  # streams the server ended (RST_STREAM or a non-OK grpc-status)
    notes: list[str] = field(default_factory=list)
    reasons: set[str] = field(default_factory=set)  # the GOAWAYs' debug data, shortened

    def saw(self, raw: RawH2) -> None:
        self.connections += 1
        goaway = raw.goaway()
        if goaway is not None:
            self.goaways[goaway[0]] = self.goaways.get(goaway[0], 0) + 1
            self.reasons.add(goaway[1][:48].decode("ascii", "replace"))
        self.closed += raw.eof
        self.refused_streams += sum(1 for f in raw.frames if f.kind == wire.RST_STREAM
                                    or (f.headers and f.headers.get(b"grpc-status", b"0") != b"0"))


async def repeat_until_sent(total: int, per_connection, port: int, attack: Attack, parallel: int = 1) -> None:
    """Run ``per_connection(raw) -> frames sent`` on new connections (``parallel`` at once) until ``total``
    frames were sent in all and MIN_ATTACK_SECONDS passed: an attacker that is cut off comes back."""
    sent = 0
    started = time.monotonic()

    async def one() -> None:
        nonlocal sent
        while sent < total or time.monotonic() - started < MIN_ATTACK_SECONDS:
            raw = await RawH2.open(port)
            try:
                sent += await per_connection(raw)
                await raw.closed(timeout=2.0)  # the server's last word, if it has one (late on a loaded machine)
            finally:
                raw.close()
                attack.saw(raw)

    await asyncio.gather(*(one() for _ in range(parallel)))


async def send_in_batches(raw: RawH2, frames, count: int, batch: int) -> int:
    """Send ``count`` frames made by ``frames(i)`` in writes of ``batch``; stop early once cut."""
    sent = 0
    while sent < count and not raw.eof:
        n = min(batch, count - sent)
        raw.send(b"".join(frames(sent + i) for i in range(n)))
        sent += n
        if not await raw.drain():
            break
    return sent


async def rapid_reset(port: int, engine: str) -> Attack:
    """20,000 streams, each a whole GetConfig call reset at once (CVE-2023-44487), 1,000 a connection."""
    attack = Attack()

    async def streams(raw: RawH2) -> int:
        def reset_call(i: int) -> bytes:
            return call_frames(2 * i + 1, b"", GET_CONFIG) + wire.rst_stream(2 * i + 1, wire.CANCEL)
        return await send_in_batches(raw, reset_call, 1000, 100)

    await repeat_until_sent(20_000, streams, port, attack)
    return attack


async def ping_flood(port: int, engine: str) -> Attack:
    """100,000 PINGs, 1,000 a connection, 10 connections at a time."""
    attack = Attack()
    ping = wire.frame(wire.PING, 0, 0, b"flooding")

    async def pings(raw: RawH2) -> int:
        return await send_in_batches(raw, lambda i: ping, 1000, 250)

    await repeat_until_sent(100_000, pings, port, attack, parallel=10)
    return attack


async def settings_flood(port: int, engine: str) -> Attack:
    """20,000 SETTINGS frames (each changing the stream window: work to apply), 1,000 a connection,
    10 connections at a time (grpcio, which does not cut them, takes most of a minute per 20,000)."""
    attack = Attack()
    frames = [wire.settings_frame({wire.SETTINGS_INITIAL_WINDOW_SIZE: w}) for w in (65_535, 70_000)]

    async def settings(raw: RawH2) -> int:
        return await send_in_batches(raw, lambda i: frames[i % 2], 1000, 250)

    await repeat_until_sent(20_000, settings, port, attack, parallel=10)
    return attack


async def idle_connections(port: int, engine: str) -> Attack:
    """1,000 HTTP/2 connections that open no stream, held until the server closes them."""
    attack = Attack()
    held: list[RawH2] = []
    try:
        for _ in range(10):
            held += await asyncio.gather(*(RawH2.open(port) for _ in range(100)))
        await asyncio.gather(*(raw.closed(IDLE_TIMEOUT + WAIT) for raw in held))
    finally:
        for raw in held:
            raw.close()
            attack.saw(raw)
    return attack


async def oversized_headers(port: int, engine: str) -> Attack:
    """100 requests, each with a 100 KiB header value (the cap is 16 KiB) over CONTINUATION frames; every
    other one sent only after acknowledging the server's SETTINGS (grpc applies its cap only from then)."""
    attack = Attack()
    acked = 0
    block = request_headers(GET_CONFIG, [(b"x-flood", b"h" * 100 * 1024)])
    chunks = [block[i:i + 16_000] for i in range(0, len(block), 16_000)]
    frames = (wire.frame(wire.HEADERS, 0, 1, chunks[0])
              + b"".join(wire.frame(wire.CONTINUATION, 0, 1, c) for c in chunks[1:-1])
              + wire.frame(wire.CONTINUATION, wire.END_HEADERS, 1, chunks[-1])
              + wire.frame(wire.DATA, wire.END_STREAM, 1, wire.grpc_message(b"")))

    async def one(raw: RawH2) -> int:
        nonlocal acked
        if attack.connections % 2:
            await raw.wait_for(lambda f: f.kind == wire.SETTINGS and not f.flags & wire.ACK, "the server's SETTINGS")
            acked += 1  # RawH2 acknowledged them as they came
        raw.send(frames)
        await raw.drain()
        await raw.wait_for(lambda f: f.kind in (wire.GOAWAY, wire.RST_STREAM) or (f.stream_id == 1 and f.headers),
                           "an answer to the oversized header list")
        return 1

    await repeat_until_sent(100, one, port, attack, parallel=5)
    attack.notes = [f"sent after acknowledging SETTINGS: {acked}"]
    return attack


async def oversized_messages(port: int, engine: str) -> Attack:
    """Heartbeat calls of 5 MiB each (the cap is 4 MiB), 5 at a time on grpc's own client, 50 at least."""
    attack = Attack()
    codes: list[grpc.StatusCode] = []
    started = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/torchft.LighthouseService/Heartbeat")
        message = pb.LighthouseHeartbeatRequest(replica_id="r" * 5 * 1024 * 1024).SerializeToString()
        while len(codes) < 50 or time.monotonic() - started < MIN_ATTACK_SECONDS:
            results = await asyncio.gather(*(call(message, timeout=WAIT) for _ in range(5)), return_exceptions=True)
            codes += [r.code() if isinstance(r, grpc.aio.AioRpcError) else grpc.StatusCode.OK for r in results]
    attack.connections = len(codes)  # calls, here
    attack.refused_streams = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    attack.notes = sorted({code.name for code in codes})
    return attack


async def slowloris(port: int, engine: str) -> Attack:
    """100 requests whose body, and 100 whose header block, trickle in a byte every 0.5 s."""
    attack = Attack()
    bodies = [await RawH2.open(port) for _ in range(100)]
    heads = [await RawH2.open(port) for _ in range(100)]
    block = request_headers(GET_CONFIG)
    try:
        for raw in heads:  # its ACK must not fall inside the header block
            await raw.wait_for(lambda f: f.kind == wire.SETTINGS and not f.flags & wire.ACK, "the server's SETTINGS")
        for raw in bodies:
            raw.send(wire.frame(wire.HEADERS, wire.END_HEADERS, 1, block)
                     + wire.frame(wire.DATA, 0, 1, wire.GRPC_MESSAGE_HEADER.pack(0, 1000)))
        for raw in heads:
            raw.send(wire.frame(wire.HEADERS, 0, 1, block[:10]))
        deadline = time.monotonic() + 2 * REQUEST_TIMEOUT + 2
        while time.monotonic() < deadline:
            if engine == "native" and all(r.eof or r.grpc_status(1) is not None for r in bodies + heads):
                break  # all cut: nothing left to trickle
            for raw in bodies:
                raw.send(wire.frame(wire.DATA, 0, 1, b"s"))
            for raw in heads:
                raw.send(wire.frame(wire.CONTINUATION, 0, 1, b"\x00"))
            await asyncio.sleep(0.5)
        attack.notes = [f"bodies ended by the server: {sum(r.grpc_status(1) is not None for r in bodies)}/100",
                        f"header blocks cut: {sum(r.eof for r in heads)}/100"]
    finally:
        for raw in bodies + heads:
            raw.close()
            attack.saw(raw)
    return attack


ATTACKS = [rapid_reset, ping_flood, settings_flood, idle_connections, oversized_headers, oversized_messages,
           slowloris]


CALM, NO_ERROR = wire.ENHANCE_YOUR_CALM, wire.NO_ERROR


def check_cut(attack: str, engine: str, outcome: Attack, hits: dict[str, int]) -> None:
    """Where ``engine`` has the limit ``attack`` runs into, the attacker was cut off (and, native, counted)."""
    every = outcome.connections
    if attack in ("rapid_reset", "ping_flood", "settings_flood", "oversized_headers"):
        if engine == "native":  # the reason reaches the peer: GOAWAY before a FIN, never a reset
            assert outcome.goaways.get(CALM, 0) == every, f"not every connection got GOAWAY ENHANCE_YOUR_CALM: {outcome}"
        elif attack in GRPCIO_CUTS:  # grpc sometimes resets the connection instead of letting its GOAWAY arrive
            assert outcome.closed == every and outcome.goaways.get(CALM, 0) > 0, f"connections held: {outcome}"
    if attack == "idle_connections":  # every one of them closed, by either engine
        assert outcome.closed == every == 1000, f"idle connections held: {outcome}"
        if engine == "native":
            assert outcome.goaways.get(NO_ERROR, 0) == 1000, outcome
    if attack == "oversized_headers" and engine == "grpcio":
        # grpc-core holds a peer to its header list cap only once the peer acknowledged its SETTINGS; a
        # request sent before that is served whatever its size (8 MB was tried): see grpcio_options.
        acked = int(outcome.notes[0].rpartition(" ")[2])
        assert outcome.refused_streams >= acked > 0, f"an acknowledged oversized request was served: {outcome}"
    if attack == "oversized_messages":
        assert outcome.refused_streams == outcome.connections >= 50 and outcome.notes == ["RESOURCE_EXHAUSTED"], outcome
    if attack == "slowloris" and engine == "native":
        assert outcome.notes == ["bodies ended by the server: 100/100", "header blocks cut: 100/100"], outcome
    if attack == "slowloris" and engine == "grpcio":  # no stream before its headers end: idle, to grpc
        assert outcome.notes[1] == "header blocks cut: 100/100", outcome
    if engine == "native":
        names = {"rapid_reset": ["rapid_reset"], "ping_flood": ["ping_flood"], "settings_flood": ["settings_flood"],
                 "idle_connections": ["idle_timeout"], "oversized_headers": ["header_list_size"],
                 "oversized_messages": ["request_size"], "slowloris": ["slow_request"]}[attack]
        assert all(hits.get(name, 0) > 0 for name in names), f"the lighthouse counted {hits}"


# Attacks that grpcio also cuts with GOAWAY ENHANCE_YOUR_CALM (the others: see grpcio_options).
GRPCIO_CUTS = ("ping_flood",)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("attack", ATTACKS, ids=lambda attack: attack.__name__)
def test_legitimate_calls_go_on_during_a_flood(attack, engine, tmp_path):
    with lighthouse_process(engine, tmp_path) as lighthouse, LegitimateClient(lighthouse.port) as legit:
        wait_until_sync(lambda: legit.snapshot()[2] >= 5, "the legitimate groups' first quorums")
        before, mark = lighthouse.memory(), legit.snapshot()
        started = time.monotonic()
        outcome = asyncio.run(attack(lighthouse.port, engine))
        elapsed, ended = time.monotonic() - started, time.time()
        latencies, errors, quorums = legit.since(mark)
        after, status = lighthouse.memory(), lighthouse.status_written_after(ended)
    log = (tmp_path / "lighthouse.log").read_text()
    growth = after["VmHWM"] - before["VmRSS"]
    summary = (f"{attack.__name__} on {engine}: {elapsed:.1f}s, legitimate calls {len(latencies)} "
               f"(quorums {quorums}), p99 {p99(latencies) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms, "
               f"errors {len(errors)}; lighthouse RSS {before['VmRSS'] >> 20} MiB -> peak {after['VmHWM'] >> 20} MiB; "
               f"attack {outcome}; server {status}")
    print(summary)
    assert not errors, f"legitimate calls failed: {errors[:3]}\n{summary}"
    assert quorums >= 3, f"the legitimate groups made no progress during the attack\n{summary}"
    assert p99(latencies) < P99_BOUND, summary
    assert growth < MEMORY_BOUND, summary
    check_cut(attack.__name__, engine, outcome, status.get("limits_hit", {}))
    if engine == "native":  # every hit counted, but logged at most once per 10 s
        assert log.count("hit a flood limit") <= elapsed / 10 + 2, log[-3000:]
