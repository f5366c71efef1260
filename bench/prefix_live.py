"""Prefix-aware against prefix-blind prefill placement, on real processes.

    python -m bench prefix_live                 # both runs, 60 s of arrivals each (~3 minutes)
    python -m bench prefix_live --duration 30 --seed 2 --num-gpu-blocks 3000
    python -m bench prefix_live --quick         # ~10 s, a faster cluster, nothing judged

The cluster, on loopback: four prefill emulators with bench/calibrate.py's latency model (two at
10,000 tokens/s, two 3× slower, one prefill at a time, 5 % slowdown per extra request, attention
b = a / 53,250), each reporting its cached tokens (``--prompt-tokens-details``) and holding a
prefix cache of ``--num-gpu-blocks`` blocks of 16 tokens (default 4,000: 64,000 tokens, about
the KV cache an 8B model leaves on a 24 GB GPU at 128 KiB per token; the decode emulators get
the same); two decode emulators (calibrate's); two sidecars, each beside one decode emulator,
sharing a real ``redis-server``.

The workload is the shared-system-prompt one: 32 system prompts of 2,000–8,000 tokens
(uniform), one per request chosen with Zipf popularity (s = 1.1), then a unique user part of
50–500 tokens; outputs of 100–300 tokens; Poisson arrivals at ``--load`` of what the prefill
pool computes per second without any cache hit. Everything is seeded. Prompts are text of four
characters per token: the emulators count ``ceil(characters / 4)`` tokens (``--tokenizer
chars``) and cache blocks of 64 characters, which is also the sidecar's estimate and block, so
both see the prompts' prefix structure as it is.

The same trace runs twice, prefix-blind (``SIDECAR_PREFILL_PREFIX_INDEX=false``) then
prefix-aware (``true``). Before each run every emulator's prefix cache is emptied (``POST
/reset_prefix_cache``); each run has two sidecars of its own, on a Redis key prefix of their
own (started with the cluster, idle until their run, stopped after it); the run begins once both
have synced and scraped every endpoint. Reported per run: time to first token
(mean, p50, p90; every request, the cold start included), failures, the share of remote
prefills, the share of prompt tokens the client saw cached (``usage.prompt_tokens_details``);
per prefill emulator the run's ``vllm:prefix_cache_hits_total`` / ``queries_total``; the
placements by reason; the sidecars' prediction error (``pd_sidecar_prefill_prefix_error_tokens``,
``pd_sidecar_prefill_cached_tokens_total``, ``/debug/scheduler``'s ``prefill_prefixes``). The
target: mean TTFT prefix-aware ≤ 0.8 × blind, with hits on the prefill emulators; the
exit status is 1 when it is missed (never with ``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import random
import secrets
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.calibrate import CALIBRATION, scheduling, until
from bench.cluster import BenchLauncher, add_launcher_arguments, raise_open_files_limit, run
from bench.readings import Contention, Metrics, load_average
from devkit.processes import STOP_GRACE_S, Child, free_port, tcp_open
from devkit.stats import percentile
from sidecar.emulator.engine import prefill_seconds

SYSTEM_PROMPTS = 32
SYSTEM_TOKENS = (2_000, 8_000)
ZIPF_S = 1.1
USER_TOKENS = (50, 500)
OUTPUT_TOKENS = (100, 300)
"""The shared-system-prompt workload, fixed."""
CHARS_PER_TOKEN = 4
TARGET = 0.8
"""Mean TTFT prefix-aware / prefix-blind, at most."""
QUICK_SPEEDUP = 20.0
"""``--quick``: every engine delay divided by this."""
INDEX_SETTING = "SIDECAR_PREFILL_PREFIX_INDEX"
ERROR_METRIC = "pd_sidecar_prefill_prefix_error_tokens"
CACHED_METRIC = "pd_sidecar_prefill_cached_tokens_total"
HASH_KEY_SETTING = "SIDECAR_PREFIX_HASH_KEY"


# --- the workload ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    system: int
    """Which system prompt."""
    user_tokens: int
    output_tokens: int
    at: float
    """Seconds after the run's start."""


