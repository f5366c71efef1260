"""The scheduling simulator: goodput and latency of every policy on a modelled P/D cluster.

    python -m bench simulate                      # every scenario, seeds 1, 2, 3 (~6 minutes)
    python -m bench simulate --quick              # smaller runs, coarser search
    python -m bench simulate --scenario standard --policies qoe,round_robin:always,never
    python -m bench simulate --plain              # the first, idealised model
    python -m bench simulate --protocol --scenario shared-prompts   # the evaluation protocol

A variant is ``policy`` (conditional disaggregation, the production decider), ``policy:always``
(disaggregate every request) or ``never`` (every prefill on the local decode engine). Each
scenario runs its own variants (``--policies`` replaces them) and judges its own checks on every
seed; the exit status is 0 exactly when every check passed. A check whose variants did not run
fails (``--no-checks`` skips them all, and says so). See docs/scheduling.md for the model.

``--protocol`` runs the evaluation protocol instead (``bench.sim.protocol``): every variant
(default: ``qoe``, ``qoe:always`` and the two anchors) at each rate of a fixed grid of the
scenario's capacity, on seeds 1-5 (``--seeds``), and prints the curves and the ratios with their
paired confidence intervals; it judges no check.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from bench.sim import protocol
from bench.sim.anchors import ANCHORS
from bench.sim.checks import Outcome, Verdict
from bench.sim.goodput import LOWEST_RATE, Goodput, find_goodput
from bench.sim.run import RunStats, simulate
from bench.sim.scenario import (
    ANCHOR_VARIANTS,
    LEAST_LOADED,
    QOE,
    ROUND_ROBIN,
    Scenario,
    Variant,
)
from bench.sim.scenarios import SCENARIOS
from sidecar.scheduling.policies import POLICIES


@dataclass(frozen=True, slots=True)
class Effort:
    measured: int
    warmup: int
    precision: float


FULL = Effort(measured=6000, warmup=1000, precision=0.02)
QUICK = Effort(measured=1500, warmup=300, precision=0.06)


def parse_variant(text: str) -> Variant:
    """``policy``, ``policy:always``, ``policy:blind`` (no prefill prefix index),
    ``policy:exact`` (the exact index fed by KV events), ``never``, or an anchor's name
    (``sglang_cache_aware``, ``llm-d_pd_scorer``, ``llm-d_precise``). What-ifs, added as modes:
    ``sync=S`` (reservations shared by the coalesced design, a background sync every S
    seconds; ``eager``: a change synced at once when the last sync is ``S`` old), ``sampleN``
    (qoe compares N random candidates), ``topN`` (qoe draws its pick among
    the N lowest predicted TTFTs); e.g. ``qoe:always:sync=0.1:top2``."""
    if text == "never":
        return Variant("qoe", "never")
    if text in ANCHOR_VARIANTS:
        return ANCHOR_VARIANTS[text]
    policy, *modes = text.split(":")
    if policy not in POLICIES:
        choices = (*POLICIES, *ANCHORS)
        raise argparse.ArgumentTypeError(f"unknown policy {policy!r}; one of {choices}")
    what_ifs: dict[str, Any] = {}
    for mode in list(modes):
        for prefix, name, kind in (("sync=", "sync_s", float), ("sample", "choices", int)):
            if mode.startswith(prefix):
                what_ifs[name] = _positive(kind, mode.removeprefix(prefix), mode)
                modes.remove(mode)
        if mode.startswith("top"):
            what_ifs["among"] = _positive(int, mode.removeprefix("top"), mode)
            modes.remove(mode)
    if "eager" in modes:
        if "sync_s" not in what_ifs:
            raise argparse.ArgumentTypeError("'eager' is a mode of 'sync=S'")
        what_ifs["eager"] = True
        modes.remove("eager")
    unknown = set(modes) - {"conditional", "always", "blind", "exact"}
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown mode {', '.join(sorted(unknown))!r}; 'always', 'blind', 'exact', "
            "'sync=S', 'eager', 'sampleN', 'topN' or none"
        )
    if {"blind", "exact"} <= set(modes):
        raise argparse.ArgumentTypeError("a variant is 'blind' or 'exact', not both")
    always = "always" in modes
    return Variant(
        policy,
        "always" if always else "conditional",
        blind="blind" in modes,
        exact="exact" in modes,
        **what_ifs,
    )


def _positive(kind: type[float] | type[int], text: str, mode: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{mode!r}: a positive number after the mode's name")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench simulate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument(
        "--policies",
        type=lambda text: [parse_variant(part.strip()) for part in text.split(",") if part],
        help="comma-separated variants (qoe, round_robin:always, never, ...) instead of each "
        "scenario's own; what-ifs: qoe:sync=0.1 (coalesced sharing), :eager, :top2, :sample2",
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests, coarser search")
    parser.add_argument("--requests", type=int, help="measured requests per run")
    parser.add_argument(
        "--seeds",
        type=lambda text: [int(part) for part in text.split(",") if part],
        help="comma-separated workload seeds (default 1,2,3; with --protocol 1,2,3,4,5)",
    )
    parser.add_argument(
        "--protocol",
        action="store_true",
        help="the evaluation protocol: a fixed grid of rates, paired intervals over the seeds",
    )
    parser.add_argument(
        "--grid",
        type=lambda text: [float(part) for part in text.split(",") if part],
        help="with --protocol: rates as fractions of the scenario's capacity "
        "(default 0.2,0.4,0.6,0.8,1,1.2; --quick 0.4,0.8,1.2)",
    )
    parser.add_argument(
        "--runs-file",
        help="with --protocol: a file of runs kept between invocations; a run already in it (same "
        "scenario, variant, seed, rate and effort) is read instead of simulated. Runs of a "
        "variant whose code changed since are stale: use a new file",
    )
    parser.add_argument("--no-checks", action="store_true", help="judge no check (exit 0)")
    parser.add_argument(
        "--trace",
        help="a Mooncake-format trace (JSON lines: timestamp, input_length, output_length, "
        "hash_ids): runs the mooncake scenario, skipped without it",
    )
    model = parser.add_argument_group("the model (defaults: what production does)")
    model.add_argument("--plain", action="store_true", help="the first, idealised model: all below")
    model.add_argument(
        "--prefill-engines", type=int, help="prefill engines (default: the scenario's)"
    )
    model.add_argument(
        "--decode-engines",
        type=int,
        help="decode engines, one sidecar each (default: the scenario's)",
    )
    model.add_argument("--state", choices=["redis", "coalesced", "shared", "local"])
    model.add_argument(
        "--sync-s",
        type=float,
        help="with --state coalesced: seconds between a sidecar's background syncs (default 0.1)",
    )
    model.add_argument("--stale-mode", choices=["scrape", "delay"])
    model.add_argument("--staleness", type=float, help="scrape interval, seconds (default 1)")
    model.add_argument("--exact-tokens", action="store_true", help="sidecars see true counts")
    model.add_argument("--linear-prefill", action="store_true", help="no attention term")
    model.add_argument("--reserve-prompt", action="store_true", help="reserve whole prompts")
    model.add_argument("--ttft-ratio", type=float, help="the decider's ttft_ratio")
    model.add_argument("--stall-weight", type=float, help="what-if: the decider's stall_weight")
    model.add_argument("--choices", type=int, help="candidates qoe compares (default 8)")
    model.add_argument(
        "--redis-refresh", type=float, help="what-if: the Redis worker also syncs every S seconds"
    )
    model.add_argument("--bursty", action="store_true", help="gamma arrivals, CV 3")
    model.add_argument(
        "--retest-s", type=float, help="what-if: the planner's re-test interval (0: never)"
    )
    parser.add_argument(
        "--rate", type=float, help="reference rate for the latency table (default: qoe goodput)"
    )
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    return parser.parse_args(argv)


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    chosen = list(SCENARIOS.values()) if args.scenario == "all" else [SCENARIOS[args.scenario]]
    traced = [scenario for scenario in chosen if scenario.workload == "trace"]
    for scenario in traced:
        if args.trace is None:
            print(f"(scenario {scenario.name} skipped: it replays a trace, give --trace PATH)")
            chosen.remove(scenario)
        else:
            chosen[chosen.index(scenario)] = replace(scenario, trace_path=args.trace)
    changes: dict[str, Any] = {}
    if args.policies:
        changes["variants"] = tuple(args.policies)
    if args.staleness is not None:
        changes["staleness_s"] = args.staleness
    if args.bursty:
        changes["bursty"] = True
    if args.ttft_ratio is not None:
        changes["ttft_ratio"] = args.ttft_ratio
    if args.choices is not None:
        changes["choices"] = args.choices
    if args.stall_weight is not None:
        changes["stall_weight"] = args.stall_weight
    if args.redis_refresh is not None:
        changes["redis_refresh_s"] = args.redis_refresh
    if args.retest_s is not None:
        changes["retest_s"] = args.retest_s
    if args.sync_s is not None:
        if args.sync_s <= 0:
            raise SystemExit("--sync-s must be above 0")
        changes["sync_s"] = args.sync_s
    for name in ("prefill_engines", "decode_engines"):
        count = getattr(args, name)
        if count is not None:
            if count < 1:
                raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
            changes[name] = count
    if args.prefill_engines is not None:
        uneven = [scenario.name for scenario in chosen if scenario.prefill_speeds]
        if uneven:
            raise SystemExit(
                f"--prefill-engines: {', '.join(uneven)} set each prefill engine's speed"
            )
    plain: dict[str, Any] = {"state": "shared", "stale_mode": "delay"} if args.plain else {}
    for name, flag in (("state", args.state), ("stale_mode", args.stale_mode)):
        if flag:
            plain[name] = flag
    if args.exact_tokens or args.plain:
        changes["tokens"] = "exact"
    if args.linear_prefill or args.plain:
        changes["crossover_tokens"] = 0
    if args.reserve_prompt or args.plain:
        changes["reserve"] = "prompt"
    return [replace(scenario, **changes, **plain) for scenario in chosen]


def main_cli(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    effort = QUICK if args.quick else FULL
    if args.requests:
        effort = replace(effort, measured=args.requests, warmup=max(100, args.requests // 6))
    started = time.perf_counter()
    chosen = scenarios(args)
    if args.protocol:
        return _protocol(args, chosen, effort, started)
    seeds: list[int] = args.seeds or [1, 2, 3]
    keys = [
        (scenario.name, seed, variant)
        for scenario in chosen
        for seed in seeds
        for variant in scenario.variants
    ]
    by_name = {scenario.name: scenario for scenario in chosen}
    with _executor(args.jobs) as pool:
        searches = {
            key: pool.submit(
                find_goodput,
                by_name[key[0]],
                key[2],
                guess=by_name[key[0]].guess,
                measured=effort.measured,
                warmup=effort.warmup,
                seed=key[1],
                precision=effort.precision,
            )
            for key in keys
        }
        goodputs = {key: future.result() for key, future in searches.items()}
        references: dict[tuple[str, int], float] = {}
        for scenario in chosen:
            for seed in seeds:
                qoe = goodputs.get((scenario.name, seed, QOE))
                best = max(goodputs[scenario.name, seed, v].rate for v in scenario.variants)
                # qoe's goodput; the best variant's when qoe met the target at no rate tried;
                # the search's lowest rate when none did (a latency table at rate 0 is none).
                references[scenario.name, seed] = (
                    args.rate or (qoe.rate if qoe and qoe.rate > 0 else best) or LOWEST_RATE
                )
        latency = {
            key: pool.submit(
                simulate,
                by_name[key[0]],
                key[2],
                references[key[0], key[1]],
                measured=effort.measured,
                warmup=effort.warmup,
                seed=key[1],
            )
            for key in keys
        }
        at_reference = {key: future.result() for key, future in latency.items()}
    print(
        f"pd-sidecar scheduling simulator (seeds {', '.join(map(str, seeds))}; "
        f"{effort.measured} measured requests per run after {effort.warmup} warm-up; goodput "
        f"search precision {effort.precision * 100:g} %)"
    )
    verdicts: list[Verdict] = []
    for scenario in chosen:
        print()
        print(f"== {scenario.describe()}")
        print(_goodput_table(scenario, seeds, goodputs))
        for seed in seeds:
            print()
            print(
                f"seed {seed}, at {references[scenario.name, seed]:.1f} req/s (the qoe goodput) "
                "- prefill queue = requests queued or running on a prefill engine; max/mean = "
                "time-averaged longest queue / time-averaged mean queue:"
            )
            stats = [at_reference[scenario.name, seed, v] for v in scenario.variants]
            print(_latency_table(scenario.variants, stats))
            print(_slo_table(scenario.variants, stats))
            if scenario.workload != "mixed":
                print(_prefix_table(scenario.variants, stats))
        print()
        if args.no_checks:
            print("  checks not judged (--no-checks)")
            continue
        for seed in seeds:
            outcome = Outcome(
                {v: goodputs[scenario.name, seed, v].rate for v in scenario.variants},
                {
                    v: at_reference[scenario.name, seed, v].queue_max_over_mean
                    for v in scenario.variants
                },
            )
            for check in scenario.checks:
                verdict = check.judge(outcome)
                verdicts.append(verdict)
                print(f"  [{verdict.tag}] {scenario.name} seed {seed}: {verdict.text}")
    runs = sum(len(g.runs) for g in goodputs.values()) + len(at_reference)
    failed = sum(verdict.failed for verdict in verdicts)
    judged = sum(verdict.ok is not None for verdict in verdicts)
    print()
    print(f"{runs} runs in {time.perf_counter() - started:.0f} s ({args.jobs} worker(s))")
    if not args.no_checks:
        print(f"checks: {judged - failed} of {judged} passed" + (" - FAIL" if failed else ""))
    return 1 if failed else 0


def _protocol(
    args: argparse.Namespace, chosen: list[Scenario], effort: Effort, started: float
) -> int:
    seeds: list[int] = args.seeds or list(protocol.SEEDS)
    grid: list[float] = args.grid or list(protocol.QUICK_GRID if args.quick else protocol.GRID)
    print(
        f"pd-sidecar scheduling simulator, evaluation protocol (seeds "
        f"{', '.join(map(str, seeds))}; {effort.measured} measured requests per run after "
        f"{effort.warmup} warm-up)"
    )
    runs = 0
    with _executor(args.jobs) as pool:
        for scenario in chosen:
            scenario = replace(scenario, trace_windows=True)
            variants = list(args.policies or protocol.VARIANTS)
            nominal = protocol.capacity(scenario)
            rates = [fraction * nominal.rate for fraction in grid]
            kept = _kept_runs(args.runs_file)
            where = repr(replace(scenario, variants=(), checks=()))

            def stored(
                variant: Variant, seed: int, rate: float, where: str = where
            ) -> tuple[Any, ...]:
                return (where, variant, seed, rate, effort.measured, effort.warmup)

            futures = {
                (variant, seed, rate): pool.submit(
                    simulate,
                    scenario,
                    variant,
                    rate,
                    measured=effort.measured,
                    warmup=effort.warmup,
                    seed=seed,
                )
                for variant in variants
                for seed in seeds
                for rate in rates
                if stored(variant, seed, rate) not in kept
            }
            results = {key: future.result() for key, future in futures.items()}
            runs += len(results)
            if args.runs_file:
                kept.update({stored(*key): run for key, run in results.items()})
                with open(args.runs_file, "wb") as file:
                    pickle.dump(kept, file)
            results.update(
                {
                    (variant, seed, rate): kept[stored(variant, seed, rate)]
                    for variant in variants
                    for seed in seeds
                    for rate in rates
                    if (variant, seed, rate) not in results
                }
            )
            print()
            print(f"== {scenario.describe()}")
            print(protocol.report(scenario, variants, seeds, grid, nominal, results))
    print()
    print(
        f"{runs} runs in {time.perf_counter() - started:.0f} s ({args.jobs} worker(s))"
        + (f"; the others read from {args.runs_file}" if args.runs_file else "")
    )
    return 0


def _kept_runs(path: str | None) -> dict[tuple[Any, ...], RunStats]:
    """The runs a ``--runs-file`` holds (none: no file yet)."""
    if not path or not os.path.exists(path):
        return {}
    with open(path, "rb") as file:
        kept: dict[tuple[Any, ...], RunStats] = pickle.load(file)
    return kept


def _executor(jobs: int) -> Executor:
    return ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else _Inline()


class _Inline(Executor):
    """Runs each submission at once, in this process (``--jobs 1``, tests)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def _goodput_table(
    scenario: Scenario, seeds: list[int], goodputs: dict[tuple[str, int, Variant], Goodput]
) -> str:
    target = round(scenario.target_attainment * 100)
    lines = [
        f"Goodput (req/s): highest rate with >= {target} % of requests meeting TTFT <= "
        f"{scenario.ttft_slo_s:g} s ({scenario.long_ttft_slo_s:g} s over "
        f"{scenario.long_prompt_tokens} prompt tokens) and TPOT <= "
        f"{scenario.tpot_slo_s * 1000:g} ms; x = the ratio to round_robin / least_loaded "
        "behind the same decider",
        f"{'variant':<22}{'decider':<13}"
        + "".join(f"{f'seed {seed}':>10}{'x rr':>7}{'x ll':>7}" for seed in seeds),
    ]
    for variant in scenario.variants:
        row = f"{variant.label:<22}{variant.mode:<13}"
        for seed in seeds:
            rate = goodputs[scenario.name, seed, variant].rate
            rr = goodputs.get((scenario.name, seed, ROUND_ROBIN))
            ll = goodputs.get((scenario.name, seed, LEAST_LOADED))
            row += f"{rate:>10.2f}{_ratio(rate, rr)}{_ratio(rate, ll)}"
        lines.append(row)
    return "\n".join(lines)


