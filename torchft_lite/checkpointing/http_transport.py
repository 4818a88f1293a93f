"""HTTPTransport: serve one step's state dict over HTTP from the control-plane loop; fetch a peer's the same way.

The training thread calls the transport; the work runs on the control-plane
loop, behind a timeout that names its wait (``HTTPTransport._call``). Serving:
:meth:`HTTPTransport.send_checkpoint` publishes the state dict on the checkpoint
server (``_http_server``) and :meth:`HTTPTransport.disallow_checkpoint` waits for
its receivers, then releases it. Receiving: :meth:`HTTPTransport.recv_checkpoint`
(one source) and :meth:`HTTPTransport.recv_checkpoint_striped` (several, the
first as the truth) run a ``_http_receive.Receiver``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Coroutine, Sequence, TypeVar

from torchft_lite.checkpointing._http_receive import DONE_TIMEOUT, Receiver
from torchft_lite.checkpointing._http_socket import ABORT_GRACE, listen
from torchft_lite.checkpointing.transport import CheckpointTransport
from torchft_lite.errors import CheckpointError, CheckpointTimeout, ConfigError
from torchft_lite.rpc.access import Access
from torchft_lite.rpc.loop import control_plane
from torchft_lite.rpc.tls import TlsSettings
from torchft_lite.serialization.decode import targets_of
from torchft_lite.serialization.encode import FlatStateDict, flatten

if TYPE_CHECKING:
    from torchft_lite.checkpointing._http_server import CheckpointServer
    from torchft_lite.checkpointing._http_snapshot import Snapshot

__all__ = ["HTTPTransport", "HTTPTransportStatistics"]

T = TypeVar("T")
logger = logging.getLogger(__name__)


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

    A heal over HTTP: the healthy replica's ``send_checkpoint`` flattens its state
    dict (``serialization.encode.flatten``: validated on the caller's thread, read
    only when a receiver asks) and publishes it on its CheckpointServer; the
    replica behind calls ``recv_checkpoint``, whose Receiver GETs the encoding
    through ``_http_client``. The first bytes are the header, which
    ``serialization.spec.parse_header`` validates before anything is allocated; a
    ``serialization.decode.TensorWriter`` then takes the data straight into the
    receiver's tensors, checks every block's sum, and builds the state dict. The
    server counts the receiver finished once every data byte is out (or on its
    ``done`` POST), and ``disallow_checkpoint`` (which waits for the ``dst_ranks``
    receivers, at most the send's timeout) returns.

    Args:
        timeout: default bound for serving and for held requests.
        num_chunks: receive the tensor data over this many concurrent HTTP
            requests, split by bytes; 0 or 1 means one stream. None (the
            default): chosen per receive from the data's size and what the
            source advertises (``_streams``: one stream per 256 MiB, at most
            the source's 4 and one per two usable CPUs; a small state dict
            keeps one). Fresh tensors a
            receive allocates have their pages populated on two threads
            ahead of the writes, whatever the streams (``serialization.prefault``).
        hostname: advertised in :meth:`metadata`; defaults to ``socket.gethostname()``.
        bind_host: the address the server listens on ("::" is dual-stack).
        port: the port to listen on; 0 picks a free one.
        token: the job token, as ``access=Access(token)`` (kept for callers of
            earlier versions; pass one of ``token`` and ``access``).
        access: who may fetch this replica's state dict, and what this
            transport's receives send (``torchft_lite.rpc.access``): with a job
            token, every request must carry ``Authorization: Bearer <token>``
            (401 without or when wrong, nothing served) and every receive sends
            it; without one, only loopback peers are served (403), unless
            insecure. None: from ``TORCHFT_LITE_TOKEN``/``TORCHFT_LITE_TOKEN_FILE``
            /``TORCHFT_LITE_INSECURE``, so the Manager's own transport follows
            the job's environment.
        tls: TLS for serving and receiving (``torchft_lite.rpc.tls``): with a
            certificate the server is HTTPS only and :meth:`metadata` says
            ``https://``; receives use TLS for ``https://`` sources, and for
            every source once any TLS setting is given, checking the source's
            certificate against the CA. None: from ``TORCHFT_LITE_TLS_CERT``
            /``_KEY``/``_CA``, as ``access`` is from the environment.
        state_dict: when given, returns the local state dict; a received tensor
            whose path, dtype and shape match one of its tensors is written into
            that tensor (which the result then holds) instead of a new one: no
            extra memory, and contiguous CPU targets receive straight from the
            socket. A failed receive may leave such tensors partly overwritten.
        defer_server: bind the port now, start the server (and import
            aiohttp: about 0.1 s) at the first publish or :meth:`warm_up`,
            whichever comes first; a request that arrives before waits in the
            socket's backlog and is answered once it is up. The Manager's own
            transport is made this way and warmed at its second step's vote, so
            a restarted replica does not pay for a server it needs only when it
            is a heal's source before its first committed step. False (the
            default): it is serving when this returns.
    """

    def __init__(self, timeout: timedelta, num_chunks: int | None = None, *, hostname: str | None = None,
                 bind_host: str = "::", port: int = 0, token: str | None = None,
                 state_dict: Callable[[], T] | None = None, access: Access | None = None,
                 tls: TlsSettings | None = None, defer_server: bool = False) -> None:
        if token is not None and access is not None:
            raise ConfigError("pass the job token as token= or access=, not both")
        try:
            access = Access(token) if token is not None else access if access is not None else Access.from_env()
            tls = TlsSettings.from_env() if tls is None else tls
        except ValueError as exc:
            raise ConfigError(f"checkpoint transport: {exc}") from exc
        if num_chunks is not None and num_chunks < 0:
            raise ConfigError(f"num_chunks must be >= 0, got {num_chunks}")
        if timeout.total_seconds() <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        self._timeout = timeout.total_seconds()
        self._num_chunks = num_chunks
        self._hostname = hostname or socket.gethostname()
        self._state_dict = state_dict
        self._plane = control_plane()
        self._last_sent: FlatStateDict | None = None  # for allow_checkpoint
        self._stopped = False
        self._tls = tls
        self._receiver = Receiver(num_chunks, access.headers(), tls)
        self._access = access
        try:
            self._listener: socket.socket | None = listen(bind_host, port)
        except OSError as exc:
            raise CheckpointError(f"cannot listen on {bind_host}:{port} for checkpoints: {exc}") from exc
        self._port: int = self._listener.getsockname()[1]
        self._server: CheckpointServer | None = None
        self._server_lock = threading.Lock()  # one start, and shutdown after it
        if not defer_server:
            self._serving()

    # ------------------------------------------------------------ public API

    def metadata(self) -> str:
        host = f"[{self._hostname}]" if ":" in self._hostname and not self._hostname.startswith("[") else self._hostname
        return f"{self._tls.scheme}://{host}:{self._port}/checkpoint"

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
        if self._serving().snapshot is not None:
            self.disallow_checkpoint()
        seconds = timeout.total_seconds() if timeout else 0.0
        self._publish(len(dst_ranks), step, flat, seconds if seconds > 0 else self._timeout)
        self._last_sent = flat

    def allow_checkpoint(self, step: int) -> None:
        """Serve the state dict of the last :meth:`send_checkpoint` again, as step ``step`` (torchft's API).

        The caller vouches that the state dict now holds ``step``: it is read
        as it is when a receiver asks. Another step still published is
        released first, as :meth:`disallow_checkpoint` does. Before any send,
        ``None`` is served. No receiver is expected.
        """
        snapshot = self._serving().snapshot
        if snapshot is not None and snapshot.step == step:
            return
        if snapshot is not None:
            self.disallow_checkpoint()
        flat = self._last_sent if self._last_sent is not None else flatten(None)
        self._publish(0, step, flat, self._timeout, again=True)

    def disallow_checkpoint(self) -> None:
        """Wait for the receivers of the published step (at most the send's timeout), then stop serving it."""
        server = self._server
        snapshot = None if server is None else server.snapshot
        if server is None or snapshot is None:
            return
        self._call(server.release(), snapshot.timeout + 2 * ABORT_GRACE,
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
        ranges (``num_chunks`` None: as many as the size and the primary's
        advertisement pick, see the constructor), fetched at once, range ``i`` from source ``i % len(sources)``.
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
                          seconds + DONE_TIMEOUT + ABORT_GRACE, f"step {step} from replica(s) {ranks}")

    def shutdown(self, wait: bool = True) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._last_sent = None
        with self._server_lock:  # after a start under way: it can't finish into a stopped transport
            server, listener, self._listener = self._server, self._listener, None
        if server is None:
            if listener is not None:
                listener.close()
            return
        future = self._plane.submit(server.stop())
        if wait:
            try:
                future.result(self._timeout + 2 * ABORT_GRACE)
            except concurrent.futures.TimeoutError as exc:
                raise CheckpointTimeout(f"timed out stopping the checkpoint server on port {self._port}") from exc
        else:
            future.add_done_callback(_log_failure)

    # torchft's HTTPTransport has these attributes (its tests read them): views of the published snapshot here.
    @property
    def _disallowed(self) -> bool:
        return self._snapshot() is None

    @property
    def _step(self) -> int:
        """The step served, or last published (-1 before any)."""
        snapshot = self._snapshot()
        if snapshot is not None:
            return snapshot.step
        return -1 if self._server is None else self._server.last_step

    @property
    def _checkpoint_lock(self) -> "_ServingLock":
        return _ServingLock(self)

    def statistics(self) -> HTTPTransportStatistics:
        server = self._server
        snapshot = None if server is None else server.snapshot
        return HTTPTransportStatistics(
            published_step=None if snapshot is None else snapshot.step,
            held_requests=0 if server is None else server.held,
            active_streams=0 if snapshot is None else len(snapshot.streams),
            receivers_finished=0 if snapshot is None else snapshot.finished,
            bytes_served=0 if server is None else server.bytes_served,
        )

    def warm_up(self) -> None:
        """Start a deferred server on a background thread (returns at once; a no-op once started)."""
        if self._server is None and not self._stopped:
            threading.Thread(target=self._warm_up, name="checkpoint-server-start", daemon=True).start()

    def _warm_up(self) -> None:
        try:
            self._serving()
        except Exception as exc:  # the next send starts it again, and raises
            logger.warning("the checkpoint server did not start in the background: %s: %s", type(exc).__name__, exc)

    def _serving(self) -> "CheckpointServer":
        """The server, started now if it has not been yet (on the loop, bounded by the timeout)."""
        with self._server_lock:
            if self._server is not None:
                return self._server
            if self._stopped or self._listener is None:
                raise CheckpointError("the transport is shut down")
            from torchft_lite.checkpointing._http_server import CheckpointServer  # aiohttp's import is here

            server = CheckpointServer(self._timeout, self._access, self._hostname,
                                      self._tls.server_context() if self._tls.serving else None)
            self._call(server.start(self._listener), self._timeout, "the checkpoint server to start")
            self._server = server
            return server

    def _snapshot(self) -> "Snapshot | None":
        server = self._server
        return None if server is None else server.snapshot

    def _publish(self, expected: int, step: int, flat: FlatStateDict, timeout: float, again: bool = False) -> None:
        if self._stopped:
            raise CheckpointError("the transport is shut down")
        self._call(self._serving().publish(expected, step, flat, timeout), self._timeout,
                   f"publishing step {step}{' again' if again else ''}")

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float, what: str) -> Any:
        try:
            return self._plane.run(coro, timeout, what)
        except TimeoutError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointTimeout(str(exc)) from exc


class _ServingLock:
    """torchft's HTTPTransport holds a lock's write side while nothing may be served; this answers the same."""

    def __init__(self, transport: HTTPTransport) -> None:
        self._transport = transport

    def w_locked(self) -> bool:
        return self._transport._snapshot() is None


def _log_failure(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.warning("checkpoint transport shutdown failed: %r", future.exception())