@dataclass(frozen=True, slots=True)
class Workload:
    seed: int
    system_tokens: tuple[int, ...]
    requests: tuple[Request, ...]

    def prompt(self, index: int) -> str:
        request = self.requests[index]
        system = text(f"s{self.seed}-{request.system}", self.system_tokens[request.system])
        return system + text(f"u{self.seed}-{index}", request.user_tokens)

    def prompt_tokens(self, request: Request) -> int:
        return self.system_tokens[request.system] + request.user_tokens


def text(tag: str, tokens: int) -> str:
    """Exactly ``tokens × 4`` characters of words that start with ``tag``: no two tags share
    a 64-character block."""
    chars = tokens * CHARS_PER_TOKEN
    words = (f"{tag}.{i}" for i in range(chars))
    out: list[str] = []
    length = 0
    while length <= chars:  # the words and a space after each: one more than joined
        word = next(words)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)[:chars]


def system_prompts(seed: int) -> tuple[int, ...]:
    rng = random.Random(f"systems-{seed}")
    return tuple(rng.randint(*SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS))


def draws(seed: int) -> Iterator[tuple[int, int, int]]:
    """An endless seeded stream of (system prompt, user tokens, output tokens)."""
    rng = random.Random(f"requests-{seed}")
    weights = [1 / rank**ZIPF_S for rank in range(1, SYSTEM_PROMPTS + 1)]
    while True:
        [system] = rng.choices(range(SYSTEM_PROMPTS), weights)
        yield system, rng.randint(*USER_TOKENS), rng.randint(*OUTPUT_TOKENS)


def make_workload(seed: int, rate: float, duration_s: float) -> Workload:
    """Poisson arrivals at ``rate`` over ``duration_s``."""
    arrivals = random.Random(f"arrivals-{seed}")
    requests = []
    at = 0.0
    for system, user, output in draws(seed):
        at += arrivals.expovariate(rate)
        if at > duration_s:
            break
        requests.append(Request(system, user, output, at))
    return Workload(seed, system_prompts(seed), tuple(requests))


def pool_rate(seed: int, speeds: Sequence[float]) -> float:
    """Requests per second the prefill pool computes when nothing is cached."""
    systems = system_prompts(seed)
    a = 1.0 / CALIBRATION.prefill_tokens_per_s
    sample = [draw for draw, _ in zip(draws(seed), range(20_000), strict=False)]
    work = statistics.fmean(
        prefill_seconds(a, CALIBRATION.crossover_tokens, systems[system] + user)
        for system, user, _ in sample
    )
    return sum(speed * a for speed in speeds) / work  # engines of the reference speed


# --- the cluster ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    num_gpu_blocks: int
    speedup: float = 1.0
    """Every delay divided by this (``--quick``)."""
    decode_num_gpu_blocks: int | None = None
    """The decode emulators' blocks; None: ``num_gpu_blocks``."""
    prefill_speeds: tuple[float, ...] | None = None
    """The prefill emulators' tokens/s; None: calibrate's four."""

    def speeds(self) -> list[float]:
        speeds = self.prefill_speeds or CALIBRATION.speeds()
        return [speed * self.speedup for speed in speeds]

    def prefill_flags(self, speed: float) -> list[str]:
        c = CALIBRATION
        return [
            "--max-num-seqs", str(c.prefill_max_num_seqs),
            "--prefill-s-per-token", repr(1.0 / speed),
            "--concurrency-slowdown", repr(c.concurrency_slowdown),
            "--prefill-crossover-tokens", str(c.crossover_tokens),
            "--num-gpu-blocks", str(self.num_gpu_blocks),
            "--prompt-tokens-details",
        ]  # fmt: skip

    def decode_flags(self) -> list[str]:
        c = CALIBRATION
        return [
            "--max-num-seqs", str(c.decode_max_num_seqs),
            "--prefill-s-per-token", repr(1.0 / (c.prefill_tokens_per_s * self.speedup)),
            "--decode-s-per-token", repr(c.decode_s_per_token / self.speedup),
            "--concurrency-slowdown", repr(c.concurrency_slowdown),
            "--kv-transfer-s-per-block", repr(c.kv_transfer_s_per_block / self.speedup),
            "--prefill-crossover-tokens", str(c.crossover_tokens),
            "--block-size", str(c.block_size),
            "--num-gpu-blocks", str(self.decode_num_gpu_blocks or self.num_gpu_blocks),
            "--prompt-tokens-details",
        ]  # fmt: skip


