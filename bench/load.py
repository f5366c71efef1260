"""Load benchmark: hold many concurrent streaming P/D requests through one sidecar.

    python -m bench load                                   # 1000 streams, 3000 requests
    python -m bench load --concurrency 200 --requests 600  # a quick look
    python -m bench load --quick                           # 50 streams, 150 requests, judged

Starts a prefill emulator, a decode emulator (with a per-token delay, so that streams are long-lived
and really concurrent) and a sidecar as subprocesses on free loopback ports (bench/cluster.py),
warms up, then ramps to ``--concurrency`` streaming requests (half completions, half chat
completions, every one with the ``x-prefiller-host-port`` header, so each is a full prefill +
KV transfer + decode) and keeps that many open until ``--requests`` were sent. Every answer must
be a 200 event stream with all its tokens and ``data: [DONE]`` last.

Afterwards the sidecar must have no request in flight (``pd_sidecar_inflight_requests``,
``/debug/requests``), the prefill emulator no staged KV block, and once idle keep-alive connections
expired (``--settle-s``), the sidecar's asyncio tasks and open fds must be back to their baseline.
Exit status: 0 when all of that holds, 1 otherwise. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp

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
    Metrics,
    ProcReading,
    SidecarReading,
    load_average,
    mib,
    ms,
    own_cpu_s,
    read_proc,
)
from bench.suite import add_quick, apply_quick
from devkit.stats import (
    percentile,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench load",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--concurrency", type=int, default=1000, help="streams held open")
    parser.add_argument("--requests", type=int, default=3000, help="requests sent in total")
    parser.add_argument("--output-tokens", type=int, default=100, help="tokens per answer")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (approx.)")
    parser.add_argument(
        "--decode-s-per-token", type=float, default=0.2, help="decode emulator delay per token"
    )
    parser.add_argument("--ramp-s", type=float, default=10.0, help="time to reach concurrency")
    parser.add_argument("--warmup", type=int, default=20, help="requests before the baseline")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="per-request limit (default: 3 x the ideal stream time + 60 s)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=65.0,
        help="idle wait before the final reading (idle engine connections are closed 30 to 60 s "
        "after their last use)",
    )
    parser.add_argument(
        "--fill-prefix-indexes",
        action="store_true",
        help="before the baseline, fill the local and the prefill prefix indexes to their bounds"
        " (SIDECAR_PREFIX_CACHE_BLOCKS; SIDECAR_PREFIX_INDEX_MEMORY_MIB, with"
        " SIDECAR_PREFILL_CACHE_TOKENS large so that the one prefill endpoint may take all of"
        " it, and emulators with large caches) with long distinct prompts",
    )
    parser.add_argument(
        "--fill-prompt-tokens", type=int, default=30000, help="prompt length of the fill"
    )
    parser.add_argument(
        "--fill-concurrency",
        type=int,
        default=8,
        help="fill requests at once (each holds a few copies of its prompt: more raise the"
        " high-water mark the load's peak is read against)",
    )
    parser.add_argument("--sample-s", type=float, default=0.5, help="RSS sampling period")
    parser.add_argument("--progress-s", type=float, default=5.0, help="progress line period")
    add_cluster_arguments(parser)
    add_quick(parser, "50 streams of 10 tokens, 150 requests, a short settle; judged")
    args = parser.parse_args(argv)
    apply_quick(
        parser, args, concurrency=50, requests=150, output_tokens=10, decode_s_per_token=0.05,
        ramp_s=1.0, warmup=5, settle_s=5.0, sample_s=0.2, progress_s=2.0,
    )  # fmt: skip
    if args.concurrency < 1 or args.requests < 1 or args.output_tokens < 1:
        parser.error("--concurrency, --requests and --output-tokens must be positive")
    if args.timeout_s is None:
        args.timeout_s = 3 * args.output_tokens * args.decode_s_per_token + 60
    if args.fill_prefix_indexes:
        if not any(e.startswith("SIDECAR_PREFILL_CACHE_TOKENS=") for e in args.sidecar_env):
            args.sidecar_env.append(f"SIDECAR_PREFILL_CACHE_TOKENS={FILL_PREFILL_CACHE_TOKENS}")
        # A fill prompt plus its one output token within the emulators' context, and engines
        # whose caches (vllm:cache_config_info, which bounds the local index) exceed the bounds.
        args.emulator_arg.append(f"--max-model-len={args.fill_prompt_tokens * 2}")
        args.emulator_arg.append(f"--num-gpu-blocks={FILL_ENGINE_BLOCKS}")
    return args


FILL_PREFILL_CACHE_TOKENS = 1 << 30
"""What the fill tells the sidecar one prefill endpoint caches: more than the memory bound lets
the prefill indexes hold (155,648 blocks of 64 tokens by default), so that one endpoint fills
them, as ~38 endpoints at the default 262,144 tokens each would."""
FILL_ENGINE_BLOCKS = 1 << 20
"""The emulators' KV blocks (16 tokens) during a fill: the decode engine's cache bounds the local
index (4,096 blocks by default, below SIDECAR_PREFIX_CACHE_BLOCKS' 65,536)."""
FILL_BATCH = 128


@dataclass(frozen=True, slots=True)
class PrefixIndexes:
    local: int
    """Blocks of the local (decode) prefix index, ``/debug/scheduler``."""
    prefill: int
    """Blocks of the prefill endpoints' indexes (``pd_sidecar_prefill_prefix_index_blocks``)."""

    def describe(self) -> str:
        return f"local {self.local:,} blocks, prefill {self.prefill:,} blocks"


async def prefix_indexes(cluster: Cluster) -> PrefixIndexes:
    metrics = await cluster.sidecar_metrics()
    return PrefixIndexes(
        await cluster.prefix_index_blocks(),
        int(metrics.value("pd_sidecar_prefill_prefix_index_blocks")),
    )


async def fill_prefix_indexes(cluster: Cluster, args: argparse.Namespace) -> PrefixIndexes:
    """Send one-token requests with long distinct prompts, in batches, until a batch grows
    neither prefix index: both are at their bounds (LRUs, full from then on)."""
    sent, last = 0, await prefix_indexes(cluster)
    while True:
        stats = ClientStats()
        fill = argparse.Namespace(**{**vars(args), "output_tokens": 1,
                                     "prompt_tokens": args.fill_prompt_tokens})  # fmt: skip
        await drive(
            cluster, stats, count=FILL_BATCH, concurrency=args.fill_concurrency, ramp_s=0.0,
            args=fill, first_index=-(10**9) + sent,
        )  # fmt: skip
        sent += FILL_BATCH
        if stats.error_count:
            raise RuntimeError(f"prefix fill failed: {dict(stats.errors)} {stats.examples}")
        now = await prefix_indexes(cluster)
        print(
            f"  prefix fill: {sent} requests of ~{args.fill_prompt_tokens} tokens,"
            f" {now.describe()}, sidecar RSS {mib(read_proc(cluster.sidecar.pid).rss)}",
            flush=True,
        )
        if now.local <= last.local and now.prefill <= last.prefill:
            return now
        last = now


@dataclass(slots=True)
class Peaks:
    """What the sampler saw of the sidecar during the load phase."""

    rss: int = 0
    tasks: float = 0.0
    inflight: float = 0.0
    fds: int = 0
    samples: int = 0


async def sample(cluster: Cluster, peaks: Peaks, period_s: float) -> None:
    """Peak RSS and fds from /proc every ``period_s``; tasks and in-flight from /metrics every
    fourth time (an HTTP request through the loaded sidecar)."""
    while True:
        reading = read_proc(cluster.sidecar.pid)
        peaks.rss = max(peaks.rss, reading.rss)
        peaks.fds = max(peaks.fds, reading.fds)
        if peaks.samples % 4 == 0:
            try:
                metrics = await cluster.sidecar_metrics()
            except (aiohttp.ClientError, TimeoutError):
                pass
            else:
                peaks.tasks = max(peaks.tasks, metrics.value("pd_sidecar_asyncio_tasks"))
                peaks.inflight = max(peaks.inflight, metrics.value("pd_sidecar_inflight_requests"))
        peaks.samples += 1
        await asyncio.sleep(period_s)


async def progress(stats: ClientStats, cluster: Cluster, start: float, period_s: float) -> None:
    last_cpu = {child.name: read_proc(child.pid).cpu_s for child in cluster.children}
    last_cpu["client"] = own_cpu_s()
    last = time.monotonic()
    while True:
        await asyncio.sleep(period_s)
        now = time.monotonic()
        cpu = {child.name: read_proc(child.pid).cpu_s for child in cluster.children}
        cpu["client"] = own_cpu_s()
        shares = " ".join(
            f"{name} {100 * (cpu[name] - last_cpu[name]) / (now - last):3.0f}%" for name in cpu
        )
        last_cpu, last = cpu, now
        print(
            f"  t={now - start:6.1f}s open={stats.open_streams:5d} inflight={stats.inflight:5d}"
            f" done={stats.finished:6d} errors={stats.error_count:4d}"
            f" sidecar_rss={mib(read_proc(cluster.sidecar.pid).rss):>10}  cpu: {shares}",
            flush=True,
        )


async def drive(
    cluster: Cluster,
    stats: ClientStats,
    *,
    count: int,
    concurrency: int,
    ramp_s: float,
    args: argparse.Namespace,
    first_index: int,
) -> None:
    issued = 0
    prefill = cluster.prefill.endpoint

    def next_spec() -> RequestSpec | None:
        nonlocal issued
        if issued >= count:
            return None
        issued += 1
        index = first_index + issued
        return RequestSpec(
            index=index,
            chat=index % 2 == 0,
            output_tokens=args.output_tokens,
            prompt_tokens=args.prompt_tokens,
            prefill=prefill,
            timeout_s=args.timeout_s,
        )

    async with client_session() as session:
        await run_workers(
            concurrency,
            ramp_s,
            next_spec,
            lambda spec: stream_one(session, cluster.sidecar.url, spec, stats),
        )


async def main(args: argparse.Namespace) -> int:
    nofile = raise_open_files_limit()
    config = ClusterConfig.from_args(args, decode_s_per_token=args.decode_s_per_token)
    if args.fill_prefix_indexes:
        config = dataclasses.replace(config, prefill_pool=True)
    print(
        f"pd-sidecar load benchmark: {args.concurrency} concurrent streams, {args.requests}"
        f" requests, {args.output_tokens} tokens x {args.decode_s_per_token * 1000:.0f} ms,"
        f" ~{args.prompt_tokens}-token prompts, ramp {args.ramp_s:.0f} s"
    )
    print(f"open-files limit {nofile}, load average before start {load_average()}")
    async with Cluster(config) as cluster:
        print(
            f"processes: prefill pid {cluster.prefill.pid} {cluster.prefill.url}, decode pid"
            f" {cluster.decode.pid} {cluster.decode.url}, sidecar pid {cluster.sidecar.pid}"
            f" {cluster.sidecar.url}; logs in {cluster.log_dir}"
        )
        fresh = read_proc(cluster.sidecar.pid)
        warm = ClientStats()
        await drive(
            cluster,
            warm,
            count=args.warmup,
            concurrency=min(10, args.warmup) or 1,
            ramp_s=0.0,
            args=args,
            first_index=0,
        )
        if warm.error_count:
            print(f"warm-up failed: {dict(warm.errors)} {warm.examples}")
            return 1
        if args.fill_prefix_indexes:
            filled = await fill_prefix_indexes(cluster, args)
            print(f"prefix indexes full: {filled.describe()}", flush=True)
        before = await cluster.read_sidecar()
        indexes_before = await prefix_indexes(cluster)

        stats = ClientStats()
        peaks = Peaks()
        cpu_before = {child.name: read_proc(child.pid).cpu_s for child in cluster.children}
        client_cpu_before = own_cpu_s()
        start = time.monotonic()
        contention = Contention()
        contention.start()
        background = [
            asyncio.create_task(sample(cluster, peaks, args.sample_s)),
            asyncio.create_task(progress(stats, cluster, start, args.progress_s)),
        ]
        try:
            await drive(
                cluster,
                stats,
                count=args.requests,
                concurrency=args.concurrency,
                ramp_s=args.ramp_s,
                args=args,
                first_index=args.warmup,
            )
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await contention.stop()
        elapsed = time.monotonic() - start
        cpu = {
            child.name: read_proc(child.pid).cpu_s - cpu_before[child.name]
            for child in cluster.children
        }
        cpu["client"] = own_cpu_s() - client_cpu_before

        async def sidecar_idle() -> bool:
            return (await cluster.sidecar_metrics()).value("pd_sidecar_inflight_requests") == 0

        await wait_until(sidecar_idle, 30.0)
        right_after = await cluster.read_sidecar()
        metrics = await cluster.sidecar_metrics()
        debug_inflight = await cluster.debug_inflight()
        indexes_after = await prefix_indexes(cluster)

        async def nothing_staged() -> bool:
            return int((await cluster.kv_state())["staged_blocks"]) == 0

        await wait_until(nothing_staged, 5.0)
        kv = await cluster.kv_state()
        decode_kv = await cluster.get_json(cluster.decode.url + "/emulator/kv")
        print(f"load phase over; waiting {args.settle_s:.0f} s for idle connections to close")
        await asyncio.sleep(args.settle_s)
        after = await cluster.read_sidecar()
        sockets = cluster.sidecar_sockets()
        socket_problems = cluster.idle_socket_problems(sockets)
        pool_bound = cluster.decode_pool_bound()
        hwm = after.proc.hwm
        problems = cluster.log_problems()

    return report(
        args,
        stats=stats,
        elapsed=elapsed,
        cpu=cpu,
        fresh=fresh,
        before=before,
        right_after=right_after,
        after=after,
        peaks=peaks,
        hwm=hwm,
        metrics=metrics,
        debug_inflight=len(debug_inflight),
        kv=kv,
        decode_kv=decode_kv,
        problems=problems,
        contention=contention,
        indexes=(indexes_before, indexes_after),
        sockets=sockets,
        socket_problems=socket_problems,
        pool_bound=pool_bound,
    )


def report(
    args: argparse.Namespace,
    *,
    stats: ClientStats,
    elapsed: float,
    cpu: dict[str, float],
    fresh: ProcReading,
    before: SidecarReading,
    right_after: SidecarReading,
    after: SidecarReading,
    peaks: Peaks,
    hwm: int,
    metrics: Metrics,
    debug_inflight: int,
    kv: dict[str, object],
    decode_kv: dict[str, object],
    problems: dict[str, int],
    contention: Contention,
    indexes: tuple[PrefixIndexes, PrefixIndexes],
    sockets: Counter[str],
    socket_problems: list[str],
    pool_bound: int,
) -> int:
    outcomes = metrics.by_label("pd_sidecar_requests_total", "decision", "outcome")
    fallbacks = metrics.value("pd_sidecar_fallbacks_total")
    ideal_s = args.output_tokens * args.decode_s_per_token
    print()
    print("=== pd-sidecar load benchmark: summary ===")
    print(f"requests              {stats.finished} finished of {args.requests}, {stats.ok} ok")
    print(
        f"concurrency           {stats.max_open_streams} streams open at once (max),"
        f" {stats.max_inflight} requests in flight (max), target {args.concurrency};"
        f" sidecar saw {peaks.inflight:.0f} in flight (max of {peaks.samples // 4 + 1} scrapes)"
    )
    print(f"errors                {stats.error_count} {dict(stats.errors) or ''}")
    for kind, example in stats.examples.items():
        print(f"  e.g. {kind}: {example!r}")
    print(
        f"throughput            {stats.finished / elapsed:.1f} req/s,"
        f" {stats.events / elapsed:.0f} events/s over {elapsed:.1f} s"
    )
    print(
        f"client TTFT           p50 {ms(percentile(stats.ttfbs, 50))},"
        f" p99 {ms(percentile(stats.ttfbs, 99))}, max {ms(percentile(stats.ttfbs, 100))}"
    )
    print(
        f"stream duration       p50 {ms(percentile(stats.latencies, 50))},"
        f" p99 {ms(percentile(stats.latencies, 99))} (ideal {ideal_s * 1000:.0f} ms)"
    )
    print(
        f"sidecar RSS           peak {mib(hwm)} (VmHWM; sampled max {mib(peaks.rss)}),"
        f" fresh {mib(fresh.rss)}, before {mib(before.proc.rss)},"
        f" right after {mib(right_after.proc.rss)}, after idle {mib(after.proc.rss)}"
    )
    print(
        f"prefix indexes        before {indexes[0].describe()}; after {indexes[1].describe()}"
        + (" (filled to their bounds first)" if args.fill_prefix_indexes else "")
    )
    print(
        f"sidecar tasks         before {before.tasks:.0f}, peak {peaks.tasks:.0f},"
        f" right after {right_after.tasks:.0f}, after idle {after.tasks:.0f}"
    )
    print(
        f"sidecar open fds      before {before.proc.fds}, peak {peaks.fds},"
        f" right after {right_after.proc.fds}, after idle {after.proc.fds}"
    )
    print(
        "CPU (% of one core)   "
        + ", ".join(f"{name} {100 * seconds / elapsed:.0f}%" for name, seconds in cpu.items())
    )
    print(
        "sidecar outcomes      "
        + ", ".join(f"{d}/{o} {v:.0f}" for (d, o), v in sorted(outcomes.items()))
        + f"; fallbacks {fallbacks:.0f}"
    )
    print(
        f"prefill KV            staged_blocks {kv['staged_blocks']}, pulled_total"
        f" {kv['pulled_total']}, expired_total {kv['expired_total']},"
        f" rejected_pulls_total {kv['rejected_pulls_total']};"
        f" decode failed_pulls_total {decode_kv['failed_pulls_total']}"
    )
    print(
        f"idle sidecar sockets  {dict(sorted(sockets.items())) or 'none'}"
        f" (idle decode connections kept alive by the pollers: at most {pool_bound})"
    )
    print(f"log warnings/errors   {problems}")
    print(f"machine               {contention.describe()}; load average {load_average()}")

    failures = []
    if stats.error_count:
        failures.append(f"{stats.error_count} client errors")
    if stats.finished != args.requests:
        failures.append(f"{args.requests - stats.finished} requests never finished")
    if right_after.inflight != 0:
        failures.append(f"pd_sidecar_inflight_requests {right_after.inflight:.0f}")
    if debug_inflight:
        failures.append(f"/debug/requests lists {debug_inflight} in flight")
    if kv["staged_blocks"] != 0:
        failures.append(f"{kv['staged_blocks']} KV blocks left staged")
    if after.tasks > before.tasks + TASK_SLACK:
        failures.append(f"asyncio tasks {before.tasks:.0f} -> {after.tasks:.0f}")
    decode_idle = sockets["decode ESTABLISHED"]
    if after.proc.fds > before.proc.fds + decode_idle + FD_SLACK:
        failures.append(f"open fds {before.proc.fds} -> {after.proc.fds}")
    failures.extend(socket_problems)
    if stats.max_open_streams < args.concurrency and args.requests >= args.concurrency:
        print(
            f"note: only {stats.max_open_streams} streams were open at once"
            f" (target {args.concurrency}): raise --decode-s-per-token or --output-tokens"
        )
    if fallbacks:
        print(f"note: {fallbacks:.0f} requests fell back to a local prefill (see the sidecar log)")
    print("verdict               " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return 1 if failures else 0


def main_cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run(lambda: main(args))


if __name__ == "__main__":
    sys.exit(main_cli())
