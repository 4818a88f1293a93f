"""The lighthouse's HTTP side (aiohttp, on the lighthouse's event loop): the dashboard, its JSON API and /metrics.

Routes (:func:`start_http`): ``GET /`` (the self-contained dashboard), ``/api/status``,
``/api/history``, ``/metrics`` (``lighthouse_`` prefixed) and ``/healthz``; ``POST
/api/replicas/{replica_id}/kill`` and ``POST /api/epoch`` with the admin token. What each
answers is in docs/lighthouse.md; who may call is ``_Handlers.guard``'s (docs/security.md).
With a TLS certificate (``torchft_lite.rpc.tls``) every route is HTTPS only and the login
cookie is marked ``Secure``.
"""

from __future__ import annotations

import hmac
import html
import importlib.resources
import json
import logging
import math
from typing import Iterator

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from lighthouse.config import ADMIN_TOKEN_ENV
from lighthouse.metrics import build_registry
from lighthouse.view import LighthouseView
from torchft_lite.rpc.access import Access, Refusal
from torchft_lite.rpc.channel import open_channel
from torchft_lite.rpc.protocol import torchft_pb2 as pb
from torchft_lite.rpc.refusals import RefusalLog
from torchft_lite.rpc.sites import start_site

logger = logging.getLogger(__name__)

MAX_KILL_BODY = 4096
_REFUSAL_STATUS = {"unauthenticated": 401, "forbidden": 403}


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def _refusal_page(message: str, login: bool) -> str:
    """What a browser sees instead of the dashboard: why, and (``login``: the job has a token) how to log in."""
    hint = ("<p id=\"login-hint\">To log in, open this page once as <code>/?token=&lt;job token&gt;</code> (the "
            "value of TORCHFT_LITE_TOKEN, or of the file TORCHFT_LITE_TOKEN_FILE names). The browser then keeps a "
            "login cookie and the token leaves the address bar.</p>") if login else ""
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>torchft_lite lighthouse: refused"
            f"</title></head><body><h1>torchft_lite lighthouse</h1><p id=\"refusal\">{html.escape(message)}</p>"
            f"{hint}</body></html>")


class _RefusalCounts(Collector):
    """``lighthouse_http_unauthorized_requests_total{kind}``: HTTP requests the access policy refused."""

    def __init__(self, refusals: RefusalLog) -> None:
        self._refusals = refusals

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "lighthouse_http_unauthorized_requests", "HTTP requests refused by the access policy: kind "
            "'unauthenticated' (no or a wrong job token), 'forbidden' (not loopback while no token is set).",
            labels=["kind"])
        for kind in _REFUSAL_STATUS:
            family.add_metric([kind], self._refusals.counts.get(kind, 0))
        yield family