class LiveCluster:
    """Redis and the emulators, started once; the sidecars, per run."""

    def __init__(self, shape: Shape, log_dir: Path | None, sidecar_env: dict[str, str]) -> None:
        self.shape = shape
        self._launcher = BenchLauncher(log_dir, prefix="pd-sidecar-prefix-", grace_s=STOP_GRACE_S)
        self.log_dir = self._launcher.log_dir
        self._sidecar_env = sidecar_env
        self._hash_key = secrets.token_hex(16)  # one key for the pool: the sidecars share
        self.redis_url = ""
        self.prefill: list[Child] = []
        self.decode: list[Child] = []

    async def start(self, runs: Sequence[tuple[str, Mapping[str, str]]]) -> list[list[Child]]:
        """Redis, the emulators and each run's two sidecars (its tag, its settings), started
        together (the sidecars wait for their decode engines); returns the sidecars."""
        port = free_port()
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        redis = self._launcher.spawn("redis", [*argv, "--appendonly", "no"])
        for i, speed in enumerate(self.shape.speeds()):
            flags = self.shape.prefill_flags(speed)
            self.prefill.append(self._launcher.spawn_emulator(f"prefill-{i}", flags))
        for i in range(CALIBRATION.decode_engines):
            flags = self.shape.decode_flags()
            self.decode.append(self._launcher.spawn_emulator(f"decode-{i}", flags))
        sidecars = [self._sidecars(tag, settings) for tag, settings in runs]
        await redis.wait_ready(lambda: tcp_open("127.0.0.1", port))
        await asyncio.gather(*(c.wait_ready("/health") for c in (*self.prefill, *self.decode)))
        await asyncio.gather(*(c.wait_ready("/ready") for pair in sidecars for c in pair))
        return sidecars

    async def reset_caches(self, http: aiohttp.ClientSession) -> None:
        for child in (*self.prefill, *self.decode):
            async with http.post(child.url + "/reset_prefix_cache") as response:
                response.raise_for_status()

    def _sidecars(self, run_id: str, settings: Mapping[str, str]) -> list[Child]:
        pool = ",".join(child.endpoint for child in self.prefill)
        return [
            self._launcher.spawn_sidecar(
                f"sidecar-{run_id}-{i}",
                decode_url=decode.url,
                settings={
                    "SIDECAR_PREFILL_ENDPOINTS": pool,
                    "SIDECAR_STATE_BACKEND": "redis",
                    "SIDECAR_REDIS_URL": self.redis_url,
                    "SIDECAR_REDIS_KEY_PREFIX": run_id,
                    "SIDECAR_SCHEDULER_SEED": str(i + 1),
                    "SIDECAR_SCRAPE_INTERVAL_S": repr(CALIBRATION.staleness_s),
                    "SIDECAR_LOG_LEVEL": "WARNING",
                    HASH_KEY_SETTING: self._hash_key,
                    **settings,
                    **self._sidecar_env,
                },
            )
            for i, decode in enumerate(self.decode)
        ]

    async def close(self) -> None:
        await self._launcher.close()


# --- one run --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    ttft_s: float
    cached_tokens: int | None


