"""The HTTP side of a trainer's metrics: ``/metrics`` of one registry, under the job's access policy.

A scrape is one small GET, so the server is the standard library's
``http.server`` on one daemon thread (the control-plane loop is kept for the
training's own traffic): a thread per request, at most
:data:`MAX_CONCURRENT_SCRAPES` at once, each bounded by a socket timeout, and
one request per connection. Nothing is parsed from a request beyond its path
and its ``Authorization`` header, and nothing is unpickled.

Access (:class:`torchft_lite.rpc.access.Access`, as every other server of a job):
with a job token, a scrape must carry ``Authorization: Bearer <token>`` (401
otherwise); with no token, only loopback peers are served (403 otherwise)
unless ``TORCHFT_LITE_INSECURE=1``. With ``TORCHFT_LITE_TLS_CERT``/``_KEY`` set
it serves HTTPS, so the token never crosses the network in plain text.
Refusals are counted and logged at most once per 10 s (``RefusalLog``); request
lines are never logged, since a query string could hold a token.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import ssl
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from torchft_lite.rpc.access import Access
from torchft_lite.rpc.refusals import RefusalLog

__all__ = ["MAX_CONCURRENT_SCRAPES", "MetricsServer"]

logger = logging.getLogger(__name__)

MAX_CONCURRENT_SCRAPES = 8
"""Requests served at once; more are closed unanswered (a scraper retries at its next interval)."""
REQUEST_TIMEOUT_SEC = 10.0
"""A client that sends its request (or reads the answer) slower than this is cut off."""
POLL_SEC = 0.5
"""How often the serving thread checks whether it should stop (its owner closed it, or the Manager shut down)."""
_PATHS = ("/metrics", "/")


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a scrape in flight never keeps the process alive
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], family: int, handler: type, owner: "MetricsServer") -> None:
        self.address_family = family
        self.owner = owner
        self.slots = threading.BoundedSemaphore(MAX_CONCURRENT_SCRAPES)
        super().__init__(address, handler)
        self.timeout = POLL_SEC  # handle_request() returns after this long without a connection

    def server_bind(self) -> None:
        # HTTPServer's own looks the host's name up (socket.getfqdn), which can hang on a bad resolver.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # busy: closed unanswered rather than queued without bound
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up, timed out or failed the TLS handshake: the default prints a traceback.
        logger.debug("%s: a request from %s failed", self.owner.name, client_address[0], exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive connections to hold
    server_version = "torchft_lite-metrics"
    sys_version = ""
    timeout = REQUEST_TIMEOUT_SEC

    def setup(self) -> None:
        super().setup()  # applies ``timeout`` to the socket
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # here, on this request's thread, bounded by the timeout

    def do_GET(self) -> None:
        owner = self.server.owner
        refusal = owner.access.check(self.client_address[0], self.headers.get("Authorization"))
        if refusal is not None:
            owner.note_refusal(self.client_address[0], refusal)
            status = 401 if refusal.kind == "unauthenticated" else 403
            self._answer(status, "text/plain; charset=utf-8", (refusal.message + "\n").encode(),
                         {"WWW-Authenticate": "Bearer"} if status == 401 else {})
            return
        if urllib.parse.urlsplit(self.path).path not in _PATHS:
            self._answer(404, "text/plain; charset=utf-8", b"only /metrics is served here\n")
            return
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        self._answer(200, content_type, encoder(owner.registry))

    def _answer(self, status: int, content_type: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        logger.debug("%s: answered %s to %s", self.server.owner.name, code, self.client_address[0])

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
        # ``args`` may quote the request line, which may hold a token: only the peer is logged.
        logger.debug("%s: a malformed request from %s", self.server.owner.name, self.client_address[0])


class MetricsServer:
    """Serves ``registry`` on ``http(s)://host:port/metrics`` from a daemon thread until :meth:`close`,
    or until ``stop_when()`` turns true (checked every :data:`POLL_SEC`)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, *, access: Access,
                 tls: ssl.SSLContext | None = None, name: str = "metrics server",
                 stop_when: Callable[[], bool] = lambda: False) -> None:
        """Binds at once (``OSError`` if it can't); ``tls``: serve HTTPS with this server context."""
        self.registry, self.access, self.name = registry, access, name
        self._stop_when = stop_when
        self._stopping = threading.Event()
        self._refusals = RefusalLog(name)
        self._refusals_lock = threading.Lock()  # RefusalLog is single-threaded; requests are not
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._httpd = _Server((host, port), family, _Handler, self)
        if tls is not None:
            # The handshake happens on each request's own thread (``_Handler.setup``), not in accept().
            self._httpd.socket = tls.wrap_socket(self._httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.scheme = "https" if tls is not None else "http"
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._serve, name="torchft-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    @property
    def refusals(self) -> dict[str, int]:
        """Refused scrapes by kind (``unauthenticated``, ``forbidden``)."""
        with self._refusals_lock:
            return dict(self._refusals.counts)

    def note_refusal(self, peer: str, refusal: Any) -> None:
        with self._refusals_lock:
            self._refusals.note(peer, "GET /metrics", refusal)

    @property
    def serving(self) -> bool:
        return self._thread.is_alive()

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set() and not self._stop_when():
                self._httpd.handle_request()
        except Exception:  # logged with its traceback: the metrics stop, the training goes on
            logger.exception("%s stopped on an error", self.name)
        finally:
            self._httpd.server_close()
            logger.debug("%s on port %d stopped", self.name, self.port)

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and close the port (waits up to ``timeout`` for the serving thread). Idempotent."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
