"""The parameter server: an HTTP endpoint that opens sessions, and one two-rank process group per session.

A client GETs ``/new_session``; the server answers with a session id and a
store address (``host:port/session/<id>`` on a TCPStore it hosts), closes the
connection, and on that request's thread forms a process group with the
client (server rank 0, client rank 1, through
:func:`~torchft_lite.process_group.reconfigure_with_store`) and runs
:meth:`ParameterServer.forward` for the session. When the client dies, or
anything else fails, the session's collectives fail within the process
group's timeout: the error is logged, the group is shut down, and the server
goes on serving other sessions; the client opens a new one.

Access, as every other server of a job (:mod:`torchft_lite.rpc.access`): with
a job token, a request must carry ``Authorization: Bearer <token>`` (401
otherwise; :meth:`ParameterServer.new_session` sends it); with none, only
loopback peers are served (403) unless ``TORCHFT_LITE_INSECURE=1``. Nothing
is parsed from a request beyond its path and that header. The session's
TCPStore, like every store a process group meets on, has no access control
of its own.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import urllib.parse
import urllib.request
import uuid
from abc import ABC, abstractmethod
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from torch.distributed import PrefixStore, TCPStore

from torchft_lite.process_group import ProcessGroup, parse_store_addr, reconfigure_with_store
from torchft_lite.process_group.handles import advertised_host
from torchft_lite.rpc.access import Access
from torchft_lite.rpc.refusals import RefusalLog

__all__ = ["ParameterServer"]

logger = logging.getLogger(__name__)

SESSION_PATH = "/new_session"
REQUEST_TIMEOUT_SEC = 10.0
"""A client that sends its request (or reads the answer) slower than this is cut off."""
POLL_SEC = 0.5
"""How often the serving thread checks whether it should stop."""
DEFAULT_TIMEOUT = timedelta(seconds=60)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a session in progress never keeps the process alive
    allow_reuse_address = True

    def __init__(self, family: int, host: str, port: int, owner: "ParameterServer") -> None:
        self.address_family = family
        self.owner = owner
        super().__init__((host, port), _Handler)
        self.timeout = POLL_SEC  # handle_request() returns after this long without a connection

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:  # "::" serves IPv4 peers too
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # HTTPServer's own looks the host's name up (socket.getfqdn), which can hang on a bad resolver.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up or timed out: the default prints a traceback to stderr.
        logger.debug("parameter server: a request from %s failed", client_address[0], exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"  # one request per connection: the client reads to the end of the answer
    server_version = "torchft_lite-parameter-server"
    sys_version = ""
    timeout = REQUEST_TIMEOUT_SEC

    def do_GET(self) -> None:
        owner = self.server.owner
        peer = self.client_address[0]
        refusal = owner.access.check(peer, self.headers.get("Authorization"))
        if refusal is not None:
            owner.note_refusal(peer, refusal)
            status = 401 if refusal.kind == "unauthenticated" else 403
            self._answer(status, "text/plain; charset=utf-8", (refusal.message + "\n").encode())
            return
        if urllib.parse.urlsplit(self.path).path != SESSION_PATH:
            self._answer(400, "text/plain; charset=utf-8", f"invalid path: only {SESSION_PATH} is served\n".encode())
            return
        session_id = str(uuid.uuid4())
        store_addr = f"{owner.store_address}/session/{session_id}"
        self._answer(200, "application/json", (json.dumps({"session_id": session_id, "store_addr": store_addr})
                                               + "\n").encode())
        # Close the connection now, so the client knows the answer is complete; this thread then serves the
        # session for as long as forward() runs.
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_WR)
        logger.info("parameter server: session %s for %s", session_id, peer)
        owner._handle_session(session_id, store_addr)

    def _answer(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        logger.debug("parameter server: answered %s to %s", code, self.client_address[0])

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
        # ``args`` may quote the request line: only the peer is logged.
        logger.debug("parameter server: a malformed request from %s", self.client_address[0])


class ParameterServer(ABC):
    """A threaded parameter server on torchft_lite's reconfigurable process groups (torchft's API).

    Subclasses implement :meth:`new_process_group` and :meth:`forward`. The server is serving when the
    constructor returns; :meth:`shutdown` (ours) stops it.

    Args:
        port: the port of the HTTP endpoint that opens sessions (0 picks a free one).
        store_port: the port of the TCPStore the sessions' process groups meet on (0 picks a free one).
        timeout: (ours) how long a session's rendezvous may take on either side.
        hostname: (ours) the host clients dial, in :meth:`address` and in each session's store address
            (default: ``TORCHFT_LITE_HOSTNAME``, else the machine's hostname).
        access: (ours) who may open a session (default: the job's token settings, see the module docstring).
    """

    def __init__(self, port: int, store_port: int = 0, *, timeout: timedelta = DEFAULT_TIMEOUT,
                 hostname: str | None = None, access: Access | None = None) -> None:
        self.access = Access.from_env() if access is None else access
        self._timeout = timeout
        self._host = hostname or advertised_host()
        self._refusals = RefusalLog("parameter server")
        self._refusals_lock = threading.Lock()  # RefusalLog is single-threaded; requests are not
        self._stopping = threading.Event()
        self.store = TCPStore(host_name=self._host, port=store_port, is_master=True, wait_for_workers=False,
                              timeout=timeout)
        try:
            self._server = _Server(socket.AF_INET6, "::", port, self)
        except OSError:  # no IPv6 on this host
            self._server = _Server(socket.AF_INET, "0.0.0.0", port, self)
        self._thread = threading.Thread(target=self._serve, name="torchft-parameter-server", daemon=True)
        self._thread.start()
        logger.info("parameter server: serving sessions on %s; %s", self.address(), self.access.describe())

    @property
    def store_address(self) -> str:
        """``host:port`` of the TCPStore the sessions meet on (ours)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.store.port}"

    def address(self) -> str:
        """Where a client opens a session: ``http://host:port/new_session``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._server.server_address[1]}{SESSION_PATH}"

    def note_refusal(self, peer: str, refusal: Any) -> None:
        with self._refusals_lock:
            self._refusals.note(peer, f"GET {SESSION_PATH}", refusal)

    @property
    def refusals(self) -> dict[str, int]:
        """Refused requests by kind (``unauthenticated``, ``forbidden``) (ours)."""
        with self._refusals_lock:
            return dict(self._refusals.counts)

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                self._server.handle_request()
        except Exception:  # logged with its traceback: no new sessions, the ones in progress go on
            logger.exception("parameter server: serving stopped on an error")
        finally:
            self._server.server_close()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop opening sessions and close the HTTP port (ours; waits up to ``timeout`` for the serving thread).
        Sessions in progress run on until their ``forward`` returns. Idempotent."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @classmethod
    @abstractmethod
    def new_process_group(cls) -> ProcessGroup:
        """A new process group, not configured yet, for one side of a session. Subclasses implement it.

        Its timeout bounds every collective of the session: it is how long a side waits for a peer that died.
        """

    @classmethod
    def new_session(cls, address: str, *, timeout: timedelta = DEFAULT_TIMEOUT) -> ProcessGroup:
        """Open a session on the server at ``address`` (:meth:`address`); returns this side's process group,
        configured with the server (the client is rank 1, the server rank 0).

        ``timeout`` (ours) bounds the request and the rendezvous. Raises ``urllib.error.URLError`` when the
        server can't be reached or refuses (``HTTPError`` 401/403: see the module docstring), and
        ``ValueError`` for an answer that is not a session.
        """
        request = urllib.request.Request(address, headers=Access.from_env().headers())
        with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as answer:
            body = answer.read(64 * 1024)
        session = json.loads(body)
        if not (isinstance(session, dict) and isinstance(session.get("session_id"), str)
                and isinstance(session.get("store_addr"), str)):
            raise ValueError(f"{address} did not answer with a session: {body[:200]!r}")
        logger.info("parameter server: joining session %s at %s", session["session_id"], session["store_addr"])
        pg = cls.new_process_group()
        reconfigure_with_store(pg, session["store_addr"], 1, 2, timeout)
        return pg

    def _handle_session(self, session_id: str, store_addr: str) -> None:
        """One session on this thread: the process group with the client, then :meth:`forward`; its errors are
        logged and end the session only."""
        pg = self.new_process_group()
        try:
            reconfigure_with_store(pg, store_addr, 0, 2, self._timeout)
            self._forget(store_addr)  # both sides have met: the rendezvous keys are not needed any more
            self.forward(session_id, pg)
        except Exception:
            logger.exception("parameter server: session %s failed; the client must open a new one", session_id)
        finally:
            self._forget(store_addr)
            pg.shutdown()

    def _forget(self, store_addr: str) -> None:
        """Delete a session's rendezvous keys, so a long-lived server's store does not grow with every session."""
        store = PrefixStore(parse_store_addr(store_addr).prefix, self.store)
        for key in ("uuid", "handle/0", "handle/1"):
            store.delete_key(key)

    @abstractmethod
    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        """Serve one session; called on a thread of its own with the session's process group (server rank 0,
        client rank 1). Loop inside it to serve several operations. Subclasses implement it.

        An exception ends the session (it is logged and the group is shut down); the client opens a new one.

        Args:
            session_id: the session's unique id.
            pg: the process group configured with the client.
        """
