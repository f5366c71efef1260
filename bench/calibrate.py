"""Sim-to-real calibration: the simulator against real processes on the same arrival trace.

    python -m bench calibrate                   # every policy, 3 runs each (~5 minutes)
    python -m bench calibrate --policies qoe --runs 1 --duration 10
    python -m bench calibrate --quick           # qoe, one run of 3 s; only failed requests judged

A cluster of real processes on loopback — four prefill emulators of two speeds (two 3x faster
than the others), two decode emulators, each with ``--max-num-seqs``, and two sidecars sharing a
real ``redis-server`` — receives an arrival trace at about 70 % of the prefill pool's capacity;
the simulator, configured identically (its ``slots`` engine model is the emulator's latency
model), runs the same trace. Per policy and run: mean and p90 time to first token and the share
of remote prefills, real and simulated. They agree when the median of the runs' simulated values
is within ±25 % of the median of the real ones; the exit status is 0 when every one agrees.
Each run starts the sidecars afresh (cold speed estimates, like the simulator's) on a Redis key
prefix of their own; the emulators and Redis are started once. docs/scheduling.md has the method
and the results.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import orjson

from bench.cluster import BenchLauncher, raise_open_files_limit, run
from bench.readings import Contention, Metrics, load_average
from bench.sim.run import simulate
from bench.sim.scenario import Scenario, Variant
from bench.sim.workload import Shape, shapes
from bench.suite import add_quick, apply_quick
from devkit.processes import STOP_GRACE_S, Child, free_port, tcp_open
from devkit.stats import percentile
from sidecar.emulator.engine import prefill_seconds
from sidecar.scheduling.policies import POLICIES

TOLERANCE = 0.25
LOAD = 0.70
"""Target load: of the prefill pool's capacity, counting every prompt the decider may send."""
MIN_TOKENS = 512
"""The decider's default ``min_tokens``: shorter prompts never go remote."""

CALIBRATION = Scenario(
    name="calibration",
    engine_model="slots",
    prefill_engines=4,
    decode_engines=2,
    prefill_speeds=(10_000.0, 10_000.0, 10_000.0 / 3, 10_000.0 / 3),
    prefill_tokens_per_s=10_000.0,
    prefill_max_num_seqs=1,
    decode_max_num_seqs=16,
    concurrency_slowdown=0.05,
    decode_s_per_token=0.02,
    kv_transfer_s_per_block=0.0001,
    redis_rtt_s=0.0005,
    chat_share=0.6,
    rag_share=0.4,
    chat_output_tokens=8,
    rag_output_tokens=4,
)
"""The cluster, as the simulator sees it; the processes get the same numbers as flags."""


@dataclass(frozen=True, slots=True)
class Measure:
    ttft_mean: float
    ttft_p90: float
    remote_share: float
    requests: int
    failed: int = 0


def prefill_flags(speed: float) -> list[str]:
    scenario = CALIBRATION
    return [
        "--max-num-seqs", str(scenario.prefill_max_num_seqs),
        "--prefill-s-per-token", repr(1.0 / speed),
        "--concurrency-slowdown", repr(scenario.concurrency_slowdown),
        "--prefill-crossover-tokens", str(scenario.crossover_tokens),
        "--tokenizer", "words",
    ]  # fmt: skip


def decode_flags() -> list[str]:
    scenario = CALIBRATION
    return [
        "--max-num-seqs", str(scenario.decode_max_num_seqs),
        "--prefill-s-per-token", repr(1.0 / scenario.prefill_tokens_per_s),
        "--decode-s-per-token", repr(scenario.decode_s_per_token),
        "--concurrency-slowdown", repr(scenario.concurrency_slowdown),
        "--kv-transfer-s-per-block", repr(scenario.kv_transfer_s_per_block),
        "--prefill-crossover-tokens", str(scenario.crossover_tokens),
        "--block-size", str(scenario.block_size),
        "--tokenizer", "words",
    ]  # fmt: skip


def rate_for(scenario: Scenario, load: float, seed: int) -> float:
    """The arrival rate at which the prompts the decider may send remote (estimated at 512
    tokens or more) would keep the prefill pool ``load`` busy: work per request in seconds of
    a pool whose engines share it by speed."""
    a = 1.0 / scenario.prefill_tokens_per_s
    sample = [shape for shape, _ in zip(shapes(scenario, seed), range(20_000), strict=False)]
    work = [
        prefill_seconds(a, scenario.crossover_tokens, shape.prompt_tokens)
        for shape in sample
        if shape.prompt_chars // 4 >= MIN_TOKENS
    ]
    pool = sum(speed * a for speed in scenario.speeds())  # engines of the reference speed
    return load * pool / (sum(work) / len(sample))


