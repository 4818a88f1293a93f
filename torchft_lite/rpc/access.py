"""Who may call a server: holders of the job token, or (with no token) loopback peers only.

Every server of a job (the lighthouse's gRPC and HTTP sides, each group's
ManagerServer, the checkpoint server a heal reads from, a trainer's metrics
port) answers with one :class:`Access` policy, and every client sends what it
asks for. The three modes are on :class:`Access`; docs/security.md has the
table. Tokens are compared in constant time and never logged or shown.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

__all__ = ["Access", "INSECURE_ENV", "Refusal", "TOKEN_ENV", "TOKEN_FILE_ENV", "peer_host"]

TOKEN_ENV = "TORCHFT_LITE_TOKEN"
TOKEN_FILE_ENV = "TORCHFT_LITE_TOKEN_FILE"
INSECURE_ENV = "TORCHFT_LITE_INSECURE"
HEADER = "authorization"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Refusal:
    """Why a call was refused: ``unauthenticated`` (gRPC UNAUTHENTICATED, HTTP 401) or ``forbidden``
    (gRPC PERMISSION_DENIED, HTTP 403), and a message for the caller that never holds the token."""

    kind: str
    message: str


@dataclass(frozen=True)
class Access:
    """One server's (or client's) access policy.

    * **token** (``TORCHFT_LITE_TOKEN``, or ``TORCHFT_LITE_TOKEN_FILE`` naming a
      file that holds it): every call must carry ``authorization: Bearer <token>``
      (gRPC metadata, or the HTTP header), from any peer, loopback included; others
      are answered UNAUTHENTICATED / 401 and nothing else happens.
    * **protected mode** (no token, the default): only loopback peers are served;
      others are answered PERMISSION_DENIED / 403 with how to set a token (as
      Redis does). A single host works out of the box, and a job spread over hosts
      needs a token.
    * **insecure** (``TORCHFT_LITE_INSECURE=1`` or ``--insecure``, no token): every
      peer is served; a WARNING says so at start. With a token, ``insecure``
      changes nothing.

    ``repr`` hides the token.
    """

    token: str | None = field(default=None, repr=False)
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.token is not None:
            _validate(self.token, "the job token")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, token_file: Path | None = None,
                 insecure: bool = False) -> "Access":
        """The policy of ``TORCHFT_LITE_TOKEN``/``_TOKEN_FILE``/``_INSECURE`` (``token_file``, a
        ``--token-file`` flag, wins over both token variables; ``insecure``, a flag, adds to the variable).

        Raises ``ValueError`` for a token set twice, an empty or unreadable token file, a token with
        whitespace or control characters, or an ``TORCHFT_LITE_INSECURE`` that is not a boolean.
        """
        environ = os.environ if environ is None else environ
        flag = environ.get(INSECURE_ENV, "").strip().lower()
        if flag not in _TRUE + _FALSE:
            raise ValueError(f"{INSECURE_ENV} must be 1/true/yes/on or 0/false/no/off, got {flag!r}")
        insecure = insecure or flag in _TRUE
        if token_file is not None:
            return cls(_read_token_file(Path(token_file), "--token-file"), insecure)
        inline, path = environ.get(TOKEN_ENV), environ.get(TOKEN_FILE_ENV)
        if inline is not None and path is not None:
            raise ValueError(f"set one of {TOKEN_ENV} and {TOKEN_FILE_ENV}, not both")
        if path is not None:
            return cls(_read_token_file(Path(path), TOKEN_FILE_ENV), insecure)
        if inline is not None:
            if not inline.strip():
                raise ValueError(f"{TOKEN_ENV} is set but empty; unset it, or set a token")
            return cls(inline.strip(), insecure)
        return cls(None, insecure)

    @property
    def mode(self) -> str:
        """'token', 'loopback-only' (protected mode) or 'insecure': for logs and status pages."""
        if self.token is not None:
            return "token"
        return "insecure" if self.insecure else "loopback-only"

    def describe(self) -> str:
        """One log line's worth, without the token."""
        if self.token is not None:
            return "job token required on every call"
        if self.insecure:
            return (f"INSECURE: no job token and {INSECURE_ENV}/--insecure set, so any host that reaches this port "
                    f"may call it (set {TOKEN_ENV} or {TOKEN_FILE_ENV} to require a token)")
        return f"no job token: loopback peers only (set {TOKEN_ENV} or {TOKEN_FILE_ENV} on every process to allow others)"

    def check(self, peer: str | None, authorization: str | bytes | None, cookie: str | None = None) -> Refusal | None:
        """None when a call from ``peer`` carrying ``authorization`` (or a login ``cookie``, the value of
        :meth:`session_cookie`) may go on.

        ``peer`` is a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, ``unix:...``) or a bare host.
        """
        if self.token is not None:
            given = _bearer(authorization)
            if given is None and cookie:  # a browser's login: compared with the value the login set
                if hmac.compare_digest(cookie.encode("utf-8", "surrogateescape"), self.session_cookie().encode()):
                    return None
                return Refusal("unauthenticated", "the dashboard login expired or the job token changed: open the "
                                                  "dashboard as /?token=<token> again")
            if given is None:
                return Refusal("unauthenticated", f"this job requires its token: send 'authorization: Bearer "
                                                  f"<token>' (set {TOKEN_ENV} or {TOKEN_FILE_ENV})")
            if not hmac.compare_digest(given, self.token.encode()):
                return Refusal("unauthenticated", f"wrong job token (check {TOKEN_ENV}/{TOKEN_FILE_ENV} on this "
                                                  f"process and on the server)")
            return None
        if self.insecure or is_loopback(peer_host(peer)):
            return None
        return Refusal("forbidden", f"refused {peer_host(peer) or 'an unknown peer'}: with no job token this server "
                                    f"accepts loopback peers only. Set the same {TOKEN_ENV} (or {TOKEN_FILE_ENV}) "
                                    f"on every process of the job, or opt out with {INSECURE_ENV}=1 / --insecure")

    def session_cookie(self) -> str:
        """What a browser keeps after logging in with the token: derived from it, so the token itself is
        never stored in the browser; it changes when the token does."""
        if self.token is None:
            raise ValueError("no job token: there is nothing to log in to")
        return hmac.new(self.token.encode(), b"torchft_lite dashboard session", "sha256").hexdigest()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata for every call this process makes (empty without a token)."""
        return ((HEADER, f"Bearer {self.token}"),) if self.token is not None else ()

    def headers(self) -> dict[str, str]:
        """HTTP headers for every request this process makes (empty without a token)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token is not None else {}


