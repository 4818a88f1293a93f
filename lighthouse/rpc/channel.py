"""The client side: a lazily opened gRPC channel with cached callables for one service.

``lighthouse.client.LighthouseClient`` and torchft_lite's ManagerService client
are both one of these plus their own calls and error translation.
"""

from __future__ import annotations

import grpc

from lighthouse.rpc.addresses import grpc_target

__all__ = ["CHANNEL_OPTIONS", "UnaryChannel"]

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


class UnaryChannel:
    """A lazily opened gRPC channel with cached unary callables for one service.

    Create and use it on a single event loop. Subclasses set ``service`` and
    add their calls.
    """

    service = ""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel: grpc.aio.Channel | None = None
        self._calls: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(grpc_target(self.address), options=CHANNEL_OPTIONS)
        return self._channel

    def _call(self, method: str, request_cls, response_cls) -> grpc.aio.UnaryUnaryMultiCallable:
        call = self._calls.get(method)
        if call is None:
            call = self._open().unary_unary(
                f"/{self.service}/{method}",
                request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString,
            )
            self._calls[method] = call
        return call

    def _stream_call(self, method: str, request_cls, response_cls) -> grpc.aio.UnaryStreamMultiCallable:
        return self._open().unary_stream(
            f"/{self.service}/{method}",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            self._calls.clear()
            await channel.close()
