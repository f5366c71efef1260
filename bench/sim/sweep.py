"""The exact prefix index (``qoe exact``, fed by the prefill engines' KV events) against the
approximate one (``qoe``) over a sweep of what disturbs the prefill caches, under the evaluation
protocol (``bench.sim.protocol``).

A *cell* is one combination of: the prefill engines' cache size, engine restarts (none / each
engine restarted at exponential intervals), traffic the sidecars did not place (none / a rate of
foreign prompt tokens cached on each engine) and the KV events' lag behind the engines (which
only the exact index reads: the approximate variant runs once per cell without it and is paired
with every lag). Every cell runs both variants on the same seeds (each seed: the trace's window
and its arrivals' phase, the policies' and the disturbances' random draws) at the same fixed
rates (fractions of the fleet's capacity, computed before any policy runs).

Per cell, first what the index is for: the **prediction error** (the share of remote prefills
whose predicted cached tokens were off the engine's by more than 10 % of the prompt) and the
**realised hit share** (the cached tokens the prefill engines reused ÷ the prompt tokens sent to
them); then SLO attainment at each rate and goodput where the protocol reads it, each as the
ratio exact ÷ approximate, geometric mean over the seeds with its paired 95 % interval.

The verdicts are read from the intervals, by rules fixed before any sweep ran:

- ``>=``: at no rate does the attainment ratio's interval lie wholly below 1;
- where restarts or foreign traffic are present, ``>= 1.05x`` at the *judged* ratio — goodput
  where every seed of both crosses the target steeply, else attainment at the grid's highest
  rate: ``shown`` when its interval's lower bound is at least 1.05, ``open`` when the interval
  holds 1.05, ``missed`` when it lies below;
- where neither is present, ``tie``: every rate's interval holds 1.
"""

from __future__ import annotations

import functools
import gc
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench.sim.protocol import Capacity, Interval, capacity, crossing, paired_ratio
from bench.sim.run import RunStats, simulate
from bench.sim.scenario import QOE, QOE_EXACT, Scenario, Variant

EXACT, APPROXIMATE = QOE_EXACT, QOE
SHOWN = 1.05
"""The exact index's lead where the caches are disturbed (restarts, foreign traffic)."""


@dataclass(frozen=True, slots=True)
class Cell:
    cache_tokens: int
    """Each prefill engine's prefix cache, tokens."""
    restart_s: float
    """Mean seconds between restarts of each prefill engine; 0: none."""
    foreign_tokens_per_s: float
    """Foreign prompt tokens cached per second on each prefill engine; 0: none."""
    lag_s: float
    """How far the KV events are behind the engines (the exact index only)."""

    @property
    def disturbed(self) -> bool:
        """Something the approximate index cannot see empties or fills the caches."""
        return self.restart_s > 0 or self.foreign_tokens_per_s > 0

    @property
    def label(self) -> str:
        restarts = f"restart {self.restart_s:g} s" if self.restart_s else "no restart"
        foreign = f"foreign {self.foreign_tokens_per_s:g}/s" if self.foreign_tokens_per_s else "-"
        return (
            f"{self.cache_tokens // 1000:,}k, {restarts}, {foreign}, lag {self.lag_s * 1000:g} ms"
        )

    def approximate(self) -> Cell:
        """The cell the approximate variant runs in: the lag is nothing to it."""
        return replace(self, lag_s=0.0)


