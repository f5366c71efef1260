"""Callers waiting, under a key, for a value another request will hand them (a push
registration waiting for its KV, an SGLang claim waiting for its room)."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Waiters(Generic[K, V]):
    def __init__(self) -> None:
        self._futures: dict[K, list[asyncio.Future[V]]] = {}

    def count(self) -> int:
        return sum(len(futures) for futures in self._futures.values())

    async def wait(self, key: K, timeout_s: float) -> V | None:
        """The value handed to ``key``; None after ``timeout_s``. A caller that is cancelled
        (its client left) stops waiting at once."""
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._futures.setdefault(key, []).append(future)
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            return None
        finally:
            futures = self._futures.get(key, [])
            if future in futures:
                futures.remove(future)
            if not futures:
                self._futures.pop(key, None)

    def first(self, key: K) -> asyncio.Future[V] | None:
        """The oldest caller still waiting under ``key``, to hand it a value."""
        for future in self._futures.get(key, []):
            if not future.done():
                return future
        return None
