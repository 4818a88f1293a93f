"""The serving side's parts of HTTPTransport: a published snapshot, its receiver sessions, the socket.

A :class:`Snapshot` is one published state dict, shared by every request for
its step; a :class:`Session` is one receiver of it. :func:`pieces_of` says
what a request gets; :func:`listen`, :func:`tune` and :func:`flushed` handle
the socket. The server itself (routes, publishing, releasing) is
``http_transport``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Iterable

from aiohttp import web

from torchft_lite.checkpointing._encode import EncodedStateDict, FlatStateDict, encode

__all__ = ["Session", "Snapshot", "flushed", "listen", "pieces_of", "tune"]

logger = logging.getLogger("torchft_lite.checkpointing.http_transport")  # one logger for the server

_SEND_BUFFER_BYTES = 8 << 20
_QUEUE_BYTES = 16 << 20  # views of tensor memory the transport may queue before the stream waits


@dataclass
class Session:
    """One receiver of one snapshot.

    It is finished once every data byte has been written to it (the snapshot
    is no longer needed for it), once it reports done, or once a stream of it
    fails.
    """

    peer: str
    bytes_sent: int = 0
    data_sent: int = 0
    sent_all: bool = False
    ok: bool | None = None  # what the receiver reported, or False when a stream failed

    @property
    def finished(self) -> bool:
        return self.sent_all or self.ok is not None

    def describe(self) -> str:
        status = {True: "ok", False: "failed", None: "sent"}[self.ok]
        return f"{self.peer} {status} {self.bytes_sent}B"


@dataclass
class Snapshot:
    """A published state dict: shared by every request for its step."""

    step: int
    flat: FlatStateDict
    expected: int
    timeout: float
    deadline: float
    published_at: float
    sessions: dict[str, Session] = field(default_factory=dict)
    finished: int = 0  # sessions finished; a counter, so other threads can read it
    streams: set[asyncio.Task] = field(default_factory=set)
    encoding: asyncio.Future | None = None
    checksums: asyncio.Future | None = None  # every block's sum, packed: one pass shared by every receiver
    stop_encoding: threading.Event = field(default_factory=threading.Event)
    closed: bool = False

    def receivers_done(self) -> bool:
        return self.finished >= self.expected and self.finished == len(self.sessions)

    async def encoded(self) -> EncodedStateDict:
        """The encoding, started by the first receiver (tensors are read only when someone asks)."""
        loop = asyncio.get_running_loop()
        if self.encoding is None:
            self.encoding = loop.run_in_executor(
                None, functools.partial(encode, self.step, self.flat, should_stop=self.stop_encoding.is_set))
        try:
            return await asyncio.wait_for(asyncio.shield(self.encoding), max(0.0, self.deadline - loop.time()))
        except TimeoutError as exc:
            raise web.HTTPGatewayTimeout(text=f"step {self.step} was not encoded within the send timeout") from exc

    async def packed_checksums(self, encoded: EncodedStateDict) -> bytes:
        """Every block's sum, summed on a worker thread: the event loop goes on serving data meanwhile.

        Blocks this replica has sent were summed as they went out and are not
        read again; a release stops the pass between two blocks.
        """
        loop = asyncio.get_running_loop()
        if self.checksums is None:
            self.checksums = loop.run_in_executor(
                None, functools.partial(encoded.packed_checksums, should_stop=self.stop_encoding.is_set))
        try:
            return await asyncio.wait_for(asyncio.shield(self.checksums), max(0.0, self.deadline - loop.time()))
        except TimeoutError as exc:
            raise web.HTTPGatewayTimeout(text=f"step {self.step} was not checksummed within the send timeout") \
                from exc


def listen(host: str, port: int) -> socket.socket:
    if ":" in host:
        try:
            return socket.create_server((host, port), family=socket.AF_INET6, dualstack_ipv6=host == "::")
        except OSError:
            if host != "::":
                raise
            logger.info("IPv6 unavailable; the checkpoint server listens on 0.0.0.0 instead of ::")
            host = "0.0.0.0"
    return socket.create_server((host, port))


def pieces_of(request: web.Request, encoded: EncodedStateDict, part: str,
              sums: bytes) -> tuple[Iterable[memoryview | bytes], int, int]:
    """What to write for ``part``: the pieces, their total length, and how many data bytes they hold."""
    if part == "header":
        return [encoded.header], len(encoded.header), 0
    if part == "checksums":
        return [sums], len(sums), 0
    if part == "all":
        body, length = encoded.body()
        return itertools.chain([encoded.header], body), len(encoded.header) + length, encoded.data_bytes
    try:
        start, end = int(request.query["start"]), int(request.query["end"])
    except (KeyError, ValueError) as exc:
        raise web.HTTPBadRequest(text="start and end byte offsets are required") from exc
    try:
        body, length = encoded.body(start, end)
    except ValueError as exc:  # outside the data, or not on checksum block boundaries
        raise web.HTTPBadRequest(text=str(exc)) from exc
    return body, length, end - start


def tune(transport: asyncio.BaseTransport | None) -> None:
    """Big kernel send buffers and a deep write queue: the queue holds views, never copies."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER_BYTES)
        except OSError as exc:
            logger.debug("could not enlarge the send buffer: %r", exc)
    transport.set_write_buffer_limits(high=_QUEUE_BYTES)  # type: ignore[attr-defined]


async def flushed(transport: asyncio.BaseTransport | None) -> None:
    """Wait until ``transport`` has handed every queued byte to the kernel (or is closing).

    Duck-typed: uvloop's transports are not registered as ``asyncio.WriteTransport``.
    """
    delay = 0.0001
    while transport is not None and not transport.is_closing() \
            and transport.get_write_buffer_size():  # type: ignore[attr-defined]
        await asyncio.sleep(delay)
        delay = min(2 * delay, 0.005)
