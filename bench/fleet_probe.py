"""One sidecar's decisions in a process of its own, beside ``python -m bench fleet``'s load: the
wait a decision sees and what shared state costs that sidecar's process, not the driver's.

Started by ``python -m bench fleet --probe RATE`` at the start of each load window: one
production backend (``RedisState``, or ``CounterState`` with ``--counters``) on the fleet's
pool, started and synced before it measures; then decisions at ``--rate`` a second for
``--seconds``, each as the scheduler makes it (``refresh`` of the pool's endpoints, a
reservation on the least loaded, its release after ``--hold-ms``); then one line of JSON: the
decisions, the waits' p50, p99 and max in ms, and this process's CPU per decision and per
second (its heartbeats included).

    python -m bench.fleet_probe --url redis://127.0.0.1:6379/0 --prefix pool --counters
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time

import orjson

from bench.cluster import run
from bench.readings import own_cpu_s
from devkit.stats import percentile
from sidecar.scheduling.state import Load, StateBackend
from sidecar.scheduling.state.counter_state import CounterState
from sidecar.scheduling.state.redis import RedisState

PROMPT_TOKENS = 8192
LEASE_S = 10.0
TIMEOUT_S = 0.005


async def probe(args: argparse.Namespace) -> dict[str, float | int | None]:
    kind = CounterState if args.counters else RedisState
    backend: StateBackend = kind(
        args.url, prefix=args.prefix, cluster=args.cluster, lease_s=LEASE_S, timeout_s=TIMEOUT_S
    )
    endpoints = [f"127.0.1.{i}:8000" for i in range(args.endpoints)]
    rng = random.Random(args.seed)
    await backend.start()
    try:
        await backend.refresh(endpoints)  # registered, the clock learnt: not measured
        if isinstance(backend, CounterState):
            await backend.published()
            await backend.check_fleet()
        waits: list[float] = []
        releases: set[asyncio.Task[None]] = set()

        async def release_later(held: object) -> None:
            await asyncio.sleep(args.hold_ms / 1000)
            backend.release(held)  # type: ignore[arg-type]

        loop = asyncio.get_running_loop()
        cpu, began = own_cpu_s(), loop.time()
        for i in range(int(args.rate * args.seconds)):
            if (wait := began + i / args.rate - loop.time()) > 0:
                await asyncio.sleep(wait)
            started = time.perf_counter()
            await backend.refresh(endpoints)
            waits.append((time.perf_counter() - started) * 1000)
            loads = backend.view().loads
            least = min(loads.get(e, Load()).tokens for e in endpoints)
            chosen = rng.choice([e for e in endpoints if loads.get(e, Load()).tokens == least])
            task = asyncio.create_task(release_later(backend.reserve(chosen, PROMPT_TOKENS)))
            releases.add(task)
            task.add_done_callback(releases.discard)
        await asyncio.gather(*releases)
        spent, seconds = own_cpu_s() - cpu, loop.time() - began
    finally:
        await backend.close()
    return {
        "decisions": len(waits),
        "wait_p50_ms": percentile(waits, 50) if waits else None,
        "wait_p99_ms": percentile(waits, 99) if waits else None,
        "wait_max_ms": max(waits) if waits else None,
        "cpu_us_per_decision": 1e6 * spent / len(waits) if waits else None,
        "cpu_share": spent / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_probe", description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--cluster", action="store_true")
    parser.add_argument("--counters", action="store_true")
    parser.add_argument("--endpoints", type=int, default=32)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--hold-ms", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    logging.getLogger("sidecar.scheduling").setLevel(logging.ERROR)

    async def measured() -> int:
        sys.stdout.buffer.write(orjson.dumps(await probe(args)) + b"\n")
        return 0

    return run(measured)  # on uvloop, as the sidecar


if __name__ == "__main__":
    raise SystemExit(main())