def make_trace(scenario: Scenario, seed: int, rate: float, duration_s: float) -> list[Shape]:
    """The scenario's seeded requests arriving over ``duration_s`` at ``rate``, each given one
    of the decode pods at random (the gateway's choice, fixed by the trace); gaps in seconds."""
    homes = random.Random(f"homes-{seed}")
    trace: list[Shape] = []
    elapsed = 0.0
    for shape in shapes(scenario, seed):
        gap = shape.gap / rate
        elapsed += gap
        if elapsed > duration_s:
            break
        trace.append(replace(shape, gap=gap, home=homes.randrange(scenario.decode_engines)))
    return trace


def prompt_for(shape: Shape, tag: str) -> str:
    """A text of exactly ``shape.prompt_tokens`` words and ``shape.prompt_chars`` characters: the
    emulators (``--tokenizer words``) count the former, the sidecars estimate from the latter.
    Its first words spell a digest of ``tag``, so no two requests share a cached block."""
    words, chars = shape.prompt_tokens, shape.prompt_chars
    letters = chars - (words - 1)
    base, extra = divmod(letters, words)
    digest = hashlib.blake2b(tag.encode(), digest_size=64).hexdigest()
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    out = []
    for i in range(words):
        length = base + (1 if i < extra else 0)
        if i < 32:
            seed = int(digest[(i * 2) % 128 : (i * 2) % 128 + 2], 16)
            out.append("".join(alphabet[(seed + k * 7) % 26] for k in range(length)))
        else:
            out.append("w" * length)
    text = " ".join(out)
    assert len(text) == chars
    assert len(out) == words
    return text


# --- the real side ------------------------------------------------------------------------


class RealCluster:
    """Redis and the emulators, started once; the sidecars, per run."""

    def __init__(self, log_dir: Path | None) -> None:
        self._launcher = BenchLauncher(
            log_dir, prefix="pd-sidecar-calibrate-", grace_s=STOP_GRACE_S
        )
        self.log_dir = self._launcher.log_dir
        self.redis_url = ""
        self.prefill: list[Child] = []
        self.decode: list[Child] = []

    async def start(self) -> None:
        port = free_port()
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        redis = self._launcher.spawn("redis", [*argv, "--appendonly", "no"])
        for i, speed in enumerate(CALIBRATION.speeds()):
            self.prefill.append(self._launcher.spawn_emulator(f"prefill-{i}", prefill_flags(speed)))
        for i in range(CALIBRATION.decode_engines):
            self.decode.append(self._launcher.spawn_emulator(f"decode-{i}", decode_flags()))
        await redis.wait_ready(lambda: tcp_open("127.0.0.1", port))
        for child in (*self.prefill, *self.decode):
            await child.wait_ready("/health")

    async def sidecars(self, policy: str, run_id: str) -> list[Child]:
        pool = ",".join(child.endpoint for child in self.prefill)
        started = [
            self._launcher.spawn_sidecar(
                f"sidecar-{run_id}-{i}",
                decode_url=decode.url,
                settings={
                    "SIDECAR_PREFILL_ENDPOINTS": pool,
                    "SIDECAR_STATE_BACKEND": "redis",
                    "SIDECAR_REDIS_URL": self.redis_url,
                    "SIDECAR_REDIS_KEY_PREFIX": run_id,
                    "SIDECAR_SCHEDULER_POLICY": policy,
                    "SIDECAR_SCHEDULER_SEED": str(i + 1),
                    "SIDECAR_SCRAPE_INTERVAL_S": repr(CALIBRATION.staleness_s),
                    "SIDECAR_LOG_LEVEL": "WARNING",
                },
            )
            for i, decode in enumerate(self.decode)
        ]
        for child in started:
            await child.wait_ready("/ready")
        return started

    async def close(self) -> None:
        await self._launcher.close()


async def scheduling(http: aiohttp.ClientSession, url: str, endpoints: int) -> bool:
    """Synced with Redis and scraped every endpoint: nothing is decided on a partial view."""
    async with http.get(url + "/debug/scheduler") as response:
        snapshot = orjson.loads(await response.read())
    scraped = [e for e in snapshot["endpoints"] if e["scraped"] is not None]
    return bool(snapshot["state_backend"]["connected"]) and len(scraped) == endpoints


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError("the sidecars did not sync and scrape in time")
        await asyncio.sleep(0.05)


