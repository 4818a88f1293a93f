"""How many concurrent streams a receive uses when the caller did not say, and whether threads carry them.

A receive whose ``num_chunks`` was left unset first asks the source for the
header alone, unless this host's CPUs allow one stream whatever the size
(:func:`one_stream_here`: then the whole encoding comes in one GET). The
header's answer carries the data's size and, in the ``X-Checkpoint-Streams``
response header, how many concurrent range requests the source serves one
receiver (:func:`served_streams`). The data then comes as :func:`streams_for`
of them: one per ``BYTES_PER_STREAM`` of data, at least one, at most what the
source advertises and one per ``CPUS_PER_STREAM`` usable CPUs. From
``THREADS_FROM_CPUS`` CPUs on, each range is read (and, at the source, sent)
on a thread of its own (:func:`on_own_thread`), so a
heal's streams take as many cores; below it the event loop does it all, which
is faster where source and receiver share two cores. A source that
advertises nothing (an older one) gets one stream; one that serves no header
at all is read whole, in one request (``_http_receive``).
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Callable, Mapping, TypeVar

__all__ = ["ADVERTISE_HEADER", "BYTES_PER_STREAM", "CPUS_PER_STREAM", "MAX_STREAMS", "SERVED_STREAMS", "advertised",
           "THREADS_FROM_CPUS", "on_own_thread", "on_threads", "one_stream_here", "served_streams", "streams_for",
           "usable_cpus"]

T = TypeVar("T")

ADVERTISE_HEADER = "X-Checkpoint-Streams"
SERVED_STREAMS = 4
"""What our checkpoint server advertises at least: a receiver's connections each hold a socket and kernel
buffers of several MiB on both sides, and past four on a 2-CPU loopback they bought nothing measurable. A
source with more CPUs advertises one stream per ``CPUS_PER_STREAM`` of them (:func:`served_streams`), since
it then sends each range on a thread of its own."""
BYTES_PER_STREAM = 128 << 20
"""One stream per this much data: a 1 GiB heal takes 8 streams where the CPUs allow them (torchft's fastest
case on a 16-CPU host was its 8-chunk receive), anything under 256 MiB one."""
MAX_STREAMS = 16
"""Whatever a source advertises, a receiver opens no more than this many connections to it."""
CPUS_PER_STREAM = 2
"""A receive opens at most one stream per this many usable CPUs (one stream below four)."""


def advertised(headers: Mapping[str, str]) -> int:
    """The streams a source's answer advertises (response headers with lower-case names); 1 when it says nothing usable."""
    value = headers.get(ADVERTISE_HEADER.lower(), "").strip()
    if not value.isdigit():
        return 1
    return max(1, min(int(value), MAX_STREAMS))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


THREADS_FROM_CPUS = 4
"""From this many usable CPUs on, the data ranges of a heal are read (receiver) and sent (source) on a thread
each rather than on the event loop, so they take as many cores. Below it the loop does it all: on 2 CPUs, where
source and receiver already share the cores, threads ran at 0.71-0.85 of the loop's speed (GIL hand-offs and
wake-ups; ``heal_bench`` ``ours-2-inplace``/``ours-4-inplace``, docs/benchmarks.md)."""


def on_threads(cpus: int | None = None) -> bool:
    """Whether this process reads or sends a heal's data ranges on threads (see ``THREADS_FROM_CPUS``)."""
    return (usable_cpus() if cpus is None else cpus) >= THREADS_FROM_CPUS


def served_streams(cpus: int | None = None) -> int:
    """The streams our checkpoint server serves one receiver at once, on ``cpus`` usable CPUs (default:
    :func:`usable_cpus`): ``SERVED_STREAMS``, or one per ``CPUS_PER_STREAM`` CPUs where that is more."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(SERVED_STREAMS, min(MAX_STREAMS, cpus // CPUS_PER_STREAM))


def one_stream_here(cpus: int | None = None) -> bool:
    """Whether a receive on ``cpus`` usable CPUs (default: :func:`usable_cpus`) takes one stream whatever the
    size: then asking for the header first buys nothing, and the whole encoding comes in one GET."""
    cpus = usable_cpus() if cpus is None else cpus
    return cpus // CPUS_PER_STREAM <= 1


def streams_for(data_bytes: int, advertised_streams: int, cpus: int | None = None) -> int:
    """How many data ranges to fetch at once for ``data_bytes`` from a source that serves ``advertised_streams``,
    on ``cpus`` usable CPUs (default: :func:`usable_cpus`)."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, min(data_bytes // BYTES_PER_STREAM, advertised_streams, MAX_STREAMS, cpus // CPUS_PER_STREAM))


async def on_own_thread(name: str, abort: Callable[[], None], function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, run on a new daemon thread named ``name``.

    One thread per stream of a heal, started when the stream starts: a daemon, so a process that exits while a
    source stalls mid-heal does not wait for its blocked call (an executor's threads are joined at exit).
    Cancelling this call calls ``abort()``, which must make ``function`` return soon (a socket's shutdown), and
    re-raises the cancellation only once the thread has ended: by then it no longer touches tensor memory that
    a caller may hand to another stream, or a trainer change.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (function(*args), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the future
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop has closed: nobody waits for this stream any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        abort()
        await asyncio.wait([future])  # its error, if any (the shut socket's), is the cancellation's doing
        raise
