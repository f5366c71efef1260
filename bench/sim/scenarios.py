"""The scenarios ``python -m bench simulate`` runs, each with its variants and its checks."""

from __future__ import annotations

from dataclasses import replace

from bench.sim.checks import GoodputRatio, QueueBalance
from bench.sim.scenario import (
    ALL_VARIANTS,
    LEAST_LOADED,
    LLMD,
    NEVER,
    QOE,
    QOE_ALWAYS,
    QOE_BLIND,
    QOE_EXACT,
    ROUND_ROBIN,
    ROUND_ROBIN_ALWAYS,
    SGLANG,
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
"""The standard scenario: 4 prefill and 4 decode engines, every engine 10,000 tokens/s."""

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

PREFIX_VARIANTS = (QOE, QOE_BLIND, SGLANG, LLMD, LEAST_LOADED)
"""The prefill prefix index (production's default) against the scheduler without it,
what users would run instead (``bench.sim.anchors``), and the peers' load-only choice."""

SHARED_PROMPTS = replace(
    STANDARD,
    name="shared-prompts",
    workload="system_prompts",
    variants=PREFIX_VARIANTS,
    checks=(
        GoodputRatio(QOE, QOE_BLIND, 1.3),
        GoodputRatio(QOE, SGLANG, 1.05),
        GoodputRatio(QOE, LLMD, 1.05),
        GoodputRatio(QOE, LEAST_LOADED, 1.5, ", same decider"),
    ),
    guess=14.0,
)
"""The generated workload: 32 shared system prompts (Zipf), each with a user part of its
own, on the standard fleet."""

MOONCAKE = replace(
    STANDARD,
    name="mooncake",
    workload="trace",
    variants=PREFIX_VARIANTS,
    ttft_slo_per_prefill=3.0,
    constant_ttft_s=10.5,
    prefill_cache_tokens=3000 * 512,
    checks=(
        GoodputRatio(QOE, QOE_BLIND, 1.1),
        GoodputRatio(QOE, SGLANG, 1.05),
        GoodputRatio(QOE, LLMD, 1.05),
        GoodputRatio(QOE, LEAST_LOADED, 1.3, ", same decider"),
    ),
    guess=4.0,
)
"""Mooncake's conversation trace (``--trace PATH``), time-scaled, on the standard fleet. Its
prompts reach 126,000 tokens: the TTFT SLO is at least 3 x the prompt's prefill alone. Each
prefill engine caches 3,000 of the trace's 512-token blocks (a rough replay)."""

MOONCAKE_EVICT = replace(
    MOONCAKE,
    name="mooncake-evict",
    variants=(QOE_EXACT, QOE, QOE_BLIND, SGLANG, LLMD),
    prefill_cache_tokens=1536 * 512,
    prefill_restart_s=600.0,
    foreign_tokens_per_s=1000.0,
    target_attainment=0.80,
    checks=(
        GoodputRatio(QOE_EXACT, QOE, 1.05),
        GoodputRatio(QOE_EXACT, SGLANG, 1),
        GoodputRatio(QOE_EXACT, LLMD, 1),
        GoodputRatio(QOE, SGLANG, 1),
        GoodputRatio(QOE, LLMD, 1),
    ),
    guess=0.6,
)
"""Mooncake's trace on prefill caches that evict (1,536 of the trace's 512-token
blocks each, half of ``mooncake``'s), engines restarted every 600 s on average and 1,000 tokens/s
of traffic the sidecars never see cached on each: what the approximate index cannot see, and
the exact index (``qoe exact``, KV events 50 ms behind) does. At 90 % no variant reaches the
SLOs on this trace at any rate (``mooncake``): goodput here is the highest rate with 80 %."""

SCENARIOS = {
    scenario.name: scenario
    for scenario in (STANDARD, MIXED, WIDE, SHARED_PROMPTS, MOONCAKE, MOONCAKE_EVICT)
}
