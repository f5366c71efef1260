"""The streaming-ceiling and stream-memory benchmarks' pure parts: tokens per CPU-second and the
ratio to the aiohttp floor over interleaved rounds, and RSS per additional stream as a slope. The
benchmarks themselves run real processes (docs/benchmarks.md, "Issue 25: the streaming ceiling
and memory per stream")."""

from __future__ import annotations

from typing import Any

import pytest

from bench.ceiling import report, tokens_per_cpu_s
from bench.overhead_report import Point
from bench.stream_memory import slope


def _point(variant: str, run: int, cpu_s_per_1000: float | None, **figures: Any) -> Point:
    values: dict[str, Any] = {
        "run": run,
        "variant": variant,
        "mode": "stream 512",
        "concurrency": 256,
        "requests": 512,
        "errors": {},
        "elapsed_s": 10.0,
        "throughput_rps": 50.0,
        "latency_p50_ms": 1.0,
        "latency_p99_ms": 2.0,
        "ttfb_p50_ms": 1.0,
        "ttfb_p99_ms": 2.0,
        "cpu_s_per_1000": cpu_s_per_1000,
        "chunks_per_cpu_s": None,
        "peak_rss_mib": 60.0,
        "proxy_core_pct": 40.0,
        "client_core_pct": 90.0,
        "cpu_pressure_pct": 10.0,
        "client_cpu_s_per_1000": 0.2,
        "emulators_cpu_s_per_1000": 1.0,
    }
    values.update(figures)
    return Point(**values)


def test_tokens_per_cpu_second_of_the_proxy() -> None:
    # 4.0 CPU seconds per 1000 streams of 512 tokens: 128,000 tokens per CPU-second.
    assert tokens_per_cpu_s(_point("sidecar", 1, 4.0), 512) == pytest.approx(128_000)
    assert tokens_per_cpu_s(_point("sidecar", 1, None), 512) is None


def test_the_ratio_to_the_floor_is_of_the_medians_over_rounds() -> None:
    points = [
        _point("sidecar", 1, 4.0),
        _point("sidecar", 2, 5.0),
        _point("sidecar", 3, 40.0),  # one round on a starved machine does not move the median
        _point("aiohttp-floor", 1, 4.0),
        _point("aiohttp-floor", 2, 4.0),
        _point("aiohttp-floor", 3, 4.0),
    ]
    syscalls = {("sidecar", 1): (10.0, 20.0), ("aiohttp-floor", 1): (8.0, 16.0)}
    lines = report(points, ["sidecar", "aiohttp-floor"], 512, syscalls)
    text = "\n".join(lines)
    assert "sidecar / aiohttp-floor: 0.80×" in text  # 102,400 against 128,000
    assert "[MISSED]" in text
    assert "reads    10.0  writes    20.0" in text
    faster = [_point("sidecar", 1, 4.2), *points[3:]]
    lines = report(faster, ["sidecar", "aiohttp-floor"], 512, {})
    assert "sidecar / aiohttp-floor: 0.95×" in "\n".join(lines)
    assert "[met]" in "\n".join(lines)


def test_rss_per_stream_is_the_slope_through_the_steps_with_streams() -> None:
    mib = 1 << 20
    # 50 MiB of imports, then 30 KiB a stream; the first step (0 streams) is left out.
    readings = [(0, 50 * mib), (250, 50 * mib + 250 * 30 * 1024), (500, 50 * mib + 500 * 30 * 1024)]
    readings += [(1000, 50 * mib + 1000 * 30 * 1024)]
    assert slope(readings) == pytest.approx(30 * 1024)
    assert slope([(0, 50 * mib), (500, 50 * mib + 500 * 1024)]) == pytest.approx(1024)
