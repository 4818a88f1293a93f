"""The event loop every control-plane thread runs (the lighthouse's, the trainers')."""

from __future__ import annotations

import asyncio
import logging

__all__ = ["new_event_loop"]

logger = logging.getLogger(__name__)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop, or asyncio's default where uvloop is missing."""
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency, but don't die without it
        logger.warning("uvloop not installed; using the default asyncio event loop")
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
