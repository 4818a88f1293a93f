"""The receiving side of HTTPTransport: one heal, from one source or striped over several.

From one source with ``num_chunks`` set to 0 or 1 the whole encoding comes in
one GET. Otherwise the primary's header comes first, then block-aligned data
ranges, ``max(num_chunks, len(sources))`` of them, fetched at once, range
``i`` from source ``i % len(sources)``; with ``num_chunks`` unset (None), as
many as ``_streams.streams_for`` picks from the data's size and what the
primary advertises (a single source that serves no header is read whole).

Striped over several replicas, the first, the *primary*, is the truth: the
result is the primary's snapshot byte for byte, and the others (secondaries)
only make it arrive sooner. A secondary whose header differs is logged. A
secondary's range that fails or lags is fetched from the primary. Once every
range is in, the receiver asks the primary for its ``checksums`` and fetches
again from it every block a secondary served that differs: state that
legitimately differs between replica groups (BatchNorm running statistics, a
data loader's position) costs a re-fetch, never the heal. Only the primary's
failures, or the heal's timeout, fail it. Every source is told ``done`` at
the end, so it stops waiting for this receiver.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from torchft_lite.checkpointing import _http_client, _streams
from torchft_lite.checkpointing._body_sinks import BytesSink, DataSink, EncodedSink
from torchft_lite.errors import (
    CheckpointError, CheckpointHTTPError, CheckpointTransferError, CheckpointURLError, CheckpointURLTimeout,
)
from torchft_lite.rpc.tls import TlsSettings
from torchft_lite.serialization import checksum
from torchft_lite.serialization.decode import TensorWriter
from torchft_lite.serialization.spec import (
    MAX_HEADER_BYTES, PREFIX_SIZE, Header, Path, decode_key, decode_tree, format_path, parse_header, unpack_prefix,
)
from torchft_lite.serialization.staging import Stager, stager_for

__all__ = ["DONE_TIMEOUT", "Receiver", "encoded_header_difference", "header_difference"]

logger = logging.getLogger("torchft_lite.checkpointing.http_transport")  # one logger for both sides

DONE_TIMEOUT = 5.0  # seconds a receiver spends telling a source it has finished
_MAX_HEADER_ANSWER = PREFIX_SIZE + MAX_HEADER_BYTES
# A secondary's range runs at least this long before an idle primary may take it over: enough for a secondary
# that is slow to start (encoding its state dict) to begin, short next to a heal that is worth striping.
_PATIENCE = 1.0
_WATCH_INTERVAL = 0.05  # seconds between two looks at the secondaries' ranges, once the primary is idle
# What a failing source raises: a secondary's is survived, a primary's fails the heal.
_SOURCE_ERRORS = (CheckpointError, _http_client.HTTPStatusError, OSError, asyncio.IncompleteReadError)


@dataclass
class _Heal:
    """One receive in progress: its sources (the first is the primary), its session, its deadline."""

    urls: list[str]
    names: list[str]
    """``"replica <rank> (<url>)"`` of each source, for messages."""
    step: int
    session_id: str
    deadline: float
    """On ``time.monotonic()``."""
    joined: set[str] = field(default_factory=set)
    """The sources that have counted this session."""
    stager: Stager | None = None
    """Where bytes meant for GPU targets land (``serialization.staging``); abandoned when the heal fails, so its slots return."""


@dataclass
class _Range:
    """One block-aligned data range of a heal, and the source it is fetched from."""

    start: int
    end: int
    source: int
    """Index into the heal's sources: 0 is the primary."""
    sink: DataSink | None = None
    """Where the current fetch writes, once its answer has begun."""
    started: float = 0.0
    """When the current fetch began, on ``time.monotonic()``."""


