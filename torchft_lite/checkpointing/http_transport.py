"""HTTPTransport: serve one step's state dict over HTTP from the control-plane loop.

Routes (``{step}`` is the step asked for; every request names its receiver
session with ``?session=<id>``; held requests also pass ``?timeout=<seconds>``)::

    GET  /checkpoint/{step}                      prefix + header + data, one stream
    GET  /checkpoint/{step}/header               prefix + header only
    GET  /checkpoint/{step}/data?start=&end=     data bytes [start, end)
    GET  /checkpoint/{step}/checksums            the sum64 of every data block (uint64 LE each)
    POST /checkpoint/{step}/done?ok=1|0          the receiver has finished (also before the step is published)

A request for a step not published yet is held until it is (or until its
timeout: 504). A request for an older step, or one already released by
:meth:`HTTPTransport.disallow_checkpoint`, will never be served: 400
("invalid checkpoint requested, serving N but got step=M", torchft's answer).

``disallow_checkpoint`` waits until as many receiver sessions as ``dst_ranks``
have finished: every data byte written to them, a ``done`` report (a receiver
that fails verification says so), or a broken stream. At the send's timeout
it aborts the streams still running.

Sending a header or the checksums never finishes a session: a striping
receiver asks for them before or after its data.

Receiving (one source, or striped over several with the first as the truth)
is in ``_http_receive``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import logging
import math
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Coroutine, Iterable, Sequence, TypeVar

from aiohttp import web

from torchft_lite._control_plane import control_plane
from torchft_lite.checkpointing._http_receive import DONE_TIMEOUT, Receiver
from torchft_lite.checkpointing._http_serving import Session, Snapshot, flushed, listen, pieces_of, tune
from torchft_lite.checkpointing._decode import targets_of
from torchft_lite.checkpointing._encode import EncodedStateDict, FlatStateDict, flatten
from torchft_lite.checkpointing.transport import CheckpointTransport
from torchft_lite.errors import CheckpointError, CheckpointTimeout, ConfigError

__all__ = ["HTTPTransport", "HTTPTransportStatistics"]

T = TypeVar("T")
logger = logging.getLogger(__name__)

_ABORT_GRACE = 10.0  # seconds disallow_checkpoint waits for aborted streams and encoding to stop
_SESSION_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
# Done reports kept for steps not published yet: a bound against a flood of them.
_MAX_EARLY_DONE = 1024  # sessions per step
_MAX_EARLY_STEPS = 8


@dataclass(frozen=True)
class HTTPTransportStatistics:
    """What the transport is doing now, for status pages and tests."""

    published_step: int | None
    """The step being served, or None between disallow_checkpoint and the next send."""
    held_requests: int
    """Requests waiting for their step to be published."""
    active_streams: int
    """Responses currently streaming the published state dict."""
    receivers_finished: int
    """Receivers of the published step that have finished (succeeded or failed)."""
    bytes_served: int
    """Bytes of state dicts written since the transport started."""


class HTTPTransport(CheckpointTransport[T]):
    """Serves this replica's state dict over HTTP; fetches a peer's the same way.

    Args:
        timeout: default bound for serving and for held requests.
        num_chunks: receive the tensor data over this many concurrent HTTP
            requests, split by bytes; 0 or 1 means one stream.
        hostname: advertised in :meth:`metadata`; defaults to ``socket.gethostname()``.
        bind_host: the address the server listens on ("::" is dual-stack).
        port: the port to listen on; 0 picks a free one.
        token: when set, every request must carry ``Authorization: Bearer <token>``
            (401 without, 403 when wrong) and :meth:`recv_checkpoint` sends it.
        state_dict: when given, returns the local state dict; a received tensor
            whose path, dtype and shape match one of its tensors is written into
            that tensor (which the result then holds) instead of a new one: no
            extra memory, and contiguous CPU targets receive straight from the
            socket. A failed receive may leave such tensors partly overwritten.
    """

    def __init__(self, timeout: timedelta, num_chunks: int = 0, *, hostname: str | None = None,
                 bind_host: str = "::", port: int = 0, token: str | None = None,
                 state_dict: Callable[[], T] | None = None) -> None:
        if num_chunks < 0:
            raise ConfigError(f"num_chunks must be >= 0, got {num_chunks}")
        if timeout.total_seconds() <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        self._timeout = timeout.total_seconds()
        self._num_chunks = num_chunks
        self._hostname = hostname or socket.gethostname()
        self._token = token
        self._state_dict = state_dict
        self._plane = control_plane()
        self._snapshot: Snapshot | None = None
        self._released_step: int | None = None
        self._last_sent: FlatStateDict | None = None  # for allow_checkpoint
        self._last_step = -1
        self._early_done: dict[int, dict[str, bool]] = {}  # step -> session -> ok, reported before publishing
        self._held = 0
        self._bytes_served = 0
        self._stopped = False
        self._receiver = Receiver(num_chunks, token)
        self._runner: web.AppRunner | None = None
        self._changed: asyncio.Condition | None = None
        self._port: int = self._call(self._start(bind_host, port), self._timeout, "the checkpoint server to start")

    # ------------------------------------------------------------ public API

    def metadata(self) -> str:
        host = f"[{self._hostname}]" if ":" in self._hostname and not self._hostname.startswith("[") else self._hostname
        return f"http://{host}:{self._port}/checkpoint"

    @property
    def port(self) -> int:
        return self._port

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T,
                        timeout: timedelta | None = None) -> None:
        """Publish ``state_dict`` (by reference) as step ``step``; returns without waiting for receivers.

        ``timeout`` bounds serving it; None or zero (nothing could be served
        in no time) means the constructor's. A step still published is
        released first, as :meth:`disallow_checkpoint` does (torchft lets a
        send replace the published step).
        """
        flat = flatten(state_dict)  # refuse unsupported values here, on the caller's thread
        if self._snapshot is not None:
            self.disallow_checkpoint()
        seconds = timeout.total_seconds() if timeout else 0.0
        self._call(self._publish(len(dst_ranks), step, flat, seconds if seconds > 0 else self._timeout),
                   self._timeout, f"publishing step {step}")
        self._last_sent = flat

    def allow_checkpoint(self, step: int) -> None:
        """Serve the state dict of the last :meth:`send_checkpoint` again, as step ``step`` (torchft's API).

        The caller vouches that the state dict now holds ``step``: it is read
        as it is when a receiver asks. Another step still published is
        released first, as :meth:`disallow_checkpoint` does. Before any send,
        ``None`` is served. No receiver is expected.
        """
        snapshot = self._snapshot
        if snapshot is not None and snapshot.step == step:
            return
        if snapshot is not None:
            self.disallow_checkpoint()
        flat = self._last_sent if self._last_sent is not None else flatten(None)
        self._call(self._publish(0, step, flat, self._timeout), self._timeout, f"publishing step {step} again")

    def disallow_checkpoint(self) -> None:
        """Wait for the receivers of the published step (at most the send's timeout), then stop serving it."""
        snapshot = self._snapshot
        if snapshot is None:
            return
        self._call(self._release(), snapshot.timeout + 2 * _ABORT_GRACE,
                   f"the receivers of step {snapshot.step} to finish")

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None) -> T:
        """Fetch, verify and decode (to CPU) the state dict of ``step`` from the URL ``metadata``.

        ``timeout`` (None: the constructor's) bounds the whole receive; zero
        fails at once, as in torchft. Failures are ``CheckpointTransferError``;
        those of the HTTP exchange are also urllib's ``URLError`` (an error
        status: ``HTTPError``), as torchft's receive raises (see ``errors``).
        """
        return self.recv_checkpoint_striped([(src_rank, metadata)], step, timeout)

    def recv_checkpoint_striped(self, sources: Sequence[tuple[int, str]], step: int,
                                timeout: timedelta | None = None) -> T:
        """Fetch ``step`` from several replicas at once; the result is the first's (the primary's) byte for byte.

        The data is cut into ``max(num_chunks, len(sources))`` block-aligned
        ranges, fetched at once, range ``i`` from source ``i % len(sources)``.
        The other sources only make it faster: a difference in a header is
        logged; a range that one of them fails to deliver (or delivers much
        slower than the primary could) comes from the primary; blocks of
        theirs that differ from the primary's (by the primary's checksums,
        one extra request) are fetched again from the primary, with a
        warning naming the replica and where. Only the primary's failures
        (``CheckpointTransferError``) or the timeout fail the receive.
        """
        if not sources:
            raise ValueError("recv_checkpoint_striped needs at least one source")
        seconds = self._timeout if timeout is None else max(0.0, timeout.total_seconds())
        targets = {} if self._state_dict is None else targets_of(self._state_dict())
        urls = [metadata.rstrip("/") + f"/{step}" for _, metadata in sources]
        names = [f"replica {rank} ({url})" for (rank, _), url in zip(sources, urls)]
        ranks = ", ".join(str(rank) for rank, _ in sources)
        if self._stopped:
            raise CheckpointError("the transport is shut down")
        return self._call(self._receiver.receive(urls, names, step, seconds, targets),
                          seconds + DONE_TIMEOUT + _ABORT_GRACE, f"step {step} from replica(s) {ranks}")

    def shutdown(self, wait: bool = True) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._last_sent = None
        future = self._plane.submit(self._stop())
        if wait:
            try:
                future.result(self._timeout + 2 * _ABORT_GRACE)
            except concurrent.futures.TimeoutError as exc:
                raise CheckpointTimeout(f"timed out stopping the checkpoint server on port {self._port}") from exc
        else:
            future.add_done_callback(_log_failure)

    # torchft's HTTPTransport has these attributes (its tests read them): views of the published snapshot here.
    @property
    def _disallowed(self) -> bool:
        return self._snapshot is None

    @property
    def _step(self) -> int:
        """The step served, or last published (-1 before any)."""
        snapshot = self._snapshot
        return self._last_step if snapshot is None else snapshot.step

    @property
    def _checkpoint_lock(self) -> "_ServingLock":
        return _ServingLock(self)

    def statistics(self) -> HTTPTransportStatistics:
        snapshot = self._snapshot
        return HTTPTransportStatistics(
            published_step=None if snapshot is None else snapshot.step,
            held_requests=self._held,
            active_streams=0 if snapshot is None else len(snapshot.streams),
            receivers_finished=0 if snapshot is None else snapshot.finished,
            bytes_served=self._bytes_served,
        )

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float, what: str) -> Any:
        try:
            return self._plane.run(coro, timeout, what)
        except TimeoutError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointTimeout(str(exc)) from exc

    # ------------------------------------------------------------ server (control-plane loop)

    async def _start(self, bind_host: str, port: int) -> int:
        self._changed = asyncio.Condition()
        app = web.Application(client_max_size=4096)
        app.router.add_get("/checkpoint/{step}", functools.partial(self._serve, part="all"))
        app.router.add_get("/checkpoint/{step}/header", functools.partial(self._serve, part="header"))
        app.router.add_get("/checkpoint/{step}/data", functools.partial(self._serve, part="data"))
        app.router.add_get("/checkpoint/{step}/checksums", functools.partial(self._serve, part="checksums"))
        app.router.add_post("/checkpoint/{step}/done", self._done)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        try:
            sock = listen(bind_host, port)
        except OSError as exc:
            await self._runner.cleanup()
            raise CheckpointError(f"cannot listen on {bind_host}:{port} for checkpoints: {exc}") from exc
        await web.SockSite(self._runner, sock).start()
        logger.info("checkpoint server listening on %s:%d (advertised as %s)", bind_host, sock.getsockname()[1],
                    self._hostname)
        return sock.getsockname()[1]

    async def _publish(self, expected: int, step: int, flat: FlatStateDict, timeout: float) -> None:
        assert self._changed is not None
        async with self._changed:
            if self._stopped:
                raise CheckpointError("the transport is shut down")
            if self._snapshot is not None:
                raise CheckpointError(f"step {self._snapshot.step} is still published; "
                                      f"call disallow_checkpoint() before publishing step {step}")
            now = asyncio.get_running_loop().time()
            snapshot = self._snapshot = Snapshot(step, flat, expected, timeout, deadline=now + timeout,
                                                  published_at=now)
            self._last_step = step
            early = self._early_done.pop(step, {})
            self._early_done = {s: d for s, d in self._early_done.items() if s > step}  # older ones never come
            for session_id, ok in early.items():  # receivers that finished before this publish
                snapshot.sessions[session_id] = Session(peer="?", ok=ok)
                snapshot.finished += 1
            self._changed.notify_all()
        logger.debug("published step %d for %d receivers", step, expected)

    async def _release(self, wait: bool = True) -> None:
        snapshot = self._snapshot
        if snapshot is None or self._changed is None:
            return
        try:
            if wait:
                await self._wait_for_receivers(snapshot)
        finally:  # even when cancelled: the snapshot must not stay readable
            await self._close(snapshot)

    async def _wait_for_receivers(self, snapshot: Snapshot) -> None:
        assert self._changed is not None
        async with self._changed:
            remaining = max(0.0, snapshot.deadline - asyncio.get_running_loop().time())
            try:
                await asyncio.wait_for(self._changed.wait_for(snapshot.receivers_done), remaining)
            except TimeoutError:
                logger.warning("step %d: %d of %d receivers finished within the send timeout; aborting %d streams",
                               snapshot.step, snapshot.finished, snapshot.expected, len(snapshot.streams))

    async def _close(self, snapshot: Snapshot) -> None:
        """Stop serving ``snapshot``: refuse new requests, abort streams, stop the encoding, then log."""
        assert self._changed is not None
        async with self._changed:
            snapshot.closed = True
            if self._snapshot is snapshot:
                self._snapshot = None
                self._released_step = max(snapshot.step, self._released_step or snapshot.step)
            self._changed.notify_all()
        snapshot.stop_encoding.set()
        for task in snapshot.streams:
            task.cancel()
        workers = [future for future in (snapshot.encoding, snapshot.checksums) if future is not None]
        pending = list(snapshot.streams) + workers
        still: set = set()
        if pending:
            _, still = await asyncio.wait(pending, timeout=_ABORT_GRACE)
            if still:
                logger.warning("step %d: %d streams or encodings still running after release", snapshot.step,
                               len(still))
        if snapshot.checksums is not None and snapshot.checksums.done() and not snapshot.checksums.cancelled():
            snapshot.checksums.exception()  # abandoned by the release, as expected: retrieved, so not logged
        encoding = snapshot.encoding
        if encoding is not None and encoding.done() and not encoding.cancelled():
            if encoding.exception() is None and not still:  # an abandoned encoding is expected here
                encoding.result().release()
        served = ", ".join(session.describe() for session in snapshot.sessions.values())
        logger.info("released step %d after %.2fs: %d of %d expected receivers finished (%s)", snapshot.step,
                    asyncio.get_running_loop().time() - snapshot.published_at, snapshot.finished, snapshot.expected,
                    served or "none came")

    async def _stop(self) -> None:
        await self._release(wait=False)
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()  # held requests see _stopped and answer 503
        if self._runner is not None:
            await self._runner.cleanup()

    def _authorize(self, request: web.Request) -> None:
        if self._token is None:
            return
        given = request.headers.get("Authorization")
        if given is None:
            raise web.HTTPUnauthorized(text="this checkpoint server needs a bearer token",
                                       headers={"WWW-Authenticate": "Bearer"})
        # Header bytes that are not UTF-8 arrive as surrogate escapes: compare them as the bytes they were.
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {self._token}".encode()):
            raise web.HTTPForbidden(text="wrong bearer token for this checkpoint server")

    def _request_args(self, request: web.Request) -> tuple[int, str]:
        self._authorize(request)
        try:
            step = int(request.match_info["step"])
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"step must be an integer, got {request.match_info['step'][:40]!r}") from exc
        session = request.query.get("session", "")
        if not _SESSION_ID.fullmatch(session):
            raise web.HTTPBadRequest(text="a session id (1-64 of [0-9A-Za-z_-]) is required")
        return step, session

    async def _snapshot_for(self, step: int, hold: float) -> Snapshot:
        """The published snapshot of ``step``, waiting up to ``hold`` seconds for it to be published."""
        assert self._changed is not None
        deadline = asyncio.get_running_loop().time() + hold
        self._held += 1
        try:
            async with self._changed:
                while True:
                    snapshot = self._snapshot
                    if self._stopped:
                        raise web.HTTPServiceUnavailable(text="the checkpoint server is shutting down")
                    if snapshot is not None and snapshot.step == step:
                        return snapshot
                    # Steps never to be served again: torchft's 400, in its words.
                    if snapshot is not None and step < snapshot.step:
                        raise web.HTTPBadRequest(text=f"invalid checkpoint requested, serving {snapshot.step} but "
                                                      f"got step={step} (an older step is not served again)")
                    if snapshot is None and self._released_step is not None and step <= self._released_step:
                        raise web.HTTPBadRequest(text=f"invalid checkpoint requested, serving none (released its "
                                                      f"checkpoint after step {self._released_step}) but got "
                                                      f"step={step}")
                    remaining = deadline - asyncio.get_running_loop().time()
                    if remaining <= 0:
                        raise web.HTTPGatewayTimeout(text=f"step {step} was not published within {hold:.1f}s")
                    try:
                        await asyncio.wait_for(self._changed.wait(), remaining)
                    except TimeoutError:
                        pass  # the loop answers 504 above
        finally:
            self._held -= 1

    async def _serve(self, request: web.Request, part: str) -> web.StreamResponse:
        step, session_id = self._request_args(request)
        try:
            hold = float(request.query.get("timeout", self._timeout))
        except ValueError as exc:
            raise web.HTTPBadRequest(text="timeout must be a number of seconds") from exc
        hold = min(hold, self._timeout) if math.isfinite(hold) else self._timeout
        snapshot = await self._snapshot_for(step, hold)
        session = snapshot.sessions.setdefault(session_id, Session(peer=request.remote or "?"))
        if session.finished:
            raise web.HTTPConflict(text=f"session {session_id} has already finished")
        task = asyncio.current_task()
        assert task is not None
        snapshot.streams.add(task)
        try:
            try:
                encoded = await snapshot.encoded()
                sums = await snapshot.packed_checksums(encoded) if part == "checksums" else b""
            except CheckpointError as exc:  # released while encoding or checksumming
                raise web.HTTPConflict(text=f"step {step} is no longer served: {exc}") from exc
            except (RuntimeError, MemoryError) as exc:  # torch could not copy a tensor to CPU
                logger.error("step %d: encoding the state dict failed: %r", step, exc)
                raise web.HTTPInternalServerError(text=f"step {step} could not be encoded: {exc}") from exc
            pieces, length, data_bytes = self._pieces(request, encoded, part, sums)
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            response.content_length = length
            await response.prepare(request)
            tune(request.transport)
            for piece in pieces:  # views of tensor memory, written without a copy
                if snapshot.closed:
                    raise ConnectionAbortedError(f"step {step} was released mid-stream")
                await response.write(piece)
                session.bytes_sent += len(piece)
                self._bytes_served += len(piece)
            # Until the kernel has taken every byte, the transport may still hold views of tensor memory:
            # only then may this session count as finished (and the trainer mutate the state dict).
            await flushed(request.transport)
            await response.write_eof()
            session.data_sent += data_bytes
            # Only data finishes a session: a header (of a state dict that has data) or the checksums are asked
            # for before or after the data, and the receiver reports done once it has compared them.
            carries_data = part in ("all", "data") or (part == "header" and encoded.data_bytes == 0)
            if carries_data and session.data_sent >= encoded.data_bytes:
                await self._finish(snapshot, session, ok=None)
            return response
        except web.HTTPException:
            await self._finish(snapshot, session, ok=False)  # the receiver fails, and won't say so
            raise
        except (ConnectionError, asyncio.CancelledError) as exc:
            if request.transport is not None:
                request.transport.abort()  # drop what is buffered: a graceful close would trickle it out
            await self._finish(snapshot, session, ok=False)
            logger.info("step %d: stream to %s ended early: %s", step, session.peer, type(exc).__name__)
            raise asyncio.CancelledError from exc  # aiohttp closes the connection quietly
        finally:
            snapshot.streams.discard(task)

    def _pieces(self, request: web.Request, encoded: EncodedStateDict, part: str,
                sums: bytes) -> tuple[Iterable[memoryview | bytes], int, int]:
        return pieces_of(request, encoded, part, sums)  # a method: tests damage one server's answers

    async def _finish(self, snapshot: Snapshot, session: Session, ok: bool | None) -> None:
        """Record that ``session`` has all its data (``ok`` None), reported ``ok``, or failed."""
        assert self._changed is not None
        async with self._changed:
            was_finished = session.finished
            if ok is None:
                session.sent_all = True
            elif session.ok is None:
                session.ok = ok
            if not was_finished:
                snapshot.finished += 1
            self._changed.notify_all()

    async def _done(self, request: web.Request) -> web.Response:
        step, session_id = self._request_args(request)
        snapshot = self._snapshot
        ok = request.query.get("ok") == "1"
        if snapshot is None or snapshot.step != step:
            if self._may_publish_later(step):
                # A striping receiver can finish before this replica publishes (its primary took over our
                # ranges): kept for the publish to count, else this replica would wait its timeout for it.
                if step not in self._early_done and len(self._early_done) >= _MAX_EARLY_STEPS:
                    del self._early_done[max(self._early_done)]  # the furthest ahead is the least likely to come
                early = self._early_done.setdefault(step, {})
                if len(early) < _MAX_EARLY_DONE:
                    early[session_id] = ok
                return web.Response(text="ok (before the step was published)")
            raise web.HTTPConflict(text=f"no receiver session {session_id} for step {step}")
        # A striping receiver that needed no range from this replica (a small state dict has fewer blocks than
        # sources) still reports, so this replica stops waiting for it.
        session = snapshot.sessions.setdefault(session_id, Session(peer=request.remote or "?"))
        await self._finish(snapshot, session, ok=ok)
        return web.Response(text="ok")

    def _may_publish_later(self, step: int) -> bool:
        """Whether ``step`` is newer than every step this server has published or released."""
        newest = max((s for s in (self._released_step, self._snapshot.step if self._snapshot else None)
                      if s is not None), default=None)
        return newest is None or step > newest


class _ServingLock:
    """torchft's HTTPTransport holds a lock's write side while nothing may be served; this answers the same."""

    def __init__(self, transport: HTTPTransport) -> None:
        self._transport = transport

    def w_locked(self) -> bool:
        return self._transport._snapshot is None


def _log_failure(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("checkpoint transport shutdown failed: %r", future.exception())
