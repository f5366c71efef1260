"""An engine's load, as its ``/metrics`` scrape found it: the queue gauges the scheduler reads
and the size of its KV cache (``sidecar.engines.scrape`` parses vLLM's text into it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_ENGINES = 64
"""``vllm:cache_config_info`` lines (or data-parallel ranks) summed at most (one per
data-parallel engine): more is implausible, and the cache size is then unknown."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    waiting: float | None
    running: float | None
    kv_usage: float | None
    at: float
    """Monotonic time of the scrape."""
    cache_tokens: int | None = None
    """The engine's KV cache in tokens (``vllm:cache_config_info``; several engines' summed);
    None when the engine does not say, or says it malformed."""
    itl_sum_s: float | None = None
    itl_count: float | None = None
    """The engine's inter-token latency histogram so far (``vllm:inter_token_latency_seconds``'
    ``_sum`` and ``_count``, several engines' summed): two scrapes give the mean time between
    its tokens in between. None when the engine does not serve it."""


def total_cache(caches: list[int | None]) -> int | None:
    """Every engine's cache summed (one scrape's engines, or data-parallel ranks'); unknown
    when any is, or when there are implausibly many."""
    if not caches or len(caches) > MAX_ENGINES or None in caches:
        return None
    return sum(c for c in caches if c is not None)


def merge_loads(loads: list[EngineLoad | None]) -> EngineLoad | None:
    """Several data-parallel ranks' scrapes as one engine's: queues and caches summed (a cache
    unknown while any rank's is), KV usage averaged, the oldest scrape's time; None while any
    rank has none (one rank's load is its own)."""
    if len(loads) == 1:
        return loads[0]
    known = [load for load in loads if load is not None]
    if len(known) < len(loads) or not known:
        return None

    def total(values: list[float | None]) -> float | None:
        present = [value for value in values if value is not None]
        return sum(present) if present else None

    def all_known(field: str) -> bool:
        return all(getattr(load, field) is not None for load in known)

    usage = [load.kv_usage for load in known if load.kv_usage is not None]
    caches = [load.cache_tokens for load in known]
    return EngineLoad(
        waiting=total([load.waiting for load in known]),
        running=total([load.running for load in known]),
        kv_usage=sum(usage) / len(usage) if usage else None,
        at=min(load.at for load in known),
        cache_tokens=total_cache(caches),
        itl_sum_s=total([load.itl_sum_s for load in known]) if all_known("itl_sum_s") else None,
        itl_count=total([load.itl_count for load in known]) if all_known("itl_count") else None,
    )


def describe_load(load: EngineLoad | None, now: float) -> dict[str, Any] | None:
    """For /debug/scheduler."""
    if load is None:
        return None
    return {
        "waiting": load.waiting,
        "running": load.running,
        "kv_usage": load.kv_usage,
        "cache_tokens": load.cache_tokens,
        "age_s": round(now - load.at, 3),
    }
