"""TLS for every server and client of a job, optional: one certificate, one CA, from three variables.

The job token (:mod:`torchft_lite.rpc.access`) says who may call; TLS keeps the
token, and everything else on the wire, from being read or changed on the way.
:class:`TlsSettings` reads ``TORCHFT_LITE_TLS_CERT`` and ``TORCHFT_LITE_TLS_KEY``
(this process's servers serve TLS 1.2+ only) and ``TORCHFT_LITE_TLS_CA`` (what a
client checks a server against), and says when a client uses TLS
(:meth:`TlsSettings.uses_tls`). docs/lighthouse.md ("TLS") for users. Nothing here
reads a key into a log line; ``repr`` shows paths only.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["CA_ENV", "CERT_ENV", "KEY_ENV", "TlsSettings"]

CERT_ENV = "TORCHFT_LITE_TLS_CERT"
KEY_ENV = "TORCHFT_LITE_TLS_KEY"
CA_ENV = "TORCHFT_LITE_TLS_CA"
ALPN_GRPC = "h2"
ALPN_HTTP = "http/1.1"
_MAX_PEM_BYTES = 1 << 20  # a certificate chain or key is a few KiB; a path to something else is a mistake


@dataclass(frozen=True)
class TlsSettings:
    """Where this process's certificate, key and CA are (PEM paths); all None: plain text.

    Construction reads and checks the files (a certificate without its key or
    the reverse, a missing, unreadable or unusable file, a key that does not
    match its certificate: ``ValueError`` naming the setting), so a bad
    setting fails a process at start rather than at its first connection.
    """

    cert: Path | None = None
    """This process's certificate chain (leaf first), served by its servers (the lighthouse's gRPC and HTTP
    sides, a group's ManagerServer, the checkpoint server), which then serve TLS 1.2+ only and advertise
    ``https://`` addresses. The lighthouse also takes ``--tls-cert``/``--tls-key``."""
    key: Path | None = None
    """The private key of ``cert``."""
    ca: Path | None = None
    """The CA certificates a client checks a server's certificate against (and the server's host name against
    the certificate's SubjectAltName); None: the system's trust store."""
    names: InitVar[tuple[str, str, str] | None] = None
    """How errors name the three settings (the variables, or flags); not stored."""
    _pem: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _contexts: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self, names: tuple[str, str, str] | None) -> None:
        cert_name, key_name, ca_name = names or ("the TLS certificate", "the TLS key", "the TLS CA")
        for attr in ("cert", "key", "ca"):
            value = getattr(self, attr)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, attr, Path(value))
        if (self.cert is None) != (self.key is None):
            given, missing = (cert_name, key_name) if self.cert is not None else (key_name, cert_name)
            raise ValueError(f"{given} is set but {missing} is not: a server needs its certificate and its key; "
                             f"set both, or neither")
        for attr, name in (("cert", cert_name), ("key", key_name), ("ca", ca_name)):
            path = getattr(self, attr)
            if path is not None:
                self._pem[attr] = _read_pem(path, name)
        if self.cert is not None:
            try:
                self._server_context(ALPN_GRPC)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"{cert_name}/{key_name}: cannot use {self.cert} with the key {self.key}: "
                                 f"{_reason(exc)} (is it a PEM certificate, and the key that belongs to it?)") from None
        if self.ca is not None:
            try:
                self.client_context()
            except (ssl.SSLError, ValueError) as exc:
                raise ValueError(f"{ca_name}: {self.ca} holds no usable CA certificate: {_reason(exc)}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, cert: Path | str | None = None,
                 key: Path | str | None = None, ca: Path | str | None = None) -> "TlsSettings":
        """The settings of ``TORCHFT_LITE_TLS_CERT``/``_KEY``/``_CA``.

        ``cert`` and ``key`` (flags such as the lighthouse's ``--tls-cert``/``--tls-key``), when either is
        given, replace both variables; ``ca`` replaces ``TORCHFT_LITE_TLS_CA``. A variable set to an empty
        string is an error (unset it instead). Raises ``ValueError`` as the constructor does.
        """
        environ = os.environ if environ is None else environ
        names = [CERT_ENV, KEY_ENV, CA_ENV]
        if cert is not None or key is not None:
            names[:2] = ["--tls-cert", "--tls-key"]
        else:
            cert, key = _variable(environ, CERT_ENV), _variable(environ, KEY_ENV)
        if ca is not None:
            names[2] = "--tls-ca"
        else:
            ca = _variable(environ, CA_ENV)
        return cls(cert, key, ca, names=tuple(names))

    # ------------------------------------------------------------ what it means

    @property
    def serving(self) -> bool:
        """Whether this process's servers serve TLS (a certificate and key are set)."""
        return self.cert is not None

    @property
    def enabled(self) -> bool:
        """Whether any setting is given: then every client of this process uses TLS."""
        return self.cert is not None or self.ca is not None

    @property
    def scheme(self) -> str:
        """``https`` or ``http``: what this process's servers advertise in their addresses."""
        return "https" if self.serving else "http"

    def uses_tls(self, address: str) -> bool:
        """Whether a client of this process dials ``address`` with TLS (one rule for gRPC and HTTP).

        When the address says ``https://``, or when any of the three variables is set in this process, whatever
        scheme the address names. So ``TORCHFT_LIGHTHOUSE=http://...`` written for torchft keeps working once a
        job turns TLS on, and a job that set TLS never falls back to plain text because an address said
        ``http://``. With none of them set and no ``https://`` address, everything is plain, as before.
        """
        return self.enabled or address.strip().lower().startswith("https://")

    def describe(self) -> str:
        """One log line's worth: whether servers and clients use TLS, and with what files."""
        if not self.enabled:
            return "TLS off (plain text; set TORCHFT_LITE_TLS_CERT/_KEY/_CA to encrypt)"
        served = f"serving TLS with {self.cert}" if self.serving else "not serving TLS (no certificate)"
        trusted = f"trusting the CA in {self.ca}" if self.ca is not None else "trusting the system's CAs"
        return f"TLS on: {served}; clients use TLS, {trusted}"

    # ------------------------------------------------------------ ssl contexts

    def server_context(self, alpn: str = ALPN_HTTP) -> ssl.SSLContext:
        """The context a server wraps its connections in: TLS 1.2+, this certificate, ALPN ``alpn``
        (``h2`` for gRPC, ``http/1.1`` for HTTP). Raises ``ValueError`` without a certificate."""
        if not self.serving:
            raise ValueError(f"no TLS certificate: set {CERT_ENV} and {KEY_ENV} to serve TLS")
        return self._server_context(alpn)

    def client_context(self, alpn: str = ALPN_HTTP) -> ssl.SSLContext:
        """The context a client connects with: TLS 1.2+, the server's certificate checked against the
        CA (the system's trust store without one) and its host name against the certificate."""
        context = self._contexts.get(("client", alpn))
        if context is None:
            ca = self._pem.get("ca")
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                                 cadata=ca.decode("ascii", "replace") if ca is not None else None)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.set_alpn_protocols([alpn])
            self._contexts[("client", alpn)] = context
        return context

    def _server_context(self, alpn: str) -> ssl.SSLContext:
        context = self._contexts.get(("server", alpn))
        if context is None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(str(self.cert), str(self.key))
            context.set_alpn_protocols([alpn])
            self._contexts[("server", alpn)] = context
        return context

    # ------------------------------------------------------------ grpcio

    def grpc_server_credentials(self) -> Any:
        """grpcio's credentials for ``add_secure_port`` (grpc negotiates ALPN h2 itself)."""
        import grpc

        if not self.serving:
            raise ValueError(f"no TLS certificate: set {CERT_ENV} and {KEY_ENV} to serve TLS")
        return grpc.ssl_server_credentials([(self._pem["key"], self._pem["cert"])])

    def grpc_channel_credentials(self) -> Any:
        """grpcio's credentials for ``secure_channel``: the CA (grpc's default roots without one); grpc
        checks the target's host name against the server's certificate."""
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self._pem.get("ca"))


def _variable(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    if value is None:
        return None
    if not value.strip():
        raise ValueError(f"{name} is set but empty; unset it, or set it to a PEM file")
    return value.strip()


def _read_pem(path: Path, name: str) -> bytes:
    try:
        if path.stat().st_size > _MAX_PEM_BYTES:
            raise ValueError(f"{name}: {path} is larger than {_MAX_PEM_BYTES} bytes; expected a PEM file")
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{name}: cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{name}: {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def _reason(exc: BaseException) -> str:
    """An ssl error in a few words (its library reason when it has one)."""
    reason = getattr(exc, "reason", None)
    return f"{reason} ({exc})" if reason else str(exc)
