"""The overhead benchmark's figures: one measured point, medians over runs, the table, the targets.

A :class:`Point` is one variant, one workload and one concurrency in one run. :func:`medians`
folds the runs into one row per (variant, mode, concurrency) holding the median of every figure,
the added latency over the floor, and the errors of all runs. :func:`table` and
:func:`target_lines` print them; the JSON report holds the rows and every run's points.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FIGURES = (
    "throughput_rps",
    "latency_p50_ms",
    "latency_p99_ms",
    "ttfb_p50_ms",
    "ttfb_p99_ms",
    "cpu_s_per_1000",
    "chunks_per_cpu_s",
    "peak_rss_mib",
    "proxy_core_pct",
    "client_core_pct",
    "cpu_pressure_pct",
    "client_cpu_s_per_1000",
    "emulators_cpu_s_per_1000",
)
"""The figures of a point that runs are folded into medians."""


@dataclass(frozen=True, slots=True)
class Point:
    run: int
    variant: str
    mode: str
    """``non-stream`` or ``stream N`` (N tokens)."""
    concurrency: int
    requests: int
    """Requests answered in full."""
    errors: dict[str, int]
    elapsed_s: float
    throughput_rps: float
    latency_p50_ms: float
    latency_p99_ms: float
    ttfb_p50_ms: float
    ttfb_p99_ms: float
    cpu_s_per_1000: float | None
    """CPU seconds (user + system, every thread) of the proxy process per 1000 requests; None
    for the floor, which has no proxy."""
    chunks_per_cpu_s: float | None
    """Streamed SSE events per CPU second of the proxy (streaming points only)."""
    peak_rss_mib: float | None
    """The proxy's VmHWM during the point (reset before it when the kernel allows)."""
    proxy_core_pct: float | None
    """The proxy's CPU as % of one core over the point: near 100, the proxy is the limit."""
    client_core_pct: float
    """Client + both emulators, % of one core: near 100, the client's core is the limit."""
    cpu_pressure_pct: float | None
    """PSI "some" for the whole machine over the point: noise from other work."""
    client_cpu_s_per_1000: float
    """The load generator's own CPU seconds per 1000 requests (the floor's: both legs)."""
    emulators_cpu_s_per_1000: float
    """Both emulators' CPU seconds per 1000 requests."""


@dataclass(slots=True)
class Row:
    variant: str
    mode: str
    concurrency: int
    runs: int
    requests: int
    errors: Counter[str] = field(default_factory=Counter)
    figures: dict[str, float | None] = field(default_factory=dict)
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None

    def get(self, name: str) -> float | None:
        return self.figures.get(name)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["errors"] = dict(self.errors)
        return data


def medians(points: list[Point]) -> list[Row]:
    """One row per (variant, mode, concurrency), in the order first measured."""
    rows: dict[tuple[str, str, int], Row] = {}
    groups: dict[tuple[str, str, int], list[Point]] = {}
    for point in points:
        key = (point.variant, point.mode, point.concurrency)
        groups.setdefault(key, []).append(point)
    for key, group in groups.items():
        row = Row(*key, runs=len(group), requests=sum(p.requests for p in group))
        for point in group:
            row.errors.update(point.errors)
        for name in FIGURES:
            values = [v for p in group if (v := getattr(p, name)) is not None]
            row.figures[name] = statistics.median(values) if values else None
        rows[key] = row
    for (variant, mode, concurrency), row in rows.items():
        floor = rows.get(("floor", mode, concurrency))
        if floor is not None and variant != "floor":
            row.added_p50_ms = _minus(row.get("latency_p50_ms"), floor.get("latency_p50_ms"))
            row.added_p99_ms = _minus(row.get("latency_p99_ms"), floor.get("latency_p99_ms"))
    return list(rows.values())


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


_COLUMNS = (
    ("c", 4, "concurrency"),
    ("req/s", 7, "throughput_rps"),
    ("p50", 6, "latency_p50_ms"),
    ("p99", 6, "latency_p99_ms"),
    ("ttfb50", 6, "ttfb_p50_ms"),
    ("ttfb99", 6, "ttfb_p99_ms"),
    ("+p50", 6, "added_p50_ms"),
    ("+p99", 6, "added_p99_ms"),
    ("cpu/1k", 6, "cpu_s_per_1000"),
    ("chunks/cpu-s", 12, "chunks_per_cpu_s"),
    ("rss", 5, "peak_rss_mib"),
    ("proxy%", 6, "proxy_core_pct"),
    ("client%", 7, "client_core_pct"),
    ("psi%", 4, "cpu_pressure_pct"),
)