def _latency_table(variants: Sequence[Variant], stats: list[RunStats]) -> str:
    lines = [
        f"{'variant':<22}{'SLO %':>7}{'TTFT %':>8}{'TPOT %':>8}{'TTFT mean':>11}{'p90':>7}"
        f"{'p99':>7}{'TPOT mean':>11}{'tail TBT':>10}{'p90':>7}{'remote %':>10}{'stall %':>9}"
        f"{'queue mean':>12}{'max/mean':>10}"
    ]
    for variant, run in zip(variants, stats, strict=True):
        lines.append(
            f"{variant.label:<22}{run.attainment * 100:>7.1f}{run.ttft_attainment * 100:>8.1f}"
            f"{run.tpot_attainment * 100:>8.1f}{_ms(run.ttft_mean):>11}{_ms(run.ttft_p90):>7}"
            f"{_ms(run.ttft_p99):>7}{_ms(run.tpot_mean):>11}{_ms(run.tail_tbt_mean):>10}"
            f"{_ms(run.tail_tbt_p90):>7}{run.remote_share * 100:>10.1f}"
            f"{run.local_prefill_share * 100:>9.1f}{run.queue_mean:>12.2f}"
            f"{_number(run.queue_max_over_mean):>10}"
        )
    lines.append(
        "(latencies in ms; TTFT % / TPOT % = requests meeting that SLO alone; tail TBT = mean of "
        "the longest 10 % of a request's inter-token gaps, Mooncake's; stall % = share of "
        "decode-engine time spent on local prefills)"
    )
    return "\n".join(lines)


