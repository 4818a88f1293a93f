"""aiohttp's client in place of the heal's lean HTTP client, for ``heal_bench --receiver aiohttp``.

The heal receiver GETs through one function, ``get_into(url, params, headers,
sink_for)``: a 200 body of ``n`` bytes goes into ``sink_for(n)``, whose
``buffer()`` is a view of tensor memory and ``filled(count)`` accounts for
what was written there. The lean client lets the kernel write into that view;
this one reads aiohttp's ``bytes`` chunks and copies them in, as any
aiohttp-based receiver would. Everything else (striping, checksums, done
reports) is the same code, so the benchmark compares the two clients alone.

Tuned as far as aiohttp allows: one pooled session per event loop, an 8 MiB
read buffer, the same 8 MiB kernel receive buffer as the lean client.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Callable

import aiohttp

from torchft_lite.checkpointing import _http_client as lean
from torchft_lite.errors import CheckpointTransferError

__all__ = ["get_into", "use_aiohttp_for_heals"]

_READ_BUFFER_BYTES = 8 << 20
_sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}


def _session() -> aiohttp.ClientSession:
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None:
        session = _sessions[loop] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), read_bufsize=_READ_BUFFER_BYTES, auto_decompress=False)
    return session


async def get_into(url: str, params: dict[str, str], headers: dict[str, str],
                   sink_for: Callable[[int], lean.BodySink], *, tls: ssl.SSLContext | None = None) -> dict[str, str]:
    """What ``lean.get_into`` does, through aiohttp: its chunks are copied into the sink (over TLS with
    ``tls``, as the lean client, whatever scheme ``url`` names); returns the headers, names in lower case."""
    secure = {}
    if tls is not None:
        url, secure = "https://" + url.partition("://")[2], {"ssl": tls}
    async with _session().get(url, params=params, headers=headers, **secure) as response:
        if response.status != 200:
            text = (await response.content.read(lean.MAX_ERROR_BYTES)).decode(errors="replace")
            raise lean.HTTPStatusError(response.status, text)
        length = response.content_length
        if length is None:
            raise CheckpointTransferError("the checkpoint server's answer has no Content-Length")
        transport = response.connection.transport if response.connection is not None else None
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, lean.RECEIVE_BUFFER_BYTES)
        sink = sink_for(length)
        remaining = length
        while remaining:
            chunk = await response.content.readany()
            if not chunk:
                raise CheckpointTransferError(f"checkpoint truncated: the connection closed with {remaining} body "
                                              f"bytes missing")
            remaining -= len(chunk)
            view = memoryview(chunk)
            while view:
                destination = sink.buffer()
                count = min(len(destination), len(view))
                destination[:count] = view[:count]
                sink.filled(count)
                view = view[count:]
        return {name.lower(): value for name, value in response.headers.items()}


def use_aiohttp_for_heals() -> None:
    """Make this process's heal receiver GET through aiohttp instead of the lean client.

    The receiver (``_http_receive``) calls ``_http_client.get_into`` (and, with CPUs to spare, its threaded
    twin ``get_into_on_thread`` for data ranges) through the module, so replacing the module's functions swaps
    the client: aiohttp reads every answer on the event loop. Its ``done`` reports stay on the lean client's POST.
    """
    async def on_the_loop(url, params, headers, sink_for, *, timeout=None, tls=None):
        return await get_into(url, params, headers, sink_for, tls=tls)

    lean.get_into = get_into  # type: ignore[assignment]
    lean.get_into_on_thread = on_the_loop  # type: ignore[assignment]
