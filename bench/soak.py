"""Soak benchmark: a steady moderate load for a long time; the sidecar must not grow.

    python -m bench soak                      # 10 minutes, 150 streams
    python -m bench soak --duration 120       # a short one
    python -m bench soak --quick              # 20 s, 30 streams; RSS growth not judged

Same processes as bench/load.py. ``--concurrency`` loops send streaming requests back to back for
``--duration`` seconds: most are full P/D requests (``x-prefiller-host-port``), ``--local-fraction``
have no prefill header (the sidecar has no prefill pool, so they decode locally), and
``--disconnect-fraction`` are abandoned by the client at a random moment (during the prefill, the
KV transfer or the stream, or never when the moment comes after the end).

Every ``--sample-s`` the sidecar's RSS (``/proc``), asyncio tasks (``pd_sidecar_asyncio_tasks``)
and open fds are printed. Verdict:

- RSS growth between the reference sample and the last sample under load stays within
  ``--rss-growth-pct`` or ``--rss-growth-mib``, whichever is larger. The reference is the first
  sample after ``--warmup-s`` at which the scheduler's prefix index (an LRU of prompt-block
  hashes, ``SIDECAR_PREFIX_CACHE_BLOCKS`` = 65,536 by default; 17-22 MiB when full) is full:
  until then it grows with every distinct prompt, by design (column ``prefix``);
- after the load, once idle for ``--settle-s`` (idle engine connections close 30-60 s after their
  last use, except the decode pool the pollers keep alive; staged KV of abandoned requests
  expires after the emulator's ``--kv-expiry-s``, 30 s): tasks and fds back to the idle baseline
  taken before the load, nothing in flight, no KV block staged;
- no request failed except the ones the client abandoned on purpose.

Exit status 0 when all of that holds, 1 otherwise. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

from bench.client import (
    ClientStats,
    RequestSpec,
    client_session,
    run_workers,
    stream_one,
    wait_until,
)
from bench.cluster import (
    FD_SLACK,
    TASK_SLACK,
    Cluster,
    ClusterConfig,
    add_cluster_arguments,
    raise_open_files_limit,
    run,
)
from bench.readings import (
    Contention,
    SidecarReading,
    load_average,
    mib,
    ms,
    read_proc,
)
from bench.suite import add_quick, apply_quick
from devkit.stats import (
    percentile,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench soak",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=150, help="streams held open")
    parser.add_argument("--output-tokens", type=int, default=50, help="tokens per answer")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=256,
        help="prompt length (approx.; longer prompts fill the prefix index sooner)",
    )
    parser.add_argument(
        "--decode-s-per-token", type=float, default=0.1, help="decode emulator delay per token"
    )
    parser.add_argument(
        "--local-fraction", type=float, default=0.2, help="requests without a prefill header"
    )
    parser.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.1,
        help="requests the client abandons at a random moment",
    )
    parser.add_argument("--ramp-s", type=float, default=10.0, help="time to reach concurrency")
    parser.add_argument(
        "--warmup-s", type=float, default=60.0, help="load before the reference sample"
    )
    parser.add_argument("--sample-s", type=float, default=30.0, help="sampling period")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=65.0,
        help="idle wait before the final reading (idle engine connections are closed 30 to 60 s "
        "after their last use, unclaimed KV expires after 30 s)",
    )
    parser.add_argument("--rss-growth-pct", type=float, default=10.0, help="allowed RSS growth")
    parser.add_argument(
        "--rss-growth-mib", type=float, default=5.0, help="allowed RSS growth, absolute"
    )
    parser.add_argument("--timeout-s", type=float, default=None, help="per-request limit")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload's choices")
    add_cluster_arguments(parser)
    add_quick(parser, "20 s of 30 streams, RSS growth not judged, the leaks are")
    args = parser.parse_args(argv)
    apply_quick(
        parser, args, duration=20.0, concurrency=30, output_tokens=10, decode_s_per_token=0.05,
        ramp_s=1.0, warmup_s=5.0, sample_s=3.0, settle_s=5.0,
    )  # fmt: skip
    if args.timeout_s is None:
        args.timeout_s = 3 * args.output_tokens * args.decode_s_per_token + 60
    if args.warmup_s >= args.duration:
        parser.error("--warmup-s must be shorter than --duration")
    return args


@dataclass(frozen=True, slots=True)
class Row:
    t: float
    reading: SidecarReading
    open_streams: int
    finished: int
    errors: int
    aborted: int
    prefix_blocks: int


def print_header() -> None:
    print(
        f"{'t (s)':>7} {'RSS':>10} {'VmHWM':>10} {'tasks':>6} {'fds':>6} {'inflight':>8}"
        f" {'open':>5} {'done':>7} {'aborted':>7} {'errors':>6} {'prefix':>7}",
        flush=True,
    )


def print_row(row: Row) -> None:
    r = row.reading
    print(
        f"{row.t:7.0f} {mib(r.proc.rss):>10} {mib(r.proc.hwm):>10} {r.tasks:6.0f}"
        f" {r.proc.fds:6d} {r.inflight:8.0f} {row.open_streams:5d} {row.finished:7d}"
        f" {row.aborted:7d} {row.errors:6d} {row.prefix_blocks:7d}",
        flush=True,
    )


async def sampler(
    cluster: Cluster, stats: ClientStats, rows: list[Row], start: float, period_s: float
) -> None:
    while True:
        await asyncio.sleep(period_s)
        reading = await cluster.read_sidecar()
        row = Row(
            time.monotonic() - start,
            reading,
            stats.open_streams,
            stats.finished,
            stats.error_count,
            stats.aborted,
            await cluster.prefix_index_blocks(),
        )
        rows.append(row)
        print_row(row)


async def main(args: argparse.Namespace) -> int:
    nofile = raise_open_files_limit()
    rng = random.Random(args.seed)
    config = ClusterConfig.from_args(args, decode_s_per_token=args.decode_s_per_token)
    stream_s = args.output_tokens * args.decode_s_per_token
    print(
        f"pd-sidecar soak: {args.duration:.0f} s, {args.concurrency} concurrent streams,"
        f" {args.output_tokens} tokens x {args.decode_s_per_token * 1000:.0f} ms,"
        f" {args.local_fraction:.0%} local-only, {args.disconnect_fraction:.0%} abandoned"
    )
    print(f"open-files limit {nofile}, load average before start {load_average()}")
    async with Cluster(config) as cluster:
        print(
            f"processes: prefill pid {cluster.prefill.pid}, decode pid {cluster.decode.pid},"
            f" sidecar pid {cluster.sidecar.pid} {cluster.sidecar.url}; logs in {cluster.log_dir}"
        )
        baseline = await cluster.read_sidecar()
        stats = ClientStats()
        rows: list[Row] = []
        issued = 0
        start = time.monotonic()
        deadline = start + args.duration
        prefill = cluster.prefill.endpoint

        def next_spec() -> RequestSpec | None:
            nonlocal issued
            if time.monotonic() >= deadline:
                return None
            issued += 1
            abort = rng.random() < args.disconnect_fraction
            return RequestSpec(
                index=issued,
                chat=rng.random() < 0.5,
                output_tokens=args.output_tokens,
                prompt_tokens=args.prompt_tokens,
                prefill=None if rng.random() < args.local_fraction else prefill,
                timeout_s=args.timeout_s,
                abort_after_s=rng.uniform(0.0, 1.2 * stream_s) if abort else None,
            )

        print_header()
        print_row(Row(0.0, baseline, 0, 0, 0, 0, await cluster.prefix_index_blocks()))
        contention = Contention()
        contention.start()
        sampling = asyncio.create_task(sampler(cluster, stats, rows, start, args.sample_s))
        try:
            async with client_session() as session:
                await run_workers(
                    args.concurrency,
                    args.ramp_s,
                    next_spec,
                    lambda spec: stream_one(session, cluster.sidecar.url, spec, stats),
                )
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
            await contention.stop()
        elapsed = time.monotonic() - start
        drained = await cluster.read_sidecar()
        prefix = await cluster.prefix_index_blocks()
        print_row(
            Row(elapsed, drained, 0, stats.finished, stats.error_count, stats.aborted, prefix)
        )
        print(f"load over after {elapsed:.0f} s; idle for {args.settle_s:.0f} s")

        async def sidecar_idle() -> bool:
            return (await cluster.read_sidecar()).inflight == 0

        await wait_until(sidecar_idle, 30.0)
        await asyncio.sleep(args.settle_s)
        idle = await cluster.read_sidecar()
        sockets = cluster.sidecar_sockets()
        socket_problems = cluster.idle_socket_problems(sockets)
        pool_bound = cluster.decode_pool_bound()
        prefix = await cluster.prefix_index_blocks()
        print_row(
            Row(time.monotonic() - start, idle, 0, stats.finished, stats.error_count, 0, prefix)
        )
        capacity = cluster.prefix_index_capacity()
        debug_inflight = len(await cluster.debug_inflight())
        kv = await cluster.kv_state()
        decode_kv = await cluster.get_json(cluster.decode.url + "/emulator/kv")
        metrics = await cluster.sidecar_metrics()
        problems = cluster.log_problems()
        end_hwm = read_proc(cluster.sidecar.pid).hwm

    # Verdict.
    # The reference sample: after the warm-up, and once the prefix index (the one structure
    # that grows with distinct prompts) is full; growth before that is the index filling up.
    full = [row for row in rows if row.t >= args.warmup_s and row.prefix_blocks >= capacity]
    warm = full or [row for row in rows if row.t >= args.warmup_s]
    failures: list[str] = []
    print()
    print("=== pd-sidecar soak: summary ===")
    print(
        f"requests              {stats.finished} finished, {stats.ok} complete,"
        f" {stats.aborted} abandoned by the client, {stats.error_count} errors"
        f" {dict(stats.errors) or ''}"
    )
    for kind, example in stats.examples.items():
        print(f"  e.g. {kind}: {example!r}")
    print(
        f"throughput            {stats.finished / elapsed:.1f} req/s; max streams open at once"
        f" {stats.max_open_streams}"
    )
    print(
        f"client TTFT           p50 {ms(percentile(stats.ttfbs, 50))},"
        f" p99 {ms(percentile(stats.ttfbs, 99))}"
    )
    outcomes = metrics.by_label("pd_sidecar_requests_total", "decision", "outcome")
    print(
        "sidecar outcomes      "
        + ", ".join(f"{d}/{o} {v:.0f}" for (d, o), v in sorted(outcomes.items()))
        + f"; fallbacks {metrics.value('pd_sidecar_fallbacks_total'):.0f}"
    )
    if len(warm) >= 2:
        first, last = warm[0], warm[-1]
        growth = last.reading.proc.rss - first.reading.proc.rss
        allowed = max(
            first.reading.proc.rss * args.rss_growth_pct / 100, args.rss_growth_mib * (1 << 20)
        )
        slope = _slope_mib_per_min([(r.t, r.reading.proc.rss) for r in warm])
        print(
            f"RSS under load        {mib(first.reading.proc.rss)} at t={first.t:.0f}s ->"
            f" {mib(last.reading.proc.rss)} at t={last.t:.0f}s: {growth / (1 << 20):+.1f} MiB"
            f" (allowed {mib(allowed)}); trend {slope:+.2f} MiB/min; peak {mib(end_hwm)}"
        )
        print(
            f"tasks under load      {first.reading.tasks:.0f} -> {last.reading.tasks:.0f};"
            f" fds {first.reading.proc.fds} -> {last.reading.proc.fds}"
        )
        if not full:
            print(
                f"note: the prefix index never filled ({warm[-1].prefix_blocks} of {capacity}"
                " blocks): RSS growth includes it filling (17-22 MiB when full); lengthen"
                " --duration or --prompt-tokens, or lower SIDECAR_PREFIX_CACHE_BLOCKS"
            )
        if growth > allowed and not args.quick:
            failures.append(f"RSS grew {growth / (1 << 20):.1f} MiB under load")
    else:
        failures.append("not enough samples after the warm-up (lower --sample-s)")
    print(
        f"idle before/after     RSS {mib(baseline.proc.rss)} -> {mib(idle.proc.rss)},"
        f" tasks {baseline.tasks:.0f} -> {idle.tasks:.0f},"
        f" fds {baseline.proc.fds} -> {idle.proc.fds}"
    )
    print(
        f"leaks                 inflight gauge {idle.inflight:.0f}, /debug inflight"
        f" {debug_inflight}, prefill staged_blocks {kv['staged_blocks']}"
        f" (pulled {kv['pulled_total']}, expired {kv['expired_total']},"
        f" rejected {kv['rejected_pulls_total']}); decode failed pulls"
        f" {decode_kv['failed_pulls_total']}"
    )
    print(
        f"idle sidecar sockets  {dict(sorted(sockets.items())) or 'none'}"
        f" (idle decode connections kept alive by the pollers: at most {pool_bound})"
    )
    print(f"log warnings/errors   {problems}")
    print(f"machine               {contention.describe()}; load average {load_average()}")
    if stats.error_count:
        failures.append(f"{stats.error_count} client errors")
    if idle.inflight:
        failures.append(f"pd_sidecar_inflight_requests {idle.inflight:.0f}")
    if debug_inflight:
        failures.append(f"/debug/requests lists {debug_inflight} in flight")
    if kv["staged_blocks"] != 0:
        failures.append(f"{kv['staged_blocks']} KV blocks left staged")
    if idle.tasks > baseline.tasks + TASK_SLACK:
        failures.append(f"idle asyncio tasks {baseline.tasks:.0f} -> {idle.tasks:.0f}")
    decode_idle = sockets["decode ESTABLISHED"]
    if idle.proc.fds > baseline.proc.fds + decode_idle + FD_SLACK:
        failures.append(f"idle open fds {baseline.proc.fds} -> {idle.proc.fds}")
    failures.extend(socket_problems)
    print("verdict               " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return 1 if failures else 0


def _slope_mib_per_min(points: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS over time, MiB per minute."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 60 / (1 << 20)


def main_cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run(lambda: main(args))


if __name__ == "__main__":
    sys.exit(main_cli())
