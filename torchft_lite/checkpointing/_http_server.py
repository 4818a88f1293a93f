"""The checkpoint server: HTTPTransport's serving side, on the control-plane loop.

:class:`CheckpointServer` serves one published step at a time: the whole
encoding, its header, data ranges and block checksums, and takes a receiver's
``done`` report (the routes are on :meth:`CheckpointServer.start`). Every request
is checked first against the transport's access policy (``torchft_lite.rpc.access``:
the job token, else loopback peers only): 401 or 403, and nothing served. With a
TLS context it serves HTTPS only; the socket and its tuning are ``_http_socket``'s.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import re
import socket
import ssl
from typing import Iterable

from aiohttp import web

from torchft_lite.checkpointing._http_snapshot import Session, Snapshot
from torchft_lite.checkpointing._http_socket import ABORT_GRACE, flushed, send_on_thread, tune
from torchft_lite.checkpointing._streams import ADVERTISE_HEADER, on_threads, served_streams
from torchft_lite.errors import CheckpointError
from torchft_lite.rpc.access import Access
from torchft_lite.rpc.refusals import RefusalLog
from torchft_lite.serialization.encode import EncodedStateDict, FlatStateDict

__all__ = ["CheckpointServer"]

logger = logging.getLogger("torchft_lite.checkpointing.http_transport")  # one logger for the transport

_SESSION_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
# Sessions that asked for (or reported done on) steps not published yet: a bound against a flood of them.
_MAX_EARLY_DONE = 1024  # sessions per step
_MAX_EARLY_STEPS = 8
_MAX_SESSIONS = 256  # receivers of one published step: more is a flood (a source serves a few behind groups)
_MAX_HELD = 1024  # requests waiting for a step to be published


class CheckpointServer:
    """Serves one published :class:`Snapshot` at a time; every method but the constructor runs on the loop.

    Args:
        timeout: the longest a request is held for a step not published yet.
        access: who may ask (``Access.check`` on every request: 401 or 403 and nothing else).
        hostname: the name the transport advertises, for the log.
        tls: serve HTTPS with this context (``TlsSettings.server_context()``); None: plain HTTP.
        streams: how many concurrent range requests one receiver may make, advertised in every
            answer's ``X-Checkpoint-Streams`` (None: ``_streams.served_streams()``, from this host's CPUs); it
            bounds the default, not an explicit ``num_chunks``.

    The transport reads ``snapshot``, ``last_step``, ``held`` and
    ``bytes_served`` from the training thread (plain attributes, for its
    statistics and torchft's attributes).
    """

    def __init__(self, timeout: float, access: Access, hostname: str, tls: ssl.SSLContext | None = None,
                 streams: int | None = None) -> None:
        self._timeout = timeout
        self._streams = served_streams() if streams is None else streams
        self._tls = tls
        self._access = access
        self._refusals = RefusalLog("checkpoint server")
        self._hostname = hostname
        self.snapshot: Snapshot | None = None
        """The step being served, or None between a release and the next publish."""
        self.last_step = -1
        """The step last published (-1 before any)."""
        self.held = 0
        """Requests waiting for their step to be published."""
        self.bytes_served = 0
        """Bytes of state dicts written since the server started."""
        self._released_step: int | None = None
        # step -> session -> ok reported, or None (asked, no report yet): receivers of steps not published yet
        self._early_done: dict[int, dict[str, bool | None]] = {}
        self._held_refused = 0  # held requests refused (503) since the last publish
        self._stopped = False
        self._runner: web.AppRunner | None = None
        self._changed = asyncio.Condition()

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock``, a listening socket (``_http_socket.listen``); it is closed with the server.

        Routes (``{step}`` is the step asked for; every request names its receiver session with
        ``?session=<id>``; held requests also pass ``?timeout=<seconds>``)::

            GET  /checkpoint/{step}                      prefix + header + data, one stream
            GET  /checkpoint/{step}/header               prefix + header only
            GET  /checkpoint/{step}/data?start=&end=     data bytes [start, end)
            GET  /checkpoint/{step}/checksums            the sum64 of every data block (uint64 LE each)
            POST /checkpoint/{step}/done?ok=1|0          the receiver has finished (also before the step is published)
        """
        app = web.Application(client_max_size=4096, middlewares=[self._guard])
        app.router.add_get("/checkpoint/{step}", functools.partial(self._serve, part="all"))
        app.router.add_get("/checkpoint/{step}/header", functools.partial(self._serve, part="header"))
        app.router.add_get("/checkpoint/{step}/data", functools.partial(self._serve, part="data"))
        app.router.add_get("/checkpoint/{step}/checksums", functools.partial(self._serve, part="checksums"))
        app.router.add_post("/checkpoint/{step}/done", self._done)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, ssl_context=self._tls).start()
        host, port = sock.getsockname()[:2]
        logger.info("checkpoint server listening on %s:%d (advertised as %s; access: %s; %s)", host, port,
                    self._hostname, self._access.describe(),
                    "HTTPS (TLS)" if self._tls is not None else "plain HTTP")
        if self._access.mode == "insecure":
            logger.warning("checkpoint server on port %d: %s", port, self._access.describe())

    async def publish(self, expected: int, step: int, flat: FlatStateDict, timeout: float) -> None:
        """Serve ``flat`` as step ``step`` to ``expected`` receivers, for at most ``timeout`` seconds."""
        async with self._changed:
            if self._stopped:
                raise CheckpointError("the transport is shut down")
            if self.snapshot is not None:
                raise CheckpointError(f"step {self.snapshot.step} is still published; "
                                      f"call disallow_checkpoint() before publishing step {step}")
            now = asyncio.get_running_loop().time()
            snapshot = self.snapshot = Snapshot(step, flat, expected, timeout, deadline=now + timeout,
                                                published_at=now)
            self.last_step = step
            self._held_refused = 0
            early = self._early_done.pop(step, {})
            self._early_done = {s: d for s, d in self._early_done.items() if s > step}  # older ones never come
            for session_id, ok in early.items():
                if ok is None:  # asked before this publish: may report done without asking again
                    snapshot.known.add(session_id)
                else:  # finished before this publish
                    snapshot.sessions[session_id] = Session(peer="?", ok=ok)
                    snapshot.finished += 1
            self._changed.notify_all()
        logger.debug("published step %d for %d receivers", step, expected)

    async def release(self, wait: bool = True) -> None:
        """Stop serving the published step; first (``wait``) wait for its receivers until its deadline.

        It waits until as many receiver sessions as were expected have finished: every data byte written to
        them, a ``done`` report (a receiver that fails verification says so), or a broken stream. At the send's
        timeout it aborts the streams still running. Sending a header or the checksums never finishes a
        session: a striping receiver asks for them before or after its data.
        """
        snapshot = self.snapshot
        if snapshot is None:
            return
        try:
            if wait:
                await self._wait_for_receivers(snapshot)
        finally:  # even when cancelled: the snapshot must not stay readable
            await self._close(snapshot)

    async def stop(self) -> None:
        """Release without waiting, answer held requests 503, and close the socket."""
        self._stopped = True
        await self.release(wait=False)
        async with self._changed:
            self._changed.notify_all()  # held requests see _stopped and answer 503
        if self._runner is not None:
            await self._runner.cleanup()

    async def _wait_for_receivers(self, snapshot: Snapshot) -> None:
        async with self._changed:
            remaining = max(0.0, snapshot.deadline - asyncio.get_running_loop().time())
            try:
                await asyncio.wait_for(self._changed.wait_for(snapshot.receivers_done), remaining)
            except TimeoutError:
                logger.warning("step %d: %d of %d receivers finished within the send timeout; aborting %d streams",
                               snapshot.step, snapshot.finished, snapshot.expected, len(snapshot.streams))

    async def _close(self, snapshot: Snapshot) -> None:
        """Stop serving ``snapshot``: refuse new requests, abort streams, stop the encoding, then log."""
        async with self._changed:
            snapshot.closed = True
            if self.snapshot is snapshot:
                self.snapshot = None
                self._released_step = max(snapshot.step, self._released_step or snapshot.step)
            self._changed.notify_all()
        snapshot.stop_encoding.set()
        for task in snapshot.streams:
            task.cancel()
        workers = [future for future in (snapshot.encoding, snapshot.checksums) if future is not None]
        pending = list(snapshot.streams) + workers
        still: set = set()
        if pending:
            _, still = await asyncio.wait(pending, timeout=ABORT_GRACE)
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

    # ------------------------------------------------------------ requests

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """Every route: a caller the access policy refuses gets 401/403 and its reason, nothing else."""
        refusal = self._access.check(request.remote, request.headers.get("Authorization"))
        if refusal is None:
            return await handler(request)
        self._refusals.note(request.remote or "unknown", f"{request.method} {request.path}", refusal)
        if refusal.kind == "unauthenticated":
            raise web.HTTPUnauthorized(text=refusal.message, headers={"WWW-Authenticate": "Bearer"})
        raise web.HTTPForbidden(text=refusal.message)

    def _request_args(self, request: web.Request) -> tuple[int, str]:
        try:
            step = int(request.match_info["step"])
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"step must be an integer, got {request.match_info['step'][:40]!r}") from exc
        session = request.query.get("session", "")
        if not _SESSION_ID.fullmatch(session):
            raise web.HTTPBadRequest(text="a session id (1-64 of [0-9A-Za-z_-]) is required")
        return step, session

    async def _snapshot_for(self, step: int, hold: float) -> Snapshot:
        """The published snapshot of ``step``, waiting up to ``hold`` seconds for it to be published.

        A request for a step not published yet is held until it is (or until its timeout: 504). So is one for
        the step just released: a step that did not commit is published again when it is retried (torchft
        holds every request while nothing is published). A request for a step older than the one published or
        the one last released will never be served: 400 ("invalid checkpoint requested, serving N but got
        step=M", torchft's answer). More than ``_MAX_SESSIONS`` receivers of one step, or ``_MAX_HELD`` held
        requests, are answered 503 (logged once).
        """
        deadline = asyncio.get_running_loop().time() + hold
        if self.held >= _MAX_HELD and not (self.snapshot is not None and self.snapshot.step == step):
            self._held_refused += 1
            if self._held_refused == 1:
                logger.warning("%d requests are already waiting for a step to be published; refusing more (503) "
                               "until the next publish", self.held)
            raise web.HTTPServiceUnavailable(text=f"too many requests ({self.held}) are waiting for a step to be "
                                                  "published here; retry later")
        self.held += 1
        try:
            async with self._changed:
                while True:
                    snapshot = self.snapshot
                    if self._stopped:
                        raise web.HTTPServiceUnavailable(text="the checkpoint server is shutting down")
                    if snapshot is not None and snapshot.step == step:
                        return snapshot
                    # Steps never to be served again: torchft's 400, in its words.
                    if snapshot is not None and step < snapshot.step:
                        raise web.HTTPBadRequest(text=f"invalid checkpoint requested, serving {snapshot.step} but "
                                                      f"got step={step} (an older step is not served again)")
                    if snapshot is None and self._released_step is not None and step < self._released_step:
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
            self.held -= 1

    async def _serve(self, request: web.Request, part: str) -> web.StreamResponse:
        step, session_id = self._request_args(request)
        try:
            hold = float(request.query.get("timeout", self._timeout))
        except ValueError as exc:
            raise web.HTTPBadRequest(text="timeout must be a number of seconds") from exc
        hold = min(hold, self._timeout) if math.isfinite(hold) else self._timeout
        self._note_asked(step, session_id)
        snapshot = await self._snapshot_for(step, hold)
        session = snapshot.sessions.get(session_id)
        if session is None:
            if len(snapshot.sessions) >= _MAX_SESSIONS:
                snapshot.refused += 1
                if snapshot.refused == 1:
                    logger.warning("step %d: %d receiver sessions already; refusing more (503)", step,
                                   len(snapshot.sessions))
                raise web.HTTPServiceUnavailable(text=f"step {step} already has {len(snapshot.sessions)} receivers "
                                                      f"here (at most {_MAX_SESSIONS}); heal from another replica")
            session = snapshot.sessions[session_id] = Session(peer=request.remote or "?")
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
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                                   ADVERTISE_HEADER: str(self._streams)})
            response.content_length = length
            await response.prepare(request)
            tune(request.transport)

            def sent(count: int) -> None:
                session.bytes_sent += count
                self.bytes_served += count

            if part == "data" and self._tls is None and request.transport is not None and on_threads():
                # A data range is one of several streams: sent from a thread, so they take as many cores.
                await send_on_thread(request.transport, pieces, lambda: snapshot.closed, sent, self._timeout)
            else:
                for piece in pieces:  # views of tensor memory, written without a copy
                    if snapshot.closed:
                        raise ConnectionAbortedError(f"step {step} was released mid-stream")
                    await response.write(piece)
                    sent(len(piece))
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
        except (ConnectionError, TimeoutError, asyncio.CancelledError) as exc:  # TimeoutError: a threaded send's
            if request.transport is not None:
                request.transport.abort()  # drop what is buffered: a graceful close would trickle it out
            await self._finish(snapshot, session, ok=False)
            logger.info("step %d: stream to %s ended early: %s", step, session.peer, type(exc).__name__)
            raise asyncio.CancelledError from exc  # aiohttp closes the connection quietly
        finally:
            snapshot.streams.discard(task)

    def _pieces(self, request: web.Request, encoded: EncodedStateDict, part: str,
                sums: bytes) -> tuple[Iterable[memoryview | bytes], int, int]:
        """What to write for ``part``: the pieces, their total length, and how many data bytes they hold.

        A method: tests damage one server's answers.
        """
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

    async def _finish(self, snapshot: Snapshot, session: Session, ok: bool | None) -> None:
        """Record that ``session`` has all its data (``ok`` None), reported ``ok``, or failed."""
        async with self._changed:
            was_finished = session.finished
            if ok is None:
                session.sent_all = True
            elif session.ok is None:
                session.ok = ok
            if not was_finished:
                snapshot.finished += 1
            self._changed.notify_all()

    def _note_asked(self, step: int, session_id: str) -> None:
        """Remember a session that asks for a step not published yet: it may report ``done`` on it later."""
        if (self.snapshot is not None and self.snapshot.step == step) or not self._may_publish_later(step):
            return  # the published step's sessions are its Snapshot's; an older step is refused
        if step not in self._early_done and len(self._early_done) >= _MAX_EARLY_STEPS:
            del self._early_done[max(self._early_done)]  # the furthest ahead is the least likely to come
        early = self._early_done.setdefault(step, {})
        if len(early) < _MAX_EARLY_DONE:
            early.setdefault(session_id, None)

    async def _done(self, request: web.Request) -> web.Response:
        """``POST .../done``: a ``done`` ends only its own session, one that has asked this server for the step
        (a request held before the publish counts, so a striping receiver can finish before this replica
        publishes); a done naming any other session is a 409 and counts for nothing, so a stray or repeated
        report can never stand in for a receiver that is still to come."""
        step, session_id = self._request_args(request)
        snapshot = self.snapshot
        ok = request.query.get("ok") == "1"
        if snapshot is None or snapshot.step != step:
            # A striping receiver can finish before this replica publishes (its primary took over our ranges):
            # kept for the publish to count, else this replica would wait its timeout for it.
            early = self._early_done.get(step, {})
            if session_id not in early:
                raise web.HTTPConflict(text=f"no receiver session {session_id} for step {step} (a done must come "
                                            f"from a session that asked this server for the step)")
            early[session_id] = ok
            return web.Response(text="ok (before the step was published)")
        # A striping receiver that got no range from this replica (a small state dict has fewer blocks than
        # sources) still reports, so this replica stops waiting for it: its own session only.
        if session_id not in snapshot.sessions and session_id not in snapshot.known:
            raise web.HTTPConflict(text=f"no receiver session {session_id} for step {step} (a done must come from "
                                        f"a session that asked this server for the step)")
        session = snapshot.sessions.setdefault(session_id, Session(peer=request.remote or "?"))
        await self._finish(snapshot, session, ok=ok)
        return web.Response(text="ok")

    def _may_publish_later(self, step: int) -> bool:
        """Whether ``step`` may be published after now: newer than the step published now, and not older than
        the one last released (a step that did not commit is published again when it is retried)."""
        if self.snapshot is not None and step <= self.snapshot.step:
            return False
        return self._released_step is None or step >= self._released_step


logger = logging.getLogger("torchft_lite.checkpointing.http_transport")  # one logger for the transport