class _Handlers:
    def __init__(self, server: LighthouseView) -> None:
        self.server = server
        self.registry = build_registry(server)
        self.refusals = RefusalLog("lighthouse HTTP")
        self.registry.register(_RefusalCounts(self.refusals))
        self.dashboard = (importlib.resources.files("lighthouse") / "static" / "dashboard.html").read_bytes()

    @property
    def _cookie(self) -> str:
        """The login cookie's name: a browser keeps cookies per host, not per port, so two lighthouses on one
        host must not overwrite each other's."""
        return f"torchft_lite_session_{self.server.http_port}"

    @web.middleware
    async def guard(self, request: web.Request, handler) -> web.StreamResponse:
        """Every route: callers the access policy admits go on; others are refused and nothing else happens.

        ``config.access`` (``torchft_lite.rpc.access``) admits, with a job token, requests carrying
        ``Authorization: Bearer <token>`` or the dashboard's login cookie; without one, loopback peers (unless
        ``--insecure``). Others get 401 (with ``WWW-Authenticate: Bearer``) or 403 and the reason, counted in
        ``lighthouse_http_unauthorized_requests_total{kind}``. The admin actions (POST) also need the admin
        token: the dashboard sends it in ``Authorization`` with its login in the cookie; a script sends only
        ``Authorization: Bearer <admin token>``, which admits an admin action on its own (its holder is the
        operator), in protected mode too.
        """
        access = self.server.config.access
        if request.method == "GET" and request.path == "/" and "token" in request.query:
            return self._login(request, access)
        header = request.headers.get("Authorization")
        cookie = request.cookies.get(self._cookie)
        refusal = access.check(request.remote, header, cookie)  # a header is judged before a cookie
        if refusal is not None and header and cookie:
            # The dashboard's admin actions: the admin token in the header, the login in the cookie.
            refusal = access.check(request.remote, None, cookie)
        if refusal is not None and header and request.method == "POST" and self._admin_token_in(header):
            refusal = None  # an operator's script: the admin token authenticates its admin actions alone
        if refusal is not None:
            return self._refuse(request, refusal)
        return await handler(request)

    def _login(self, request: web.Request, access: Access) -> web.Response:
        """``GET /?token=``: set the login cookie and send the browser to ``/`` (the token leaves the URL).

        The cookie is HttpOnly and SameSite=Strict and holds a value derived from the token, never the token
        itself; the 303 to ``/`` takes the token out of the address bar and the history."""
        if access.token is None:
            refusal = access.check(request.remote, None)  # nothing to log in to: only the peer counts
        else:
            refusal = access.check(request.remote, f"Bearer {request.query.get('token', '')}")
        if refusal is not None:
            return self._refuse(request, refusal)
        response = web.Response(status=303, headers={"Location": "/", "Cache-Control": "no-store",
                                                     "Referrer-Policy": "no-referrer"})
        if access.token is not None:
            response.set_cookie(self._cookie, access.session_cookie(), path="/", httponly=True, samesite="Strict",
                                secure=request.secure)  # over HTTPS, never sent back over plain HTTP
        return response

    def _refuse(self, request: web.Request, refusal: Refusal) -> web.Response:
        """401/403 with the refusal's message (which never holds the token): a page for ``/``, JSON under
        ``/api/``, text elsewhere. Only the path is logged: a login's query holds a token."""
        self.refusals.note(request.remote or "unknown", f"{request.method} {request.path}", refusal)
        status = _REFUSAL_STATUS[refusal.kind]
        headers = {"Cache-Control": "no-store"}
        if status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="lighthouse"'
        if request.path == "/":
            return web.Response(status=status, text=_refusal_page(refusal.message, login=status == 401),
                                content_type="text/html", headers=headers)
        if request.path.startswith("/api/"):
            return _error(status, refusal.message, **headers)
        return web.Response(status=status, text=refusal.message + "\n", headers=headers)

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(body=self.dashboard, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.server.snapshot(), dumps=lambda d: json.dumps(d, allow_nan=False))

    async def history(self, request: web.Request) -> web.Response:
        """``GET /api/history`` (``lighthouse.history``): ``?seconds=S`` only the last S seconds,
        ``?samples_after=N&markers_after=M`` only what is newer than the cursors a previous answer gave."""
        query = request.query
        try:
            cursors = {name: int(query.get(name, "-1")) for name in ("samples_after", "markers_after")}
            seconds = float(query["seconds"]) if "seconds" in query else None
        except ValueError:
            return _error(400, "samples_after and markers_after must be integers, seconds a number")
        if any(value < -1 for value in cursors.values()) or (
                seconds is not None and not (math.isfinite(seconds) and seconds > 0)):
            return _error(400, "samples_after and markers_after must be >= -1, seconds a finite number > 0")
        return web.json_response(self.server.history(seconds=seconds, **cursors),
                                 dumps=lambda d: json.dumps(d, allow_nan=False))

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def _admin_token_in(self, header: str) -> bool:
        token = self.server.config.admin_token
        scheme, _, given = header.partition(" ")
        return token is not None and scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("utf-8", "surrogateescape"), token.encode())

    def _authorize(self, request: web.Request) -> web.Response | None:
        token = self.server.config.admin_token
        if token is None:
            return _error(403, f"admin actions are disabled; start the lighthouse with --admin-token or ${ADMIN_TOKEN_ENV}")
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return _error(401, "missing 'Authorization: Bearer <admin token>' header",
                          **{"WWW-Authenticate": 'Bearer realm="lighthouse"'})
        # Header bytes that are not UTF-8 arrive as surrogate escapes: compare them as the bytes they were.
        if not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token.encode()):
            return _error(403, "wrong admin token")
        return None

    async def kill(self, request: web.Request) -> web.Response:
        """``POST /api/replicas/{replica_id}/kill``: ask that replica's Manager to exit (its ``Kill`` RPC)."""
        denied = self._authorize(request)
        if denied is not None:
            return denied
        replica_id = request.match_info["replica_id"]
        msg = f"killed from the lighthouse dashboard by {request.remote}"
        if request.can_read_body:
            if (request.content_length or 0) > MAX_KILL_BODY:
                return _error(413, f"body larger than {MAX_KILL_BODY} bytes")
            try:
                body = json.loads(await request.content.read(MAX_KILL_BODY + 1) or b"{}")
            except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit
                return _error(400, "body must be JSON, e.g. {\"msg\": \"reason\"}")
            if not isinstance(body, dict) or not isinstance(body.get("msg", ""), str):
                return _error(400, "body must be a JSON object with an optional string 'msg'")
            msg = body.get("msg") or msg
        member = self.server.known_member(replica_id)
        if member is None:
            return _error(404, f"unknown replica {replica_id!r} (not heartbeating, waiting or in the last quorum)")
        if not member.address:
            return _error(409, f"replica {replica_id!r} did not advertise a manager address")
        timeout = self.server.config.kill_timeout
        logger.warning("kill requested for replica %s at %s: %s", replica_id, member.address, msg)
        try:
            # TLS when the manager's address says https:// or the lighthouse has TLS settings (torchft_lite.rpc.tls).
            async with open_channel(member.address, self.server.config.tls) as channel:
                call = channel.unary_unary(
                    "/torchft.ManagerService/Kill",
                    request_serializer=pb.KillRequest.SerializeToString,
                    response_deserializer=pb.KillResponse.FromString,
                )
                await call(pb.KillRequest(msg=msg), timeout=timeout, metadata=self.server.config.access.metadata())
        except grpc.aio.AioRpcError as exc:
            details = (exc.details() or "").lower()
            # torchft's manager exits inside the Kill handler, so its answer is a dropped
            # connection; one we could never reach is a failure.
            dropped = exc.code() == grpc.StatusCode.UNAVAILABLE and any(
                word in details for word in ("socket closed", "connection reset", "eof", "broken pipe")
            )
            if not dropped:
                name = exc.code().name if exc.code() is not None else "UNKNOWN"
                return _error(502, f"Kill RPC to {member.address} failed: {name}: {exc.details()}")
            logger.info("replica %s dropped the connection while being killed: %s", replica_id, exc.details())
        return web.json_response({"killed": replica_id, "address": member.address, "msg": msg})


    async def epoch(self, request: web.Request) -> web.Response:
        """``POST /api/epoch``: start a new epoch of the job now, when the stale-quorum guard holds participants
        back. 202 with ``{"epoch": {...}, "status": {...}}`` once it started (the quorum then forms as usual);
        409 when nothing is blocked (nothing is kept for later)."""
        denied = self._authorize(request)
        if denied is not None:
            return denied
        epoch = self.server.request_epoch(f"POST /api/epoch from {request.remote}")
        snapshot = self.server.snapshot()
        status = snapshot["status"]
        if epoch is None:
            logger.info("new epoch requested from %s, but nothing is blocked: %s", request.remote, status["reason"])
            return _error(409, "nothing to do: no participant is held back by the stale-quorum guard "
                          f"(status {status['state']}: {status['reason']}); no epoch started")
        return web.json_response({"epoch": snapshot["epoch"], "status": status}, status=202,
                                 dumps=lambda d: json.dumps(d, allow_nan=False))


async def start_http(server: LighthouseView, bind: str) -> tuple[web.AppRunner, int]:
    """Start the HTTP site on ``bind``; returns the runner (for cleanup) and the bound port."""
    handlers = _Handlers(server)
    app = web.Application(client_max_size=64 * 1024, middlewares=[handlers.guard])
    app.add_routes([
        web.get("/", handlers.index),
        web.get("/api/status", handlers.status),
        web.get("/api/history", handlers.history),
        web.get("/metrics", handlers.metrics),
        web.get("/healthz", handlers.healthz),
        web.post("/api/replicas/{replica_id}/kill", handlers.kill),
        web.post("/api/epoch", handlers.epoch),
    ])
    tls = server.config.tls
    try:
        return await start_site(app, bind, tls.server_context() if tls.serving else None)
    except OSError as exc:
        raise OSError(f"lighthouse could not bind HTTP to {bind}: {exc}") from exc
