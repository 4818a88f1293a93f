"""Helpers shared by the integration tests (fixtures are in conftest.py next to this file).

Plain functions and classes, imported by the test modules (and by the processes some of them spawn): nothing
here starts anything at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import socket
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import aiohttp
import grpc
import torch
from torch.distributed import TCPStore

from lighthouse.server import LighthouseServer
from tests.conftest import WAIT, all_in_threads, wait_until_sync
from torchft_lite.cluster.local import LighthouseProcess, ReplicaGroup
from torchft_lite.group_server.server import ManagerServer, ManagerServerConfig
from torchft_lite.manager import Manager
from torchft_lite.rpc.access import Access
from torchft_lite.rpc.h2grpc import GrpcServer
from torchft_lite.rpc.lighthouse_client import LighthouseClient
from torchft_lite.rpc.tls import TlsSettings
from torchft_lite.serialization import encode
from torchft_lite.serialization.spec import byte_view, format_path


def client_for(server: LighthouseServer) -> LighthouseClient:
    """A gRPC client of ``server`` (in this process, on 127.0.0.1) that waits up to WAIT to connect."""
    return LighthouseClient(f"127.0.0.1:{server.grpc_port}", connect_timeout=WAIT)


def form_quorum(lighthouse, members: dict[str, tuple[int, str]]) -> None:
    """One quorum of ``members`` (replica id: (step, address), each of world size 2) on ``lighthouse`` (a
    BackgroundLighthouse), joined from a thread of its own: a browser test's thread has Playwright's loop."""
    async def join():
        async with LighthouseClient(f"127.0.0.1:{lighthouse.grpc_port}") as client:
            await asyncio.gather(*(client.quorum(rid, timeout=60, step=step, address=address, world_size=2)
                                   for rid, (step, address) in members.items()))

    all_in_threads([0], lambda _: asyncio.run(join()), 120, "the quorum's thread hung")


# ---------------------------------------------------------------- the lighthouse's own gRPC server


class Probe:
    """gRPC handlers whose behaviour a test picks through the request bytes.

    Echo answers ``big:N`` with N bytes (rounded down to 256s), aborts with FAILED_PRECONDITION on ``abort``,
    raises on ``raise``, holds ``hold`` until ``release`` is set, and on ``wait`` sets ``started`` and waits
    until cancelled (counted in ``cancelled``); anything else comes back as it is, followed by ``|`` and the
    peer's address when ``echo_peer``. Count streams the numbers below its request; Watch, a long-lived stream
    as a lease is, says ``open`` and holds until ``release``."""

    def __init__(self, echo_peer: bool = False) -> None:
        self.echo_peer = echo_peer
        self.cancelled = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def echo(self, request: bytes, context) -> bytes:
        if request.startswith(b"big:"):
            return bytes(range(256)) * (int(request[4:]) // 256)
        if request == b"abort":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not now: caf\u00e9 100%")
        if request == b"raise":
            raise RuntimeError("boom")
        if request == b"hold":
            await self.release.wait()
        if request == b"wait":
            self.started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return request + b"|" + context.peer().encode() if self.echo_peer else request

    async def count(self, request: bytes, context):
        for i in range(int(request)):
            yield str(i).encode()

    async def watch(self, request: bytes, context):
        yield b"open"
        await self.release.wait()


@contextlib.asynccontextmanager
async def probe_server(echo_peer: bool = False, **settings) -> AsyncIterator[tuple[GrpcServer, Probe, int]]:
    """A GrpcServer (``settings`` are its own) on 127.0.0.1, port 0, serving a ``Probe`` at /t.S/Echo,
    /t.S/Count and /t.S/Watch: ``(server, probe, port)``. At the end the probe's holds are released and the
    server stopped (1 s of grace)."""
    probe = Probe(echo_peer)
    server = GrpcServer(**settings)
    server.add_unary("/t.S/Echo", probe.echo)
    server.add_server_stream("/t.S/Count", probe.count)
    server.add_server_stream("/t.S/Watch", probe.watch)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, probe, port
    finally:
        probe.release.set()
        await server.stop(1.0)


# ---------------------------------------------------------------- HTTP requests


def bearer(token: str | None) -> dict[str, str]:
    """The header that carries ``token`` (none for None)."""
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def fetch(url: str, method: str = "GET", headers: dict[str, str] | None = None, *,
          context: ssl.SSLContext | None = None, text: bool = False, timeout: float = WAIT,
          expect: int | None = None) -> tuple[int, Any, dict[str, str]]:
    """Status, body (bytes; a str when ``text``) and headers of one blocking request; an error status is an
    answer too, and ``expect`` is the status it must have, when given."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:
            status, body, answer_headers = answer.status, answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as refused:
        with refused:
            status, body, answer_headers = refused.code, refused.read(), dict(refused.headers)
    assert expect is None or status == expect, (url, status, body[:500])
    return status, body.decode() if text else body, answer_headers