def peer_host(peer: str | None) -> str | None:
    """The host of a gRPC peer string or an aiohttp ``request.remote``: 'ipv6:[::1]:5' -> '::1'."""
    if not peer:
        return None
    if peer.startswith("unix:"):
        return "unix"
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            # grpcio writes a URI ('ipv6:%5B::1%5D:5', a zone as %25); the native server writes it plain.
            rest = urllib.parse.unquote(peer[len(prefix):])
            if rest.startswith("["):
                return rest[1:rest.find("]")] if "]" in rest else None
            host, sep, _ = rest.rpartition(":")
            return host if sep else rest
    return peer


def is_loopback(host: str | None) -> bool:
    """127.0.0.0/8, ::1, an IPv4-mapped loopback, or a Unix socket; never a name (names can be spoofed)."""
    if host is None:
        return False
    if host == "unix":
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _bearer(authorization: str | bytes | None) -> bytes | None:
    if authorization is None:
        return None
    if isinstance(authorization, str):  # header bytes that are not UTF-8 arrive as surrogate escapes
        authorization = authorization.encode("utf-8", "surrogateescape")
    scheme, _, given = authorization.strip().partition(b" ")
    given = given.strip()
    return given if scheme.lower() == b"bearer" and given else None


def _read_token_file(path: Path, source: str) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{source}: cannot read the token file {path}: {exc}") from None
    if not token:
        raise ValueError(f"{source}: the token file {path} is empty")
    return token


def _validate(token: str, what: str) -> None:
    if not token or any(c.isspace() or not c.isprintable() or not c.isascii() for c in token):
        raise ValueError(f"{what} must be non-empty printable ASCII without whitespace (it travels in a header)")
