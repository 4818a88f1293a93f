"""The heal's HTTP client reads a response the same on the event loop and on a thread of its own; a cancelled
threaded read has stopped writing into its sink by the time the cancellation returns."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from tests.conftest import WAIT
from tests.integration.helpers import read_request
from torchft_lite.checkpointing import _http_client, _streams
from torchft_lite.errors import CheckpointTransferError

BODY = bytes(range(256)) * 4096  # 1 MiB


class Sink:
    """A body collected into one buffer, with a count of every ``filled`` call."""

    def __init__(self, length: int) -> None:
        self.data = bytearray(length)
        self.count = 0
        self.calls = 0

    def buffer(self) -> memoryview:
        return memoryview(self.data)[self.count:self.count + 100_000]  # several reads, whatever the socket has

    def filled(self, count: int) -> None:
        self.count += count
        self.calls += 1


class OneShotServer:
    """Answers each connection with ``answer(conn)`` on a thread; stopped (and its threads joined) by ``close``."""

    def __init__(self, answer) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/data"
        self._answer = answer
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if b"\r\n\r\n" not in read_request(conn):
                return
            try:
                self._answer(conn)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # a blocked accept() returns (close alone leaves it blocked)
        except OSError:
            pass
        self._listener.close()
        self._accepting.join(timeout=10)
        for thread in self._threads:
            thread.join(timeout=10)


def head(status: int, length: int) -> bytes:
    return f"HTTP/1.1 {status} X\r\nContent-Length: {length}\r\n\r\n".encode()


def fetch(on_thread: bool, url: str, sink_for) -> dict[str, str]:
    async def call():
        if on_thread:
            return await _http_client.get_into_on_thread(url, {"a": "1"}, {}, sink_for, timeout=WAIT)
        return await _http_client.get_into(url, {"a": "1"}, {}, sink_for)
    return asyncio.run(call())


@pytest.mark.parametrize("on_thread", [False, True], ids=["loop", "thread"])
def test_a_body_sent_in_pieces_lands_whole(on_thread):
    def answer(conn):
        conn.sendall(head(200, len(BODY)) + BODY[:10])  # the head and the body's first bytes in one segment
        for start in range(10, len(BODY), 300_001):
            conn.sendall(BODY[start:start + 300_001])

    server = OneShotServer(answer)
    sinks: list[Sink] = []
    try:
        headers = fetch(on_thread, server.url, lambda n: sinks.append(Sink(n)) or sinks[-1])
    finally:
        server.close()
    assert headers["content-length"] == str(len(BODY))
    assert bytes(sinks[0].data) == BODY and sinks[0].calls > 1


@pytest.mark.parametrize("on_thread", [False, True], ids=["loop", "thread"])
def test_an_error_status_raises_with_the_body_text(on_thread):
    server = OneShotServer(lambda conn: conn.sendall(head(404, 9) + b"not found"))
    try:
        with pytest.raises(_http_client.HTTPStatusError, match="HTTP 404: not found"):
            fetch(on_thread, server.url, Sink)
    finally:
        server.close()


@pytest.mark.parametrize("on_thread", [False, True], ids=["loop", "thread"])
def test_a_truncated_body_fails(on_thread):
    server = OneShotServer(lambda conn: conn.sendall(head(200, 100) + b"x" * 60))
    try:
        with pytest.raises(CheckpointTransferError, match="40 body bytes missing"):
            fetch(on_thread, server.url, Sink)
    finally:
        server.close()


@pytest.mark.parametrize("on_thread", [False, True], ids=["loop", "thread"])
def test_a_refusing_sink_fails_the_fetch(on_thread):
    def refuse(length: int):
        raise CheckpointTransferError(f"not {length} bytes")

    server = OneShotServer(lambda conn: conn.sendall(head(200, 5) + b"hello"))
    try:
        with pytest.raises(CheckpointTransferError, match="not 5 bytes"):
            fetch(on_thread, server.url, refuse)
    finally:
        server.close()


def test_a_cancelled_threaded_read_writes_nothing_once_cancelled():
    """The receiver hands a cancelled range's blocks to another fetch at once: the old thread must be done."""
    more = threading.Event()

    def answer(conn):
        conn.sendall(head(200, len(BODY)) + BODY[:1000])
        more.wait(timeout=30)  # the rest only after the cancellation returned
        conn.sendall(BODY[1000:])

    server = OneShotServer(answer)
    sinks: list[Sink] = []

    async def scenario() -> int:
        task = asyncio.create_task(_http_client.get_into_on_thread(
            server.url, {}, {}, lambda n: sinks.append(Sink(n)) or sinks[-1], timeout=WAIT))
        while not sinks or sinks[0].count < 1000:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return sinks[0].calls

    try:
        calls = asyncio.run(scenario())
    finally:
        more.set()
        server.close()  # joins the server's thread: it has sent the rest, or failed to
    # the socket was shut down and the thread had returned before the cancellation did: nothing more landed
    assert sinks[0].calls == calls and sinks[0].count == 1000


def test_a_threaded_read_gives_up_after_its_timeout_even_if_nobody_cancels_it():
    """The backstop for a read nobody cancels (its event loop gone): the thread ends on its own."""
    stalled = threading.Event()

    def answer(conn):
        conn.sendall(head(200, 100) + b"x" * 10)
        stalled.wait(timeout=30)

    server = OneShotServer(answer)

    async def call():
        return await _http_client.get_into_on_thread(server.url, {}, {}, Sink, timeout=0.5)

    try:
        with pytest.raises(TimeoutError):
            asyncio.run(call())
    finally:
        stalled.set()
        server.close()


def test_reading_threads_are_daemons():
    """A process exiting mid-heal does not wait for a read blocked on a stalled source."""
    names: list[tuple[str, bool]] = []

    async def scenario():
        def record():
            names.append((threading.current_thread().name, threading.current_thread().daemon))
        await _streams.on_own_thread("torchft-heal-read", lambda: None, record)

    asyncio.run(scenario())
    assert names == [("torchft-heal-read", True)]
