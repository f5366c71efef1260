"""bench/saturation.py: the arguments it sends are production's, and its accounting (the quick
run is ``make bench-smoke``'s)."""

from __future__ import annotations

import argparse

import pytest
import redis.asyncio as aioredis

from bench import saturation
from bench.saturation import Cost
from sidecar.scheduling.state import Load, counters
from sidecar.scheduling.state.protocol import SCRIPT, decode_reply, keys
from tests.processes import RedisServer


def test_a_core_serves_a_million_over_the_cpu_per_call() -> None:
    cost = Cost("get", calls=1000, calls_per_s=20_000.0, command_us=0.5, cpu_us=12.5)
    assert cost.per_core == pytest.approx(80_000.0)


async def test_the_sync_it_sends_is_one_the_production_script_takes(
    redis_server: RedisServer,
) -> None:
    """The measured sync is production's: the script accepts it and counts its reservations in
    the pool's totals."""
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        pool = keys("saturation-test")
        args = saturation.sync_args("sidecar-1", endpoints=32, held=4, first=30, speeds=True)
        reply = await client.eval(SCRIPT, len(pool), *pool, *args)
    finally:
        await client.aclose()
    answer = decode_reply(reply, now=saturation.NOW, max_ejection_s=60.0)
    held = ["127.0.0.31:8000", "127.0.0.32:8000", "127.0.0.1:8000", "127.0.0.2:8000"]
    assert answer.totals == {endpoint: Load(8192, 1) for endpoint in held}
    assert len(answer.speeds) == 32
    assert not answer.skipped


@pytest.mark.system
async def test_a_short_run_counts_every_call_it_sent() -> None:
    args = argparse.Namespace(
        calls=500, clients=4, sidecars=20, endpoints=8, held=2, keys=3, ride=0.86, previous=0.3
    )
    costs = await saturation.run(args)
    assert [cost.command for cost in costs] == [
        "sync",
        "sharded",
        "get",
        "mget",
        "hincrby",
        "hgetall",
        "counters read",
        "counters reserve",
        "counters release",
        "counters release + read",
        "strings read",
        "strings reserve",
        "hash read",
        "hash reserve",
        "get (driver)",
        "decision: read, reserve, release",
        "decision: the release with a read (86%)",
        "decision: and the previous epoch read in 30%",
    ]
    for cost in costs:
        assert cost.calls >= 500
        assert cost.cpu_us > 0
        assert cost.command_us > 0


async def test_the_counters_it_reads_are_the_keys_a_sidecar_reads(
    redis_server: RedisServer,
) -> None:
    """The measured read names the keys the counters' module reads, and its values decode as
    counts of the reservations written."""
    client = aioredis.Redis.from_url(redis_server.url)
    args = argparse.Namespace(calls=200, clients=4, endpoints=4, ride=0.86, previous=0.3)
    try:
        costs = await saturation._counter_costs(client, redis_server.port, args)
        pool = counters.Counters(client, "saturation")
        endpoints = [saturation._endpoint(i) for i in range(4)]
        keys = [pool.key(e, saturation.COUNTERS_EPOCH + d) for e in endpoints for d in (-1, 0)]
        values = await client.mget(keys)
    finally:
        await client.aclose()
    assert len(costs) == 12
    for raw in values:
        count = counters.decode_count(raw)
        assert count is not None
        assert count.load == Load(81920, 10)
        assert not count.clamped
