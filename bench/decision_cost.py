"""The scheduler's own decision cost: placing a 2,000-token prompt among 8 prefill endpoints.

    python bench/decision_cost.py      # every policy on the memory backend, qoe on Redis
    python bench/decision_cost.py --iterations 500 --policies qoe

Runs the sidecar's real scheduling objects in this process (no HTTP): a ``Scheduler`` with a
static pool of 8 endpoints (nothing listens there: the scraper is not started, so candidates
have no scraped load, only reservations) and its state backend, memory or Redis (a
``redis-server`` started on a free loopback port; skipped with a note when the program is
missing). Each iteration times ``await scheduler.place(body, None)`` with ``perf_counter_ns``
for a completion whose prompt is 8,000 characters (2,000 estimated tokens), distinct per
iteration like real traffic (so the prefix index hashes and inserts its 125 blocks every time);
up to ``IN_FLIGHT`` placements stay reserved, the oldest released after each new one, so
policies see non-trivial reservations. Reported: the median and p99 in microseconds, and the
parts of a placement timed on their own (the prompt's size and text, the prefix index: hashing
once, lookup and insert; the decider and policy on 8 ready-made candidates). A placement also
claims the decode rank (one, ``SIDECAR_DECODE_URL``), ended when its reservation is released.
With Redis, the round trip of one ``PING`` through the same client library is measured apart,
so that the placement reads as one round trip plus the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import statistics
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis.asyncio as aioredis

from devkit.processes import Launcher, free_port, tcp_open
from devkit.stats import percentile
from sidecar.config import Settings
from sidecar.discovery import Discovery
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.decider import Decider
from sidecar.scheduling.endpoints import Endpoint
from sidecar.scheduling.model import Candidate, LocalView
from sidecar.scheduling.placement import Placement
from sidecar.scheduling.policies import POLICIES, make_policy
from sidecar.scheduling.prompts import PrefixIndex, estimate_tokens, prompt_text
from sidecar.scheduling.scheduler import Scheduler, SchedulerOptions
from sidecar.scheduling.state import MemoryState, StateBackend
from sidecar.scheduling.state.redis import RedisState

ENDPOINTS = 8
PROMPT_TOKENS = 2000
IN_FLIGHT = 4
"""Placements kept reserved while the next is made (half an endpoint's worth each)."""


def body(index: int) -> dict[str, Any]:
    prompt = f"{index:>12} " + "w" * (PROMPT_TOKENS * 4 - 13)
    return {"model": "emulated-model", "prompt": prompt, "max_tokens": 16}


def summary(samples_ns: list[int]) -> dict[str, float]:
    us = [s / 1000 for s in samples_ns]
    return {
        "median_us": statistics.median(us),
        "p99_us": percentile(us, 99),
        "n": len(us),
    }


def pool() -> tuple[Endpoint, ...]:
    return tuple(Endpoint("127.0.0.1", 20000 + i) for i in range(ENDPOINTS))


async def time_placements(
    policy: str, backend: StateBackend, iterations: int, *, pause_s: float = 0.0
) -> tuple[dict[str, float], Counter[str]]:
    """Placements timed one by one on a scheduler over ``backend``; ``pause_s`` between them
    (untimed) lets a Redis backend's background sync of the last release finish first."""
    settings = Settings(
        decode_url="http://127.0.0.1:1",
        prefill_endpoints=pool(),
        scheduler_policy=policy,
        scheduler_seed=0,
    )
    scheduler = Scheduler(
        SchedulerOptions.from_settings(settings),
        discovery=Discovery(settings.prefill_endpoints, None),
        backend=backend,
        metrics=Metrics(),
    )
    # No engine monitor: its scrapes would eject the 8 endpoints nobody listens on.
    await scheduler.start()
    reasons: Counter[str] = Counter()
    held: deque[Placement] = deque()
    samples: list[int] = []
    try:
        for index in range(iterations + iterations // 10):  # the first tenth warms up
            request = body(index)
            start = time.perf_counter_ns()
            placement = await scheduler.place(request, None)
            elapsed = time.perf_counter_ns() - start
            if index >= iterations // 10:
                samples.append(elapsed)
                reasons[placement.decision.reason] += 1
            held.append(placement)
            if len(held) > IN_FLIGHT:
                done = held.popleft()
                if done.endpoint is None:
                    scheduler.local_first_byte(done, None)
                else:
                    scheduler.prefill_finished(done, ok=None)
                done.rank.end()  # the decode rank's slot, as the pipeline ends it
            if pause_s:
                await asyncio.sleep(pause_s)
    finally:
        await scheduler.close()
    return summary(samples), reasons


def time_parts(iterations: int) -> dict[str, dict[str, float]]:
    """The pieces of one placement, each timed on its own."""
    index = PrefixIndex(block_tokens=16, capacity_blocks=65536)
    rng = random.Random(0)
    decider = Decider(make_policy("qoe", rng))
    candidates = [
        Candidate(key=str(e), reserved_tokens=1000 * (i % 3), reserved_requests=i % 3)
        for i, e in enumerate(pool())
    ]
    parts: dict[str, list[int]] = {"size and text": [], "prefix index": [], "decider (qoe)": []}
    for i in range(iterations):
        request = body(10**9 + i)
        t0 = time.perf_counter_ns()
        tokens = estimate_tokens(request)
        text = prompt_text(request)
        t1 = time.perf_counter_ns()
        hashes = index.hashes(text)
        cached = index.cached_tokens(hashes)
        index.insert(hashes)
        t2 = time.perf_counter_ns()
        decider.decide(candidates, LocalView(), prompt_tokens=tokens, cached_tokens=cached)
        t3 = time.perf_counter_ns()
        parts["size and text"].append(t1 - t0)
        parts["prefix index"].append(t2 - t1)
        parts["decider (qoe)"].append(t3 - t2)
    return {name: summary(samples) for name, samples in parts.items()}


async def round_trip(url: str, iterations: int) -> dict[str, float]:
    """One PING through redis.asyncio, the client the Redis backend uses."""
    client = aioredis.Redis.from_url(url)
    samples = []
    try:
        await client.ping()
        for _ in range(iterations):
            start = time.perf_counter_ns()
            await client.ping()
            samples.append(time.perf_counter_ns() - start)
    finally:
        await client.aclose()
    return summary(samples)


async def with_redis(
    launcher: Launcher, run: Callable[[str], Awaitable[dict[str, Any]]]
) -> dict[str, Any] | str:
    """``run(url)`` against a fresh redis-server, or why it could not start."""
    binary = shutil.which("redis-server")
    if binary is None:
        return "skipped: redis-server is not installed"
    port = free_port()
    argv = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
    ]  # fmt: skip
    child = await launcher.start(
        "redis", argv, ready=lambda: tcp_open("127.0.0.1", port), timeout_s=10
    )
    try:
        return await run(f"redis://127.0.0.1:{port}/0")
    finally:
        await child.stop()


async def measure(
    iterations: int, policies: list[str], *, redis_policy: str = "qoe"
) -> dict[str, Any]:
    """Every figure of the decision-cost part, as the JSON report holds it."""
    result: dict[str, Any] = {
        "prompt_tokens": PROMPT_TOKENS,
        "endpoints": ENDPOINTS,
        "in_flight": IN_FLIGHT,
        "memory": {},
        "parts": time_parts(iterations),
    }
    for policy in policies:
        figures, reasons = await time_placements(policy, MemoryState(), iterations)
        result["memory"][policy] = {**figures, "reasons": dict(reasons)}

    if redis_policy not in result["memory"]:
        figures, _ = await time_placements(redis_policy, MemoryState(), iterations)
        result["memory"][redis_policy] = {**figures, "reasons": {}}
    memory_median = result["memory"][redis_policy]["median_us"]

    async def redis_run(url: str) -> dict[str, Any]:
        errors: Counter[str] = Counter()

        def count(kind: str) -> None:
            errors[kind] += 1

        # The production decision budget (SIDECAR_STATE_TIMEOUT_MS, 5 ms): a placement whose
        # sync takes longer decides on the local view; counted here, not logged each time.
        backend = RedisState(url, prefix="bench", lease_s=10, timeout_s=0.005, on_error=count)
        quiet = logging.getLogger("sidecar.scheduling")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            figures, reasons = await time_placements(
                redis_policy, backend, iterations, pause_s=0.002
            )
        finally:
            quiet.setLevel(level)
        ping = await round_trip(url, iterations)
        return {
            "policy": redis_policy,
            **figures,
            "reasons": dict(reasons),
            "ping": ping,
            "over_round_trip_us": figures["median_us"] - ping["median_us"],
            "over_memory_us": figures["median_us"] - memory_median,
            "backend_errors": dict(errors),
        }

    async with Launcher(prefix="pd-sidecar-bench-redis-") as launcher:
        result["redis"] = await with_redis(launcher, redis_run)
    return result


def report(result: dict[str, Any]) -> list[str]:
    """The decision-cost table, as lines."""
    lines = [
        f"scheduler decision: a {result['prompt_tokens']}-token prompt among"
        f" {result['endpoints']} endpoints, {result['in_flight']} placements in flight",
        f"  {'what':<34} {'median µs':>10} {'p99 µs':>10}",
    ]
    for policy, figures in result["memory"].items():
        lines.append(
            f"  {'place(), memory, ' + policy:<34} {figures['median_us']:>10.1f}"
            f" {figures['p99_us']:>10.1f}"
        )
    for part, figures in result["parts"].items():
        lines.append(
            f"  {'  part: ' + part:<34} {figures['median_us']:>10.1f} {figures['p99_us']:>10.1f}"
        )
    redis = result["redis"]
    if isinstance(redis, str):
        lines.append(f"  place(), redis: {redis}")
    else:
        lines.append(
            f"  {'place(), redis, ' + redis['policy']:<34} {redis['median_us']:>10.1f}"
            f" {redis['p99_us']:>10.1f}"
        )
        lines.append(
            f"  {'  redis PING round trip':<34} {redis['ping']['median_us']:>10.1f}"
            f" {redis['ping']['p99_us']:>10.1f}"
        )
        lines.append(
            f"  = one round trip + {redis['over_round_trip_us']:.1f} µs (medians);"
            f" {redis['over_memory_us']:.1f} µs more than on the memory backend;"
            f" decisions {redis['reasons']}; over the 5 ms budget"
            f" {redis['backend_errors'].get('timeout', 0)} times"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--iterations", type=int, default=2000, help="timed placements each")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    args = parser.parse_args(argv)
    from bench.cluster import run

    async def go() -> int:
        result = await measure(args.iterations, args.policies.split(","))
        print("\n".join(report(result)))
        return 0

    return run(go)


if __name__ == "__main__":
    sys.exit(main())
