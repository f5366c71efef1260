"""The evaluation protocol: every variant on one fixed grid of rates, over several seeds, and
each comparison as a ratio with a confidence interval paired over the seeds.

- The grid is fractions of the scenario's nominal capacity (``capacity``), a number computed
  from the fleet and the workload alone, before any policy runs: the same rates for every
  variant.
- A seed draws the workload (for a trace: where its replay starts and its arrivals' phase,
  ``Scenario.trace_windows``), the policies' and the gateway's random choices and the sidecars'
  scrape phases; every variant sees the same seeds.
- A ratio of variant A to variant B (attainment at a rate, goodput) is taken per seed, and its
  95 % interval is the geometric mean's: exp(mean ± t · sd / √n) of the per-seed log ratios,
  t of Student's distribution with n − 1 degrees of freedom.
- Goodput (the rate where attainment crosses the target, interpolated between the grid's rates)
  is reported only where the curve crosses steeply (``STEEP``); otherwise the curves speak.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.sim.run import RunStats
from bench.sim.scenario import LLMD, QOE, QOE_ALWAYS, SGLANG, Scenario, Variant
from bench.sim.workload import shapes
from sidecar.emulator.engine import prefill_seconds

GRID = (0.2, 0.4, 0.6, 0.8, 1.0, 1.2)
"""Rates as fractions of the scenario's capacity."""
QUICK_GRID = (0.4, 0.8, 1.2)
SEEDS = (1, 2, 3, 4, 5)
VARIANTS = (QOE, QOE_ALWAYS, SGLANG, LLMD)
"""The whole system, placement alone (every request disaggregated), and the two anchors."""
STEEP = 1.0
"""Attainment falling by at least this much per capacity (20 points per 20 % step) across the
crossing: the goodput read there moves little with a point of attainment."""
CAPACITY_SAMPLE = 4000
"""Requests of the workload (seed 1) the capacity is computed on; a trace: all of it."""

_T975 = (
    *(12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228),
    *(2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086),
    *(2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042),
)
"""Student's t, 97.5 % quantile, for 1-30 degrees of freedom (beyond: 1.96)."""


@dataclass(frozen=True, slots=True)
class Capacity:
    rate: float
    """min(prefill, decode): requests/s."""
    prefill: float
    """The prefill engines' rate with every request disaggregated and every shared segment of
    the prompts computed once in all (what no placement can beat)."""
    decode: float
    """The decode engines' rate at a full batch (``decode_max_batch``) of the mean answer."""


def capacity(scenario: Scenario) -> Capacity:
    """The scenario's nominal capacity, from its fleet and workload alone."""
    if scenario.workload == "trace":
        from bench.sim.traces import mooncake

        sample = mooncake(scenario.trace_path or "", scenario, 1)
    else:
        stream = shapes(scenario, 1)
        sample = [next(stream) for _ in range(CAPACITY_SAMPLE)]
    seen: set[int] = set()
    """Chained hashes of the prefixes (in segments) computed so far."""
    work = 0.0  # seconds of prefill at 1 token/s linear speed
    outputs = 0
    for shape in sample:
        outputs += shape.output_tokens
        held = 0
        prefix = 0
        cached = True
        for segment in shape.segments:
            prefix = hash((prefix, segment.key, segment.tokens))
            if cached and prefix in seen:
                held += segment.tokens
            else:
                cached = False
                seen.add(prefix)
        computed = max(1, shape.prompt_tokens - held)
        work += prefill_seconds(1.0, scenario.crossover_tokens, computed, held)
    mean_work = work / len(sample)
    prefill = sum(speed / mean_work for speed in scenario.speeds())
    batch = scenario.decode_max_batch or 64
    mean_output = outputs / len(sample)
    decode = scenario.decode_engines * batch / (scenario.decode_step_s(batch) * mean_output)
    return Capacity(min(prefill, decode), prefill, decode)


