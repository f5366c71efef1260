"""The overhead benchmark's pure parts: answer checks, medians and added latency, the targets'
ratios (and their rebasing on the aiohttp floor), the profile summary. The benchmark itself runs
in CI as ``make bench-smoke``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.client import Workload
from bench.overhead_report import Point, markdown, medians, rows_from_json, targets
from bench.profiling import heaviest

STREAM = Workload(True, 3, 16)
NON_STREAM = Workload(False, 3, 16)


def _point(variant: str, mode: str, concurrency: int, run: int = 1, **figures: Any) -> Point:
    values: dict[str, Any] = {
        "run": run,
        "variant": variant,
        "mode": mode,
        "concurrency": concurrency,
        "requests": 100,
        "errors": {},
        "elapsed_s": 1.0,
        "throughput_rps": 100.0,
        "latency_p50_ms": 1.0,
        "latency_p99_ms": 2.0,
        "ttfb_p50_ms": 1.0,
        "ttfb_p99_ms": 2.0,
        "cpu_s_per_1000": None if variant == "floor" else 0.5,
        "chunks_per_cpu_s": None,
        "peak_rss_mib": None,
        "proxy_core_pct": None,
        "client_core_pct": 90.0,
        "cpu_pressure_pct": None,
        "client_cpu_s_per_1000": 0.2,
        "emulators_cpu_s_per_1000": 1.0,
    }
    values.update(figures)
    return Point(**values)


def test_a_stream_is_complete_only_with_every_token_and_done() -> None:
    events = b"".join(b'data: {"choices":[{"text":" w"}]}\n\n' for _ in range(3))
    assert STREAM.check(200, events + b"data: [DONE]\n\n") is None
    assert STREAM.check(200, events) == "no [DONE]"
    assert STREAM.check(200, events[:-36] + b"data: [DONE]\n\n") == "2/3 tokens"
    assert STREAM.check(200, events + b'data: {"error":{}}\n\ndata: [DONE]\n\n') == "error event"
    assert STREAM.check(503, b"") == "status 503"
    assert NON_STREAM.check(200, b'{"choices":[{"text":" a b c"}]}') is None
    assert NON_STREAM.check(200, b'{"choices":[]}') == "no choice"


def test_bodies_are_distinct_and_sized() -> None:
    first, second = NON_STREAM.body(1), NON_STREAM.body(2)
    assert first["prompt"] != second["prompt"]
    assert len(first["prompt"]) == 16 * 4
    assert STREAM.mode == "stream 3"
    assert NON_STREAM.mode == "non-stream"


def test_medians_over_runs_and_added_latency_over_the_floor() -> None:
    points = [
        _point("floor", "non-stream", 1, run, latency_p50_ms=1.0 + run / 10) for run in (1, 2, 3)
    ] + [
        _point("sidecar", "non-stream", 1, run, latency_p50_ms=p50, cpu_s_per_1000=cpu)
        for run, p50, cpu in ((1, 1.5, 0.9), (2, 9.0, 0.7), (3, 1.4, 0.8))
    ]
    points[4] = _point("sidecar", "non-stream", 1, 2, latency_p50_ms=9.0, errors={"timeout": 2})
    rows = {row.variant: row for row in medians(points)}
    sidecar = rows["sidecar"]
    assert sidecar.runs == 3
    assert sidecar.requests == 300
    assert sidecar.get("latency_p50_ms") == 1.5
    assert sidecar.added_p50_ms is not None
    assert abs(sidecar.added_p50_ms - 0.3) < 1e-9
    assert sidecar.errors == {"timeout": 2}
    assert rows["floor"].added_p50_ms is None
    assert rows["floor"].get("cpu_s_per_1000") is None


def test_targets_rebase_on_the_aiohttp_floor_when_it_misses() -> None:
    rows = medians(
        [
            _point("sidecar", "non-stream", 16, cpu_s_per_1000=0.6),
            _point("aiohttp-floor", "non-stream", 16, cpu_s_per_1000=0.58),
            _point("vllm-router", "non-stream", 16, cpu_s_per_1000=0.29),
            _point("sidecar", "stream 64", 16, cpu_s_per_1000=1.0),
            _point("aiohttp-floor", "stream 64", 16, cpu_s_per_1000=0.9),
            _point("vllm-router", "stream 64", 16, cpu_s_per_1000=1.1),
        ]
    )
    cpu_non_stream, cpu_stream = targets(rows, "stream 64")[:2]
    # The floor is 2x vllm-router: the target becomes 1.1x the floor, which 0.6/0.58 meets.
    assert "1.1× the aiohttp floor" in cpu_non_stream["target"]
    assert cpu_non_stream["met"] is True
    assert "1.1×" not in cpu_stream["target"]
    assert cpu_stream["met"] is True


def test_profile_summary_counts_a_frame_once_per_stack() -> None:
    raw = "\n".join(
        [
            "main (a.py:1);f (sidecar/x.py:2);f (sidecar/x.py:2);gc_collect_main (libpython) 3",
            "main (a.py:1);g (aiohttp/y.py:3) 1",
            "",
        ]
    )
    lines = heaviest(raw)
    assert lines[0].startswith("4 samples")
    assert "   75.0%  garbage collection" in lines
    assert "   75.0%  f (sidecar/x.py:2)" in lines
    assert "  100.0%  main (a.py:1)" in lines


@pytest.mark.system  # ~10 s: placements on both backends, a redis-server
async def test_the_decision_costs_report_is_written_as_json() -> None:
    """The overhead benchmark writes ``decision_cost.measure``'s figures into its JSON report
    (``make bench-smoke`` in CI): every key must be text (orjson refuses others)."""
    from bench import decision_cost

    figures = await decision_cost.measure(3, ["qoe"])
    decoded = orjson.loads(orjson.dumps(figures))
    assert set(decoded["continuations"]) == {"16", "64"}
    assert decoded["memory"]["qoe"]["median_us"] > 0


def test_the_results_page_s_overhead_tables_are_their_json_rendered() -> None:
    """docs/benchmark-tables.md: after each link to an overhead report, its tables, one per mode
    in order, are what ``python -m bench.overhead_report REPORT`` prints for it."""
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "benchmark-tables.md").read_text()
    sections = re.split(r"\(\[JSON\]\(\.\./(bench/results/[^)]+\.json)\)\)", page)
    assert len(sections) >= 5, "two overhead reports linked"
    for report, after in zip(sections[1::2], sections[2::2], strict=True):
        tables = markdown(rows_from_json(orjson.loads((root / report).read_bytes())))
        shown = [block.strip().splitlines() for block in re.findall(r"(?:^\|.*\n)+", after, re.M)]
        assert shown[: len(tables)] == list(tables.values()), report