def _cell(row: Row, name: str, width: int) -> str:
    if name == "concurrency":
        return f"{row.concurrency:>{width}}"
    value = getattr(row, name) if name.startswith("added") else row.get(name)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'—':>{width}}"
    if name in ("cpu_s_per_1000",):
        return f"{value:>{width}.3f}"
    if name.endswith("_ms"):
        return f"{value:>{width}.2f}" if abs(value) < 100 else f"{value:>{width}.0f}"
    return f"{value:>{width}.0f}"


def table(rows: list[Row]) -> list[str]:
    """One block per mode, rows by concurrency then variant; latencies in ms, CPU in seconds
    per 1000 requests, RSS in MiB."""
    lines = []
    for mode in dict.fromkeys(row.mode for row in rows):
        lines.append("")
        lines.append(f"{mode}:")
        header = f"  {'variant':<14}" + " ".join(f"{t:>{w}}" for t, w, _ in _COLUMNS) + "  errors"
        lines.append(header)
        ordered = sorted((r for r in rows if r.mode == mode), key=lambda r: r.concurrency)
        for row in ordered:
            cells = " ".join(_cell(row, name, width) for _, width, name in _COLUMNS)
            errors = sum(row.errors.values())
            lines.append(f"  {row.variant:<14}{cells}  {errors or ''}")
    return lines


def _find(rows: list[Row], variant: str, mode: str, concurrency: int) -> Row | None:
    for row in rows:
        if (row.variant, row.mode, row.concurrency) == (variant, mode, concurrency):
            return row
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(rows: list[Row], stream_mode: str) -> list[dict[str, Any]]:
    """The targets this benchmark measures, with today's figures and ratios."""
    found: list[dict[str, Any]] = []

    def cpu(variant: str, mode: str) -> float | None:
        row = _find(rows, variant, mode, 16)
        return row.get("cpu_s_per_1000") if row else None

    for mode, limit, what in (
        ("non-stream", 1.5, "CPU per non-streaming request (c=16)"),
        (stream_mode, 1.0, "CPU per 64-token stream (c=16)"),
    ):
        side, router, floor = (
            cpu("sidecar", mode),
            cpu("vllm-router", mode),
            cpu("aiohttp-floor", mode),
        )
        vs_router, floor_vs_router = _ratio(side, router), _ratio(floor, router)
        vs_floor = _ratio(side, floor)
        # When the aiohttp floor itself misses, the target is 1.1 x that floor.
        rebased = floor_vs_router is not None and floor_vs_router > limit
        met = (
            (vs_floor is not None and vs_floor <= 1.1)
            if rebased
            else (vs_router is not None and vs_router <= limit)
        )
        found.append(
            {
                "target": f"{what} ≤ {limit}× vllm-router's"
                + (" → ≤ 1.1× the aiohttp floor (the floor misses it)" if rebased else ""),
                "today": f"sidecar/vllm-router {_x(vs_router)}, aiohttp-floor/vllm-router"
                f" {_x(floor_vs_router)}, sidecar/aiohttp-floor {_x(vs_floor)}",
                "met": met
                if side is not None and (router is not None or floor is not None)
                else None,
            }
        )
    for mode in ("non-stream", stream_mode):
        row = _find(rows, "sidecar", mode, 1)
        added = row.added_p50_ms if row else None
        found.append(
            {
                "target": f"added p50 at c=1 ({mode}) ≤ 0.25 ms over the floor",
                "today": "n/a" if added is None else f"+{added:.2f} ms",
                "met": None if added is None else added <= 0.25,
            }
        )
    side_row = _find(rows, "sidecar", "non-stream", 16)
    router_row = _find(rows, "vllm-router", "non-stream", 16)
    ratio = _ratio(
        side_row.get("latency_p99_ms") if side_row else None,
        router_row.get("latency_p99_ms") if router_row else None,
    )
    found.append(
        {
            "target": "p99 at c=16 (non-stream) ≤ 1.5× vllm-router's",
            "today": _x(ratio),
            "met": None if ratio is None else ratio <= 1.5,
        }
    )
    side_row = _find(rows, "sidecar", stream_mode, 256)
    router_row = _find(rows, "vllm-router", stream_mode, 256)
    if side_row is not None:
        errors = sum(side_row.errors.values())
        ratio = _ratio(
            side_row.get("ttfb_p99_ms"), router_row.get("ttfb_p99_ms") if router_row else None
        )
        found.append(
            {
                "target": "c=256 streaming: no errors, p99 TTFB ≤ vllm-router's",
                "today": f"{errors} errors, p99 TTFB {_x(ratio)} vllm-router's",
                "met": None if ratio is None else errors == 0 and ratio <= 1.0,
            }
        )
    return found


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}×"