@dataclass(frozen=True, slots=True)
class Interval:
    """A ratio's geometric mean over the seeds and its paired 95 % interval."""

    mean: float
    low: float
    high: float
    seeds: int

    def __str__(self) -> str:
        if self.seeds < 2:
            return f"{self.mean:.2f}"
        return f"{self.mean:.2f} [{self.low:.2f}, {self.high:.2f}]"


def paired_ratio(values: Sequence[float], bases: Sequence[float]) -> Interval | None:
    """The ratio ``values / bases`` per seed (the same seeds, in order), as an interval; None
    when a seed's pair has a zero (a ratio that does not exist)."""
    if any(v <= 0 or b <= 0 for v, b in zip(values, bases, strict=True)):
        return None
    logs = [math.log(v / b) for v, b in zip(values, bases, strict=True)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return Interval(math.exp(mean), math.nan, math.nan, len(logs))
    t = _T975[len(logs) - 2] if len(logs) - 1 <= len(_T975) else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs))


@dataclass(frozen=True, slots=True)
class Crossing:
    """Where one seed's attainment curve crosses the target."""

    rate: float
    """Interpolated between the grid's rates; 0 below the grid, its top rate above it."""
    steep: bool
    """Crossed within the grid with a drop of at least ``STEEP`` per capacity."""
    bound: str = ""
    """"<" below the grid's lowest rate, ">=" at or above its highest, else ""."""


def crossing(curve: Sequence[tuple[float, float]], target: float, capacity: float) -> Crossing:
    """``curve``: (rate, attainment) along the grid, rising rates."""
    for i, (rate, attained) in enumerate(curve):
        if attained >= target:
            continue
        if i == 0:
            return Crossing(0.0, False, "<")
        low_rate, low_attained = curve[i - 1]
        drop = low_attained - attained
        at = low_rate + (rate - low_rate) * (low_attained - target) / drop
        steep = drop / ((rate - low_rate) / capacity) >= STEEP
        return Crossing(at, steep)
    return Crossing(curve[-1][0], False, ">=")


def comparisons(variants: Sequence[Variant]) -> list[tuple[str, Variant, Variant]]:
    """The three factors apart, among the variants that ran: the decider alone (``qoe`` ÷
    ``qoe always``: the same placement), placement alone (``qoe always`` ÷ each anchor, every
    request disaggregated by both), the whole system (``qoe`` ÷ each anchor). Without those
    variants: each variant ÷ the first."""
    present = set(variants)
    anchors = [v for v in variants if v.mode == "anchor"]
    pairs: list[tuple[str, Variant, Variant]] = []
    if {QOE, QOE_ALWAYS} <= present:
        pairs.append(("decider alone", QOE, QOE_ALWAYS))
    if QOE_ALWAYS in present:
        pairs += [("placement alone", QOE_ALWAYS, anchor) for anchor in anchors]
    if QOE in present:
        pairs += [("whole system", QOE, anchor) for anchor in anchors]
    if not pairs:
        pairs = [("vs first", variant, variants[0]) for variant in variants[1:]]
    return pairs


Runs = dict[tuple[Variant, int, float], RunStats]
"""(variant, seed, rate) -> its run."""


