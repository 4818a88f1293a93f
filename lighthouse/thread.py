"""Run a lighthouse on its own event loop in a background thread.

For tests, demos and training scripts that want a lighthouse in-process
(torchft offers the same with ``LighthouseServer(...).address()``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Awaitable, Callable, TypeVar

from lighthouse.config import LighthouseConfig
from lighthouse.server import LighthouseServer
from torchft_lite.rpc.loop import new_event_loop

T = TypeVar("T")
logger = logging.getLogger(__name__)


class BackgroundLighthouse:
    """``with BackgroundLighthouse(config) as lh: ... lh.address() ...``"""

    def __init__(self, config: LighthouseConfig, *, start_timeout: float = 30.0, **server_kwargs: Any) -> None:
        self.config = config
        self.start_timeout = start_timeout
        self._server_kwargs = server_kwargs
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name="lighthouse", daemon=True)
        self._started = concurrent.futures.Future()
        self.server: LighthouseServer | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            try:
                self.server = LighthouseServer(self.config, **self._server_kwargs)
                await self.server.serve(lambda: self._started.set_result(None))
            except BaseException as exc:
                if not self._started.done():
                    self._started.set_exception(exc)
                raise

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:
            # Before start-up the caller gets it from start(); afterwards it is
            # logged now and raised again by stop().
            self._error = exc
            if self._started.done():
                logger.exception("lighthouse thread failed")
        finally:
            self._loop.close()

    def start(self) -> "BackgroundLighthouse":
        self._thread.start()
        try:
            self._started.result(timeout=self.start_timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"lighthouse did not start within {self.start_timeout:.0f}s") from None
        return self

    def call(self, fn: Callable[[], Awaitable[T]], timeout: float = 10.0) -> T:
        """Run ``fn()`` on the lighthouse's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout)

    def snapshot(self, timeout: float = 10.0) -> dict:
        async def get() -> dict:
            return self.server.snapshot()

        return self.call(get, timeout)

    def statistics(self, timeout: float = 10.0):
        async def get():
            return self.server.statistics()

        return self.call(get, timeout)

    def address(self) -> str:
        return self.server.address()

    @property
    def grpc_port(self) -> int:
        return self.server.grpc_port

    @property
    def http_port(self) -> int | None:
        return self.server.http_port

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive() and self.server is not None:
            self._loop.call_soon_threadsafe(self.server.request_stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"lighthouse thread did not stop within {timeout:.0f}s")
        if self._error is not None and self._started.done() and self._started.exception() is None:
            raise RuntimeError("the lighthouse failed while running") from self._error

    def __enter__(self) -> "BackgroundLighthouse":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
