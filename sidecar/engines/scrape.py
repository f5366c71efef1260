"""Engine load from vLLM's Prometheus text: the three gauges the scheduler reads, the size of
the engine's KV cache, and its inter-token latency histogram's sum and count (``INTER_TOKEN``).

Only the lines of those metrics are looked at (vLLM's /metrics is large: histograms per model); a
gauge reported per label set (several models, data-parallel ranks) is summed, kv usage averaged.
A missing gauge is None: an engine without metrics is scheduled by reservations alone.

The cache's size comes from the labels of ``vllm:cache_config_info``, an info gauge (value 1)
whose labels are every field of vLLM's ``CacheConfig`` as strings (``CacheConfig.metrics_info()``
in ``vllm/config/cache.py``, exported by ``PrometheusStatLogger.log_metrics_info`` in
``vllm/v1/metrics/loggers.py``), one line per engine (label ``engine``)::

    vllm:cache_config_info{block_size="16",...,num_gpu_blocks="27000",...,engine="0"} 1.0

Its capacity in tokens is ``kv_cache_size_tokens`` where vLLM exports it (newer versions: the
group-aware size, right for hybrid models too), else ``num_gpu_blocks × block_size``. Label
values are trusted only as ASCII digits within sane ranges; anything else (``"None"`` before the
engine profiled its memory, a malformed line) makes the size unknown.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

from sidecar.fleet.load import EngineLoad, total_cache

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
_NAMES = (WAITING, RUNNING, KV_USAGE)
INTER_TOKEN = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
"""The histogram of the time between a request's tokens (its ``_sum`` and ``_count``): vLLM's
name since 0.11, and the name it had before (``vllm/v1/metrics/loggers.py``)."""

MAX_BLOCK_SIZE = 1 << 16
"""Tokens per block; vLLM's are 16 by default, hybrid models' some thousands."""
MAX_GPU_BLOCKS = 100_000_000
MAX_CACHE_TOKENS = 10_000_000_000
"""Per engine: far above any GPU's (a 10¹⁰-token cache would be petabytes of KV)."""
_MAX_DIGITS = len(str(MAX_CACHE_TOKENS))
_MAX_INFO_LINE = 16_384
"""Characters of a ``vllm:cache_config_info`` line read at most (vLLM's is about 1,000)."""
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"')
"""One ``name="value"`` pair of the text format; a value escapes ``\\``, ``\"`` and newlines."""


def _labels(line: str, start: int) -> dict[str, str] | None:
    """The label set that opens at ``line[start] == "{"``; None unless it is well formed."""
    labels: dict[str, str] = {}
    pos = start + 1
    while True:
        if line.startswith("}", pos):
            return labels
        match = _LABEL.match(line, pos)
        if match is None:
            return None
        labels[match[1]] = match[2]
        pos = match.end()
        if line.startswith(",", pos):
            pos += 1
        elif not line.startswith("}", pos):
            return None


def _count(labels: dict[str, str], name: str, limit: int) -> int | None:
    """A label that is a whole number from 1 to ``limit``, in ASCII digits; else None."""
    value = labels.get(name)
    if value is None or not (0 < len(value) <= _MAX_DIGITS and value.isascii()):
        return None
    if not value.isdigit():
        return None
    number = int(value)
    return number if 1 <= number <= limit else None


def cache_tokens_of(line: str) -> int | None:
    """One ``vllm:cache_config_info`` line's cache size in tokens, or None."""
    start = line.find("{")
    if start < 0 or len(line) > _MAX_INFO_LINE:
        return None
    labels = _labels(line, start)
    if labels is None:
        return None
    tokens = _count(labels, "kv_cache_size_tokens", MAX_CACHE_TOKENS)
    if tokens is not None:
        return tokens
    block_size = _count(labels, "block_size", MAX_BLOCK_SIZE)
    blocks = _count(labels, "num_gpu_blocks", MAX_GPU_BLOCKS)
    if block_size is None or blocks is None or block_size * blocks > MAX_CACHE_TOKENS:
        return None
    return block_size * blocks


def _sample_lines(text: str, name: str) -> Iterator[str]:
    """The lines of ``name``'s samples, found with ``str.find`` (the text is not split: vLLM's
    is some hundreds of lines, of which a handful are wanted)."""
    needle = "\n" + name
    start = 0 if text.startswith(name) else text.find(needle) + 1
    while start >= 0 and (start > 0 or text.startswith(name)):
        end = text.find("\n", start)
        if end < 0:
            end = len(text)
        if text.startswith(("{", " "), start + len(name)):  # not a longer name
            yield text[start:end]
        found = text.find(needle, end)
        start = found + 1 if found >= 0 else -1


def _values(text: str, name: str) -> list[float]:
    """Every sample's value of the gauge ``name`` but NaNs (unknown) and unparsable ones."""
    values = []
    for line in _sample_lines(text, name):
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if value == value:  # NaN is "unknown"
            values.append(value)
    return values


def parse_engine_load(text: str, at: float) -> EngineLoad:
    waiting, running, usage = (_values(text, name) for name in _NAMES)
    caches = [cache_tokens_of(line) for line in _sample_lines(text, CACHE_CONFIG)]
    return EngineLoad(
        waiting=sum(waiting) if waiting else None,
        running=sum(running) if running else None,
        kv_usage=sum(usage) / len(usage) if usage else None,
        at=at,
        cache_tokens=total_cache(caches),
        **_inter_token(text),
    )


def _inter_token(text: str) -> dict[str, float]:
    """``itl_sum_s`` and ``itl_count`` of the first name of ``INTER_TOKEN`` the text serves
    (summed over its label sets); nothing when it serves neither, or when any of the served
    ``_sum`` and ``_count`` values is infinite or negative (no counter is)."""
    for name in INTER_TOKEN:
        sums, counts = _values(text, name + "_sum"), _values(text, name + "_count")
        if sums and counts:
            if not all(0.0 <= value < math.inf for value in (*sums, *counts)):
                return {}
            return {"itl_sum_s": sum(sums), "itl_count": sum(counts)}
    return {}
