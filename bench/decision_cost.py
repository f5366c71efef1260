"""The scheduler's own decision cost: placing a 2,000-token prompt among 8 prefill endpoints.

    python -m bench decision_cost      # every policy on the memory backend, qoe on Redis
    python -m bench decision_cost --iterations 500 --policies qoe
    python -m bench decision_cost --baseline ../main --rounds 3   # A/B, interleaved
    python -m bench decision_cost --instructions --baseline ../main  # callgrind, Ir per placement
    python -m bench decision_cost --kv-events   # the exact indexes in sync: bench/decision_kv.py
    python -m bench decision_cost --quick       # 100 placements each

Runs the sidecar's real scheduling objects in this process (no HTTP): a ``Scheduler`` with a static
pool of 8 endpoints (nothing listens there: the scraper is not started, so candidates have no
scraped load, only reservations) and its state backend, memory or Redis (a ``redis-server`` started
on a free loopback port; skipped with a note when the program is missing). The prefill prefix index
is on with a keyed hash (``SIDECAR_PREFIX_HASH_KEY``, a fixed bench key), as is the local decode
prefix index. Each iteration times ``await scheduler.place_request(body, None)`` with
``perf_counter_ns`` for a completion whose prompt is 8,000 characters (2,000 estimated tokens),
distinct per iteration like real traffic (so both prefix indexes hash and insert every block every
time: 125 local blocks of 16 tokens, 31 prefill blocks of 64); up to ``IN_FLIGHT`` placements stay
reserved, the oldest released after each new one, so policies see non-trivial reservations.
Reported: the median and p99 in microseconds, and the parts of a placement timed on their own. A
decision hashes a prompt only as far as its look-ups read it (the first miss, for a distinct
prompt); what the placement teaches the indexes is recorded after ``place_request()`` returns
(``Scheduler._record``, in the loop's next turn): timed apart, right after each placement, as
"recorded after". The parts: the local index (the prompt's hashes to the first miss, the rank's
look-up), the candidates with their per-endpoint look-ups (8 prefill indexes), the policy (the
decider on 8 ready-made candidates), the reservation (the backend's reserve, the prediction kept),
and, recorded after, the local index's insert (every block hashed) and the prefill index's (every
block hashed, the chosen endpoint's index updated, the prefix published).

With Redis: the round trip of one ``PING`` and of an ``EVALSHA`` of an empty script through the
same client library, measured apart, so that the placement reads as one round trip plus the
rest; the placements run twice, with the prefix share on (the key set: each placement publishes
its blocks) and off, to show that publishing stays off the decision's path.

``--baseline DIR``: the placements (memory and Redis, qoe) of the checkout DIR's ``sidecar``
too, each variant in a process of its own, alternated ``--rounds`` times against one
redis-server. ``--instructions``: instructions (callgrind's ``Ir``) per memory placement, of
this checkout and of the baseline, which the machine's load does not move; for a checkout that
records after the decision, the decision's own too (the same run with the recording left out,
which for distinct prompts changes no look-up: they miss at the first block either way).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if os.environ.get("DECISION_COST_NO_HIREDIS"):  # redis-py as without hiredis: its Python parser
    sys.modules["hiredis"] = None  # type: ignore[assignment]

import argparse
import asyncio
import functools
import glob
import json
import logging
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from bench.suite import add_quick, apply_quick
from devkit.processes import Launcher, free_port, tcp_open
from devkit.stats import percentile
from sidecar.config import Settings
from sidecar.discovery import Discovery
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.model import LocalView
from sidecar.scheduling.placement import Placement
from sidecar.scheduling.policies import POLICIES
from sidecar.scheduling.scheduler import Scheduler, SchedulerOptions
from sidecar.scheduling.state import MemoryState, StateBackend
from sidecar.scheduling.state.redis import RedisState

if TYPE_CHECKING:
    from sidecar.fleet.endpoints import Endpoint

REPO = Path(__file__).resolve().parent.parent
ENDPOINTS = 8
PROMPT_TOKENS = 2000
IN_FLIGHT = 4
"""Placements kept reserved while the next is made (half an endpoint's worth each)."""
HASH_KEY = "decision-cost-bench-key"
"""``SIDECAR_PREFIX_HASH_KEY`` of the bench's schedulers (keyed, stable hashes)."""


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


@functools.cache
def pool() -> tuple[Endpoint, ...]:
    """Parsed by the settings (once): the measured code imports no module a ``--baseline`` checkout
    may keep elsewhere (``Endpoint``'s)."""
    addresses = ",".join(f"127.0.0.1:{20000 + i}" for i in range(ENDPOINTS))
    return Settings(decode_url="http://127.0.0.1:1", prefill_endpoints=addresses).prefill_endpoints


def scheduler_on(backend: StateBackend, policy: str, *, key: str | None = HASH_KEY) -> Scheduler:
    settings = Settings(
        decode_url="http://127.0.0.1:1",
        prefill_endpoints=pool(),
        scheduler_policy=policy,
        scheduler_seed=0,
        prefill_prefix_index=True,
        prefix_hash_key=key,
    )
    return Scheduler(
        SchedulerOptions.from_settings(settings),
        discovery=Discovery(settings.prefill_endpoints, None),
        backend=backend,
        metrics=Metrics(),
    )


def finish(scheduler: Scheduler, done: Placement) -> None:
    if done.endpoint is None:
        scheduler.local_first_byte(done, None)
    else:
        scheduler.prefill_finished(done, ok=None)
    done.rank.end()  # the decode rank's slot, as the pipeline ends it


async def time_placements(
    policy: str,
    backend: StateBackend,
    iterations: int,
    *,
    pause_s: float = 0.0,
    key: str | None = HASH_KEY,
    timed: bool = True,
    recorded: bool = True,
) -> tuple[dict[str, float], Counter[str], dict[str, Any]]:
    """Placements timed one by one on a scheduler over ``backend``; ``pause_s`` between them
    (untimed) lets a Redis backend's background sync of the last release finish first. Each
    placement's recording (this checkout's ``Scheduler._record``) is applied right after it,
    timed apart (``recorded=False``: left out, to count the decision alone). Returns the
    figures, the decisions' reasons and the backend's status at the end."""
    scheduler = scheduler_on(backend, policy, key=key)
    # No engine monitor: its scrapes would eject the 8 endpoints nobody listens on.
    await scheduler.start()
    # What the placement records after its decision (a checkout that records while placing: None).
    record: Callable[[], None] | None = getattr(scheduler, "_record", None)
    if record is not None and not recorded:
        scheduler._defer = lambda *_: None  # type: ignore[method-assign]
    reasons: Counter[str] = Counter()
    held: deque[Placement] = deque()
    samples: list[int] = []
    cpu_samples: list[int] = []
    record_cpu: list[int] = []
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    try:
        for index in range(iterations + iterations // 10):  # the first tenth warms up
            request = body(index)
            start, cpu_start = clock(), cpu()
            placement, _ = await scheduler.place_request(request, None)
            elapsed, cpu_elapsed = clock() - start, cpu() - cpu_start
            if record is not None:  # as the loop's next turn would: not in the decision's time
                cpu_start = cpu()
                record()
                if index >= iterations // 10:
                    record_cpu.append(cpu() - cpu_start)
            if index >= iterations // 10:
                samples.append(elapsed)
                cpu_samples.append(cpu_elapsed)
                reasons[placement.decision.reason] += 1
            held.append(placement)
            if len(held) > IN_FLIGHT:
                finish(scheduler, held.popleft())
            if pause_s:
                await asyncio.sleep(pause_s)
        status = backend.status()
    finally:
        await scheduler.close()
    figures = summary(samples) if timed else {}
    if timed:  # the thread's CPU time: what other processes on the machine inflate least
        figures["cpu_median_us"] = summary(cpu_samples)["median_us"]
        if record_cpu:
            figures["recorded_after_cpu_median_us"] = summary(record_cpu)["median_us"]
    return figures, reasons, status


HISTORY = "".join(
    f"turn {n:04d}: something said in the conversation. ".ljust(100) for n in range(80)
)
"""A conversation's 2,000-token history (8,000 characters), for ``time_continuations``."""


async def time_continuations(iterations: int, block_tokens: int) -> dict[str, float]:
    """A continuation's decision: ``HISTORY`` placed once, then each placement that history and
    a distinct 50-token turn (the local rank and the endpoint it went to hold the history, so
    both indexes hash its blocks to find the match); local blocks of ``block_tokens``. The
    thread's CPU median of the decision and of its recording after."""
    settings = Settings(
        decode_url="http://127.0.0.1:1",
        prefill_endpoints=pool(),
        scheduler_seed=0,
        prefix_hash_key=HASH_KEY,
        prefix_block_tokens=block_tokens,
    )
    scheduler = Scheduler(
        SchedulerOptions.from_settings(settings),
        discovery=Discovery(settings.prefill_endpoints, None),
        backend=MemoryState(),
        metrics=Metrics(),
    )
    await scheduler.start()
    record: Callable[[], None] = getattr(scheduler, "_record", lambda: None)
    cpu = time.thread_time_ns
    decisions: list[int] = []
    after: list[int] = []
    try:
        first, _ = await scheduler.place_request({"model": "m", "prompt": HISTORY}, None)
        finish(scheduler, first)
        for i in range(iterations + iterations // 10):
            turn = {"model": "m", "prompt": HISTORY + f"{i:>8} " + "q" * 192, "max_tokens": 1}
            start = cpu()
            placement, _ = await scheduler.place_request(turn, None)
            middle = cpu()
            record()
            end = cpu()
            finish(scheduler, placement)
            if i >= iterations // 10:
                decisions.append(middle - start)
                after.append(end - middle)
    finally:
        await scheduler.close()
    return {
        "cpu_median_us": summary(decisions)["median_us"],
        "recorded_after_cpu_median_us": summary(after)["median_us"],
    }


def time_parts(iterations: int) -> dict[str, dict[str, float]]:
    """The pieces of one placement, each timed on its own, on a scheduler's own objects (the
    ``Scheduler``'s private parts: this bench reads them as ``_place`` and ``_record`` use
    them)."""
    scheduler = scheduler_on(MemoryState(), "qoe")
    planner, ranks, hasher = scheduler._planner, scheduler.ranks, scheduler._hasher
    assert hasher is not None
    for endpoint in pool():
        planner.join(endpoint, scheduler.pool.new_health())
    # What _reserve would record after the decision is applied (and timed) below instead.
    scheduler._defer = lambda *_: None  # type: ignore[method-assign]
    names = [
        "local index, to the first miss",
        "candidates, their look-ups (8)",
        "policy (qoe, 8 candidates)",
        "reservation",
        "after: local index (125 blocks)",
        "after: prefill index (31 blocks)",
    ]
    parts: dict[str, list[int]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    held: deque[Any] = deque()
    for i in range(iterations + iterations // 10):
        text = body(10**9 + i)["prompt"]
        t0 = clock()
        local = ranks.blocks(text)
        claim, cached = ranks.choose(local, PROMPT_TOKENS, text)
        t1 = clock()
        data = text.encode()
        hashes = hasher.blocks(data)
        view, now, wall = scheduler._now()
        candidates = planner.candidates(view, now, wall, hashes)
        t2 = clock()
        decision = planner.decider.decide(
            candidates,
            LocalView(
                claim.rank.ahead_tokens, None, planner.local_speed.value, claim.rank.inflight - 1
            ),
            prompt_tokens=PROMPT_TOKENS,
            cached_tokens=cached,
        )
        t3 = clock()
        chosen = decision.endpoint or candidates[0].key
        placement = scheduler._reserve(
            decision, planner.pool[chosen].endpoint, claim, hashes, len(data)
        )
        t4 = clock()
        scheduler._record_rank(claim.rank, local)
        t5 = clock()
        scheduler._record_prefill(chosen, hashes)
        t6 = clock()
        held.append(placement)
        if len(held) > IN_FLIGHT:
            finish(scheduler, held.popleft())
        if i < iterations // 10:
            continue
        for name, (a, b) in zip(
            names, [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6)], strict=True
        ):
            parts[name].append(b - a)
    return {name: summary(samples) for name, samples in parts.items()}


async def round_trips(url: str, iterations: int) -> dict[str, dict[str, float]]:
    """One PING, and one EVALSHA of a script that does nothing, through redis.asyncio; and, when
    this checkout has it, through the backend's bare connection (``bare_ping``,
    ``bare_empty_evalsha``: the round trip the syncs pay on a standalone Redis)."""
    client = aioredis.Redis.from_url(url)
    empty = client.register_script("return 0")
    calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("ping", client.ping),
        ("empty_evalsha", lambda: empty(keys=[], args=[])),
    ]
    bare: Any = None
    try:
        from sidecar.scheduling.state.resp import RespConnection

        bare = RespConnection(url, timeout_s=1.0)
        calls += [
            ("bare_ping", lambda: bare.call("PING")),
            ("bare_empty_evalsha", lambda: bare.evalsha(empty.sha, "return 0", (), [])),
        ]
    except ImportError:  # a checkout from before it
        pass
    figures = {}
    try:
        for name, call in calls:
            await call()
            samples = []
            for _ in range(iterations):
                start = time.perf_counter_ns()
                await call()
                samples.append(time.perf_counter_ns() - start)
            figures[name] = summary(samples)
    finally:
        await client.aclose()
        if bare is not None:
            bare.close()
    return figures


async def call_costs(url: str, iterations: int, rounds: int = 3) -> dict[str, dict[str, Any]]:
    """What one call costs this process, alternated in ``rounds`` blocks on one connection
    each: through redis.asyncio with hiredis's parser and with redis-py's own (Python) one, and
    through the backend's bare connection (``state.resp``, hiredis) when this checkout has it.
    A ``PING``, an ``EVALSHA`` of an empty script and one of the sync script (a table of
    ``IN_FLIGHT`` reservations; the reply, the pool's totals of 8 endpoints with 32 other
    sidecars, decoded and applied as a refresh does). Wall and thread CPU per call, medians and
    p99."""
    import hashlib

    from redis._parsers import _AsyncHiredisParser, _AsyncRESP2Parser

    from sidecar.scheduling.state.protocol import SCRIPT, SyncProtocol, decode_reply, keys

    try:
        from sidecar.scheduling.state.resp import RespConnection
    except ImportError:  # a checkout from before it
        RespConnection = None  # type: ignore[assignment,misc]

    prefix = "bench-calls"
    await seed_sidecars(url, prefix, 32)
    me = SyncProtocol("bench-calls-me", lease_s=600, wake=lambda: None)
    for endpoint in list(pool())[:IN_FLIGHT]:
        me.reserve(str(endpoint), PROMPT_TOKENS)
    sha = hashlib.sha1(SCRIPT.encode()).hexdigest()
    empty_sha = hashlib.sha1(b"return 0").hexdigest()

    def through_redis_py(parser_class: Any) -> tuple[dict[str, Any], Callable[[], Any]]:
        client = aioredis.Redis.from_url(url, parser_class=parser_class)
        empty = client.register_script("return 0")
        script = client.register_script(SCRIPT)
        return {
            "ping": client.ping,
            "empty_evalsha": lambda: empty(keys=[], args=[]),
            "sync_evalsha": lambda: script(keys=keys(prefix), args=sync_args()),
        }, client.aclose

    def bare() -> tuple[dict[str, Any], Callable[[], Any]]:
        conn = RespConnection(url, timeout_s=1.0)

        async def closed() -> None:
            conn.close()

        return {
            "ping": lambda: conn.call("PING"),
            "empty_evalsha": lambda: conn.evalsha(empty_sha, "return 0", (), []),
            "sync_evalsha": lambda: conn.evalsha(sha, SCRIPT, keys(prefix), sync_args()),
        }, closed

    pending: list[Any] = []

    def sync_args() -> list[Any]:
        sync = me.begin(time.time())
        pending.append(sync)
        return sync.args()

    variants: dict[str, Callable[[], tuple[dict[str, Any], Callable[[], Any]]]] = {
        "hiredis": lambda: through_redis_py(_AsyncHiredisParser),
        "python": lambda: through_redis_py(_AsyncRESP2Parser),
    }
    if RespConnection is not None:
        variants["bare"] = bare
    samples: dict[str, dict[str, tuple[list[int], list[int]]]] = {}
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    for _ in range(rounds):
        for variant, make in variants.items():
            calls, aclose = make()
            try:
                for name, call in calls.items():
                    wall, thread = samples.setdefault(variant, {}).setdefault(name, ([], []))
                    for i in range(iterations + 1):  # the first connects (and loads)
                        start, cpu_start = clock(), cpu()
                        raw = await call()
                        if pending:
                            reply = decode_reply(raw, now=time.time(), max_ejection_s=3600)
                            me.received(pending.pop(), reply)
                        if i:
                            wall.append(clock() - start)
                            thread.append(cpu() - cpu_start)
            finally:
                await aclose()
    return {
        variant: {
            name: {**summary(wall), "cpu": summary(thread)}
            for name, (wall, thread) in figures.items()
        }
        for variant, figures in samples.items()
    }


async def seed_sidecars(url: str, prefix: str, count: int) -> None:
    """``count`` other live sidecars in the pool ``prefix``, each holding a reservation on every
    endpoint (through the sync script itself, with a long lease)."""
    from sidecar.scheduling.state.protocol import SCRIPT, SyncProtocol, keys

    client = aioredis.Redis.from_url(url)
    script = client.register_script(SCRIPT)
    try:
        for i in range(count):
            other = SyncProtocol(f"other-{i}", lease_s=600, wake=lambda: None)
            for endpoint in pool():
                other.reserve(str(endpoint), 1000)
            sync = other.begin(time.time())
            await script(keys=keys(prefix), args=sync.args())
    finally:
        await client.aclose()


async def script_calls(url: str) -> int:
    """``EVALSHA`` calls Redis answered since the last ``CONFIG RESETSTAT``."""
    client = aioredis.Redis.from_url(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def script_usec(url: str) -> float:
    """Redis's own time per ``EVALSHA`` since the last ``CONFIG RESETSTAT``."""
    client = aioredis.Redis.from_url(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return float(stats.get("cmdstat_evalsha", {}).get("usec_per_call", 0.0))


async def reset_stats(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    try:
        await client.config_resetstat()
    finally:
        await client.aclose()


async def redis_placements(
    url: str,
    iterations: int,
    policy: str,
    *,
    prefix: str,
    key: str | None = HASH_KEY,
    others: int = 0,
) -> dict[str, Any]:
    """Placements on the Redis backend (``prefix``: its keys; ``others``: live sidecars holding
    reservations there besides this one), with the production decision budget
    (``SIDECAR_STATE_TIMEOUT_MS``, 5 ms): a placement whose sync takes longer decides on the
    local view; counted here, not logged each time. Redis's own time per script call is read
    from ``INFO commandstats`` (the prefix share's calls included when ``key`` is set)."""
    await seed_sidecars(url, prefix, others)
    await reset_stats(url)
    errors: Counter[str] = Counter()

    def count(kind: str) -> None:
        errors[kind] += 1

    backend = RedisState(url, prefix=prefix, lease_s=10, timeout_s=0.005, on_error=count)
    quiet = logging.getLogger("sidecar.scheduling")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        figures, reasons, status = await time_placements(
            policy, backend, iterations, pause_s=0.002, key=key
        )
    finally:
        quiet.setLevel(level)
    return {
        **figures,
        "reasons": dict(reasons),
        "backend_errors": dict(errors),
        "prefix_share": status.get("prefix_share"),
        "script_usec": await script_usec(url),
        "others": others,
    }


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
        figures, reasons, _ = await time_placements(policy, MemoryState(), iterations)
        result["memory"][policy] = {**figures, "reasons": dict(reasons)}
    result["continuations"] = {  # keyed by text: the report is written as JSON
        str(block): await time_continuations(iterations, block) for block in (16, 64)
    }

    if redis_policy not in result["memory"]:
        figures, _, _ = await time_placements(redis_policy, MemoryState(), iterations)
        result["memory"][redis_policy] = {**figures, "reasons": {}}
    memory_median = result["memory"][redis_policy]["median_us"]

    async def redis_run(url: str) -> dict[str, Any]:
        shared = await redis_placements(url, iterations, redis_policy, prefix="bench-shared")
        alone = await redis_placements(
            url, iterations, redis_policy, prefix="bench-alone", key=None
        )
        trips = await round_trips(url, iterations)
        ping = trips.get("bare_ping", trips["ping"])  # the round trip the syncs pay
        return {
            "policy": redis_policy,
            **shared,
            "share_off": alone,
            **trips,
            "over_round_trip_us": shared["median_us"] - ping["median_us"],
            "over_memory_us": shared["median_us"] - memory_median,
            "beyond_us": shared["median_us"] - memory_median - ping["median_us"],
            "beyond_share_off_us": alone["median_us"] - memory_median - ping["median_us"],
        }

    async with Launcher(prefix="pd-sidecar-bench-redis-") as launcher:
        result["redis"] = await with_redis(launcher, redis_run)
    return result


def report(result: dict[str, Any]) -> list[str]:
    """The decision-cost table, as lines."""
    lines = [
        f"scheduler decision: a {result['prompt_tokens']}-token prompt among"
        f" {result['endpoints']} endpoints, {result['in_flight']} placements in flight,"
        " prefill prefix index on (keyed hashes), local prefix index on",
        f"  {'what':<44} {'median µs':>10} {'p99 µs':>10} {'CPU med µs':>10}",
    ]

    def row(name: str, figures: dict[str, float]) -> None:
        cpu = figures.get("cpu_median_us")
        lines.append(
            f"  {name:<44} {figures['median_us']:>10.1f} {figures['p99_us']:>10.1f}"
            + (f" {cpu:>10.1f}" if cpu is not None else "")
        )

    for policy, figures in result["memory"].items():
        row("place_request(), memory, " + policy, figures)
        after = figures.get("recorded_after_cpu_median_us")
        if after is not None:
            lines.append(f"  {'  recorded after it (CPU median)':<44} {after:>10.1f}")
    for part, figures in result["parts"].items():
        row("  part: " + part, figures)
    for block, figures in result["continuations"].items():
        lines.append(
            f"  place_request(), a continuation of {len(HISTORY) // 4} tokens, local blocks of"
            f" {block}:"
            f" CPU median {figures['cpu_median_us']:.1f} µs, recorded after"
            f" {figures['recorded_after_cpu_median_us']:.1f} µs"
        )
    redis = result["redis"]
    if isinstance(redis, str):
        lines.append(f"  place_request(), redis: {redis}")
        return lines
    row("place_request(), redis, " + redis["policy"] + ", prefix share on", redis)
    row("place_request(), redis, " + redis["policy"] + ", prefix share off", redis["share_off"])
    row("  redis PING round trip (redis.asyncio)", redis["ping"])
    row("  redis EVALSHA of an empty script (redis.asyncio)", redis["empty_evalsha"])
    if "bare_ping" in redis:
        row("  redis PING round trip (the syncs' connection)", redis["bare_ping"])
        row("  redis empty EVALSHA (the syncs' connection)", redis["bare_empty_evalsha"])
    share = redis["prefix_share"]
    lines.append(
        f"  = one round trip + {redis['over_round_trip_us']:.1f} µs (medians);"
        f" {redis['over_memory_us']:.1f} µs more than on the memory backend;"
        f" beyond the memory placement and the round trip: {redis['beyond_us']:.1f} µs"
        f" (share off {redis['beyond_share_off_us']:.1f} µs);"
        f" decisions {redis['reasons']}; over the 5 ms budget"
        f" {redis['backend_errors'].get('timeout', 0)} times"
    )
    lines.append(f"  prefix share at the end (share on): {share}")
    return lines


# --- A/B against another checkout, in processes of their own ---------------------------------


async def child(
    kind: str, iterations: int, url: str | None, prefix: str, others: int = 0
) -> dict[str, Any]:
    """One variant's placements (qoe), as ``--child`` prints them."""
    if kind == "memory":
        figures, reasons, _ = await time_placements("qoe", MemoryState(), iterations)
        return {**figures, "reasons": dict(reasons)}
    if kind in ("count", "count-decision"):  # untimed, for callgrind
        recorded = kind == "count"
        await time_placements("qoe", MemoryState(), iterations, timed=False, recorded=recorded)
        return {}
    if kind == "count-syncs":  # the backend alone, for callgrind: reserve, refresh, release
        assert url is not None
        await reset_stats(url)
        backend = RedisState(url, prefix=prefix, lease_s=60, timeout_s=1.0)
        await backend.start()
        try:
            for _ in range(iterations + iterations // 10):
                reservation = backend.reserve(str(pool()[0]), PROMPT_TOKENS)
                await backend.refresh()
                backend.release(reservation)
                await asyncio.sleep(0.002)  # the worker's sync of both
        finally:
            await backend.close()
        return {"script_calls": await script_calls(url)}
    if kind == "count-redis":  # untimed, for callgrind: a budget no slowed-down sync misses
        assert url is not None
        await reset_stats(url)
        backend = RedisState(url, prefix=prefix, lease_s=60, timeout_s=1.0)
        await time_placements("qoe", backend, iterations, pause_s=0.002, key=None, timed=False)
        return {"script_calls": await script_calls(url)}
    assert url is not None
    return await redis_placements(url, iterations, "qoe", prefix=prefix, key=None, others=others)


def child_command(repo: Path) -> tuple[list[str], dict[str, str]]:
    """How ``repo``'s own copy of this benchmark is started as a child, and its environment.

    Each checkout is measured by its own harness, started in its directory so that its
    ``sidecar`` package is the one imported: the harness uses the scheduler's internals, which
    change between checkouts. A checkout with ``bench/__main__.py`` runs it as a module; an older
    one as the script it was then, which finds its checkout through ``DECISION_COST_REPO``."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("PYTHONPATH", None)  # nothing of this checkout's may shadow the measured one's
    if (repo / "bench" / "__main__.py").exists():
        return [sys.executable, "-m", "bench.decision_cost"], env
    env["DECISION_COST_REPO"] = str(repo)
    return [sys.executable, str(repo / "bench" / "decision_cost.py")], env


def run_child(
    repo: Path,
    kind: str,
    iterations: int,
    url: str = "",
    prefix: str = "",
    wrap: tuple[str, ...] = (),
    others: int = 0,
) -> dict[str, Any]:
    command, env = child_command(repo)
    argv = [*wrap, *command, "--child", kind, "--iterations", str(iterations)]
    if url:
        argv += ["--redis-url", url, "--redis-prefix", prefix, "--others", str(others)]
    done = subprocess.run(argv, env=env, cwd=repo, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}


def load() -> str:
    pressure = Path("/proc/pressure/cpu").read_text().split()[1]  # "avg10=..." of "some"
    return f"load average {os.getloadavg()[0]:.2f}, cpu pressure {pressure}"


async def ab(baseline: Path, iterations: int, rounds: int, others: list[int]) -> list[str]:
    """Memory and Redis placements of this checkout and ``baseline``, alternated; on Redis with
    each count of other live sidecars in ``others`` (the prefix share off: the script's own
    time is then the reservation sync's alone)."""
    here = REPO
    variants = {"this": here, "baseline": baseline}
    lines = [
        f"A/B, {rounds} rounds of {iterations} placements each (qoe): median / p99 µs, the"
        " thread's CPU µs (median); Redis: the script's own µs per call (INFO commandstats) and"
        " a PING's median µs"
    ]

    async def run(url: str) -> dict[str, Any]:
        for r in range(rounds):
            for name, repo in variants.items():
                figures = await asyncio.to_thread(run_child, repo, "memory", iterations)
                after = figures.get("recorded_after_cpu_median_us")
                lines.append(
                    f"  round {r + 1} {name:<8} memory            {figures['median_us']:>8.1f}"
                    f" / {figures['p99_us']:>8.1f}  CPU {figures['cpu_median_us']:>6.1f}"
                    + (f"  recorded after: CPU {after:>6.1f}" if after is not None else "")
                    + f"  ({load()})"
                )
                for count in others:
                    figures = await asyncio.to_thread(
                        run_child, repo, "redis", iterations, url, f"ab-{name}-{r}-{count}",
                        (), count,
                    )  # fmt: skip
                    trips = await round_trips(url, 300)
                    ping = trips["ping"]["median_us"]
                    bare = trips.get("bare_ping", {}).get("median_us", float("nan"))
                    lines.append(
                        f"  round {r + 1} {name:<8} redis, {count:>3} others"
                        f" {figures['median_us']:>8.1f} / {figures['p99_us']:>8.1f}"
                        f"  CPU {figures['cpu_median_us']:>6.1f}"
                        f"  script {figures['script_usec']:>6.1f}  PING {ping:>6.1f}"
                        f" (bare {bare:>5.1f})"
                        f"  timeouts {figures['backend_errors'].get('timeout', 0)}  ({load()})"
                    )
        return {}

    async with Launcher(prefix="pd-sidecar-bench-redis-") as launcher:
        outcome = await with_redis(launcher, run)
    if isinstance(outcome, str):
        lines.append(outcome)
    return lines


def callgrind_total(path: str) -> int:
    """The ``Ir`` a callgrind run counted (its output file's summary)."""
    text = Path(glob.glob(path)[0]).read_text()
    return int(text.split("\nsummary: ")[1].split()[0])


def instructions(repo: Path, short: int, long: int, kind: str = "count") -> float:
    """Ir per memory placement of ``repo``'s sidecar: two runs under callgrind, ``short`` and
    ``long`` placements, the difference divided by ``long - short`` (start-up cancels out).
    ``kind``: ``count-decision`` leaves each placement's recording out (the decision alone)."""
    counts = []
    with tempfile.TemporaryDirectory() as out:
        for n in (short, long):
            wrap = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.{n}")
            run_child(repo, kind, n, wrap=wrap)
            counts.append(callgrind_total(f"{out}/cg.{n}"))
    return (counts[1] - counts[0]) / ((long - short) * 1.1)  # the warm-up tenth runs too


def records_after(repo: Path) -> bool:
    """``repo``'s scheduler records a placement after its decision (``Scheduler._record``)."""
    return "def _record(" in (repo / "sidecar/scheduling/scheduler.py").read_text()


def redis_instructions(
    baseline: Path | None, short: int, long: int, kind: str = "count-redis"
) -> list[str]:
    """Ir per Redis placement (qoe, the prefix share off, 2 ms between placements as in the
    timed runs: the background syncs of each reservation and release included), of this
    checkout and ``baseline``, with hiredis and (a checkout without the syncs' own connection)
    with redis-py's Python parser; and the script calls Redis answered per placement."""
    repos = {"this": REPO}
    if baseline is not None:
        repos["baseline"] = baseline
    what = "placement (qoe, share off)" if kind == "count-redis" else "reserve, refresh, release"
    lines = [f"instructions per Redis {what}; {short} and {long} of them"]

    async def run(url: str) -> dict[str, Any]:
        for name, repo in repos.items():
            # A checkout with the syncs' own connection needs hiredis; one before it runs
            # without (redis-py's Python parser) as well.
            own = (repo / "sidecar/scheduling/state/resp.py").exists()
            for parser in ("hiredis",) if own else ("hiredis", "python"):
                counts, calls = [], []
                with tempfile.TemporaryDirectory() as out:
                    for n in (short, long):
                        wrap = (
                            "env", *(("DECISION_COST_NO_HIREDIS=1",) if parser == "python" else ()),
                            "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.{n}",
                        )  # fmt: skip
                        figures = await asyncio.to_thread(
                            run_child, repo, kind, n, url, f"ir-{name}-{parser}-{n}-{kind}", wrap
                        )
                        calls.append(figures["script_calls"])
                        counts.append(await asyncio.to_thread(callgrind_total, f"{out}/cg.{n}"))
                placements = (long - short) * 1.1
                syncs = calls[1] - calls[0]
                lines.append(
                    f"  {name:<8} {parser:<8} {(counts[1] - counts[0]) / placements:>12,.0f} Ir"
                    f"  script calls per placement {syncs / placements:.2f}"
                    f"  Ir per script call {(counts[1] - counts[0]) / max(syncs, 1):>10,.0f}"
                    f"  ({load()})"
                )
        return {}

    async def go() -> None:
        async with Launcher(prefix="pd-sidecar-bench-redis-") as launcher:
            outcome = await with_redis(launcher, run)
        if isinstance(outcome, str):
            lines.append(outcome)

    asyncio.run(go())
    return lines


def call_report(figures: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["one call through redis.asyncio: wall median / p99 µs, thread CPU median / p99 µs"]
    for name in ("ping", "empty_evalsha", "sync_evalsha"):
        for parser, calls in figures.items():
            f = calls[name]
            lines.append(
                f"  {name:<14} {parser:<8} {f['median_us']:>8.1f} / {f['p99_us']:>8.1f}"
                f"   CPU {f['cpu']['median_us']:>7.1f} / {f['cpu']['p99_us']:>8.1f}"
            )
    return lines


def main_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench decision_cost",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--iterations", type=int, default=2000, help="timed placements each")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    parser.add_argument("--baseline", type=Path, default=None, help="checkout to compare with")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds with --baseline")
    parser.add_argument(
        "--instructions", action="store_true", help="callgrind Ir per memory placement"
    )
    parser.add_argument(
        "--redis-instructions",
        action="store_true",
        help="callgrind Ir per Redis placement, hiredis and not (and the baseline's)",
    )
    parser.add_argument(
        "--redis-calls",
        action="store_true",
        help="one PING / EVALSHA's cost in this process, hiredis against redis-py's parser",
    )
    parser.add_argument(
        "--syncs-only",
        action="store_true",
        help="with --redis-instructions: the backend alone (reserve, refresh, release)",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="the decision with the exact indexes in sync (bench/decision_kv.py; with"
        " --instructions: callgrind)",
    )
    parser.add_argument(
        "--child",
        choices=("memory", "redis", "count", "count-decision", "count-redis", "count-syncs"),
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--redis-url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--redis-prefix", default="bench", help=argparse.SUPPRESS)
    parser.add_argument(
        "--others", default="0,32", help="other live sidecars in the Redis pool (A/B; list)"
    )
    add_quick(parser, "100 placements each")
    args = apply_quick(parser, parser.parse_args(argv), iterations=100)
    from bench.cluster import run

    if args.kv_events:
        from bench import decision_kv

        return decision_kv.run(args.iterations, count=args.instructions)

    if args.instructions:
        repos = {"this": REPO}
        if args.baseline is not None:
            repos["baseline"] = args.baseline.resolve()
        for name, repo in repos.items():
            ir = instructions(repo, 100, 600)
            print(f"instructions per placement (memory, qoe), {name} ({repo}): {ir:,.0f}")
            if records_after(repo):
                ir = instructions(repo, 100, 600, "count-decision")
                print(f"  of which the decision (the recording left out): {ir:,.0f}")
        return 0

    if args.redis_instructions:
        baseline = args.baseline.resolve() if args.baseline is not None else None
        kind = "count-syncs" if args.syncs_only else "count-redis"
        print("\n".join(redis_instructions(baseline, 100, 400, kind)))
        return 0

    async def go() -> int:
        if args.redis_calls:
            print(load())

            async def calls(url: str) -> dict[str, Any]:
                return await call_costs(url, args.iterations)

            async with Launcher(prefix="pd-sidecar-bench-redis-") as launcher:
                figures = await with_redis(launcher, calls)
            print(figures if isinstance(figures, str) else "\n".join(call_report(figures)))
            print(load())
            return 0
        if args.child is not None:
            figures = await child(
                args.child,
                args.iterations,
                args.redis_url,
                args.redis_prefix,
                int(args.others.split(",")[0]),
            )
            print(json.dumps(figures))
            return 0
        if args.baseline is not None:
            others = [int(n) for n in args.others.split(",")]
            lines = await ab(args.baseline.resolve(), args.iterations, args.rounds, others)
            print("\n".join(lines))
            return 0
        print(load())
        result = await measure(args.iterations, args.policies.split(","))
        print("\n".join(report(result)))
        print(load())
        return 0

    return run(go)


if __name__ == "__main__":
    sys.exit(main_cli())