async def http(target: LighthouseServer | int, method: str, path: str, *, host: str = "127.0.0.1",
               session: aiohttp.ClientSession | None = None, **kwargs) -> tuple[int, Any, dict[str, str]]:
    """Status, body (JSON when it parses, else text) and headers of one request to the HTTP side of ``target``
    (a lighthouse server, or the port it serves HTTP on) at ``host``; a redirect is an answer, not followed.
    Over ``session`` when given (its cookies, its headers), else over a session of its own."""
    port = target if isinstance(target, int) else target.http_port
    own = session is None
    session = session or aiohttp.ClientSession()
    try:
        async with session.request(method, f"http://{host}:{port}{path}", allow_redirects=False,
                                   **kwargs) as response:
            text = await response.text()
            try:
                body = json.loads(text)
            except ValueError:
                body = text
            return response.status, body, dict(response.headers)
    finally:
        if own:
            await session.close()


# ---------------------------------------------------------------- checkpoints: what was sent, what arrived


def digest(step: int, state) -> str:
    """Of the whole encoding of ``state`` as ``step``: every tensor's bytes, dtype and shape, and every
    non-tensor leaf."""
    return hashlib.sha256(encode.encode_to_bytes(step, state)).hexdigest()


def same_encoding(received, sent, step: int = 5) -> bool:
    """Whether ``received`` and ``sent`` encode to the same bytes as ``step``."""
    return encode.encode_to_bytes(step, received) == encode.encode_to_bytes(step, sent)


def tensor_digest(tensor) -> str:
    """Of one tensor's bytes (a DTensor: pass its local shard, or ``full_tensor()``), 16 hex digits."""
    return hashlib.sha256(byte_view(tensor.detach().contiguous())).hexdigest()[:16]


def shard_digests(state: dict) -> dict[str, str]:
    """This rank's local tensors of ``state`` (a DTensor's shard) by path, each hashed by ``tensor_digest``."""
    flat = encode.flatten(state)
    return {format_path(path): tensor_digest(tensor) for path, tensor in zip(flat.paths, flat.tensors)}


