"""The exact prefix index against the approximate one: cache size, restarts, foreign traffic, lag.

    python -m bench exact_sweep --trace <Mooncake conversation trace.jsonl> --jobs 1
    python -m bench exact_sweep --quick        # the smoke run: the generated workload, seconds

``qoe exact`` (each prefill candidate's cached tokens from its exact index, fed by the engines'
KV events) and ``qoe`` (the approximate index) on the scheduling simulator, under the evaluation
protocol: one fixed grid of rates for every cell, seeds varying the trace window and the arrival
jitter, ratios with intervals paired over the seeds (``bench.sim.sweep``, which states the cells
and the verdicts' rules). With ``--trace``: the ``mooncake-evict`` fleet replaying the trace
(caches of 1,536 and 3,000 blocks of 512 tokens); without it, the generated shared-prompts
workload on caches that hold a fraction of its system prompts. Prints the table, writes the JSON
(``--json``); judges nothing (exit status 0 once every run ran).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import orjson

from bench.sim.scenarios import MOONCAKE_EVICT, SHARED_PROMPTS
from bench.sim.sweep import Sweep, document, outcomes, report, run
from bench.suite import add_quick

TRACE_CACHES = (1536 * 512, 3000 * 512)
"""``mooncake-evict``'s and ``mooncake``'s prefill caches (blocks of the trace's 512 tokens)."""
GENERATED_CACHES = (16_384, 65_536)
"""The shared-prompts workload's 32 system prompts hold about 160,000 tokens: a tenth of them
per engine, and a third or so."""
RESTART_S = 150.0
"""Each engine restarted every 150 s on average: several restarts in a run of a few hundred
virtual seconds (``mooncake-evict``'s 600 s would be one, or none)."""
FOREIGN_TOKENS_PER_S = 1000.0
"""``mooncake-evict``'s foreign traffic per engine."""
LAGS = (0.05, 1.0)
"""KV events an engine step and a network hop behind, and a congested second."""
GRID = (0.5, 0.8)
"""Half of the fleet's capacity, where every variant meets its SLOs more or less, and 80 %."""
SEEDS = (1, 2, 3, 4, 5)
MEASURED, WARMUP = 250, 250
"""Per run: the warm-up fills the caches (the trace reuses a prefix 100-2,000 requests later;
a 1,536-block cache holds the last ~260 requests' prompts across the four engines)."""
QUICK_SEEDS, QUICK_GRID, QUICK_MEASURED, QUICK_WARMUP = (1, 2), (0.8,), 30, 10
"""The smoke run: besides these, the first cache size and the first lag only (4 cells)."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench exact_sweep", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--trace", help="a Mooncake-format trace (default: generated prompts)")
    parser.add_argument(
        "--seeds",
        type=lambda text: tuple(int(part) for part in text.split(",") if part),
        help="comma-separated seeds (default 1,2,3,4,5)",
    )
    parser.add_argument(
        "--grid",
        type=lambda text: tuple(float(part) for part in text.split(",") if part),
        help="rates as fractions of the capacity (default 0.5,0.8)",
    )
    parser.add_argument("--requests", type=int, help=f"measured requests per run ({MEASURED})")
    parser.add_argument("--warmup", type=int, help=f"warm-up requests per run ({WARMUP})")
    parser.add_argument(
        "--kv-in-flight",
        action="store_true",
        help="what-if: the exact index also counts the prompts placed and not reported yet",
    )
    parser.add_argument("--json", type=Path, help="write the sweep's JSON there")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    add_quick(parser, "the generated workload (no trace), 4 cells, 2 seeds, one rate, 30 requests")
    return parser.parse_args(argv)


def sweep_of(args: argparse.Namespace) -> Sweep:
    quick = args.quick
    caches: tuple[int, ...] = GENERATED_CACHES
    lags: tuple[float, ...] = LAGS
    base = SHARED_PROMPTS
    if args.trace:
        base, caches = replace(MOONCAKE_EVICT, trace_path=args.trace), TRACE_CACHES
    if args.kv_in_flight:
        base = replace(base, kv_in_flight=True)
    if quick:
        caches, lags = caches[:1], lags[:1]
    return Sweep(
        base=base,
        caches=caches,
        restart_s=RESTART_S,
        foreign_tokens_per_s=FOREIGN_TOKENS_PER_S,
        lags=lags,
        grid=args.grid or (QUICK_GRID if quick else GRID),
        seeds=args.seeds or (QUICK_SEEDS if quick else SEEDS),
        measured=args.requests or (QUICK_MEASURED if quick else MEASURED),
        warmup=args.warmup if args.warmup is not None else (QUICK_WARMUP if quick else WARMUP),
    )


def main_cli(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sweep = sweep_of(args)
    started = time.perf_counter()
    last = [started]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] >= 60 or done == total:
            last[0] = now
            print(f"[{now - started:.0f} s] {done} of {total} runs", file=sys.stderr, flush=True)

    runs = run(sweep, args.jobs, progress)
    results = outcomes(sweep, runs)
    print(f"== {sweep.scenario(sweep.cells()[0]).describe()}")
    print(report(sweep, results))
    print()
    print(f"{len(runs)} runs in {time.perf_counter() - started:.0f} s ({args.jobs} worker(s))")
    if args.json is not None:
        args.json.write_bytes(
            orjson.dumps(document(sweep, results, runs), option=orjson.OPT_INDENT_2)
        )
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main_cli())