@dataclass(frozen=True, slots=True)
class RunResult:
    name: str
    ttfts: list[float]
    failed: int
    remote_share: float
    cached_share: float | None
    """Of the prompt tokens, those the client was told were cached (None: never told)."""
    hits: list[tuple[float, float]]
    """Per prefill emulator: this run's prefix-cache hits and queries, in tokens."""
    reasons: dict[str, float]
    """The sidecars' placements by decision and reason (``remote/scheduled``, ...)."""
    error_sum: float
    error_count: float
    """Of ``pd_sidecar_prefill_prefix_error_tokens``, both sidecars'."""
    predicted: float
    reported: float
    """Prefix-cache hits on the prefill engines, predicted and reported, in tokens (prefills
    whose answer said)."""
    prefixes_views: list[Any]
    """Each sidecar's ``/debug/scheduler`` ``prefill_prefixes``."""
    placements: list[str | None] = field(default_factory=list)
    """Per request of the workload, the prefill endpoint it went to (None: local, or failed)."""

    def mean_abs_error(self) -> float | None:
        """Of every sidecar's endpoints, weighted by their answers."""
        total = answers = 0.0
        for view in self.prefixes_views:
            endpoints = view.get("endpoints", {}) if isinstance(view, dict) else {}
            for stats in endpoints.values():
                count = stats.get("answers_with_cached_tokens") or 0
                if count and stats.get("mean_abs_error_tokens") is not None:
                    total += stats["mean_abs_error_tokens"] * count
                    answers += count
        return total / answers if answers else None

    def ttft(self, stat: str) -> float:
        if not self.ttfts:
            return math.nan
        if stat == "mean":
            return statistics.fmean(self.ttfts)
        return percentile(self.ttfts, 50 if stat == "p50" else 90)