@dataclass(frozen=True, slots=True)
class Sweep:
    base: Scenario
    """The fleet, workload and SLOs (its cache, restart, foreign and lag settings are the
    cells')."""
    caches: tuple[int, ...]
    restart_s: float
    foreign_tokens_per_s: float
    lags: tuple[float, ...]
    grid: tuple[float, ...]
    """Rates as fractions of the base's capacity."""
    seeds: tuple[int, ...]
    measured: int
    warmup: int

    def cells(self) -> list[Cell]:
        return [
            Cell(cache, restart, foreign, lag)
            for cache in self.caches
            for restart in (0.0, self.restart_s)
            for foreign in (0.0, self.foreign_tokens_per_s)
            for lag in self.lags
        ]

    def scenario(self, cell: Cell) -> Scenario:
        return replace(
            self.base,
            prefill_cache_tokens=cell.cache_tokens,
            prefill_restart_s=cell.restart_s,
            foreign_tokens_per_s=cell.foreign_tokens_per_s,
            kv_event_lag_s=cell.lag_s,
            variants=(EXACT, APPROXIMATE),
            trace_windows=True,
        )

    def runs(self) -> list[Key]:
        """Every run, seed by seed (a trace's requests are built once per seed and process):
        the exact variant in every cell, the approximate one once per cell without its lag."""
        keys: list[Key] = []
        for seed in self.seeds:
            done: set[Cell] = set()
            for cell in self.cells():
                for variant, where in ((EXACT, cell), (APPROXIMATE, cell.approximate())):
                    if where in done:
                        continue
                    done.add(where)
                    keys += [(variant, where, seed, fraction) for fraction in self.grid]
        return keys


@functools.lru_cache(maxsize=4)
def nominal_capacity(base: Scenario) -> Capacity:
    """The base's capacity (``protocol.capacity``), computed once per process."""
    return capacity(base)


Key = tuple[Variant, Cell, int, float]
"""(variant, cell, seed, grid fraction) of one run."""
Runs = dict[Key, RunStats]


def run_one(sweep: Sweep, key: Key, rate: float) -> RunStats:
    variant, cell, seed, _ = key
    stats = simulate(
        sweep.scenario(cell),
        variant,
        rate,
        measured=sweep.measured,
        warmup=sweep.warmup,
        seed=seed,
    )
    # A run leaves cycles (the engines' caches and the loop's pending events refer to each
    # other) that the collector's thresholds leave for long: hundreds of runs in one process
    # grew it by gigabytes.
    gc.collect()
    return stats


def run(sweep: Sweep, jobs: int = 1, progress: Callable[[int, int], None] | None = None) -> Runs:
    """Every run of the sweep, ``jobs`` processes at once (1: in this process)."""
    nominal = nominal_capacity(sweep.base)
    keys = sweep.runs()
    results: Runs = {}
    if jobs <= 1:
        for key in keys:
            results[key] = run_one(sweep, key, key[3] * nominal.rate)
            if progress is not None:
                progress(len(results), len(keys))
        return results
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures: dict[Key, Future[RunStats]] = {
            key: pool.submit(run_one, sweep, key, key[3] * nominal.rate) for key in keys
        }
        for key, future in futures.items():
            results[key] = future.result()
            if progress is not None:
                progress(len(results), len(keys))
    return results


@dataclass(frozen=True, slots=True)
class Side:
    """One variant in one cell: means over the seeds, per grid rate."""

    wrong: list[float]
    """Prediction error: share of remote prefills off by more than 10 % of the prompt."""
    over: list[float]
    """Of them, predicted more than the engine held."""
    hit: list[float]
    """Realised hit share of the prompt tokens sent to prefill engines."""
    remote: list[float]
    attainment: list[float]
    ttft_mean: list[float]
    goodput: list[float]
    """Per seed: where its attainment curve crosses the target (``protocol.crossing``)."""
    steep: bool
    """Every seed's curve crosses steeply."""


@dataclass(frozen=True, slots=True)
class Outcome:
    cell: Cell
    exact: Side
    approximate: Side
    attainment: list[Interval | None]
    """Exact ÷ approximate, per grid rate (None: a seed with 0 attainment)."""
    goodput: Interval | None
    """Exact ÷ approximate where every seed of both crosses steeply; else None."""
    judged: Interval | None
    judged_at: str
    """``goodput``, or the attainment at the grid's highest rate."""
    at_least: bool
    """No rate's interval lies wholly below 1."""
    lead: str
    """Disturbed cells: ``shown``, ``open`` or ``missed`` (``>= 1.05x``); else ``""``."""
    tie: str
    """Undisturbed cells: ``yes`` when every rate's interval holds 1, ``NO`` when one does
    not, ``unread`` when a rate has no interval (a seed with 0 attainment); else ``""``."""

    @property
    def verdict(self) -> str:
        parts = [">= " + ("yes" if self.at_least else "NO")]
        if self.cell.disturbed:
            parts.append(f">= {SHOWN:g}x {self.lead}")
        else:
            parts.append(f"tie {self.tie}")
        return ", ".join(parts)


