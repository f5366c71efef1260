"""The scenarios ``python -m bench.simulate`` runs, each with its variants and its checks."""

from __future__ import annotations

from dataclasses import replace

from bench.sim.checks import GoodputRatio, QueueBalance
from bench.sim.scenario import (
    ALL_VARIANTS,
    LEAST_LOADED,
    NEVER,
    QOE,
    QOE_ALWAYS,
    ROUND_ROBIN,
    ROUND_ROBIN_ALWAYS,
    Scenario,
    Variant,
)

CONDITIONAL = (QOE, Variant("power_of_two"), LEAST_LOADED, ROUND_ROBIN, Variant("random"))

STANDARD = Scenario(
    variants=ALL_VARIANTS,
    checks=(
        GoodputRatio(QOE, ROUND_ROBIN_ALWAYS, 1.5, " (vLLM's proxy)"),
        GoodputRatio(QOE, LEAST_LOADED, 1.1, ", same decider"),
        GoodputRatio(QOE, QOE_ALWAYS, 1),
        GoodputRatio(QOE, NEVER, 1),
        GoodputRatio(QOE, ROUND_ROBIN, None, ", same decider"),
    ),
    guess=18.0,
)
"""Issue 4's standard scenario: 4 prefill and 4 decode engines, every engine 10,000 tokens/s."""

MIXED = replace(
    STANDARD,
    name="mixed",
    prefill_speeds=(30_000.0, 30_000.0, 10_000.0, 10_000.0),
    variants=CONDITIONAL,
    checks=(
        GoodputRatio(QOE, ROUND_ROBIN, 1.3, ", same decider"),
        GoodputRatio(QOE, LEAST_LOADED, 1.3, ", same decider"),
    ),
    guess=28.0,
)
"""The standard workload on a prefill fleet of two GPU generations: two engines 3x faster."""

WIDE = replace(
    STANDARD,
    name="wide",
    decode_engines=16,
    variants=CONDITIONAL,
    checks=(QueueBalance(QOE, 1.5), QueueBalance(LEAST_LOADED, None)),
    guess=45.0,
)
"""16 decode engines and their sidecars sharing the standard 4 prefill engines."""

SCENARIOS = {scenario.name: scenario for scenario in (STANDARD, MIXED, WIDE)}
