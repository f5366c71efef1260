"""``BoundedCache``: the one cache of values computed from a few recurring inputs.

Header values the gateway repeats, the timeouts a few settings give, DNS answers: each miss costs
one computation, and a flood of distinct inputs (a client's junk headers, a deadline-bounded
timeout per request) costs no more than ``size`` entries.
"""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """A dict of at most ``size`` entries: putting one more drops the oldest put (putting a key
    again makes it the newest). A hit costs one dict lookup."""

    __slots__ = ("_entries", "_size")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a cache holds at least one entry")
        self._size = size
        self._entries: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def put(self, key: K, value: V) -> None:
        entries = self._entries
        entries.pop(key, None)
        entries[key] = value
        if len(entries) > self._size:
            del entries[next(iter(entries))]

    def __len__(self) -> int:
        return len(self._entries)
