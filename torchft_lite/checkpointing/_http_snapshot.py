"""What the checkpoint server serves: one published step (a :class:`Snapshot`) and its receivers (:class:`Session`).

A :class:`Snapshot` is shared by every request for its step: it holds the
flattened state dict (``serialization.encode.flatten``, validated when published),
encodes it when the first receiver asks, and sums every block once when a
striping receiver asks for the checksums. A :class:`Session` is one receiver
of it, named by the ``session`` each of its requests carries. The server that
answers the requests is ``_http_server``.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from dataclasses import dataclass, field

from aiohttp import web

from torchft_lite.serialization.encode import EncodedStateDict, FlatStateDict, encode

__all__ = ["Session", "Snapshot"]


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
    known: set[str] = field(default_factory=set)  # sessions that asked before the publish: may report done
    refused: int = 0  # new sessions refused (503) past the cap
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