def outcomes(sweep: Sweep, runs: Runs) -> list[Outcome]:
    nominal = nominal_capacity(sweep.base)
    target = sweep.base.target_attainment
    result = []
    for cell in sweep.cells():
        exact = _side(sweep, runs, EXACT, cell, nominal, target)
        approximate = _side(sweep, runs, APPROXIMATE, cell.approximate(), nominal, target)
        ratios = [
            paired_ratio(
                [runs[EXACT, cell, seed, f].attainment for seed in sweep.seeds],
                [runs[APPROXIMATE, cell.approximate(), seed, f].attainment for seed in sweep.seeds],
            )
            for f in sweep.grid
        ]
        goodput = (
            paired_ratio(exact.goodput, approximate.goodput)
            if exact.steep and approximate.steep
            else None
        )
        judged, judged_at = (
            (goodput, "goodput")
            if goodput is not None
            else (ratios[-1], f"attainment at {sweep.grid[-1] * 100:g} %")
        )
        at_least = all(ratio is None or not ratio.high < 1.0 for ratio in ratios)
        lead = ""
        tie = ""
        if cell.disturbed:
            lead = lead_of(judged)
        elif any(ratio is None for ratio in ratios):
            tie = "unread"
        else:
            tie = "yes" if all(r.low <= 1.0 <= r.high for r in ratios if r is not None) else "NO"
        result.append(
            Outcome(
                cell, exact, approximate, ratios, goodput, judged, judged_at, at_least, lead, tie
            )
        )
    return result


def lead_of(judged: Interval | None) -> str:
    if judged is None:
        return "unread"
    if judged.low >= SHOWN:
        return "shown"
    return "open" if judged.high >= SHOWN else "missed"


def _side(
    sweep: Sweep, runs: Runs, variant: Variant, cell: Cell, nominal: Capacity, target: float
) -> Side:
    def mean(metric: Callable[[RunStats], float]) -> list[float]:
        return [
            statistics.fmean(metric(runs[variant, cell, seed, f]) for seed in sweep.seeds)
            for f in sweep.grid
        ]

    rates = [f * nominal.rate for f in sweep.grid]
    crossings = [
        crossing(
            [
                (rate, runs[variant, cell, seed, f].attainment)
                for rate, f in zip(rates, sweep.grid, strict=True)
            ],
            target,
            nominal.rate,
        )
        for seed in sweep.seeds
    ]
    return Side(
        wrong=mean(lambda r: r.prefix_wrong_share),
        over=mean(lambda r: r.prefix_over_share),
        hit=mean(lambda r: r.prefill_hit_share),
        remote=mean(lambda r: r.remote_share),
        attainment=mean(lambda r: r.attainment),
        ttft_mean=mean(lambda r: r.ttft_mean),
        goodput=[c.rate for c in crossings],
        steep=all(c.steep for c in crossings),
    )


