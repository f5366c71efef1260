"""The streaming ceiling: tokens relayed per CPU-second of each proxy, on one core of its own.

    python bench/ceiling.py                        # 256 streams of 512 tokens, 5 rounds
    python bench/ceiling.py --rounds 3 --requests 512
    python bench/ceiling.py --baseline ../base     # main's sidecar as sidecar-base, interleaved

The overhead benchmark's processes (bench/contenders.py: two zero-latency emulators and the client
on one core, the proxy under test alone on the other) and its measured point
(``measure_point`` of bench/overhead.py: a warm-up, then ``--requests`` timed requests while the
proxy's CPU seconds are read from ``/proc/<pid>/stat``), with one workload: ``--concurrency``
(256) streams of ``--output-tokens`` (512) tokens at once, back to back. The figure is **tokens
relayed per CPU-second of the proxy** — what one core busy with nothing else would relay — for
the sidecar, the aiohttp floor (bench/floor_proxy.py) and vllm-router, and its ratio to the
floor's. The variants are interleaved: every round starts each proxy in turn (the order rotated
by one each round), so a change of the machine's load touches them all alike; the report holds
the median of the rounds, each round's figure, the CPU pressure and the load average.

With no delay in the emulator, the decode engine writes its events as fast as its core allows
and a proxy reads several of them per socket read: the figure is a ceiling for this event size
and write pattern, not a per-event cost. Exit status 1 when a request failed or a variant could
not start; figures are never judged. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from bench.client import Workload
from bench.cluster import BenchLauncher, add_launcher_arguments, raise_open_files_limit, run
from bench.contenders import (
    BASELINE_VARIANT,
    PYTHON_PROXIES,
    Pinning,
    locate_router,
    runtime_checks,
    start_emulators,
    start_proxy,
)
from bench.overhead import header_lines, measure_point
from bench.overhead_report import Point
from bench.readings import io_syscalls, load_average
from devkit.processes import LaunchError

PROXIES = ("sidecar", "aiohttp-floor", "vllm-router")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    parser.add_argument("--requests", type=int, default=1024, help="timed streams per point")
    parser.add_argument(
        "--warmup", type=int, default=256, help="untimed streams before each point (≥ c)"
    )
    parser.add_argument("--concurrency", type=int, default=256, help="streams open at once")
    parser.add_argument("--output-tokens", type=int, default=512, help="tokens per stream")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (approx.)")
    parser.add_argument(
        "--variants", default=",".join(PROXIES), help=f"comma-separated, of {', '.join(PROXIES)}"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"also measure the sidecar of the checkout DIR as {BASELINE_VARIANT}",
    )
    parser.add_argument("--json", type=Path, default=None, help="report path (default: log dir)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--vllm-router", type=Path, default=None, help="the vllm-router program")
    parser.add_argument(
        "--no-install-router",
        action="store_true",
        help="do not install vllm-router into ~/.cache/pd-sidecar when it is missing",
    )
    parser.add_argument("--router-policy", default="round_robin", help="vllm-router's --policy")
    add_launcher_arguments(parser)
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if args.baseline is not None:
        if not (args.baseline / "sidecar" / "__main__.py").exists():
            parser.error(f"--baseline: {args.baseline} is not a checkout of the sidecar")
        args.variants.insert(0, BASELINE_VARIANT)
    unknown = set(args.variants) - {*PROXIES, BASELINE_VARIANT}
    if unknown:
        parser.error(f"unknown variant: {sorted(unknown)}")
    if min(args.rounds, args.requests, args.concurrency, args.output_tokens) < 1:
        parser.error("--rounds, --requests, --concurrency and --output-tokens must be positive")
    return args


def tokens_per_cpu_s(point: Point, output_tokens: int) -> float | None:
    """Tokens relayed per CPU-second of the proxy over the timed streams of ``point``."""
    if point.cpu_s_per_1000 is None or point.cpu_s_per_1000 <= 0:
        return None
    return 1000 * output_tokens / point.cpu_s_per_1000


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def report(
    points: list[Point],
    variants: list[str],
    output_tokens: int,
    syscalls: dict[tuple[str, int], tuple[float, float]],
) -> list[str]:
    """The table of medians over the rounds, the ratios to the aiohttp floor, and the proxies'
    reads and writes per stream (how many chunks the zero-latency emulator's events came in:
    the fewer, the cheaper a token)."""
    per_variant: dict[str, dict[str, float | None]] = {}
    lines = [
        f"  {'variant':<14}{'tokens/cpu-s':>13}{'per round':>40}{'tokens/s':>10}"
        f"{'proxy%':>7}{'client%':>8}{'rss':>6}{'psi%':>5}  errors"
    ]
    for variant in variants:
        mine = [p for p in points if p.variant == variant]
        rates = [r for p in mine if (r := tokens_per_cpu_s(p, output_tokens)) is not None]
        figures = {
            "tokens_per_cpu_s": _median(rates),
            "tokens_per_s": _median([p.throughput_rps * output_tokens for p in mine]),
            "proxy_core_pct": _median([p.proxy_core_pct for p in mine if p.proxy_core_pct]),
            "client_core_pct": _median([p.client_core_pct for p in mine]),
            "peak_rss_mib": _median([p.peak_rss_mib for p in mine if p.peak_rss_mib]),
            "cpu_pressure_pct": _median(
                [p.cpu_pressure_pct for p in mine if p.cpu_pressure_pct is not None]
            ),
        }
        per_variant[variant] = figures
        errors = sum(sum(p.errors.values()) for p in mine)
        rounds = " ".join(f"{r:,.0f}" for r in rates)
        lines.append(
            f"  {variant:<14}{_num(figures['tokens_per_cpu_s']):>13}{rounds:>40}"
            f"{_num(figures['tokens_per_s']):>10}{_num(figures['proxy_core_pct']):>7}"
            f"{_num(figures['client_core_pct']):>8}{_num(figures['peak_rss_mib']):>6}"
            f"{_num(figures['cpu_pressure_pct']):>5}  {errors or ''}"
        )
    lines.append("")
    lines.append("  system calls per stream (warm-up and timed; median of the rounds):")
    for variant in variants:
        counts = [v for (name, _), v in syscalls.items() if name == variant]
        if counts:
            reads = statistics.median(r for r, _ in counts)
            writes = statistics.median(w for _, w in counts)
            lines.append(f"    {variant:<14} reads {reads:7.1f}  writes {writes:7.1f}")
    floor = per_variant.get("aiohttp-floor", {}).get("tokens_per_cpu_s")
    lines.append("")
    for variant, figures in per_variant.items():
        rate = figures["tokens_per_cpu_s"]
        if variant != "aiohttp-floor" and rate is not None and floor:
            lines.append(f"  {variant} / aiohttp-floor: {rate / floor:.2f}×")
    side = per_variant.get("sidecar", {}).get("tokens_per_cpu_s")
    if side is not None and floor:
        verdict = "met" if side / floor >= 0.9 else "MISSED"
        lines.append(f"  [{verdict}] sidecar ≥ 0.9× the aiohttp floor's tokens per CPU-second")
    return lines


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


async def main(args: argparse.Namespace) -> int:
    raise_open_files_limit()
    pinning = Pinning.choose(not args.no_pin)
    router: Path | None = None
    router_note = "vllm-router not asked for"
    if "vllm-router" in args.variants:
        router, router_note = await locate_router(args.vllm_router, not args.no_install_router)
    print("\n".join(header_lines(pinning, router_note)), flush=True)
    print(
        f"streaming ceiling: {args.concurrency} streams of {args.output_tokens} tokens at once,"
        f" {args.requests} timed streams per point, {args.rounds} interleaved rounds",
        flush=True,
    )
    pinning.pin_self()
    sidecar_env = dict(item.split("=", 1) for item in args.sidecar_env)
    launcher = BenchLauncher(args.log_dir, prefix="pd-sidecar-ceiling-")
    workload = Workload(True, args.output_tokens, args.prompt_tokens)
    variants = [v for v in args.variants if v != "vllm-router" or router is not None]
    points: list[Point] = []
    failures: list[str] = []
    loads: list[str] = []
    syscalls: dict[tuple[str, int], tuple[float, float]] = {}
    """Read and write system calls of the proxy per stream (warm-up and timed), by round."""
    async with launcher:
        print(f"logs in {launcher.log_dir}")
        prefill, decode = await start_emulators(launcher, pinning)
        next_index = [0]
        for round_index in range(1, args.rounds + 1):
            shift = (round_index - 1) % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                try:
                    proxy, target = await start_proxy(
                        launcher, variant, pinning=pinning, prefill=prefill, decode=decode,
                        router=router, sidecar_env=sidecar_env, router_policy=args.router_policy,
                        baseline=args.baseline,
                    )  # fmt: skip
                except LaunchError as exc:
                    failures.append(f"{variant} could not start")
                    print(f"round {round_index}: {variant} could not start: {exc}")
                    continue
                if proxy is not None and variant in PYTHON_PROXIES and round_index == 1:
                    checks = ", ".join(
                        f"{name} {'yes' if ok else 'NO'}"
                        for name, ok in runtime_checks(proxy).items()
                    )
                    print(f"  {variant}: {checks}", flush=True)
                io_before = io_syscalls(proxy.pid) if proxy is not None else (0, 0)
                try:
                    point = await measure_point(
                        target, workload, run_index=round_index, concurrency=args.concurrency,
                        args=args, proxy=proxy, emulators=(prefill, decode),
                        next_index=next_index,
                    )  # fmt: skip
                    io_after = io_syscalls(proxy.pid) if proxy is not None else (0, 0)
                finally:
                    if proxy is not None:
                        await proxy.stop(5)
                points.append(point)
                streams = max(args.warmup, 2 * args.concurrency) + args.requests
                if proxy is not None:
                    reads, writes = io_after[0] - io_before[0], io_after[1] - io_before[1]
                    syscalls[(variant, round_index)] = (reads / streams, writes / streams)
                rate = tokens_per_cpu_s(point, args.output_tokens)
                errors = sum(point.errors.values())
                print(
                    f"round {round_index} {variant:<13} {_num(rate):>10} tokens/cpu-s"
                    f"  {point.throughput_rps * args.output_tokens:9,.0f} tokens/s"
                    f"  proxy {point.proxy_core_pct or 0:3.0f}%  psi"
                    f" {point.cpu_pressure_pct or 0:3.0f}%  load {load_average()}"
                    + (f"  ERRORS {errors}" if errors else ""),
                    flush=True,
                )
            loads.append(load_average())
    lines = report(points, variants, args.output_tokens, syscalls)
    print()
    print(
        f"medians of {args.rounds} round(s): tokens/cpu-s = tokens relayed per CPU-second of the"
        " proxy; tokens/s = wall-clock rate; proxy% / client% = % of one core (proxy; client +"
        " emulators); rss = peak MiB; psi% = machine CPU pressure"
    )
    print("\n".join(lines))
    print(f"load average after each round: {'; '.join(loads)}")
    errors = sum(sum(p.errors.values()) for p in points)
    if errors:
        failures.append(f"{errors} failed requests")
    path = args.json or launcher.log_dir / "ceiling.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        orjson.dumps(
            {
                "header": header_lines(pinning, router_note),
                "arguments": {k: str(v) for k, v in vars(args).items()},
                "points": [
                    {**_asdict(p), "tokens_per_cpu_s": tokens_per_cpu_s(p, args.output_tokens)}
                    for p in points
                ],
                "report": lines,
                "load_averages": loads,
                "syscalls_per_stream": {f"{v} {r}": list(c) for (v, r), c in syscalls.items()},
                "failures": failures,
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    print(f"\nJSON report: {path}")
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    return 0


def _asdict(point: Point) -> dict[str, object]:
    return {name: getattr(point, name) for name in Point.__dataclass_fields__}


def main_cli(argv: list[str] | None = None) -> int:
    return run(lambda: main(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main_cli())