async def send(
    http: aiohttp.ClientSession, url: str, body: bytes, start_at: float, request_id: str
) -> Outcome | None:
    """Send at ``start_at`` (loop time) as ``request_id``; the time to the first token event and
    the cached tokens of the final usage event; None on failure."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start_at - loop.time()))
    sent = loop.time()
    first: float | None = None
    last = b""
    headers = {"Content-Type": "application/json", "x-request-id": request_id}
    try:
        async with http.post(url + "/v1/completions", data=body, headers=headers) as response:
            if response.status != 200:
                await response.read()
                return None
            async for line in response.content:
                if line.startswith(b"data: {"):
                    if first is None:
                        first = loop.time()
                    last = line
    except aiohttp.ClientError:
        return None
    if first is None:
        return None
    usage = orjson.loads(last[len(b"data: ") :]).get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Outcome(first - sent, cached if isinstance(cached, int) else None)


async def counters(http: aiohttp.ClientSession, child: Child) -> tuple[float, float]:
    async with http.get(child.url + "/metrics") as response:
        metrics = Metrics.parse(await response.text())
    return (
        metrics.value("vllm:prefix_cache_hits_total"),
        metrics.value("vllm:prefix_cache_queries_total"),
    )


async def placed_on(http: aiohttp.ClientSession, url: str, request_id: str) -> str | None:
    """The prefill endpoint the sidecar at ``url`` sent ``request_id`` to (None: prefilled on
    its decode engine, or no record)."""
    async with http.get(f"{url}/debug/requests/{request_id}") as response:
        if response.status != 200:
            await response.read()
            return None
        endpoint = orjson.loads(await response.read()).get("prefill_endpoint")
    return endpoint if isinstance(endpoint, str) else None


async def run_once(
    cluster: LiveCluster,
    http: aiohttp.ClientSession,
    workload: Workload,
    name: str,
    sidecars: list[Child],
) -> tuple[RunResult, str]:
    """The workload through ``sidecars``, on emulators with empty prefix caches."""
    await cluster.reset_caches(http)
    try:
        for child in sidecars:
            await until(functools.partial(scheduling, http, child.url, len(cluster.prefill)))
        bodies = [
            orjson.dumps(
                {
                    "prompt": workload.prompt(index),
                    "max_tokens": request.output_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
            for index, request in enumerate(workload.requests)
        ]
        before = [await counters(http, child) for child in cluster.prefill]
        contention = Contention()
        contention.start()
        start = asyncio.get_running_loop().time() + 0.2
        homes = random.Random(f"homes-{workload.seed}")
        via = [sidecars[homes.randrange(len(sidecars))].url for _ in workload.requests]
        outcomes = await asyncio.gather(
            *(
                send(http, url, body, start + r.at, f"{name}-{i}")
                for i, (r, body, url) in enumerate(zip(workload.requests, bodies, via, strict=True))
            )
        )
        await contention.stop()
        placements = [await placed_on(http, url, f"{name}-{i}") for i, url in enumerate(via)]
        after = [await counters(http, child) for child in cluster.prefill]
        remote = error_sum = error_count = predicted = reported = 0.0
        reasons: dict[str, float] = {}
        views = []
        for child in sidecars:
            async with http.get(child.url + "/metrics") as response:
                metrics = Metrics.parse(await response.text())
            remote += metrics.value("pd_sidecar_scheduler_decisions_total", decision="remote")
            by = metrics.by_label("pd_sidecar_scheduler_decisions_total", "decision", "reason")
            for (decision, reason), count in by.items():
                if count:
                    key = f"{decision}/{reason}"
                    reasons[key] = reasons.get(key, 0.0) + count
            error_sum += metrics.value(ERROR_METRIC + "_sum")
            error_count += metrics.value(ERROR_METRIC + "_count")
            predicted += metrics.value(CACHED_METRIC, source="predicted")
            reported += metrics.value(CACHED_METRIC, source="reported")
            async with http.get(child.url + "/debug/scheduler") as response:
                views.append(orjson.loads(await response.read()).get("prefill_prefixes"))
    finally:
        await asyncio.gather(*(child.stop() for child in sidecars))
    done = [o for o in outcomes if o is not None]
    told = [(o, r) for o, r in zip(outcomes, workload.requests, strict=True) if o is not None]
    cached = [o.cached_tokens for o, _ in told if o.cached_tokens is not None]
    prompt = sum(workload.prompt_tokens(r) for o, r in told if o.cached_tokens is not None)
    result = RunResult(
        name=name,
        ttfts=[o.ttft_s for o in done],
        failed=len(outcomes) - len(done),
        remote_share=remote / max(1, len(outcomes)),
        cached_share=sum(cached) / prompt if prompt else None,
        hits=[(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)],
        reasons=reasons,
        error_sum=error_sum,
        error_count=error_count,
        predicted=predicted,
        reported=reported,
        prefixes_views=views,
        placements=placements,
    )
    return result, contention.describe()


# --- the report -----------------------------------------------------------------------------


def report(results: list[RunResult]) -> list[str]:
    lines = [
        f"{'run':<14}{'TTFT mean':>10}{'p50':>8}{'p90':>8}{'failed':>8}{'remote':>8}"
        f"{'cached':>8}  prefill emulators' hits / queries (tokens, this run)"
    ]
    for r in results:
        cached = "n/a" if r.cached_share is None else f"{r.cached_share * 100:.0f}%"
        hits = ", ".join(f"{h:,.0f}/{q:,.0f} ({h / q * 100 if q else 0:.0f}%)" for h, q in r.hits)
        lines.append(
            f"{r.name:<14}{r.ttft('mean') * 1000:>8.0f}ms{r.ttft('p50') * 1000:>6.0f}ms"
            f"{r.ttft('p90') * 1000:>6.0f}ms{r.failed:>8}{r.remote_share * 100:>7.0f}%"
            f"{cached:>8}  {hits}"
        )
    for r in results:
        placed = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.reasons.items()))
        lines.append(f"{r.name}: placements {placed}")
    for r in results:
        if r.error_count:
            abs_error = r.mean_abs_error()
            error = (
                f"mean {r.error_sum / r.error_count:+,.0f} tokens (predicted - reported)"
                + ("" if abs_error is None else f", mean |error| {abs_error:,.0f}")
                + f" over {r.error_count:,.0f} prefills; hits predicted {r.predicted:,.0f}, "
                f"reported {r.reported:,.0f} tokens"
                + (f" ({r.predicted / r.reported - 1:+.1%})" if r.reported else "")
            )
        else:
            error = f"none ({ERROR_METRIC}: no sample)"
        lines.append(f"{r.name}: prediction error {error}")
        if r.error_count:
            for i, view in enumerate(r.prefixes_views):
                text = orjson.dumps(view).decode()
                lines.append(f"  sidecar {i} prefill_prefixes: {text[:400]}")
    return lines


def verdict(blind: RunResult, aware: RunResult) -> tuple[bool, str]:
    ratios = {stat: aware.ttft(stat) / blind.ttft(stat) for stat in ("mean", "p50", "p90")}
    hits = sum(h for h, _ in aware.hits)
    ok = ratios["mean"] <= TARGET and hits > 0 and blind.failed == aware.failed == 0
    text = (
        "TTFT prefix-aware / prefix-blind: "
        + ", ".join(f"{stat} {ratio:.2f}" for stat, ratio in ratios.items())
        + f" (target: mean <= {TARGET}); prefill cache hits, prefix-aware: {hits:,.0f} tokens"
    )
    return ok, text


# --- affinity under bounded caches ----------------------------------------------------------

AFFINITY_HITS = 0.85
"""The prefill servers' hit ratio, prefix-aware, of the ideal, at least."""
AFFINITY_TTFT = 0.8
"""Mean TTFT prefix-aware / round robin, at most."""
AFFINITY_ONE_SERVER = 0.8
"""Of each prefix's remote prefills, the share on its busiest server, at least."""
AFFINITY_JUDGED = 5
"""Prefixes with fewer remote prefills than this are listed, not judged."""
AFFINITY_DECODE_BLOCKS = 64
"""The decode emulators' prefix caches in ``--affinity``: too small to hold a system prompt, so
that the decider sees every prompt uncached on its decode engine and the prefills go remote."""


