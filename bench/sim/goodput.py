"""Goodput: the highest arrival rate at which the target share of requests meets both SLOs.

The request stream is the same at every rate (only the gaps are scaled), so attainment falls
almost monotonically with the rate. The search brackets the crossing geometrically from a guess,
then bisects (in log space) to a relative precision.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.sim.run import RunStats, simulate
from bench.sim.scenario import Scenario, Variant

LOWEST_RATE = 0.25
"""The lowest rate the goodput search tries (requests/s)."""


@dataclass(frozen=True, slots=True)
class Goodput:
    variant: str
    rate: float
    """Highest rate found meeting the target (0 when even the lowest rate tried misses it)."""
    at_rate: RunStats | None
    runs: list[RunStats]


def find_goodput(
    scenario: Scenario,
    variant: Variant,
    *,
    guess: float,
    measured: int,
    warmup: int,
    seed: int,
    precision: float = 0.02,
    step: float = 1.3,
    lowest: float = LOWEST_RATE,
    highest: float = 500.0,
) -> Goodput:
    runs: list[RunStats] = []

    def passes(rate: float) -> bool:
        stats = simulate(scenario, variant, rate, measured=measured, warmup=warmup, seed=seed)
        runs.append(stats)
        return stats.attainment >= scenario.target_attainment

    low: float | None = None
    high: float | None = None
    rate = guess
    while low is None or high is None:
        if passes(rate):
            low = rate
            if high is None:
                if rate >= highest:
                    break
                rate = min(highest, rate * step)
        else:
            high = rate
            if low is None:
                if rate <= lowest:
                    break
                rate = max(lowest, rate / step)
    if low is not None and high is not None:
        while high / low > 1.0 + precision:
            middle = (low * high) ** 0.5
            if passes(middle):
                low = middle
            else:
                high = middle
    best = low or 0.0
    at_rate = next((run for run in runs if run.rate == best), None)
    return Goodput(variant.label, best, at_rate, runs)
