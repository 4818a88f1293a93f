"""The client side: a lazily opened gRPC channel with cached callables for one service.

``torchft_lite.rpc.lighthouse_client.LighthouseClient`` and torchft_lite's ManagerService client
are both one of these plus their own calls and error translation.

Every call it makes carries the job token (``authorization: Bearer ...``
metadata, from an :class:`~torchft_lite.rpc.access.Access`), so a subclass's
calls need not think of it; and it goes over TLS when the job's TLS settings
say so (:func:`open_channel`, :mod:`torchft_lite.rpc.tls`).
"""

from __future__ import annotations

import functools

import grpc

from torchft_lite.rpc.access import Access
from torchft_lite.rpc.addresses import grpc_target
from torchft_lite.rpc.tls import TlsSettings

__all__ = ["CHANNEL_OPTIONS", "UnaryChannel", "open_channel"]

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # A restarted lighthouse (or ManagerServer) is back within a second or two;
    # gRPC's default reconnect backoff grows to minutes and would keep the
    # channel down long after it returned.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def open_channel(address: str, tls: TlsSettings, options=None) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address`` (``host:port``, or ``http(s)://host:port``): TLS, verified against
    ``tls``'s CA and the address's host name, when ``tls.uses_tls(address)``; plain h2c otherwise."""
    target = grpc_target(address)
    if tls.uses_tls(address):
        return grpc.aio.secure_channel(target, tls.grpc_channel_credentials(), options=options)
    return grpc.aio.insecure_channel(target, options=options)


class UnaryChannel:
    """A lazily opened gRPC channel with cached unary callables for one service.

    Create and use it on a single event loop. Subclasses set ``service`` and
    add their calls. ``access``: whose token every call carries; None reads
    ``TORCHFT_LITE_TOKEN``/``TORCHFT_LITE_TOKEN_FILE`` now (a bad one raises
    ``ValueError`` here, not at the first call). ``tls``: whether and how the
    channel uses TLS; None reads ``TORCHFT_LITE_TLS_CERT``/``_KEY``/``_CA`` now
    (the same way).
    """

    service = ""

    def __init__(self, address: str, *, access: Access | None = None, tls: TlsSettings | None = None) -> None:
        self.address = address
        self.access = Access.from_env() if access is None else access
        self.tls = TlsSettings.from_env() if tls is None else tls
        self._metadata = self.access.metadata() or None
        self._channel: grpc.aio.Channel | None = None
        self._calls: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = open_channel(self.address, self.tls, CHANNEL_OPTIONS)
        return self._channel

    def _call(self, method: str, request_cls, response_cls) -> grpc.aio.UnaryUnaryMultiCallable:
        call = self._calls.get(method)
        if call is None:
            call = self._with_token(self._open().unary_unary(
                f"/{self.service}/{method}",
                request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString,
            ))
            self._calls[method] = call
        return call

    def _stream_call(self, method: str, request_cls, response_cls) -> grpc.aio.UnaryStreamMultiCallable:
        return self._with_token(self._open().unary_stream(
            f"/{self.service}/{method}",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        ))

    def _with_token(self, call):
        """``call`` with the token's metadata bound (a caller's own ``metadata=`` replaces it)."""
        return call if self._metadata is None else functools.partial(call, metadata=self._metadata)

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            self._calls.clear()
            await channel.close()
