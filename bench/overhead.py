"""Overhead benchmark: the sidecar side by side with vllm-router, an aiohttp floor and no proxy.

    python -m bench overhead                 # the full matrix, 3 runs, medians (make bench)
    python -m bench overhead --runs 1        # one run
    python -m bench overhead --quick         # the CI smoke run: c=16, a few hundred requests
    python -m bench overhead --profile docs/profiles   # py-spy flame graphs at c=16 instead

Every request is a full P/D exchange on the same two zero-latency emulators and the same load
generator (``drive`` in bench/client.py): the **floor** (the client sends the prefill leg and the
decode leg itself), the **sidecar** (the client names the prefill in ``x-prefiller-host-port``), the
**aiohttp floor** (bench/floor_proxy.py: the smallest two-leg proxy on the same stack) and
**vllm-router** (Rust, from PyPI; skipped with a note when it cannot be installed). The proxy
under test has a core of its own (``taskset``); the emulators and the client share the other
(bench/contenders.py). For non-streaming and ``--output-tokens``-token streaming answers at each
``--concurrency``: a warm-up, then ``--requests`` requests timed by the client (throughput,
latency and time to first byte p50/p99) while the proxy's CPU seconds (from ``/proc/<pid>/stat``,
the primary figure: stable on a noisy machine), its peak RSS and the machine's CPU pressure are
read. Then the scheduler's own decision cost (bench/decision_cost.py). A table, the targets
with today's ratios, and a JSON report (``--json``).

Exit status 1 when a request failed or a variant could not start; figures are never judged.
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import orjson
from aiohttp import http_parser

from bench import decision_cost
from bench.client import Tally, Target, Workload, client_session, drive
from bench.cluster import BenchLauncher, add_launcher_arguments, raise_open_files_limit, run
from bench.contenders import (
    BASELINE_VARIANT,
    PYTHON_PROXIES,
    REPO,
    VARIANTS,
    Pinning,
    locate_router,
    runtime_checks,
    start_emulators,
    start_proxy,
)
from bench.overhead_report import Point, medians, table, target_lines, targets
from bench.profiling import profile
from bench.readings import cpu_pressure_us, load_average, own_cpu_s, read_proc
from devkit.processes import Child, LaunchError
from devkit.stats import percentile
from sidecar.scheduling.policies import POLICIES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench overhead",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of the matrix (medians)")
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per point")
    parser.add_argument(
        "--warmup",
        type=int,
        default=200,
        help="untimed requests before each point (at least 2 × c)",
    )
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (approx.)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    parser.add_argument("--modes", default="non-stream,stream", help="non-stream, stream or both")
    parser.add_argument(
        "--decision-iterations", type=int, default=2000, help="timed placements per scheduler case"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CI smoke: 1 run, c=16, 300 requests, 50 warm-up, 200 placements",
    )
    parser.add_argument("--json", type=Path, default=None, help="report path (default: log dir)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    parser.add_argument("--vllm-router", type=Path, default=None, help="the vllm-router program")
    parser.add_argument(
        "--no-install-router",
        action="store_true",
        help="do not install vllm-router into ~/.cache/pd-sidecar when it is missing",
    )
    parser.add_argument(
        "--router-policy",
        default="round_robin",
        help="vllm-router's --policy (its default, cache_aware, adds a render call to each engine)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"also measure the sidecar of the checkout DIR (e.g. a `git worktree` of main) as"
        f" the variant {BASELINE_VARIANT}, right before the sidecar in every run: before and"
        " after in one run",
    )
    add_launcher_arguments(parser)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="instead of measuring: py-spy flame graphs of the sidecar and the aiohttp floor"
        " at c=16 into DIR",
    )
    parser.add_argument("--profile-s", type=float, default=20.0, help="seconds per profile")
    parser.add_argument(
        "--profile-native",
        action="store_true",
        help="profiles with C frames too (uvloop, the C HTTP parser, the garbage collector)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.requests, args.warmup = 1, 300, 50
        args.concurrency, args.decision_iterations = "16", 200
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.variants = [v for v in args.variants.split(",") if v]
    args.modes = [m for m in args.modes.split(",") if m]
    if args.baseline is not None:
        if not (args.baseline / "sidecar" / "__main__.py").exists():
            parser.error(f"--baseline: {args.baseline} is not a checkout of the sidecar")
        at = args.variants.index("sidecar") if "sidecar" in args.variants else 0
        args.variants.insert(at, BASELINE_VARIANT)
    unknown = set(args.variants) - {*VARIANTS, BASELINE_VARIANT}
    if unknown or not set(args.modes) <= {"non-stream", "stream"}:
        parser.error(f"unknown variant or mode: {sorted(unknown) or args.modes}")
    if args.runs < 1 or args.requests < 1 or min(args.concurrency) < 1:
        parser.error("--runs, --requests and --concurrency must be positive")
    return args


def reset_peak_rss(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux ``clear_refs`` 5)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


async def measure_point(
    target: Target,
    workload: Workload,
    *,
    run_index: int,
    concurrency: int,
    args: argparse.Namespace,
    proxy: Child | None,
    emulators: tuple[Child, Child],
    next_index: list[int],
) -> Point:
    """Warm up, then time ``args.requests`` requests while reading the processes."""
    async with client_session(lean=True) as session:
        warm = Tally()
        warmup = max(args.warmup, 2 * concurrency)
        await drive(
            session, target, workload, count=warmup, concurrency=concurrency,
            first_index=next_index[0], stats=warm,
        )  # fmt: skip
        next_index[0] += warmup
        gc.collect()
        if proxy is not None:
            reset_peak_rss(proxy.pid)
        proxy_before = read_proc(proxy.pid).cpu_s if proxy is not None else 0.0
        client_before = own_cpu_s()
        emulators_before = sum(read_proc(e.pid).cpu_s for e in emulators)
        psi_before, start = cpu_pressure_us(), time.monotonic()
        stats = Tally()
        await drive(
            session, target, workload, count=args.requests, concurrency=concurrency,
            first_index=next_index[0], stats=stats,
        )  # fmt: skip
        next_index[0] += args.requests
        elapsed = time.monotonic() - start
        psi_after = cpu_pressure_us()
        client_cpu = own_cpu_s() - client_before
        emulators_cpu = sum(read_proc(e.pid).cpu_s for e in emulators) - emulators_before
        reading = read_proc(proxy.pid) if proxy is not None else None
    errors = Counter(warm.errors) + stats.errors
    for kind, example in {**warm.examples, **stats.examples}.items():
        print(f"    error {kind}: {example!r}")
    proxy_cpu = reading.cpu_s - proxy_before if reading is not None else None
    pressure = None
    if psi_before is not None and psi_after is not None and elapsed > 0:
        pressure = 100 * (psi_after - psi_before) / 1e6 / elapsed
    done = stats.ok
    return Point(
        run=run_index,
        variant=target.name,
        mode=workload.mode,
        concurrency=concurrency,
        requests=done,
        errors=dict(errors),
        elapsed_s=elapsed,
        throughput_rps=done / elapsed,
        latency_p50_ms=1000 * percentile(stats.latencies, 50),
        latency_p99_ms=1000 * percentile(stats.latencies, 99),
        ttfb_p50_ms=1000 * percentile(stats.ttfbs, 50),
        ttfb_p99_ms=1000 * percentile(stats.ttfbs, 99),
        cpu_s_per_1000=None if proxy_cpu is None or not done else 1000 * proxy_cpu / done,
        chunks_per_cpu_s=stats.events / proxy_cpu if workload.stream and proxy_cpu else None,
        peak_rss_mib=None if reading is None else reading.hwm / (1 << 20),
        proxy_core_pct=None if proxy_cpu is None else 100 * proxy_cpu / elapsed,
        client_core_pct=100 * (client_cpu + emulators_cpu) / elapsed,
        client_cpu_s_per_1000=1000 * client_cpu / max(done, 1),
        emulators_cpu_s_per_1000=1000 * emulators_cpu / max(done, 1),
        cpu_pressure_pct=pressure,
    )


def header_lines(pinning: Pinning, router_note: str) -> list[str]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "missing"

    commit = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    c_parser = http_parser.HttpResponseParser.__module__ == "aiohttp._http_parser"
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    return [
        f"pd-sidecar overhead benchmark, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, code {commit}",
        f"machine: {platform.node()}, {len(os.sched_getaffinity(0))} CPUs ({model}),"
        f" Linux {platform.release()}, load average {load_average()}",
        f"python {platform.python_version()}, aiohttp {version('aiohttp')},"
        f" uvloop {version('uvloop')}, orjson {version('orjson')}; {pinning.note}",
        f"client: aiohttp C parser {'yes' if c_parser else 'NO'}, event loop {loop}",
        router_note,
    ]


def _checks_line(child: Child) -> str:
    checks = runtime_checks(child)
    text = ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in checks.items())
    return f"  {child.name} pid {child.pid} at {child.url}: {text}"


async def main(args: argparse.Namespace) -> int:
    raise_open_files_limit()
    pinning = Pinning.choose(not args.no_pin)
    router: Path | None = None
    router_note = "vllm-router not asked for"
    if "vllm-router" in args.variants:
        router, router_note = await locate_router(args.vllm_router, not args.no_install_router)
    print("\n".join(header_lines(pinning, router_note)), flush=True)
    pinning.pin_self()
    sidecar_env = dict(item.split("=", 1) for item in args.sidecar_env)
    launcher = BenchLauncher(args.log_dir, prefix="pd-sidecar-overhead-")
    failures: list[str] = []
    points: list[Point] = []
    checks: dict[str, dict[str, bool]] = {}
    workloads = [
        Workload(mode == "stream", args.output_tokens, args.prompt_tokens) for mode in args.modes
    ]
    async with launcher:
        print(f"logs in {launcher.log_dir}")
        prefill, decode = await start_emulators(launcher, pinning)
        if args.profile is not None:
            return await profile(
                launcher, pinning, prefill, decode, args.profile, args.profile_s, sidecar_env,
                native=args.profile_native,
            )  # fmt: skip
        next_index = [0]
        variants = [v for v in args.variants if v != "vllm-router" or router is not None]
        for run_index in range(1, args.runs + 1):
            for variant in variants:
                try:
                    proxy, target = await start_proxy(
                        launcher, variant, pinning=pinning, prefill=prefill, decode=decode,
                        router=router, sidecar_env=sidecar_env, router_policy=args.router_policy,
                        baseline=args.baseline,
                    )  # fmt: skip
                except LaunchError as exc:
                    failures.append(f"{variant} could not start")
                    print(f"run {run_index}: {variant} could not start: {exc}")
                    continue
                if proxy is not None and variant in PYTHON_PROXIES:
                    print(_checks_line(proxy), flush=True)
                    checks[variant] = runtime_checks(proxy)
                try:
                    for workload in workloads:
                        for concurrency in args.concurrency:
                            point = await measure_point(
                                target, workload, run_index=run_index, concurrency=concurrency,
                                args=args, proxy=proxy, emulators=(prefill, decode),
                                next_index=next_index,
                            )  # fmt: skip
                            points.append(point)
                            print(_progress(point), flush=True)
                finally:
                    if proxy is not None:
                        await proxy.stop(5)
        decisions = await decision_cost.measure(
            args.decision_iterations,
            ["qoe", "round_robin"] if args.quick else list(POLICIES),
        )
    rows = medians(points)
    stream_mode = Workload(True, args.output_tokens, args.prompt_tokens).mode
    found = targets(rows, stream_mode)
    print()
    print(
        f"medians of {args.runs} run(s); {args.requests} timed requests per point; latencies in"
        " ms, +p50/+p99 over the floor, cpu/1k = proxy CPU seconds per 1000 requests, rss = peak"
        " MiB, proxy% / client% = % of one core (proxy; client + emulators), psi% = machine CPU"
        " pressure"
    )
    print("\n".join(table(rows)))
    print()
    print("\n".join(decision_cost.report(decisions)))
    print("\n".join(target_lines(found)))
    errors = sum(sum(p.errors.values()) for p in points)
    if errors:
        failures.append(f"{errors} failed requests")
    report = {
        "header": header_lines(pinning, router_note),
        "arguments": {k: str(v) for k, v in vars(args).items()},
        "runtime_checks": checks,
        "rows": [row.as_json() for row in rows],
        "points": [asdict(point) for point in points],
        "decisions": decisions,
        "targets": found,
        "failures": failures,
    }
    path = args.json or launcher.log_dir / "overhead.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"\nJSON report: {path}")
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    return 0


def _progress(point: Point) -> str:
    cpu = "—" if point.cpu_s_per_1000 is None else f"{point.cpu_s_per_1000:.3f}"
    errors = sum(point.errors.values())
    return (
        f"run {point.run} {point.variant:<13} {point.mode:<10} c={point.concurrency:<4}"
        f" {point.throughput_rps:7.0f} req/s  p50 {point.latency_p50_ms:6.2f} ms"
        f"  p99 {point.latency_p99_ms:7.2f} ms  cpu/1k {cpu}"
        f"  psi {point.cpu_pressure_pct or 0:3.0f}%" + (f"  ERRORS {errors}" if errors else "")
    )


def main_cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("taskset") is None and not args.no_pin:
        print("note: taskset not found; processes are not pinned")
    return run(lambda: main(args))


if __name__ == "__main__":
    sys.exit(main_cli())
