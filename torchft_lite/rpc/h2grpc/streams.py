"""One HTTP/2 stream (one gRPC call) as the connection and the server share it."""

from __future__ import annotations

import asyncio
from collections import deque

STREAM_RECV_WINDOW = 4 * 1024 * 1024


class Stream:
    __slots__ = ("id", "headers", "body", "received", "recv_window", "send_window", "pending", "trailers", "task",
                 "request_done", "response_started", "deadline")

    def __init__(self, stream_id: int, send_window: int, recv_window: int = STREAM_RECV_WINDOW) -> None:
        self.id = stream_id
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.received = 0  # request body bytes, counted in the connection's in-flight total until the stream ends
        self.recv_window = recv_window
        self.send_window = send_window
        self.pending: deque[memoryview] = deque()  # DATA payload not yet sent
        self.trailers: bytes | None = None  # HEADERS frame to send once pending is empty
        self.task: asyncio.Task | None = None  # the call answering it; cancelled when the stream is reset
        self.request_done = False
        self.response_started = False
        self.deadline: float | None = None  # set by the guard's sweep: when a request still arriving is ended