def report(sweep: Sweep, results: Sequence[Outcome]) -> str:
    nominal = nominal_capacity(sweep.base)
    rates = [f * nominal.rate for f in sweep.grid]
    at = " / ".join(f"{r:.2f}" for r in rates)
    lines = [
        f"capacity {nominal.rate:.2f} req/s; rates {at} req/s "
        f"({', '.join(f'{f * 100:g} %' for f in sweep.grid)}); seeds "
        f"{', '.join(map(str, sweep.seeds))}; {sweep.measured} measured requests per run after "
        f"{sweep.warmup} warm-up; target attainment {sweep.base.target_attainment * 100:g} %",
        "off % = remote prefills whose predicted cached tokens were off the engine's by more "
        "than 10 % of the prompt; hit % = cached tokens the prefill engines reused / prompt "
        "tokens sent to them (exact / approximate, mean over seeds, at each rate); ratio = exact "
        "/ approximate, geometric mean [paired 95 % interval]",
        "",
        f"{'cell (cache, restarts, foreign, lag)':<48}{'off %':>22}{'hit %':>22}"
        f"{'SLO %':>22}"
        + "".join(f"{f'ratio @ {r:.2f}':>22}" for r in rates)
        + f"{'goodput ratio':>22}  verdict",
    ]
    for outcome in results:
        exact, approximate = outcome.exact, outcome.approximate
        row = f"{outcome.cell.label:<48}"
        for mine, theirs in (
            (exact.wrong, approximate.wrong),
            (exact.hit, approximate.hit),
            (exact.attainment, approximate.attainment),
        ):
            cells = " ".join(
                f"{a * 100:.1f}/{b * 100:.1f}" for a, b in zip(mine, theirs, strict=True)
            )
            row += f"{cells:>22}"
        for ratio in outcome.attainment:
            row += f"{str(ratio) if ratio else '-':>22}"
        goodput = str(outcome.goodput) if outcome.goodput else "flat"
        row += f"{goodput:>22}  {outcome.verdict}"
        lines.append(row)
    disturbed = [o for o in results if o.cell.disturbed]
    calm = [o for o in results if not o.cell.disturbed]
    lines += [
        "",
        f">= (no rate's interval below 1): {sum(o.at_least for o in results)} of "
        f"{len(results)} cells; >= {SHOWN:g}x where disturbed (judged: goodput where steep, else "
        f"attainment at the highest rate): shown {sum(o.lead == 'shown' for o in disturbed)}, "
        f"open {sum(o.lead == 'open' for o in disturbed)}, missed "
        f"{sum(o.lead == 'missed' for o in disturbed)} of {len(disturbed)}; tie where "
        f"undisturbed: {sum(o.tie == 'yes' for o in calm)} of {len(calm)}",
    ]
    return "\n".join(lines)


def document(sweep: Sweep, results: Sequence[Outcome], runs: Runs) -> dict[str, Any]:
    """The sweep as JSON: its settings, each cell's outcome, every run's figures."""
    nominal = nominal_capacity(sweep.base)

    def interval(value: Interval | None) -> dict[str, float] | None:
        return None if value is None else asdict(value)

    return {
        "scenario": sweep.base.describe(),
        "capacity": asdict(nominal),
        "grid": list(sweep.grid),
        "rates": [f * nominal.rate for f in sweep.grid],
        "seeds": list(sweep.seeds),
        "measured": sweep.measured,
        "warmup": sweep.warmup,
        "target_attainment": sweep.base.target_attainment,
        "cells": [
            {
                "cell": asdict(o.cell),
                "disturbed": o.cell.disturbed,
                "exact": asdict(o.exact),
                "approximate": asdict(o.approximate),
                "attainment_ratio": [interval(r) for r in o.attainment],
                "goodput_ratio": interval(o.goodput),
                "judged": interval(o.judged),
                "judged_at": o.judged_at,
                "at_least": o.at_least,
                "lead": o.lead,
                "tie": o.tie,
                "verdict": o.verdict,
            }
            for o in results
        ],
        "runs": [
            {
                "variant": variant.label,
                "cell": asdict(cell),
                "seed": seed,
                "rate": stats.rate,
                "attainment": stats.attainment,
                "prefix_wrong_share": stats.prefix_wrong_share,
                "prefix_over_share": stats.prefix_over_share,
                "prefill_hit_share": stats.prefill_hit_share,
                "remote_share": stats.remote_share,
                "ttft_mean": stats.ttft_mean,
                "wall_s": stats.wall_s,
            }
            for (variant, cell, seed, _), stats in runs.items()
        ],
    }