class ScriptedSource:
    """A checkpoint source on 127.0.0.1 (port 0, at ``url``) that answers each request with ``answer(path,
    query)``, a whole HTTP response, then closes the connection; ``paths`` holds ``"METHOD path"`` of every
    request. It serves from a thread of ``threads`` (an executor) until ``close()``: for answers our own
    server never gives (the ``scripted`` fixture closes the ones it starts)."""

    def __init__(self, threads, answer: Callable[[str, dict[str, str]], bytes]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/checkpoint"
        self.paths: list[str] = []
        self.stopped = False
        self.task = threads.submit(self._serve, answer)

    def _serve(self, answer) -> None:
        while not self.stopped:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(WAIT)
                request = read_request(conn)
                method, target = request.split(b" ")[:2]
                parsed = urllib.parse.urlsplit(target.decode())
                self.paths.append(f"{method.decode()} {parsed.path}")
                try:
                    conn.sendall(answer(parsed.path, dict(urllib.parse.parse_qsl(parsed.query))))
                except OSError:
                    pass  # the receiver hung up (it refused the answer): the test says what it expected

    def close(self) -> None:
        self.stopped = True
        self.task.result(WAIT)
        self.listener.close()


def read_request(conn: socket.socket) -> bytes:
    """A request's head (and whatever came with it), read until its blank line or the peer's close."""
    request = b""
    while b"\r\n\r\n" not in request:
        chunk = conn.recv(4096)
        if not chunk:
            break
        request += chunk
    return request


def response(status: int, body: bytes, extra: str = "") -> bytes:
    """A whole HTTP/1.1 answer: ``status``, Content-Length, the header lines in ``extra`` and ``body``."""
    return (f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


# ---------------------------------------------------------------- Managers in this process


PAIR = dict(min_replica_size=2, use_async_quorum=False, connect_timeout=timedelta(seconds=20))
"""``make_manager`` settings of two replica groups in threads that wait for each other at every step."""


def make_manager(lighthouse, pg, transport, replica_id: str, state: dict | None = None, *,
                 load_state_dict: Callable[[Any], None] | None = None, state_dict: Callable[[], Any] | None = None,
                 timeout: float = 20.0, min_replica_size: int = 1, preemption_signals=(), **settings):
    """A Manager of one rank on ``lighthouse`` (a BackgroundLighthouse), with its own TCPStore on port 0
    (kept alive as long as the manager) and ``transport`` (None: the Manager's default).

    Its state: ``load_state_dict``/``state_dict`` when given; else the dict ``state`` (a fresh
    ``{"w": zeros(3)}`` by default), whose ``"w"`` is what a heal sends and replaces. ``settings`` go to
    the Manager as they are."""
    if load_state_dict is None or state_dict is None:
        weights = state if state is not None else {"w": torch.zeros(3)}
        load_state_dict = lambda sd: weights.update(w=sd["w"].clone())  # noqa: E731
        state_dict = lambda: {"w": weights["w"]}  # noqa: E731
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=min_replica_size, rank=0,
        world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse.server.address(),
        replica_id=replica_id, hostname="127.0.0.1", checkpoint_transport=transport,
        timeout=timedelta(seconds=timeout), quorum_timeout=timedelta(seconds=30),
        preemption_signals=preemption_signals, **settings,
    )
    manager._test_store = store  # keep the store alive as long as the manager
    return manager


def run_two(fn: Callable[[int], Any]) -> list[Any]:
    """``fn(0)`` and ``fn(1)`` in two threads at once (two replica groups); their results, each waited for
    up to 3 x WAIT."""
    return list(all_in_threads(range(2), fn, 3 * WAIT, "a replica group's thread hung").values())


@contextlib.asynccontextmanager
async def manager_server(lighthouse_addr: str, access: Access | None = None, *, tls: TlsSettings | None = None,
                         lighthouse: LighthouseClient | None = None, **settings):
    """A ManagerServer on 127.0.0.1 (port 0) whose Kill is recorded in ``server.kills`` instead of exiting;
    stopped at the end. Replica "victim" of one rank, store "store:1234", heartbeats every 0.1 s and a
    quorum timeout of WAIT, unless ``settings`` (ManagerServerConfig's) say otherwise. ``access``, ``tls``
    and ``lighthouse`` (a client of its own) go to the server: None is the server's default."""
    config = dict(replica_id="victim", lighthouse_addr=lighthouse_addr, hostname="127.0.0.1",
                  store_address="store:1234", world_size=1, bind="127.0.0.1:0", heartbeat_interval=0.1,
                  quorum_timeout=WAIT)
    config.update(settings)
    kills: list[str] = []
    server = ManagerServer(ManagerServerConfig(**config), on_kill=kills.append, lighthouse=lighthouse,
                           access=access, tls=tls)
    server.kills = kills
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


# ---------------------------------------------------------------- jobs of replica-group processes

REPO = Path(__file__).resolve().parents[2]
TRAIN_DDP = REPO / "examples" / "train_ddp.py"
TRAIN_HSDP = REPO / "examples" / "train_hsdp.py"
JOB_WAIT = 240.0  # generous: several torch processes share two cores


def read_reports(path: Path) -> list[dict]:
    """The rows a job's ``--report`` file holds so far: one JSON object a line (none before the file exists)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_of(rows: list[dict], group: int, rank: int = 0) -> list[int]:
    return [r["step"] for r in rows if r["group"] == group and r["rank"] == rank]


def assert_identical_per_step(rows: list[dict]) -> int:
    """Group rank r of every replica group holds the same parameters at every step it committed.

    (Group rank r of all replica groups forms one data-parallel ring, as in
    torchft; ranks of one group see different data, so they are compared per
    rank.) Returns how many (step, rank) pairs were seen by more than one group.
    """
    by_step: dict[tuple[int, int], dict[int, str]] = defaultdict(dict)
    for row in rows:
        by_step[(row["step"], row["rank"])][row["group"]] = row["checksum"]
    shared = 0
    for (step, rank), sums in sorted(by_step.items()):
        assert len(set(sums.values())) == 1, f"parameters diverged at step {step} rank {rank}: {sums}"
        shared += len(sums) > 1
    return shared


def read_logs(directory: Path, pattern: str) -> str:
    """The logs under ``directory`` whose names match ``pattern`` (such as ``group1.*.log``), in name order."""
    return "".join(p.read_text(errors="replace") for p in sorted(directory.glob(pattern)))


def metrics_urls(directory: Path, pattern: str = "group0.*.log") -> list[str]:
    """The Prometheus addresses the trainers whose logs match ``pattern`` said they serve on."""
    return re.findall(r"serving Prometheus metrics on (http://127\.0\.0\.1:\d+/metrics)", read_logs(directory, pattern))


def failed_group(groups: Sequence[ReplicaGroup]) -> str | None:
    """Which of ``groups`` has no process left and one that exited with an error, if any."""
    for group in groups:
        if not group.alive() and any(code not in (0, None) for code in group.wait(0)):
            return f"group {group.group_id} exited with {group.wait(0)}"
    return None


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = JOB_WAIT,
             groups: Sequence[ReplicaGroup] = ()) -> None:
    """Poll ``predicate`` every 0.2 s until true; fail naming ``what`` after ``timeout`` seconds, or at once
    when one of ``groups`` failed (``failed_group``)."""
    wait_until_sync(predicate, what, timeout, interval=0.2, failed=lambda: failed_group(groups))


@contextlib.contextmanager
def replica_groups(tmp_path: Path, **lighthouse_kw) -> Iterator[tuple[LighthouseProcess, Callable[..., ReplicaGroup]]]:
    """A lighthouse process (no startup grace unless ``lighthouse_kw`` says otherwise: these tests start every
    group themselves) and ``start(group_id, num_groups, script, args, world_size=1, env=None)``, which starts a
    replica group logging under ``tmp_path``. Every group, then the lighthouse, is stopped at the end."""
    lighthouse_kw.setdefault("startup_grace", 0.0)
    lighthouse = LighthouseProcess(log_path=tmp_path / "lighthouse.log", **lighthouse_kw).start()
    groups: list[ReplicaGroup] = []

    def start(group_id: int, num_groups: int, script: Path, args: Sequence[str], world_size: int = 1,
              env: dict[str, str] | None = None) -> ReplicaGroup:
        group = ReplicaGroup(group_id, num_groups, lighthouse.address, script, args, world_size=world_size,
                             log_dir=tmp_path, env=env)
        groups.append(group)
        return group.start()

    try:
        yield lighthouse, start
    finally:
        for group in groups:
            group.stop()
        lighthouse.stop()


@contextlib.contextmanager
def cluster(tmp_path: Path, **lighthouse_kw):
    """``replica_groups`` of ``examples/train_ddp.py``: yields the lighthouse, ``add(group_id, num_groups,
    steps, ...)`` (a group reporting to the job's report file) and that file."""
    report = tmp_path / "report.jsonl"
    with replica_groups(tmp_path, **lighthouse_kw) as (lighthouse, start):
        def add(group_id: int, num_groups: int, steps: int, world_size: int = 1, sleep: float = 0.0,
                env: dict[str, str] | None = None, pg: str = "gloo", min_replicas: int = 1,
                extra: tuple[str, ...] = ()) -> ReplicaGroup:
            return start(group_id, num_groups, TRAIN_DDP,
                         ["--steps", str(steps), "--report", str(report), "--step-sleep", str(sleep), "--timeout", "15",
                          "--pg", pg, "--min-replicas", str(min_replicas), *extra],
                         world_size=world_size, env=env)

        yield lighthouse, add, report
