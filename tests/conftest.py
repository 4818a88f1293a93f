"""Shared helpers of every layer: a lighthouse on port 0, condition polling, a clock the test moves,
a fake ManagerService."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Hashable, Iterable

import grpc
import pytest

from lighthouse.config import LighthouseConfig
from lighthouse.server import LighthouseServer
from torchft_lite.rpc.protocol import torchft_pb2 as pb

# Generous: the suite shares two cores with other processes.
WAIT = 60.0


def lighthouse_config(**overrides) -> LighthouseConfig:
    settings = dict(min_replicas=1, bind="127.0.0.1:0", http_bind="127.0.0.1:0", join_timeout=30.0,
                    heartbeat_timeout=5.0, quorum_tick=0.05, startup_grace=0.0)
    settings.update(overrides)
    return LighthouseConfig(**settings)


@contextlib.asynccontextmanager
async def running_lighthouse(**overrides) -> AsyncIterator[LighthouseServer]:
    server = LighthouseServer(lighthouse_config(**overrides))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = WAIT) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.05)


class FrozenClock:
    """A monotonic clock that moves only when the test moves it (``now``, or ``advance()``): pass it where
    code takes a ``clock``, so that a timeout passes exactly when the test says, never on its own."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def block_amax(tensor, block: int = 1024, dtype=None):
    """Each element's block maximum magnitude, shaped like ``tensor`` (blocks of ``block`` values of the
    flattened tensor), in ``dtype`` (float32 unless given): the scale behind 8-bit quantization's bounds."""
    import torch  # here, not at the top: most of the suite's tests need no torch

    flat = tensor.detach().reshape(-1).to(torch.float32 if dtype is None else dtype).abs()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block))
    return padded.view(-1, block).amax(1).repeat_interleave(block)[:flat.numel()].view(tensor.shape)


def two_layers(seed: int = 0):
    """The same two-layer model (3 -> 4 -> 2) for a seed every time: drawn from a generator of its own, as the
    global one is shared by the replica groups' threads."""
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return model


def cpu_mesh(ranks, names=None, rank: int = 0, device_type: str = "cpu"):
    """A DeviceMesh over ``ranks`` (nested lists: more dimensions) as rank ``rank`` sees it, built without
    process groups: DTensors on it need no collective, nor any process but this one."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=names, _init_backend=False, _rank=rank)


def dtensor(local, mesh, placements, shape):
    """A DTensor whose local shard is ``local`` on ``mesh`` (``placements``), standing for a contiguous tensor
    of ``shape``; no collective checks it."""
    import torch
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape).stride())


def read_header(blob: bytes):
    """The parsed header of an encoded checkpoint (its prefix's checksum checked) and the offset where the
    data after it starts."""
    from torchft_lite.serialization import spec

    length, crc = spec.unpack_prefix(blob[:spec.PREFIX_SIZE])
    header_end = spec.PREFIX_SIZE + length
    return spec.parse_header(blob[spec.PREFIX_SIZE:header_end], crc), header_end


def disk_full(*args, **kwargs):
    """A stand-in for a write (or an fsync) that finds the disk full: raises ENOSPC."""
    raise OSError(errno.ENOSPC, "No space left on device")


REQUIRE_TORCHFT_ENV = "TORCHFT_LITE_REQUIRE_TORCHFT"


def needs_torchft(available: bool, reason: str) -> pytest.MarkDecorator:
    """Skip (naming ``reason``) tests that need torchft where it is missing, except where
    ``TORCHFT_LITE_REQUIRE_TORCHFT=1`` (``.ci/run`` sets it): there collecting them fails, loudly."""
    if not available and os.environ.get(REQUIRE_TORCHFT_ENV) == "1":
        raise RuntimeError(f"{reason}, and {REQUIRE_TORCHFT_ENV}=1 requires the tests that compare with torchft "
                           f"to run: install torchft-nightly (make does)")
    return pytest.mark.skipif(not available, reason=reason)


def non_loopback_address() -> str:
    """An address of this machine other than loopback, for tests of protected mode (a peer that is not
    loopback); skips, naming why, on a machine that has none."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = probe.getsockname()[0]
        except OSError:
            address = ""
    if not address or address.startswith("127.") or address == "0.0.0.0":
        pytest.skip("skipped: this machine has no IPv4 address other than loopback to call a server from")
    return address


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA and a certificate it signed for 127.0.0.1/::1/localhost (openssl CLI), per module."""
    from benchmarks._throwaway_pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory):
    """A second CA and certificate, which ``pki``'s CA never signed: a client or server not of the job."""
    from benchmarks._throwaway_pki import make_pki

    return make_pki(tmp_path_factory.mktemp("other"), name="other")


def wait_until_sync(predicate: Callable[[], bool], what: str, timeout: float = WAIT, interval: float = 0.05,
                    failed: Callable[[], str | None] | None = None) -> None:
    """Poll ``predicate`` every ``interval`` seconds until true; fail naming ``what`` after ``timeout``
    seconds, or at once when ``failed()`` names why it can't come true any more (say, a process it waits
    for exited)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        reason = failed() if failed is not None else None
        if reason is not None:
            pytest.fail(f"{reason} while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def in_threads(keys: Iterable[Hashable], body: Callable[[Any], Any], timeout: float = WAIT,
               hung: str | None = "a thread hung") -> tuple[dict, dict]:
    """``body(key)`` for every key at once, on a thread each, each joined for up to ``timeout`` seconds; the
    test fails with ``hung`` if one is still running (unless ``hung`` is None). What each returned and what each
    raised, as two dicts in the order of ``keys``."""
    keys = list(keys)
    returned: dict = {}
    raised: dict = {}

    def run(key) -> None:
        try:
            returned[key] = body(key)
        except BaseException as exc:  # handed to the caller
            raised[key] = exc

    threads = [threading.Thread(target=run, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if hung is not None:
        assert not any(thread.is_alive() for thread in threads), hung
    return ({key: returned[key] for key in keys if key in returned},
            {key: raised[key] for key in keys if key in raised})


def all_in_threads(keys: Iterable[Hashable], body: Callable[[Any], Any], timeout: float = WAIT,
                   hung: str = "a thread hung") -> dict:
    """``in_threads``, where no ``body`` may raise: the test fails naming the first key whose did (its error
    chained). What each returned, by key."""
    returned, raised = in_threads(keys, body, timeout, hung)
    if raised:
        key, exc = next(iter(raised.items()))
        raise AssertionError(f"{key} raised {exc!r}") from exc
    return returned


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie). Linux: reads /proc."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class FakeManager:
    """A ManagerService that records Kill requests (for the dashboard's kill button)."""

    def __init__(self) -> None:
        self.kills: list[str] = []
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None

    async def _kill(self, request: bytes, context) -> bytes:
        self.kills.append(pb.KillRequest.FromString(request).msg)
        return b""

    async def start(self) -> "FakeManager":
        self._server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "torchft.ManagerService",
            {"Kill": grpc.unary_unary_rpc_method_handler(self._kill, lambda b: b, lambda b: b)},
        )
        self._server.add_generic_rpc_handlers((handler,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return self

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)