def _slo_table(variants: Sequence[Variant], stats: list[RunStats]) -> str:
    """Each SLO set (``bench.sim.slos``): both bounds met / TTFT's / the decode one's, in %."""
    names = list(stats[0].slos)
    lines = [
        "SLO sets, % of requests meeting both / the TTFT bound / the decode bound (scaled: the "
        "scenario's; constant: DistServe-style; mooncake: TTFT 30 s and tail TBT):",
        f"{'variant':<22}" + "".join(f"{name:>20}" for name in names),
    ]
    for variant, run in zip(variants, stats, strict=True):
        cells = (
            f"{met.both * 100:.1f}/{met.ttft * 100:.1f}/{met.decode * 100:.1f}"
            for met in run.slos.values()
        )
        lines.append(f"{variant.label:<22}" + "".join(f"{cell:>20}" for cell in cells))
    return "\n".join(lines)


def _prefix_table(variants: Sequence[Variant], stats: list[RunStats]) -> str:
    lines = [
        "prefill prefix caches: hit % = share of the prompt tokens sent remote that the chosen "
        "engine held; off % = prefills whose predicted cached tokens were off what the engine "
        "found by more than 10 % of the prompt (over % = predicted more)",
        f"{'variant':<22}{'hit %':>7}{'off %':>7}{'over %':>8}",
    ]
    for variant, run in zip(variants, stats, strict=True):
        lines.append(
            f"{variant.label:<22}{run.prefill_hit_share * 100:>7.1f}"
            f"{run.prefix_wrong_share * 100:>7.1f}{run.prefix_over_share * 100:>8.1f}"
        )
    return "\n".join(lines)


def _ratio(value: float, base: Goodput | None) -> str:
    return f"{value / base.rate:>7.2f}" if base and base.rate else f"{'-':>7}"


def _ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1000:.0f}"


def _number(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main_cli())
