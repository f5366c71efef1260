"""The scheduling simulator: goodput and latency of every policy on a modelled P/D cluster.

    python -m bench.simulate                      # standard and wide scenarios (~2 minutes)
    python -m bench.simulate --quick              # smaller runs, coarser search
    python -m bench.simulate --scenario standard --policies qoe,round_robin:always,never

A variant is ``policy`` (conditional disaggregation, the production decider), ``policy:always``
(disaggregate every request) or ``never`` (every prefill on the local decode engine). See
docs/scheduling.md for the model and its assumptions.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sim.goodput import Goodput, find_goodput
from bench.sim.run import RunStats, simulate
from bench.sim.scenario import DEFAULT_VARIANTS, SCENARIOS, Scenario, Variant
from sidecar.scheduling.policies import POLICIES

GUESS = {"standard": 12.0, "wide": 25.0}
"""Where the goodput search starts (req/s); any value works, a close one saves runs."""


@dataclass(frozen=True, slots=True)
class Effort:
    measured: int
    warmup: int
    precision: float


FULL = Effort(measured=10_000, warmup=1500, precision=0.02)
QUICK = Effort(measured=1500, warmup=300, precision=0.05)


def parse_variant(text: str) -> Variant:
    if text == "never":
        return Variant("qoe", "never")
    policy, _, mode = text.partition(":")
    if policy not in POLICIES:
        raise argparse.ArgumentTypeError(f"unknown policy {policy!r}; one of {POLICIES}")
    if mode not in ("", "conditional", "always"):
        raise argparse.ArgumentTypeError(f"unknown mode {mode!r}; 'always' or none")
    return Variant(policy, "always" if mode == "always" else "conditional")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.simulate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument(
        "--policies",
        type=lambda text: [parse_variant(part.strip()) for part in text.split(",") if part],
        default=list(DEFAULT_VARIANTS),
        help="comma-separated variants: qoe, round_robin:always, never, ...",
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests, coarser search")
    parser.add_argument("--requests", type=int, help="measured requests per run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--staleness", type=float, help="seconds (default 1)")
    parser.add_argument("--stale-mode", choices=["delay", "scrape"])
    parser.add_argument("--state", choices=["shared", "local"])
    parser.add_argument("--ttft-ratio", type=float, help="the decider's ttft_ratio")
    parser.add_argument("--bursty", action="store_true", help="gamma arrivals, CV 3")
    parser.add_argument(
        "--rate", type=float, help="reference rate for the latency table (default: qoe goodput)"
    )
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    return parser.parse_args(argv)


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    chosen = list(SCENARIOS.values()) if args.scenario == "all" else [SCENARIOS[args.scenario]]
    changes: dict[str, Any] = {}
    if args.staleness is not None:
        changes["staleness_s"] = args.staleness
    if args.stale_mode:
        changes["stale_mode"] = args.stale_mode
    if args.state:
        changes["state"] = args.state
    if args.bursty:
        changes["bursty"] = True
    if args.ttft_ratio is not None:
        changes["ttft_ratio"] = args.ttft_ratio
    return [replace(scenario, **changes) for scenario in chosen]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    effort = QUICK if args.quick else FULL
    if args.requests:
        effort = replace(effort, measured=args.requests, warmup=max(100, args.requests // 6))
    started = time.perf_counter()
    variants: list[Variant] = args.policies
    chosen = scenarios(args)
    with _executor(args.jobs) as pool:
        searches = {
            (scenario.name, variant): pool.submit(
                find_goodput,
                scenario,
                variant,
                guess=GUESS.get(scenario.name, 10.0),
                measured=effort.measured,
                warmup=effort.warmup,
                seed=args.seed,
                precision=effort.precision,
            )
            for scenario in chosen
            for variant in variants
        }
        goodputs = {key: future.result() for key, future in searches.items()}
        references: dict[str, float] = {}
        for scenario in chosen:
            qoe = goodputs.get((scenario.name, Variant("qoe")))
            best = max(goodputs[scenario.name, variant].rate for variant in variants)
            references[scenario.name] = args.rate or (qoe.rate if qoe else best)
        latency = {
            (scenario.name, variant): pool.submit(
                simulate,
                scenario,
                variant,
                references[scenario.name],
                measured=effort.measured,
                warmup=effort.warmup,
                seed=args.seed,
            )
            for scenario in chosen
            for variant in variants
        }
        at_reference = {key: future.result() for key, future in latency.items()}
    print(
        f"pd-sidecar scheduling simulator (seed {args.seed}, {effort.measured} measured "
        f"requests per run after {effort.warmup} warm-up)"
    )
    failed = 0
    for scenario in chosen:
        rows = [goodputs[scenario.name, variant] for variant in variants]
        stats = [at_reference[scenario.name, variant] for variant in variants]
        print()
        print(f"== {scenario.describe()}")
        print(_goodput_table(scenario, variants, rows))
        print()
        print(
            f"At {references[scenario.name]:.1f} req/s (the qoe goodput) — prefill queue = "
            "requests queued or running on a prefill engine; max/mean = time-averaged longest "
            "queue / time-averaged mean queue:"
        )
        print(_latency_table(variants, stats))
        failed += _checks(scenario, goodputs, at_reference)
    runs = sum(len(g.runs) for g in goodputs.values()) + len(at_reference)
    print()
    print(f"{runs} runs in {time.perf_counter() - started:.0f} s ({args.jobs} worker(s))")
    return 1 if failed else 0


def _executor(jobs: int) -> Executor:
    return ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else _Inline()


class _Inline(Executor):
    """Runs each submission at once, in this process (``--jobs 1``, tests)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def _goodput_table(scenario: Scenario, variants: list[Variant], rows: list[Goodput]) -> str:
    by_label = {row.variant: row.rate for row in rows}
    rr = by_label.get(Variant("round_robin").label)
    ll = by_label.get(Variant("least_loaded").label)
    target = round(scenario.target_attainment * 100)
    lines = [
        f"Goodput: highest rate with >= {target} % of requests meeting TTFT <= "
        f"{scenario.ttft_slo_s:g} s ({scenario.long_ttft_slo_s:g} s over "
        f"{scenario.long_prompt_tokens} prompt tokens) and TPOT <= "
        f"{scenario.tpot_slo_s * 1000:g} ms",
        f"{'variant':<22}{'decider':<13}{'goodput req/s':>14}{'x round_robin':>15}"
        f"{'x least_loaded':>16}",
    ]
    for variant, row in zip(variants, rows, strict=True):
        lines.append(
            f"{variant.label:<22}{variant.mode:<13}{row.rate:>14.2f}"
            f"{_ratio(row.rate, rr):>15}{_ratio(row.rate, ll):>16}"
        )
    return "\n".join(lines)


