"""An aiohttp site on a ``HOST:PORT``, as the lighthouse's HTTP side binds it."""

from __future__ import annotations

import ssl

from aiohttp import web

from torchft_lite.rpc.addresses import dual_stack_socket, split_host_port

__all__ = ["start_site"]


async def start_site(app: web.Application, bind: str,
                     tls: ssl.SSLContext | None = None) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``bind``; returns the runner (``await runner.cleanup()`` stops it) and the bound port.

    Host '' or '::' means every interface, IPv4 clients included (see
    ``dual_stack_socket``). ``tls``: serve HTTPS only, with this context
    (``TlsSettings.server_context()``); None: plain HTTP. A port that cannot
    be bound raises ``OSError``.
    """
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    host, port = split_host_port(bind)
    try:
        if host in ("", "::"):
            site = web.SockSite(runner, dual_stack_socket(port), ssl_context=tls)
        else:
            site = web.TCPSite(runner, host, port, reuse_address=True, ssl_context=tls)
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    addresses = runner.addresses  # the sockets' names, of the one site
    return runner, addresses[0][1] if addresses else port
