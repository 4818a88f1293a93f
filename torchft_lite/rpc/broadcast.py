"""Items fanned out to every open server stream, none of which may block the sender.

The lighthouse streams failure notices and lease events with it; the
ManagerServer relays the lighthouse's events to its group's ranks.
"""

from __future__ import annotations

import asyncio

__all__ = ["Broadcast", "push_dropping_oldest"]


def push_dropping_oldest(queue: asyncio.Queue, item) -> None:
    """Queue ``item`` for a stream's reader; a stalled reader loses its oldest item, never blocks us."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)


class Broadcast:
    """Items fanned out to every open stream, each with its own bounded backlog."""

    def __init__(self, backlog: int) -> None:
        self._backlog = backlog
        self._queues: set[asyncio.Queue] = set()

    def __len__(self) -> int:
        return len(self._queues)

    def publish(self, item) -> None:
        for queue in self._queues:
            push_dropping_oldest(queue, item)

    async def subscribe(self):
        """Yield every item published from now on, until the caller stops iterating."""
        queue: asyncio.Queue = asyncio.Queue(self._backlog)
        self._queues.add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._queues.discard(queue)