def _latency_table(variants: list[Variant], stats: list[RunStats]) -> str:
    lines = [
        f"{'variant':<22}{'SLO %':>7}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
        f"{'remote %':>10}{'stall %':>9}{'queue mean':>12}{'max/mean':>10}"
    ]
    for variant, run in zip(variants, stats, strict=True):
        lines.append(
            f"{variant.label:<22}{run.attainment * 100:>7.1f}"
            f"{_ms(run.ttft_p50):>10}{_ms(run.ttft_p99):>8}{_ms(run.tpot_p50):>10}"
            f"{_ms(run.tpot_p99):>8}{run.remote_share * 100:>10.1f}"
            f"{run.local_prefill_share * 100:>9.1f}{run.queue_mean:>12.2f}"
            f"{_number(run.queue_max_over_mean):>10}"
        )
    lines.append("(latencies in ms; stall % = share of decode-engine time spent on local prefills)")
    return "\n".join(lines)


def _checks(
    scenario: Scenario,
    goodputs: dict[tuple[str, Variant], Goodput],
    at_reference: dict[tuple[str, Variant], RunStats],
) -> int:
    def rate(variant: Variant) -> float | None:
        found = goodputs.get((scenario.name, variant))
        return found.rate if found else None

    def ratio(variant: Variant) -> float | None:
        found = at_reference.get((scenario.name, variant))
        return found.queue_max_over_mean if found else None

    def at_least(variant: Variant, factor: float, text: str) -> tuple[str, bool | None]:
        """qoe's goodput >= factor x that of ``variant`` (strictly greater for factor 1)."""
        base = rate(variant)
        if qoe is None or base is None:
            return (text, None)
        ok = qoe > base if factor == 1 else qoe >= factor * base
        relation = "> " if factor == 1 else f">= {factor:g}x "
        shown = f" ({qoe / base:.2f}x)" if base else ""
        return (f"qoe goodput {relation}{text}{shown}", ok)

    qoe = rate(Variant("qoe"))
    checks: list[tuple[str, bool | None]] = []
    if scenario.name == "standard":
        checks.append(at_least(Variant("round_robin"), 1.3, "round_robin, same decider"))
        checks.append(
            at_least(Variant("round_robin", "always"), 1.3, "round_robin always (vLLM's proxy)")
        )
        checks.append(at_least(Variant("least_loaded"), 1.1, "least_loaded, same decider"))
        checks.append(at_least(Variant("qoe", "always"), 1, "qoe always"))
        checks.append(at_least(Variant("qoe", "never"), 1, "never (all local)"))
    if scenario.name == "wide":
        qoe_ratio, ll_ratio = ratio(Variant("qoe")), ratio(Variant("least_loaded"))
        checks.append(
            (f"qoe prefill queue max/mean <= 1.5 ({qoe_ratio or 0:.2f})", _le(qoe_ratio, 1.5))
        )
        checks.append(
            (f"least_loaded prefill queue max/mean >= 2 ({ll_ratio or 0:.2f})", _le(2.0, ll_ratio))
        )
    failed = 0
    for text, ok in checks:
        if ok is None:
            continue
        failed += not ok
        print(f"  [{'PASS' if ok else 'FAIL'}] {text}")
    return failed


def _le(low: float | None, high: float | None) -> bool | None:
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return None
    return low <= high


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def _ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1000:.0f}"


def _number(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