def block_tokens(tokens: int) -> int:
    """Of a prompt part of ``tokens`` at its start, the tokens in whole cached blocks (64
    characters, 16 tokens: the emulators' and the sidecar's)."""
    block_chars = CALIBRATION.block_size * CHARS_PER_TOKEN
    return (tokens * CHARS_PER_TOKEN // block_chars) * CALIBRATION.block_size


def ideal_hits(workload: Workload, remote: Sequence[bool]) -> tuple[float, float]:
    """Prefix-cache hits, and prompt tokens, of the remote prefills (``remote``, per request) if
    each system prompt were computed once in all and held ever after: a bound that does not
    depend on where the prefills went."""
    seen: set[int] = set()
    hits = tokens = 0.0
    for request, went in zip(workload.requests, remote, strict=True):
        if not went:
            continue
        tokens += workload.prompt_tokens(request)
        if request.system in seen:
            hits += block_tokens(workload.system_tokens[request.system])
        seen.add(request.system)
    return hits, tokens


def one_server_shares(
    workload: Workload, placements: Sequence[str | None]
) -> dict[int, tuple[float, int]]:
    """Per system prompt: the share of its remote prefills on its busiest server, and their
    count."""
    by_system: dict[int, Counter[str]] = {}
    for request, endpoint in zip(workload.requests, placements, strict=True):
        if endpoint is not None:
            by_system.setdefault(request.system, Counter())[endpoint] += 1
    return {
        system: (counts.most_common(1)[0][1] / counts.total(), counts.total())
        for system, counts in sorted(by_system.items())
    }


def affinity_report(
    workload: Workload, baseline: RunResult, aware: RunResult
) -> tuple[bool, list[str]]:
    lines = []
    ok = baseline.failed == aware.failed == 0
    for r in (baseline, aware):
        hits = sum(h for h, _ in r.hits)
        queries = sum(q for _, q in r.hits)
        best, prompt = ideal_hits(workload, [p is not None for p in r.placements])
        shares = one_server_shares(workload, r.placements)
        judged = [share for share, count in shares.values() if count >= AFFINITY_JUDGED]
        lines.append(
            f"{r.name}: prefill servers' hit ratio {hits / queries if queries else 0:.3f}, "
            f"ideal {best / prompt if prompt else 0:.3f}; mean TTFT {r.ttft('mean') * 1000:.0f} ms"
            f"; remote {sum(p is not None for p in r.placements)}/{len(r.placements)}; "
            f"prefixes on one server for >= {AFFINITY_ONE_SERVER:.0%} of their prefills: "
            f"{sum(share >= AFFINITY_ONE_SERVER for share in judged)}/{len(judged)} "
            f"(lowest {min(judged, default=math.nan):.2f})"
        )
        lines.append(
            "  per prefix (share on its busiest server / remote prefills): "
            + ", ".join(f"{s}: {share:.2f}/{count}" for s, (share, count) in shares.items())
        )
    hits = sum(h for h, _ in aware.hits)
    queries = sum(q for _, q in aware.hits)
    best, prompt = ideal_hits(workload, [p is not None for p in aware.placements])
    of_ideal = (hits / queries) / (best / prompt) if queries and best else 0.0
    ttft = aware.ttft("mean") / baseline.ttft("mean")
    aware_shares = one_server_shares(workload, aware.placements).values()
    judged = [share for share, count in aware_shares if count >= AFFINITY_JUDGED]
    ok = ok and of_ideal >= AFFINITY_HITS and ttft <= AFFINITY_TTFT
    ok = ok and all(share >= AFFINITY_ONE_SERVER for share in judged)
    servers = sorted({p for p in aware.placements if p is not None})
    for system, (share, count) in one_server_shares(workload, aware.placements).items():
        if count >= AFFINITY_JUDGED and share < AFFINITY_ONE_SERVER:
            order = [
                f"{servers.index(p)}@{r.at:.1f}s" if p is not None else f"local@{r.at:.1f}s"
                for r, p in zip(workload.requests, aware.placements, strict=True)
                if r.system == system
            ]
            lines.append(f"  prefix {system}, its requests' servers in order: {' '.join(order)}")
    lines.append(
        f"prefix-aware: hit ratio {of_ideal:.2f} of the ideal (target >= {AFFINITY_HITS}); "
        f"mean TTFT {ttft:.2f} x round robin's (target <= {AFFINITY_TTFT}); every prefix with "
        f">= {AFFINITY_JUDGED} remote prefills on one server for >= {AFFINITY_ONE_SERVER:.0%} "
        f"of them: {all(share >= AFFINITY_ONE_SERVER for share in judged)}"
    )
    return ok, lines


async def affinity_main(args: argparse.Namespace) -> int:
    """Round robin against prefix-aware placement on ``--servers`` equal prefill servers whose
    prefix caches each hold ``--cache-share`` of the system prompts' blocks."""
    systems = system_prompts(args.seed)
    shared_tokens = sum(block_tokens(tokens) for tokens in systems)
    blocks = math.ceil(args.cache_share * shared_tokens / CALIBRATION.block_size)
    speed = CALIBRATION.prefill_tokens_per_s
    shape = Shape(
        blocks,
        speedup=QUICK_SPEEDUP if args.quick else 1.0,
        decode_num_gpu_blocks=AFFINITY_DECODE_BLOCKS,
        prefill_speeds=(speed,) * args.servers,
    )
    capacity = pool_rate(args.seed, shape.speeds())
    rate = args.rate or args.load * capacity
    workload = make_workload(args.seed, rate, args.duration)
    print(
        f"pd-sidecar prefix affinity benchmark: {len(workload.requests)} requests over "
        f"{args.duration:g} s at {rate:.2f} req/s ({rate / capacity * 100:.0f} % of what the "
        f"prefill pool computes without cache hits), seed {args.seed}; {args.servers} prefill "
        f"emulators at {speed:,.0f} tokens/s holding {blocks:,} blocks each "
        f"({args.cache_share:g} of the {SYSTEM_PROMPTS} system prompts' blocks); load average "
        f"before: {load_average()}"
    )
    cluster = LiveCluster(shape, args.log_dir, dict(v.split("=", 1) for v in args.sidecar_env))
    named = {
        "round-robin": {INDEX_SETTING: "true", "SIDECAR_SCHEDULER_POLICY": "round_robin"},
        "prefix-aware": {INDEX_SETTING: "true"},
    }
    runs = [(f"p{os.getpid()}{i}", settings) for i, settings in enumerate(named.values())]
    results: list[RunResult] = []
    started = time.monotonic()
    try:
        pairs = await cluster.start(runs)
        print(f"logs: {cluster.log_dir}", flush=True)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        ) as http:
            for name, sidecars in zip(named, pairs, strict=True):
                result, contention = await run_once(cluster, http, workload, name, sidecars)
                results.append(result)
                print(f"  {name}: done; {contention}", flush=True)
    finally:
        await cluster.close()
    print()
    for line in report(results):
        print(line)
    ok, lines = affinity_report(workload, *results)
    for line in lines:
        print(line)
    print(f"{time.monotonic() - started:.0f} s; load average after: {load_average()}")
    if args.quick:
        print("--quick: not judged")
        return 0
    print("target met" if ok else "target missed - FAIL")
    return 0 if ok else 1


