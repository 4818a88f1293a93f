"""The lighthouse's HTTP side (aiohttp, on the lighthouse's event loop).

GET  /                                 self-contained dashboard (no CDN; works offline)
GET  /api/status                       the dashboard's data as JSON
GET  /metrics                          Prometheus metrics, ``lighthouse_`` prefixed
GET  /healthz                          "ok" while serving
POST /api/replicas/{replica_id}/kill   ask that replica's Manager to exit (Kill RPC);
                                       needs ``Authorization: Bearer <admin token>``
POST /api/epoch                        start a new epoch of the job now, when the stale-quorum
                                       guard holds participants back (same token): 202 with
                                       {"epoch": {...}, "status": {...}} once it started (the quorum
                                       then forms as usual); 409 when nothing is blocked (nothing
                                       is kept for later)
"""

from __future__ import annotations

import hmac
import importlib.resources
import json
import logging

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lighthouse.config import ADMIN_TOKEN_ENV
from lighthouse.metrics import build_registry
from lighthouse.protocol import torchft_pb2 as pb
from lighthouse.rpc.addresses import grpc_target
from lighthouse.rpc.sites import start_site
from lighthouse.view import LighthouseView

logger = logging.getLogger(__name__)

MAX_KILL_BODY = 4096


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


class _Handlers:
    def __init__(self, server: LighthouseView) -> None:
        self.server = server
        self.registry = build_registry(server)
        self.dashboard = (importlib.resources.files("lighthouse") / "static" / "dashboard.html").read_bytes()

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(body=self.dashboard, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.server.snapshot(), dumps=lambda d: json.dumps(d, allow_nan=False))

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

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
        target = grpc_target(member.address)
        timeout = self.server.config.kill_timeout
        logger.warning("kill requested for replica %s at %s: %s", replica_id, member.address, msg)
        try:
            async with grpc.aio.insecure_channel(target) as channel:
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
    app = web.Application(client_max_size=64 * 1024)
    app.add_routes([
        web.get("/", handlers.index),
        web.get("/api/status", handlers.status),
        web.get("/metrics", handlers.metrics),
        web.get("/healthz", handlers.healthz),
        web.post("/api/replicas/{replica_id}/kill", handlers.kill),
        web.post("/api/epoch", handlers.epoch),
    ])
    try:
        return await start_site(app, bind)
    except OSError as exc:
        raise OSError(f"lighthouse could not bind HTTP to {bind}: {exc}") from exc