def target_lines(found: list[dict[str, Any]]) -> list[str]:
    lines = ["", "targets, today:"]
    for item in found:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[item["met"]]
        lines.append(f"  [{verdict:>6}] {item['target']}: {item['today']}")
    return lines


# --- the results page's tables (docs/benchmark-tables.md) ---------------------------------------

_MARKDOWN = (
    ("req/s", "throughput_rps"),
    ("p50 ms", "latency_p50_ms"),
    ("p99 ms", "latency_p99_ms"),
    ("TTFB p50", "ttfb_p50_ms"),
    ("TTFB p99", "ttfb_p99_ms"),
    ("+p50 ms", "added_p50_ms"),
    ("CPU s / 1000 req", "cpu_s_per_1000"),
    ("chunks / CPU s", "chunks_per_cpu_s"),
    ("peak RSS MiB", "peak_rss_mib"),
    ("proxy core %", "proxy_core_pct"),
    ("client core %", "client_core_pct"),
)


def rows_from_json(report: dict[str, Any]) -> list[Row]:
    """The medians a ``--json`` report stored, as rows."""
    return [
        Row(
            item["variant"],
            item["mode"],
            item["concurrency"],
            item["runs"],
            item["requests"],
            Counter(item["errors"]),
            dict(item["figures"]),
            item["added_p50_ms"],
            item["added_p99_ms"],
        )
        for item in report["rows"]
    ]


def markdown(rows: list[Row]) -> dict[str, list[str]]:
    """A Markdown table per mode, rows by concurrency then variant, as the results page shows
    them: latencies in ms, +p50 signed, CPU in seconds per 1000 requests, RSS in MiB."""
    tables: dict[str, list[str]] = {}
    titles = ["c", "variant", *(title for title, _ in _MARKDOWN), "errors"]
    for mode in dict.fromkeys(row.mode for row in rows):
        lines = ["| " + " | ".join(titles) + " |", "|---|---|" + "---:|" * len(_MARKDOWN) + "---|"]
        for row in sorted((r for r in rows if r.mode == mode), key=lambda r: r.concurrency):
            cells = [_markdown_cell(row, name) for _, name in _MARKDOWN]
            errors = sum(row.errors.values())
            lines.append(
                f"| {row.concurrency} | {row.variant} | {' | '.join(cells)} | {errors or ''} |"
            )
        tables[mode] = lines
    return tables


def _markdown_cell(row: Row, name: str) -> str:
    value = getattr(row, name) if name.startswith("added") else row.get(name)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if name.startswith("added"):
        return f"{value:+.2f}" if abs(value) < 100 else f"{value:+.0f}"
    return _cell(row, name, 0).strip()


def main_cli(argv: list[str] | None = None) -> int:
    """``python -m bench.overhead_report REPORT.json``: its tables as the results page has them."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead_report",
        description="Print the Markdown tables of an overhead benchmark's JSON report.",
    )
    parser.add_argument("report", type=Path, help="a report of python -m bench overhead --json")
    args = parser.parse_args(argv)
    tables = markdown(rows_from_json(json.loads(args.report.read_text(encoding="utf-8"))))
    for mode, lines in tables.items():
        print(f"{mode}:\n")
        print("\n".join(lines), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main_cli())