def report(
    scenario: Scenario,
    variants: Sequence[Variant],
    seeds: Sequence[int],
    grid: Sequence[float],
    nominal: Capacity,
    runs: Runs,
) -> str:
    rates = [fraction * nominal.rate for fraction in grid]
    target = scenario.target_attainment
    lines = [
        f"capacity {nominal.rate:.2f} req/s (prefill {nominal.prefill:.2f}, decode "
        f"{nominal.decode:.2f}); rates {', '.join(f'{r:.2f}' for r in rates)} req/s "
        f"({', '.join(f'{f * 100:g} %' for f in grid)}); seeds {', '.join(map(str, seeds))}",
    ]

    def mean_of(variant: Variant, rate: float, metric: str) -> float:
        values = [_metric(runs[variant, seed, rate], metric) for seed in seeds]
        return statistics.fmean(values)

    for metric, title, unit in _METRICS:
        lines.append("")
        lines.append(f"{title} (mean over seeds), by rate:")
        lines.append(f"{'variant':<32}" + "".join(f"{r:>9.2f}" for r in rates))
        for variant in variants:
            cells = (_cell(mean_of(variant, rate, metric), unit) for rate in rates)
            lines.append(f"{variant.label:<32}" + "".join(f"{c:>9}" for c in cells))

    lines.append("")
    lines.append(
        f"goodput at {target * 100:g} % (scaled SLO), per seed; * = the curve crosses steeply "
        f"(a drop of >= {STEEP * 100:g} points per capacity), < / >= = below / above the grid:"
    )
    crossings: dict[tuple[Variant, int], Crossing] = {}
    for variant in variants:
        row = f"{variant.label:<32}"
        for seed in seeds:
            curve = [(rate, runs[variant, seed, rate].attainment) for rate in rates]
            found = crossings[variant, seed] = crossing(curve, target, nominal.rate)
            mark = "*" if found.steep else " "
            row += f"{found.bound:>4}{found.rate:>7.2f}{mark}"
        lines.append(row)

    lines.append("")
    lines.append(
        "ratios, geometric mean over seeds [paired 95 % interval]; attainment (scaled SLO) at "
        "each rate, goodput where every seed of both crosses steeply:"
    )
    header = f"{'factor':<17}{'ratio':<56}{'goodput':>24}"
    lines.append(header + "".join(f"{r:>24.2f}" for r in rates))
    for factor, variant, base in comparisons(variants):
        steep = all(crossings[v, seed].steep for v in (variant, base) for seed in seeds)
        goodput = (
            paired_ratio(
                [crossings[variant, seed].rate for seed in seeds],
                [crossings[base, seed].rate for seed in seeds],
            )
            if steep
            else None
        )
        row = f"{factor:<17}{f'{variant.label} / {base.label}':<56}"
        row += f"{(str(goodput) if goodput else '-' if steep else 'flat'):>24}"
        for rate in rates:
            ratio = paired_ratio(
                [runs[variant, seed, rate].attainment for seed in seeds],
                [runs[base, seed, rate].attainment for seed in seeds],
            )
            row += f"{(str(ratio) if ratio else '-'):>24}"
        lines.append(row)
    return "\n".join(lines)


_METRICS = (
    ("attainment", "SLO attainment, scaled SLO, %", "%"),
    ("ttft_attainment", "TTFT met, scaled SLO, %", "%"),
    ("tpot_attainment", "TPOT met, scaled SLO, %", "%"),
    ("constant", "SLO attainment, constant SLO, %", "%"),
    ("mooncake 100 ms", "SLO attainment, Mooncake's with tail TBT 100 ms, %", "%"),
    ("mooncake 200 ms", "SLO attainment, Mooncake's with tail TBT 200 ms, %", "%"),
    ("mooncake 300 ms", "SLO attainment, Mooncake's with tail TBT 300 ms, %", "%"),
    ("unfinished_share", "unfinished 60 s after the last arrival, %", "%"),
    ("ttft_mean", "TTFT mean (requests with a first token), ms", "ms"),
    ("ttft_p90", "TTFT p90, ms", "ms"),
    ("tpot_mean", "TPOT mean (finished requests), ms", "ms"),
    ("tail_tbt_mean", "tail TBT mean (finished requests), ms", "ms"),
    ("remote_share", "remote prefills, %", "%"),
    ("local_prefill_share", "decode time on local prefills, %", "%"),
    ("load_max_over_mean", "prefill load (tokens), busiest engine / mean, time-averaged", "x"),
    ("load_ratio", "prefill load (tokens), instant busiest / instant mean, averaged", "x"),
)


def _metric(run: RunStats, name: str) -> float:
    if name in run.slos:
        return run.slos[name].both
    value = getattr(run, name)
    assert isinstance(value, float)
    return value


def _cell(value: float, unit: str) -> str:
    if math.isinf(value) or math.isnan(value):
        return str(value)
    if unit == "x":
        return f"{value:.2f}"
    return f"{value * 100:.1f}" if unit == "%" else f"{value * 1000:.0f}"
