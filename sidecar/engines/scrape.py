"""Engine load from vLLM's Prometheus text: the three gauges the scheduler reads.

Only the lines of those gauges are looked at (vLLM's /metrics is large: histograms per model); a
gauge reported per label set (several models, data-parallel ranks) is summed, kv usage averaged.
A missing gauge is None: an engine without metrics is scheduled by reservations alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
_NAMES = (WAITING, RUNNING, KV_USAGE)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    waiting: float | None
    running: float | None
    kv_usage: float | None
    at: float
    """Monotonic time of the scrape."""


def parse_engine_load(text: str, at: float) -> EngineLoad:
    sums: dict[str, list[float]] = {name: [] for name in _NAMES}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        name = line[:name_end]
        if name not in sums:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if value == value:  # NaN is "unknown"
            sums[name].append(value)
    usage = sums[KV_USAGE]
    return EngineLoad(
        waiting=sum(sums[WAITING]) if sums[WAITING] else None,
        running=sum(sums[RUNNING]) if sums[RUNNING] else None,
        kv_usage=sum(usage) / len(usage) if usage else None,
        at=at,
    )


def merge_loads(loads: list[EngineLoad | None]) -> EngineLoad | None:
    """Several data-parallel ranks' scrapes as one engine's: queues summed, KV usage averaged,
    the oldest scrape's time; None while any rank has none (one rank's load is its own)."""
    if len(loads) == 1:
        return loads[0]
    known = [load for load in loads if load is not None]
    if len(known) < len(loads) or not known:
        return None

    def total(values: list[float | None]) -> float | None:
        present = [value for value in values if value is not None]
        return sum(present) if present else None

    usage = [load.kv_usage for load in known if load.kv_usage is not None]
    return EngineLoad(
        waiting=total([load.waiting for load in known]),
        running=total([load.running for load in known]),
        kv_usage=sum(usage) / len(usage) if usage else None,
        at=min(load.at for load in known),
    )


def describe_load(load: EngineLoad | None, now: float) -> dict[str, Any] | None:
    """For /debug/scheduler."""
    if load is None:
        return None
    return {
        "waiting": load.waiting,
        "running": load.running,
        "kv_usage": load.kv_usage,
        "age_s": round(now - load.at, 3),
    }