class Receiver:
    """Fetches state dicts for one HTTPTransport; lives on the control-plane loop.

    Args:
        num_chunks: data ranges to fetch at once (at least one per source); None: from the size and what the
            primary advertises (``_streams``).
        headers: sent with every request (the job token's ``Authorization``, ``Access.headers()``).
        tls: which sources are fetched over TLS, trusting what (``TlsSettings.uses_tls``: an ``https://``
            source, or every source once the job set TLS); None: ``https://`` sources only, trusting the
            system's CAs.
    """

    def __init__(self, num_chunks: int | None, headers: dict[str, str], tls: TlsSettings | None = None) -> None:
        self._num_chunks = num_chunks
        self._headers = dict(headers)
        self._tls = TlsSettings() if tls is None else tls

    def _auth_headers(self) -> dict[str, str]:
        return self._headers

    def _tls_for(self, url: str) -> ssl.SSLContext | None:
        return self._tls.client_context() if self._tls.uses_tls(url) else None

    async def receive(self, urls: list[str], names: list[str], step: int, timeout: float,
                      targets: dict[Path, Any]) -> Any:
        """The verified state dict of ``step`` from ``urls`` (the first is the primary); see the module docstring."""
        started = time.monotonic()
        heal = _Heal(urls, names, step, uuid.uuid4().hex, started + timeout, stager=stager_for(targets))
        ok = False
        where = " + ".join(urls)
        primary = urls[0]  # what fails a heal, other than its timeout, is the primary's
        try:
            async with asyncio.timeout(timeout):
                one_stream = self._num_chunks <= 1 if self._num_chunks is not None else _streams.one_stream_here()
                if len(urls) == 1 and one_stream:
                    sink, _ = await self._get_encoded(heal, primary, "", targets, header_only=False)
                    writer = sink.complete_writer()
                else:
                    writer = await self._fetch_ranges(heal, targets)
                try:
                    state = await asyncio.to_thread(writer.finish)
                except BaseException:  # the timeout, say: the thread runs on, and must not apply what it checked
                    writer.abandon()
                    raise
            ok = True
            seconds = time.monotonic() - started
            logger.info("received step %d from %s in %.2fs (%.0f MB/s)", step, where, seconds,
                        writer.header.data_bytes / max(seconds, 1e-9) / 1e6)
            return state
        # Failures of the primary become urllib's errors too (see ``errors``), as torchft's urlopen raises.
        except CheckpointError:
            raise
        except TimeoutError as exc:
            raise CheckpointURLTimeout(f"timed out after {timeout:.1f}s receiving step {step} from {where}") from exc
        except _http_client.HTTPStatusError as exc:
            if exc.status == 504:
                raise CheckpointURLTimeout(f"{primary}: {exc.text}") from exc
            hint = " (refused: check the token)" if exc.status in (401, 403) else ""
            raise CheckpointHTTPError(primary, exc.status, f"{primary} answered{hint}: {exc.text}",
                                      exc.text.encode()) from exc
        except (OSError, asyncio.IncompleteReadError) as exc:  # refused, reset, unreachable, a TLS handshake
            hint = (" (the TLS handshake failed: does that replica serve TLS, and does TORCHFT_LITE_TLS_CA hold "
                    "the CA that signed its certificate?)") if isinstance(exc, ssl.SSLError) else ""
            raise CheckpointURLError(f"receiving step {step} from {primary} failed: "
                                     f"{type(exc).__name__}: {exc}{hint}") from exc
        finally:
            if not ok and heal.stager is not None:
                heal.stager.abandon()  # a stream cut off half-way gives its slot back; nothing more is copied
            # Every source of a striped heal waits for this receiver, whether or not it got a range to serve.
            told = heal.joined if len(urls) == 1 else set(urls)
            await asyncio.gather(*(self._tell_done(url, heal, ok) for url in told))

    def _params(self, heal: _Heal, **extra: int) -> dict[str, str]:
        remaining = max(0.0, heal.deadline - time.monotonic())
        return {"session": heal.session_id, "timeout": f"{remaining:.3f}", **{k: str(v) for k, v in extra.items()}}

    async def _get_encoded(self, heal: _Heal, url: str, path: str, targets: dict[Path, Any],
                           header_only: bool | None) -> tuple[EncodedSink, dict[str, str]]:
        """GET ``url + path`` into an encoded-state-dict sink; the sink (its body complete) and the answer's headers."""
        sink: EncodedSink | None = None

        def sink_for(length: int) -> EncodedSink:
            nonlocal sink
            heal.joined.add(url)
            sink = EncodedSink(url, heal.step, length, targets, header_only=header_only, stager=heal.stager)
            return sink

        headers = await _http_client.get_into(url + path, self._params(heal), self._auth_headers(), sink_for,
                                              tls=self._tls_for(url))
        assert sink is not None
        return sink, headers

    async def _get_bytes(self, heal: _Heal, url: str, path: str, limit: int, *, exact: bool = False,
                         hold: float | None = None) -> bytes:
        """GET a small answer (a header, block sums) whole.

        An answer longer than ``limit`` (or of any other length, with ``exact``)
        is refused before it is read. ``hold``: how long the server may hold the
        request for a step not published yet (default: the rest of the heal).
        """
        sink: BytesSink | None = None

        def sink_for(length: int) -> BytesSink:
            nonlocal sink
            heal.joined.add(url)  # it answered: it knows this session
            if length > limit or (exact and length != limit):
                raise CheckpointTransferError(f"{url}{path} answered {length} bytes, expected "
                                              f"{limit if exact else f'at most {limit}'}")
            sink = BytesSink(length)
            return sink

        params = self._params(heal)
        if hold is not None:
            params["timeout"] = f"{hold:.3f}"
        await _http_client.get_into(url + path, params, self._auth_headers(), sink_for, tls=self._tls_for(url))
        assert sink is not None
        return bytes(sink.data)

    async def _fetch_range(self, heal: _Heal, writer: TensorWriter, part: _Range, url: str) -> None:
        """GET the data bytes of ``part`` and their sums from ``url``, straight into ``writer``."""
        def data_sink(length: int) -> DataSink:
            sink = DataSink(writer, part.start, part.end)
            if length != sink.length:
                raise CheckpointTransferError(f"{url}: range [{part.start}, {part.end}) came with {length} bytes, "
                                              f"expected {sink.length}")
            heal.joined.add(url)
            part.sink = sink
            return sink

        params = self._params(heal, start=part.start, end=part.end)
        if heal.stager is None and _streams.on_threads():  # host targets, cores to spare: a thread per range
            await _http_client.get_into_on_thread(f"{url}/data", params, self._auth_headers(), data_sink,
                                                  timeout=max(heal.deadline - time.monotonic(), 1.0),
                                                  tls=self._tls_for(url))
        else:  # GPU targets land through the one staging ring, which the event loop alone fills; or few cores
            await _http_client.get_into(f"{url}/data", params, self._auth_headers(), data_sink,
                                        tls=self._tls_for(url))

    async def _fetch_ranges(self, heal: _Heal, targets: dict[Path, Any]) -> TensorWriter:
        """The primary's header, then the data in block-aligned ranges fetched at once from every source.

        The result is the primary's snapshot byte for byte; the other sources
        (secondaries) only make it arrive sooner, so that state which
        legitimately differs between replica groups (BatchNorm running
        statistics, a data loader's position) never stops a heal. Their
        headers are fetched alongside the primary's (the data waits for none
        of them) and a difference is logged (:meth:`_compare_headers`); a
        secondary's range that fails or lags comes from the primary instead
        (:meth:`_stripe`); blocks a secondary served that differ from the
        primary's are fetched again from the primary (:meth:`_match_primary`).
        """
        headers = {source: asyncio.create_task(self._get_bytes(heal, url, "/header", _MAX_HEADER_ANSWER))
                   for source, url in enumerate(heal.urls) if source}
        try:
            primary, advertised = await self._primary_header(heal, targets)
            writer = primary.complete_writer()
            if primary.whole:
                return writer
            streams = self._num_chunks if self._num_chunks is not None else \
                _streams.streams_for(writer.header.data_bytes, advertised)
            parts = writer.header.blocks.split(max(streams, len(heal.urls)))
            ranges = [_Range(start, end, i % len(heal.urls)) for i, (start, end) in enumerate(parts)]
            await self._stripe(heal, writer, ranges)
            await self._compare_headers(heal, primary, headers, ranges)
            await self._match_primary(heal, writer, ranges)
        finally:
            await _cancel(list(headers.values()))
        return writer

    async def _primary_header(self, heal: _Heal, targets: dict[Path, Any]) -> tuple[EncodedSink, int]:
        """The primary's header and how many streams it advertises (``_streams``).

        With ``num_chunks`` unset and one source, a source that serves no
        header alone is read whole, in one stream: one that answers the
        header's request with everything, or has no such route (404, 405).
        """
        adaptive, url = self._num_chunks is None and len(heal.urls) == 1, heal.urls[0]
        try:
            sink, answer = await self._get_encoded(heal, url, "/header", targets,
                                                   header_only=None if adaptive else True)
        except _http_client.HTTPStatusError as exc:
            if not adaptive or exc.status not in (404, 405):
                raise
            logger.info("step %d: %s serves no header alone (HTTP %d); receiving the state dict whole, in one "
                        "stream", heal.step, heal.names[0], exc.status)
            sink, answer = await self._get_encoded(heal, url, "", targets, header_only=False)
        return sink, _streams.advertised(answer)

    async def _stripe(self, heal: _Heal, writer: TensorWriter, ranges: list[_Range]) -> None:
        """Fetch every range at once; what a secondary fails to deliver, or delivers too slowly, the primary sends.

        A failed range of the primary fails the heal. A secondary's range that
        fails (refused, reset, an HTTP error, truncated, a layout its ranges do
        not fit) is fetched again, whole, from the primary at once, its partly
        filled blocks forgotten first. Once the primary has nothing left to
        fetch, a secondary's range that has run for ``_PATIENCE`` seconds is
        taken over too when it has sent nothing, or when at its pace it would
        end later than the primary could fetch it all again (:func:`_lagging`):
        a secondary that stops answering costs the heal that much, not its
        timeout. Every range's ``source`` is, on return, the source it came from.
        """
        blocks = writer.header.blocks
        began = time.monotonic()
        primary_bytes, primary_until = 0, began  # what the primary delivered, and when it last finished a range
        running: dict[asyncio.Task, _Range] = {}

        def fetch(part: _Range, source: int) -> None:
            part.source, part.sink, part.started = source, None, time.monotonic()
            task = asyncio.create_task(self._fetch_range(heal, writer, part, heal.urls[source]))
            running[task] = part

        def fetch_from_primary(part: _Range, why: str) -> None:
            logger.warning("step %d: %s %s; fetching data bytes [%d, %d) from the primary %s instead", heal.step,
                           heal.names[part.source], why, part.start, part.end, heal.names[0])
            writer.receive_again(blocks.covering(part.start, part.end))  # whatever part of it had arrived
            fetch(part, 0)

        for part in ranges:
            fetch(part, part.source)
        try:
            while running:
                # Bounded by the heal's timeout; while a secondary's range runs, wake up now and then to judge it.
                watching = any(part.source for part in running.values())
                done, _ = await asyncio.wait(list(running), timeout=_WATCH_INTERVAL if watching else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    part = running.pop(task)
                    error = task.exception()
                    if error is None:
                        if part.source == 0:
                            primary_bytes += part.end - part.start
                            primary_until = time.monotonic()
                    elif part.source == 0 or not isinstance(error, _SOURCE_ERRORS):
                        raise error
                    else:
                        fetch_from_primary(part, f"failed ({_describe(error)})")
                if any(part.source == 0 for part in running.values()):
                    continue
                now = time.monotonic()
                primary_rate = primary_bytes / max(primary_until - began, 1e-6)
                for task, part in list(running.items()):
                    why = _lagging(part, now, primary_rate)
                    if why is None or task.done():  # a range that has just ended is judged by the next wait
                        continue
                    del running[task]
                    await _cancel([task])  # it writes into the blocks the primary is about to send: stop it first
                    fetch_from_primary(part, why)
        finally:
            await _cancel(list(running))

    async def _compare_headers(self, heal: _Heal, primary: EncodedSink, headers: dict[int, asyncio.Task],
                               ranges: list[_Range]) -> None:
        """Log each secondary whose header differs from the primary's; the heal uses the primary's either way.

        A header still on its way is waited for when its source served data
        (it answers, and its data was of the primary's layout at least);
        otherwise the comparison is given up.
        """
        served = {part.source for part in ranges}
        for source, task in headers.items():
            if not task.done() and source not in served:
                logger.info("step %d: %s has not sent its header; not compared with the primary's", heal.step,
                            heal.names[source])
                continue
            try:
                raw = await task
            except _SOURCE_ERRORS as exc:
                logger.warning("step %d: could not fetch the header of %s to compare it with the primary's: %s",
                               heal.step, heal.names[source], _describe(exc))
                continue
            assert primary.writer is not None
            difference = encoded_header_difference(primary.writer.header, primary.header_bytes, raw)
            if difference is not None:
                logger.warning("%s and %s disagree about step %d: %s; the heal takes the header of the primary %s, "
                               "and its data wherever they differ", heal.names[0], heal.names[source], heal.step,
                               difference, heal.names[0])

    async def _match_primary(self, heal: _Heal, writer: TensorWriter, ranges: list[_Range]) -> None:
        """Fetch again from the primary every block that a secondary served and that differs from the primary's.

        The primary's ``/checksums`` holds every block's sum (it sums the
        blocks it did not serve, on a worker thread); a block a secondary
        served is kept only when its bytes as received and that secondary's
        own sum both equal it. Adjacent blocks travel as one range. A heal
        served by the primary alone asks for nothing.
        """
        blocks = writer.header.blocks
        served_by: dict[int, int] = {}  # block -> the secondary it came from
        for part in ranges:
            if part.source:
                served_by.update(dict.fromkeys(blocks.covering(part.start, part.end), part.source))
        if not served_by:
            return
        answer = await self._get_bytes(heal, heal.urls[0], "/checksums", len(blocks) * checksum.SUM_BYTES,
                                       exact=True)
        differing = await asyncio.to_thread(writer.blocks_differing_from, checksum.unpack(answer), sorted(served_by))
        if not differing:
            return
        by_source: dict[int, list[int]] = {}
        for block in differing:
            by_source.setdefault(served_by[block], []).append(block)
        which = "; ".join(f"{heal.names[source]}: {len(found)} blocks ({blocks.bytes_of(found)} bytes), first "
                          f"{writer.describe_block(found[0])}" for source, found in by_source.items())
        logger.warning("step %d: data from %s differs from the primary %s's (state that differs between replica "
                       "groups, a diverged replica, or damage in transit); fetching those %d blocks (%d bytes) again "
                       "from the primary", heal.step, which, heal.names[0], len(differing),
                       blocks.bytes_of(differing))
        writer.receive_again(differing)
        streams = asyncio.Semaphore(max(len(ranges), len(heal.urls)))

        async def fetch_again(start: int, end: int) -> None:
            async with streams:
                await self._fetch_range(heal, writer, _Range(start, end, 0), heal.urls[0])

        await _all([asyncio.create_task(fetch_again(start, end)) for start, end in blocks.ranges_of(differing)])

    async def _tell_done(self, url: str, heal: _Heal, ok: bool) -> None:
        """Tell ``url`` this session has finished: a server counts a done only from a session that asked it
        for the step, so a source that has not answered this session yet (a secondary that served no range)
        is first asked for its header without waiting (it notes the session, or serves the header)."""
        try:
            async with asyncio.timeout(DONE_TIMEOUT):
                if url not in heal.joined:
                    try:
                        await self._get_bytes(heal, url, "/header", _MAX_HEADER_ANSWER, hold=0.0)
                    except _http_client.HTTPStatusError:
                        pass  # 504: not published yet, but the session is noted; 400: that step is over anyway
                await _http_client.post(f"{url}/done", {"session": heal.session_id, "ok": "1" if ok else "0"},
                                        self._auth_headers(), tls=self._tls_for(url))
        except _http_client.HTTPStatusError as exc:
            logger.debug("%s/done answered HTTP %d", url, exc.status)
        except (CheckpointTransferError, OSError) as exc:  # refused, reset, unreachable, timed out (TimeoutError)
            logger.debug("could not tell %s that session %s finished: %r", url, heal.session_id, exc)


def _lagging(part: _Range, now: float, primary_rate: float) -> str | None:
    """Why the idle primary should fetch ``part`` itself rather than wait for its secondary; None to wait.

    ``primary_rate`` is the primary's pace so far (data bytes per second).
    The secondary's range is restarted from scratch at the primary (a range's
    sums come at its end), so it is worth it only when the secondary would
    need longer for what is left than the primary for the whole.
    """
    elapsed = now - part.started
    if elapsed < _PATIENCE:
        return None
    sink = part.sink
    if sink is None or sink.received == 0:
        return f"has sent nothing in {elapsed:.1f}s"
    left = (sink.length - sink.received) * elapsed / sink.received
    if primary_rate > 0 and left > sink.length / primary_rate:
        return f"would need about {left:.1f}s more at its pace ({sink.received / elapsed / 1e6:.1f} MB/s)"
    return None


def _describe(error: BaseException) -> str:
    """An error of a source, for a log line."""
    if isinstance(error, (CheckpointError, _http_client.HTTPStatusError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


async def _all(tasks: list[asyncio.Task]) -> list:
    """Every task's result; when one fails, the others are cancelled (and awaited) before its error is raised."""
    try:
        return await asyncio.gather(*tasks)
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def encoded_header_difference(header: Header, header_bytes: bytes, raw: bytes) -> str | None:
    """None when ``raw`` (another source's prefix and header) equals ``header_bytes``; else what differs, in words.

    ``header`` is ``header_bytes`` validated: the primary's, which a striped heal takes.
    """
    if raw == header_bytes:
        return None
    try:
        length, crc = unpack_prefix(raw[:PREFIX_SIZE])
        if len(raw) != PREFIX_SIZE + length:
            raise CheckpointTransferError(f"a {length}-byte header declared, {len(raw) - PREFIX_SIZE} sent")
        return header_difference(header, parse_header(raw[PREFIX_SIZE:], crc))
    except CheckpointTransferError as exc:
        return f"the second sent an unusable header: {exc}"


def header_difference(first: Header, other: Header) -> str:
    """What ``other`` declares differently from ``first``, in a few words for an error message.

    Two replicas that serve the same step should send byte-identical headers;
    when they do not, this says where they part: the step, the block size, the
    first tensor whose path, dtype or shape differs, or the first non-tensor
    value that differs (an optimizer's ``lr``, say).
    """
    if first.step != other.step:
        return f"step {first.step} vs step {other.step}"
    if first.blocks.block_bytes != other.blocks.block_bytes:
        return f"checksum blocks of {first.blocks.block_bytes} vs {other.blocks.block_bytes} bytes"
    for index in range(max(len(first.entries), len(other.entries))):
        if index >= len(first.entries) or index >= len(other.entries):
            extra = first if index < len(first.entries) else other
            return (f"structure: {len(first.entries)} vs {len(other.entries)} tensors (tensor "
                    f"{format_path(extra.paths[index])} is only in one)")
        mine, theirs = first.entries[index], other.entries[index]
        if first.paths[index] != other.paths[index]:
            return f"structure: tensor {index} is {format_path(first.paths[index])} vs " \
                   f"{format_path(other.paths[index])}"
        if (mine.dtype, mine.shape) != (theirs.dtype, theirs.shape):
            return f"structure: tensor {format_path(first.paths[index])} is {mine.dtype}{list(mine.shape)} vs " \
                   f"{theirs.dtype}{list(theirs.shape)}"
    return _node_difference(first.tree, other.tree, ()) or "the header bytes (same contents, encoded differently)"


def _node_difference(mine: Any, theirs: Any, path: Path) -> str | None:
    """The first place two validated trees differ, or None (raw JSON nodes: a NaN equals itself here)."""
    if mine == theirs:
        return None
    (tag, value), (their_tag, their_value) = mine, theirs
    if tag == their_tag == "dict":
        keys = [decode_key(key, path) for key, _ in value]
        if keys != [decode_key(key, path) for key, _ in their_value]:
            return f"structure: the keys at {format_path(path)} differ"
        pairs = zip(keys, value, their_value)
        children = ((path + (key,), a, b) for key, (_, a), (_, b) in pairs)
    elif tag == their_tag and tag in ("list", "tuple"):
        if len(value) != len(their_value):
            return f"structure: {len(value)} vs {len(their_value)} items at {format_path(path)}"
        children = ((path + (i,), a, b) for i, (a, b) in enumerate(zip(value, their_value)))
    else:
        return f"value at {format_path(path)}: {_shown(mine, path)} vs {_shown(theirs, path)}"
    for child_path, a, b in children:
        found = _node_difference(a, b, child_path)
        if found is not None:
            return found
    return None


def _shown(node: Any, path: Path) -> str:
    def leaf(index: int, _: Path, layout: Any = None) -> str:
        if layout is None:
            return f"<tensor {index}>"
        placements = ",".join(":".join(str(part) for part in placement) for placement in layout.placements)
        return f"<DTensor {list(layout.shape)} ({placements}) on {layout.mesh.device_type} mesh " \
               f"{list(layout.mesh.shape)}>"

    text = repr(decode_tree(node, path, leaf))
    return text if len(text) <= 90 else text[:87] + "..."
