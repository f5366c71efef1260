"""bench/fleet.py: the figures it derives from the servers' readings, and a run on a real
redis-server (the quick run, across both stores, is ``make bench-smoke``'s)."""

from __future__ import annotations

import random

import pytest
import redis.asyncio as aioredis

from bench import fleet
from bench.fleet import Cell, ServerCost, Window
from sidecar.scheduling.state.protocol import keys
from tests.processes import RedisServer


def _server(port: int, calls: int, usec: float, cpu_s: float, slowest: float | None = None):
    return ServerCost(port, calls, usec, cpu_s, slowest)


def test_a_cell_charges_decisions_only_what_the_idle_fleet_did_not_spend() -> None:
    # Idle: 10 s, 64 sidecars, 192 heartbeat syncs, 0.2 CPU-seconds (0.02 a second).
    idle = Window(10.0, 0, [_server(1, 192, 100.0, 0.2)])
    # Load: 10 s, 1,000 decisions, 3,192 calls over three masters, 0.8 CPU-seconds.
    load = Window(
        10.0,
        1000,
        [_server(1, 3000, 120.0, 0.6, 1.5), _server(2, 96, 80.0, 0.1), _server(3, 96, 80.0, 0.1)],
        waits_ms=[float(i) / 100 for i in range(1000)],
        offered_s=10.0,
        over_budget=10,
    )
    figures = Cell("cluster", 64, 100.0, idle, load, resum_ms=None).figures()
    assert figures["achieved_per_s"] == 100.0
    # 3,192 calls less the idle fleet's 192 over the same 10 s: 3 per decision.
    assert figures["script_calls_per_decision"] == pytest.approx(3.0)
    assert figures["script_usec_per_call"] == pytest.approx((3000 * 120 + 192 * 80) / 3192)
    # 0.8 CPU-seconds less the idle 0.2: 600 µs per decision, 1,667 decisions a core.
    assert figures["redis_cpu_us_per_decision"] == pytest.approx(600.0)
    assert figures["decisions_per_redis_core"] == pytest.approx(1e6 / 600)
    assert figures["idle_syncs_per_sidecar_s"] == pytest.approx(0.3)
    assert figures["busiest_master_share"] == pytest.approx(0.75)
    assert figures["wait_p50_ms"] == pytest.approx(4.99)  # nearest rank: the 500th of 1,000
    assert figures["wait_p99_ms"] == pytest.approx(9.89)
    assert figures["over_budget"] == pytest.approx(0.01)
    assert figures["slowest_command_ms"] == 1.5


@pytest.mark.system
async def test_a_fleet_on_a_real_redis_reports_every_decision_and_its_costs(
    redis_server: RedisServer,
) -> None:
    store = fleet.Store("redis", redis_server.url, (redis_server.port,), cluster=False)
    args = fleet.main_parser().parse_args(
        ["--idle-s", "0.2", "--load-s", "0.5", "--hold-ms", "50", "--endpoints", "4"]
    )
    cell = await fleet.measure_cell(store, 6, 40.0, args, random.Random(1))
    figures = cell.figures()
    assert cell.load.decisions == 20
    # Each decision's refresh, reservation and release are syncs of the script.
    assert cell.load.script_calls >= 2 * cell.load.decisions
    assert figures["script_usec_per_call"] > 0
    assert cell.load.cpu_s > 0
    # Every sidecar said goodbye: nothing of the fleet is left counted.
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await client.zcard(keys("fleet-redis-6-40")[0]) == 0
    finally:
        await client.aclose()


@pytest.mark.system
async def test_with_the_prefix_share_on_observers_learn_the_others_placements(
    redis_server: RedisServer,
) -> None:
    store = fleet.Store("redis", redis_server.url, (redis_server.port,), cluster=False)
    args = fleet.main_parser().parse_args(
        ["--idle-s", "0.2", "--load-s", "2.5", "--hold-ms", "50", "--prefix-share"]
    )
    cell = await fleet.measure_cell(store, 4, 20.0, args, random.Random(2))
    figures = cell.figures()
    assert cell.load.decisions == 50
    # Placements of the first 1.5 s are a second old at the end: the observers learnt some
    # (the share syncs every 0.25 s, polls every 1 s), each after it was published.
    assert cell.load.learnt_share is not None
    assert cell.load.learnt_share > 0
    assert cell.load.learnt_age_ms
    assert min(cell.load.learnt_age_ms) > 0
    # Each placement's 128 digests go to Redis and back to the three others.
    assert figures["net_bytes_per_decision"] > 128 * 8
