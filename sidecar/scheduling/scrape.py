"""Engine load from vLLM's Prometheus text: the three gauges the scheduler reads.

Only the lines of those gauges are looked at (vLLM's /metrics is large: histograms per model); a
gauge reported per label set (several models, data-parallel ranks) is summed, kv usage averaged.
A missing gauge is None: an engine without metrics is scheduled by reservations alone.
"""

from __future__ import annotations

from dataclasses import dataclass

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