async def send(http: aiohttp.ClientSession, url: str, body: bytes, start_at: float) -> float | None:
    """Send at ``start_at`` (loop time); the time to the first token event, None on failure."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start_at - loop.time()))
    sent = loop.time()
    first: float | None = None
    try:
        async with http.post(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        ) as response:
            if response.status != 200:
                await response.read()
                return None
            async for line in response.content:
                if first is None and line.startswith(b"data: {"):
                    first = loop.time()
    except aiohttp.ClientError:
        return None
    return None if first is None else first - sent


async def real_run(
    cluster: RealCluster, http: aiohttp.ClientSession, policy: str, trace: list[Shape], tag: str
) -> tuple[Measure, list[float], str]:
    """One run through the real processes: the measure, the sidecars' scrape phases (for the
    simulator), the contention seen."""
    sidecars = await cluster.sidecars(policy, tag)
    try:
        for child in sidecars:
            await until(functools.partial(scheduling, http, child.url, len(cluster.prefill)))
        bodies = []
        for index, shape in enumerate(trace):
            text = prompt_for(shape, f"{tag}-{index}")
            body = {"prompt": text, "max_tokens": shape.output_tokens, "stream": True}
            bodies.append(orjson.dumps(body))
        contention = Contention()
        contention.start()
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.2
        phases = [await scrape_phase(http, child.url, start) for child in sidecars]
        offsets = []
        elapsed = 0.0
        for shape in trace:
            elapsed += shape.gap
            offsets.append(elapsed)
        results = await asyncio.gather(
            *(
                send(http, sidecars[shape.home or 0].url, body, start + offset)
                for shape, body, offset in zip(trace, bodies, offsets, strict=True)
            )
        )
        await contention.stop()
        remote = 0.0
        for child in sidecars:
            async with http.get(child.url + "/metrics") as response:
                metrics = Metrics.parse(await response.text())
            remote += metrics.value("pd_sidecar_scheduler_decisions_total", decision="remote")
    finally:
        await asyncio.gather(*(child.stop() for child in sidecars))
    ttfts = [t for t in results if t is not None]
    measure = Measure(
        ttft_mean=statistics.fmean(ttfts) if ttfts else math.nan,
        ttft_p90=percentile(ttfts, 90) if ttfts else math.nan,
        remote_share=remote / len(trace),
        requests=len(trace),
        failed=len(trace) - len(ttfts),
    )
    return measure, phases, contention.describe()


async def scrape_phase(http: aiohttp.ClientSession, url: str, start: float) -> float:
    """When the sidecar at ``url`` scrapes, in seconds after ``start`` (loop time) modulo the
    interval: from the age of its latest scrape (all its engines are scraped together)."""
    async with http.get(url + "/debug/scheduler") as response:
        snapshot = orjson.loads(await response.read())
        now = asyncio.get_running_loop().time()
    ages = [float(e["scraped"]["age_s"]) for e in snapshot["endpoints"] if e["scraped"]]
    return (now - min(ages) - start) % CALIBRATION.staleness_s


def sim_run(policy: str, trace: list[Shape], seed: int, phases: list[float]) -> Measure:
    stats = simulate(
        CALIBRATION,
        Variant(policy),
        1.0,
        measured=len(trace),
        warmup=0,
        seed=seed,
        trace=trace,
        scrape_phases=phases,
    )
    return Measure(stats.ttft_mean, stats.ttft_p90, stats.remote_share, stats.requests)


# --- the comparison ---------------------------------------------------------------------------


def agree(real: float, sim: float) -> bool:
    return real > 0 and abs(sim / real - 1) <= TOLERANCE


def _pct(sim: float, real: float) -> str:
    return f"{(sim / real - 1) * 100:+.0f}%" if real else "-"


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raise_open_files_limit()
    rate = args.rate or rate_for(CALIBRATION, LOAD, 1)
    print(
        f"pd-sidecar calibration: {', '.join(args.policies)}; {args.runs} run(s) each of "
        f"{args.duration:g} s at {rate:.2f} req/s (~{LOAD * 100:.0f} % of the prefill pool); "
        f"load average before: {load_average()}"
    )
    print(CALIBRATION.describe())
    cluster = RealCluster(args.log_dir)
    started = time.monotonic()
    table: dict[str, list[tuple[Measure, Measure]]] = {p: [] for p in args.policies}
    try:
        await cluster.start()
        print(f"logs: {cluster.log_dir}")
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        ) as http:
            for run_index in range(args.runs):
                seed = args.seed + run_index
                trace = make_trace(CALIBRATION, seed, rate, args.duration)
                for policy in args.policies:
                    tag = f"c{os.getpid()}r{run_index}{policy}"
                    real, phases, contention = await real_run(cluster, http, policy, trace, tag)
                    sim = sim_run(policy, trace, seed, phases)
                    table[policy].append((real, sim))
                    print(
                        f"  run {run_index + 1} seed {seed} {policy:<13} {len(trace)} requests"
                        f" ({real.failed} failed): TTFT mean {real.ttft_mean * 1000:.0f} / "
                        f"{sim.ttft_mean * 1000:.0f} ms, p90 {real.ttft_p90 * 1000:.0f} / "
                        f"{sim.ttft_p90 * 1000:.0f} ms, remote {real.remote_share * 100:.0f} / "
                        f"{sim.remote_share * 100:.0f} % (real / sim); load average "
                        f"{load_average()}; {contention}; scrape phases "
                        + ", ".join(f"{phase:.2f}" for phase in phases)
                        + " s",
                        flush=True,
                    )
    finally:
        await cluster.close()
    print()
    print(f"Median of {args.runs} run(s), real vs simulated (agree: within ±{TOLERANCE:.0%}):")
    print(
        f"{'policy':<14}{'TTFT mean real':>15}{'sim':>7}{'diff':>7}{'p90 real':>10}{'sim':>7}"
        f"{'diff':>7}{'remote real':>13}{'sim':>6}{'diff':>7}  verdict"
    )
    failed = 0
    for policy, pairs in table.items():
        reals = [pair[0] for pair in pairs]
        sims = [pair[1] for pair in pairs]
        values = []
        ok = True
        for name in ("ttft_mean", "ttft_p90", "remote_share"):
            r = statistics.median(getattr(m, name) for m in reals)
            s = statistics.median(getattr(m, name) for m in sims)
            ok = ok and agree(r, s)
            values.append((r, s))
        lost = sum(m.failed for m in reals)
        ok = (ok or args.quick) and lost == 0  # the smoke run: only failed requests count
        failed += not ok
        if args.quick:
            verdict = "not judged (--quick)" if ok else "FAIL"
        else:
            verdict = "agree" if ok else "DISAGREE"
        (mr, ms), (pr, ps), (rr, rs) = values
        print(
            f"{policy:<14}{mr * 1000:>13.0f}ms{ms * 1000:>5.0f}ms{_pct(ms, mr):>7}"
            f"{pr * 1000:>8.0f}ms{ps * 1000:>5.0f}ms{_pct(ps, pr):>7}"
            f"{rr * 100:>12.1f}%{rs * 100:>5.1f}%{_pct(rs, rr):>7}  "
            + verdict
            + (f" ({lost} failed requests)" if lost else "")
        )
    print()
    summary = "all agree" if not failed else f"{failed} polic(y/ies) disagree - FAIL"
    if args.quick:
        summary = "no failed request" if not failed else "failed requests - FAIL"
    print(f"{time.monotonic() - started:.0f} s; load average after: {load_average()}; {summary}")
    return 1 if failed else 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench calibrate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--policies",
        type=lambda text: [p for p in text.split(",") if p],
        default=list(POLICIES),
        help=f"comma-separated, of {', '.join(POLICIES)}",
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per policy (median taken)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per run")
    parser.add_argument("--rate", type=float, help="req/s (default: ~70 %% of the pool)")
    parser.add_argument("--seed", type=int, default=1, help="trace seed of the first run")
    parser.add_argument("--log-dir", type=Path, default=None, help="children's logs")
    add_quick(parser, "qoe, one run of 3 s; only failed requests judged")
    args = apply_quick(parser, parser.parse_args(argv), policies=["qoe"], runs=1, duration=3.0)
    unknown = [p for p in args.policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policy {', '.join(unknown)}")
    return args


def main_cli(argv: list[str] | None = None) -> int:
    return run(functools.partial(main, argv))


if __name__ == "__main__":
    sys.exit(main_cli())
