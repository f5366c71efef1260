"""The queue between a subscriber's receive task and its apply task, bounded by items and bytes.

A decoded batch costs far more than its msgpack: a token id of 3 to 5 bytes on the wire is a
36- to 40-byte int object and its slot in a tuple, so one message at the wire's limits is 10 to
20 MiB of Python objects (``wire.decoded_bytes``). A queue bounded by items alone (1,024 batches)
could hold 16 GiB; this one also holds at most ``max_bytes`` of decoded batches, as
``wire.decoded_bytes`` estimates them (an upper bound), so what waits for the apply task is
``max_bytes`` plus at most one batch: an item larger than the room left is let in only into an
empty queue, which it would otherwise never enter (or forced in behind the reset that
replaced what was dropped: ``put_nowait(force=True)``).

``put`` waits for room (a replay: memory stays the queue's); ``put_nowait`` says whether the
item fit, and the subscriber decides what to drop. ``task_done`` and ``join`` as
``asyncio.Queue``'s: ``join`` returns once everything put so far was handed over and done.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Backlog(Generic[T]):
    """A FIFO of ``(item, cost)`` holding at most ``max_items`` items and ``max_bytes`` of cost
    (plus one item, into an empty queue)."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        if max_items < 1 or max_bytes < 1:
            raise ValueError("max_items and max_bytes must be >= 1")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._items: deque[tuple[T, int]] = deque()
        self.bytes = 0
        """The cost of what is queued now."""
        self.peak_bytes = 0
        """The most cost ever queued at once."""
        self._unfinished = 0
        self._changed = asyncio.Event()
        self._done = asyncio.Event()
        self._done.set()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def fits(self, cost: int) -> bool:
        """Whether an item of ``cost`` may be queued now."""
        items = self._items
        if not items:
            return True
        return len(items) < self.max_items and self.bytes + cost <= self.max_bytes

    def put_nowait(self, item: T, cost: int, *, force: bool = False) -> bool:
        """Queue ``item`` if it fits (``force``: whether or not); False (nothing queued)
        otherwise."""
        if not force and not self.fits(cost):
            return False
        self._items.append((item, cost))
        self.bytes += cost
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self._unfinished += 1
        self._done.clear()
        self._wake()
        return True

    async def put(self, item: T, cost: int) -> None:
        """Queue ``item``, waiting for room."""
        while not self.put_nowait(item, cost):
            await self._wait()

    def get_nowait(self) -> T:
        """The oldest item; raises ``asyncio.QueueEmpty``."""
        if not self._items:
            raise asyncio.QueueEmpty
        item, cost = self._items.popleft()
        self.bytes -= cost
        self._wake()
        return item

    async def get(self) -> T:
        while not self._items:
            await self._wait()
        return self.get_nowait()

    def task_done(self) -> None:
        self._unfinished -= 1
        if self._unfinished <= 0:
            self._unfinished = 0
            self._done.set()

    async def join(self) -> None:
        await self._done.wait()

    async def _wait(self) -> None:
        await self._changed.wait()

    def _wake(self) -> None:
        # One event per change, replaced: every waiter (a putter, the getter) looks again.
        self._changed.set()
        self._changed = asyncio.Event()
