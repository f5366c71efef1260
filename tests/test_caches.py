"""The one bounded cache (headers' parsed targets, the engines' timeouts, DNS answers)."""

from __future__ import annotations

import pytest

from sidecar.caches import BoundedCache


def test_a_full_cache_forgets_the_oldest_put() -> None:
    cache: BoundedCache[str, int] = BoundedCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("a", 3)  # "a" is the newest now
    cache.put("c", 4)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (3, None, 4)
    assert len(cache) == 2


def test_a_flood_of_distinct_keys_costs_at_most_its_size() -> None:
    cache: BoundedCache[int, int] = BoundedCache(16)
    for key in range(10_000):
        cache.put(key, key)
    assert len(cache) == 16
    assert cache.get(9_999) == 9_999
    assert cache.get(0) is None


def test_a_cache_holds_at_least_one_entry() -> None:
    with pytest.raises(ValueError, match="at least one"):
        BoundedCache(0)
