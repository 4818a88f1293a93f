"""The checkpoint server's socket: where it listens, and how a stream's connection is tuned.

``::`` binds through ``torchft_lite.rpc.addresses.dual_stack_socket``, as the
other servers of a trainer do. ``torchft_lite.rpc.sites.start_site`` is not
used: its runner has aiohttp's default shutdown timeout (the checkpoint server
gives held requests one second), and it binds every address a host name
resolves to where this server binds one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Callable, Iterable

from torchft_lite.checkpointing._streams import on_own_thread
from torchft_lite.rpc.addresses import dual_stack_socket

__all__ = ["QUEUE_BYTES", "SEND_BUFFER_BYTES", "flushed", "listen", "send_on_thread", "tune"]

logger = logging.getLogger("torchft_lite.checkpointing.http_transport")  # one logger for the transport

BACKLOG = 128  # connections the kernel accepts before the server reads them
ABORT_GRACE = 10.0  # seconds a release waits for aborted streams and encoding to stop
SEND_BUFFER_BYTES = 8 << 20
QUEUE_BYTES = 16 << 20  # views of tensor memory the transport may queue before the stream waits
# Over TLS what is queued is encrypted copies (the TLS layer encrypts a write at once, and hands the whole
# of its output to the socket's own transport, which queues it again): a small queue bounds that memory
# per stream; encryption, not the queue, paces a TLS stream.
TLS_QUEUE_BYTES = 2 << 20


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` now: a connection made before the server runs waits in its backlog
    (``HTTPTransport(defer_server=True)``) instead of being refused."""
    if host == "::":
        sock = dual_stack_socket(port)
        if sock.family != socket.AF_INET6:
            logger.info("IPv6 unavailable; the checkpoint server listens on 0.0.0.0 instead of ::")
    elif ":" in host:
        sock = socket.create_server((host, port), family=socket.AF_INET6)
    else:
        sock = socket.create_server((host, port))
    sock.listen(BACKLOG)
    return sock


def tune(transport: asyncio.BaseTransport | None) -> None:
    """Big kernel send buffers and a deep write queue: the queue holds views, never copies (over TLS, a
    shallow one: it holds encrypted copies)."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        except OSError as exc:
            logger.debug("could not enlarge the send buffer: %r", exc)
    tls = transport.get_extra_info("ssl_object") is not None
    transport.set_write_buffer_limits(high=TLS_QUEUE_BYTES if tls else QUEUE_BYTES)  # type: ignore[attr-defined]


async def flushed(transport: asyncio.BaseTransport | None) -> None:
    """Wait until ``transport`` has handed every queued byte to the kernel (or is closing).

    Duck-typed: uvloop's transports are not registered as ``asyncio.WriteTransport``.
    """
    delay = 0.0001
    while transport is not None and not transport.is_closing() \
            and transport.get_write_buffer_size():  # type: ignore[attr-defined]
        await asyncio.sleep(delay)
        delay = min(2 * delay, 0.005)


_REPORT_BYTES = 32 << 20  # bytes a sending thread sends between two reports to the loop


async def send_on_thread(transport: asyncio.BaseTransport, pieces: Iterable[memoryview | bytes],
                         stopped: Callable[[], bool], sent: Callable[[int], None], timeout: float) -> None:
    """Write ``pieces`` to ``transport``'s socket from a thread of their own, not from the event loop.

    So that the streams of a heal are sent on as many cores (each piece's checksum, computed as the piece is
    produced, too). The thread writes through a duplicate of the socket's descriptor, after everything the
    transport had queued is out (the response's head) and while nothing else writes to it; every send waits
    at most ``timeout`` for the kernel to take bytes. ``stopped()`` is asked before each piece (a release),
    and ``sent(count)`` is called on the loop every few MiB sent. Cancelling shuts the socket down and returns once
    the thread has stopped reading tensor memory. Plain TCP only: over TLS the transport encrypts.
    """
    await flushed(transport)
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing():
        raise ConnectionResetError("the connection closed before the data was sent")
    duplicate = socket.socket(fileno=os.dup(sock.fileno()))
    duplicate.settimeout(timeout)  # a send that waits longer fails (socket.timeout, an OSError)
    loop = asyncio.get_running_loop()

    def report(count: int) -> None:
        try:
            loop.call_soon_threadsafe(sent, count)
        except RuntimeError:  # the loop has closed (the process is exiting): nobody reads the count
            pass

    def send() -> None:
        unreported = 0
        try:
            for piece in pieces:
                if stopped():
                    raise ConnectionAbortedError("the step was released mid-stream")
                duplicate.sendall(piece)
                unreported += len(piece)
                if unreported >= _REPORT_BYTES:  # a wake-up of the loop per piece would cost it a core's share
                    report(unreported)
                    unreported = 0
        finally:
            if unreported:
                report(unreported)

    def abort() -> None:
        try:
            duplicate.shutdown(socket.SHUT_RDWR)  # a blocked send returns at once
        except OSError:
            pass

    try:
        await on_own_thread("torchft-heal-send", abort, send)
    finally:
        duplicate.close()