async def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raise_open_files_limit()
    if args.affinity:
        return await affinity_main(args)
    shape = Shape(
        args.num_gpu_blocks,
        speedup=QUICK_SPEEDUP if args.quick else 1.0,
        decode_num_gpu_blocks=args.decode_num_gpu_blocks,
    )
    capacity = pool_rate(args.seed, shape.speeds())
    rate = args.rate or args.load * capacity
    workload = make_workload(args.seed, rate, args.duration)
    print(
        f"pd-sidecar prefix benchmark: {len(workload.requests)} requests over "
        f"{args.duration:g} s at {rate:.2f} req/s ({rate / capacity * 100:.0f} % of what the "
        f"prefill pool computes without cache hits), seed {args.seed}; load average before: "
        f"{load_average()}"
    )
    print(
        f"workload: {SYSTEM_PROMPTS} system prompts of {SYSTEM_TOKENS[0]:,}-{SYSTEM_TOKENS[1]:,} "
        f"tokens (Zipf s = {ZIPF_S}), user parts {USER_TOKENS[0]}-{USER_TOKENS[1]}, outputs "
        f"{OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]} tokens; cluster: 4 prefill emulators ("
        + ", ".join(f"{s:,.0f}" for s in shape.speeds())
        + f" tokens/s), 2 decode emulators, {shape.num_gpu_blocks:,} blocks of 16 tokens each"
        + (
            f" ({shape.decode_num_gpu_blocks:,} on the decode emulators)"
            if shape.decode_num_gpu_blocks
            else ""
        )
        + ", 2 sidecars, redis"
        + (f" (--quick: {QUICK_SPEEDUP:g}x faster engines)" if args.quick else "")
    )
    cluster = LiveCluster(shape, args.log_dir, dict(v.split("=", 1) for v in args.sidecar_env))
    results: list[RunResult] = []
    started = time.monotonic()
    runs = [
        (f"p{os.getpid()}{tag}", {INDEX_SETTING: "true" if aware else "false"})
        for tag, aware in (("b", False), ("a", True))
    ]
    try:
        pairs = await cluster.start(runs)
        print(f"logs: {cluster.log_dir}", flush=True)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        ) as http:
            for name, sidecars in zip(("prefix-blind", "prefix-aware"), pairs, strict=True):
                result, contention = await run_once(cluster, http, workload, name, sidecars)
                results.append(result)
                print(f"  {result.name}: done; {contention}", flush=True)
    finally:
        await cluster.close()
    print()
    for line in report(results):
        print(line)
    ok, text = verdict(*results)
    print(text)
    print(f"{time.monotonic() - started:.0f} s; load average after: {load_average()}")
    if args.quick:
        print("--quick: not judged")
        return 0
    print("target met" if ok else "target missed - FAIL")
    return 0 if ok else 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench prefix_live", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--load", type=float, default=0.7, help="of the uncached pool's rate")
    parser.add_argument("--rate", type=float, help="req/s (instead of --load)")
    parser.add_argument("--seed", type=int, default=1, help="the workload's seed")
    parser.add_argument(
        "--num-gpu-blocks", type=int, default=4000, help="every emulator's KV blocks (16 tokens)"
    )
    parser.add_argument(
        "--decode-num-gpu-blocks",
        type=int,
        default=None,
        help="the decode emulators' KV blocks (default: --num-gpu-blocks)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 s at 4 req/s, 20x faster engines; no verdict"
    )
    parser.add_argument(
        "--affinity",
        action="store_true",
        help="round robin against prefix-aware on equal prefill servers with bounded caches",
    )
    parser.add_argument(
        "--servers", type=int, default=2, help="--affinity: prefill servers (default 2)"
    )
    parser.add_argument(
        "--cache-share",
        type=float,
        default=0.5,
        help="--affinity: each prefill cache holds this share of the system prompts (0.5)",
    )
    add_launcher_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.duration = min(args.duration, 1.0)
        args.rate = args.rate or 4.0
    return args


def main_cli(argv: list[str] | None = None) -> int:
    return run(functools.partial(main, argv))


if __name__ == "__main__":
    sys.exit(main_cli())
