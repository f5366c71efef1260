"""bench/fleet.py: the figures it derives from the servers' readings, and a run on a real
redis-server (the quick run, across both stores, is ``make bench-smoke``'s)."""

from __future__ import annotations

import random

import pytest
import redis.asyncio as aioredis

from bench import fleet
from bench.fleet import Cell, ServerCost, Window
from sidecar.scheduling.state import sharded
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
async def test_the_counters_backend_with_a_probe_reports_its_decisions_and_waits(
    redis_server: RedisServer,
) -> None:
    """``--reservations counter-state --probe``: the fleet's decisions through the production
    ``CounterState``, and one more sidecar's in a process of its own, each measured."""
    store = fleet.Store("redis", redis_server.url, (redis_server.port,), cluster=False)
    args = fleet.main_parser().parse_args(
        [
            *("--idle-s", "0.2", "--load-s", "0.5", "--hold-ms", "50", "--endpoints", "4"),
            *("--reservations", "counter-state", "--probe", "20"),
        ]
    )
    cell = await fleet.measure_cell(store, 6, 40.0, args, random.Random(1))
    figures = cell.figures()
    assert cell.load.decisions == 20
    assert cell.resum_ms is None  # no table to re-sum
    assert figures["probe_decisions"] == 10
    assert 0 < figures["probe_wait_p50_ms"] <= figures["probe_wait_max_ms"]
    assert figures["probe_cpu_us_per_decision"] > 0
    client = aioredis.Redis.from_url(redis_server.url)
    try:  # every sidecar (the probe's too) gave its reservations back and left
        assert await client.zcard(keys("fleet-redis-6-40")[0]) == 0
        counters = [k async for k in client.scan_iter(match="{fleet-redis-6-40:*")]
        assert counters  # the keys outlive their epoch, at zero
        assert await client.mget(counters) == [b"0"] * len(counters)
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


def test_a_scrape_cell_reads_per_round_and_per_second_of_steady_state() -> None:
    # 16 sidecars, 3 rounds each (3 s of steady state; the window itself took 2.9 s), 4
    # endpoints scraped 6, 6, 6 and 9 times; 96 commands costing 960 µs.
    cell = fleet.ScrapeCell(
        "redis",
        16,
        3,
        1.0,
        2.9,
        {"a:1": 6, "b:1": 6, "c:1": 6, "d:1": 9},
        {"mget": (48, 480.0), "set": (48, 480.0)},
        redis_cpu_s=0.029,
        driver_cpu_s=0.48,
        first_round_ms=2.0,
    )
    figures = cell.figures()
    assert figures["scrapes_per_endpoint_s"] == pytest.approx(27 / 4 / 3)
    assert figures["busiest_endpoint_s"] == pytest.approx(3.0)
    assert figures["commands_per_round"] == pytest.approx(2.0)
    assert figures["redis_usec_per_round"] == pytest.approx(20.0)
    assert figures["redis_usec_per_s"] == pytest.approx(320.0)
    assert figures["redis_cpu_per_s"] == pytest.approx(0.01)
    assert figures["sidecar_cpu_share"] == pytest.approx(0.01)


@pytest.mark.system
async def test_shared_scrapes_on_a_real_redis_scrape_each_endpoint_twice_a_round(
    redis_server: RedisServer,
) -> None:
    store = fleet.Store("redis", redis_server.url, (redis_server.port,), cluster=False)
    args = fleet.main_parser().parse_args(["--scrapes", "--rounds", "2", "--endpoints", "6"])
    cell = await fleet.scrape_cell(store, 12, args)
    figures = cell.figures()
    # Two owners per endpoint, whatever the twelve sidecars: 2 scrapes per endpoint a second.
    assert set(cell.scrapes.values()) == {4}
    assert figures["scrapes_per_endpoint_s"] == pytest.approx(2.0)
    # A round's read (MGET) and an owner's publications (SET), costed by Redis.
    assert cell.commands["mget"][0] == 12 * 2
    assert cell.commands["set"][0] == 6 * 2 * 2
    assert figures["redis_usec_per_round"] > 0


def _master(port: int, cpu_s: float, **commands: tuple[int, float]) -> fleet.MasterReading:
    return fleet.MasterReading(port, cpu_s, dict(commands), None)


def test_a_sharded_cell_charges_each_master_what_its_idle_self_did_not_spend() -> None:
    # Three masters idle for 2 s at 0.01 CPU-seconds each (cluster gossip, cron).
    idle = fleet.ShardedWindow(2.0, 1, [_master(p, 0.01) for p in (1, 2, 3)])
    # 1,000 syncs in 4 s: 0.1, 0.08 and 0.06 CPU-seconds, less 0.02 idle each.
    writes = fleet.ShardedWindow(
        4.0,
        1000,
        [
            _master(1, 0.10, evalsha=(400, 20_000.0)),
            _master(2, 0.08, evalsha=(350, 14_000.0)),
            _master(3, 0.06, evalsha=(250, 6_000.0)),
        ],
    )
    # 1,000 reads, 12 MGETs each (4 per master): 0.04 CPU-seconds on each master.
    reads = fleet.ShardedWindow(
        4.0, 1000, [_master(p, 0.04, mget=(4000, 8_000.0)) for p in (1, 2, 3)]
    )
    floor = fleet.ShardedWindow(4.0, 1000, [_master(p, 0.03, get=(333, 333.0)) for p in (1, 2, 3)])
    cell = fleet.ShardedCell("cluster", 64, 250.0, idle, writes, reads, floor)
    figures = cell.figures()
    assert figures["syncs_per_s"] == 250.0
    assert figures["script_usec_per_call"] == pytest.approx(40_000 / 1000)
    assert figures["mget_calls_per_read"] == 12
    assert figures["mget_usec_per_call"] == pytest.approx(2.0)
    # Per sync: (0.08 + 0.06 + 0.04) CPU-seconds over 1,000; per read 3 × 0.02 over 1,000.
    assert figures["cpu_us_per_sync"] == pytest.approx(180.0)
    assert figures["cpu_us_per_read"] == pytest.approx(60.0)
    assert figures["floor_cpu_us_per_call"] == pytest.approx(30.0)
    # The busiest master: 80 µs a sync and 20 a read, of 240 in all.
    assert figures["busiest_cpu_us_per_pair"] == pytest.approx(100.0)
    assert figures["busiest_master_share"] == pytest.approx(100 / 240)
    # 1,000 pods, a sync and a read each every 100 ms: 10,000 pairs a second.
    assert figures["target_cores"] == pytest.approx(2.4)
    assert figures["target_busiest_cores"] == pytest.approx(1.0)


@pytest.mark.system
async def test_sharded_reservations_on_a_real_redis_cost_one_script_a_sync_one_mget_a_read(
    redis_server: RedisServer,
) -> None:
    store = fleet.Store("redis", redis_server.url, (redis_server.port,), cluster=False)
    args = fleet.main_parser().parse_args(
        ["--reservations", "sharded", "--idle-s", "0.2", "--load-s", "0.5", "--endpoints", "8"]
    )
    args.rates = [40.0]
    cell = await fleet.sharded_cell(store, 24, 40.0, args, random.Random(3))
    figures = cell.figures()
    assert (cell.writes.count, cell.reads.count, cell.floor.count) == (20, 20, 20)
    assert figures["failed"] == 0
    # One script a sync, one MGET of every shard's totals a read.
    assert cell.writes.calls("evalsha") == 20
    assert cell.reads.calls("mget") == 20
    assert figures["script_usec_per_call"] > 0
    # The masters' CPU was read over the writes. Less the idle's share, the figure is only
    # >= 0 here: a 0.2 s idle reading can outweigh 20 syncs' work (the arithmetic has its test).
    assert sum(m.cpu_s for m in cell.writes.masters) > 0
    assert figures["cpu_us_per_sync"] >= 0
    # Every sidecar lapsed was dropped (else the cell raises), at most 8 a call: a call per
    # shard that finds none left, and one more per shard that held some (fewer than 8 each).
    held = {sharded.shard_of(f"{i:032x}", sharded.SHARDS) for i in range(24)}
    assert cell.expiry is not None
    assert cell.expiry.count == sharded.SHARDS + len(held)
    assert cell.reset_ms is not None


def test_a_counter_cell_charges_decisions_what_the_idle_masters_did_not_spend() -> None:
    idle = fleet.ShardedWindow(2.0, 1, [_master(p, 0.01) for p in (1, 2, 3)])
    # 1,000 decisions in 4 s: a read on every master (one MGET each), a reserve and a release
    # on one; 0.06, 0.04 and 0.04 CPU-seconds, less 0.02 idle each.
    load = fleet.ShardedWindow(
        4.0,
        1000,
        [
            _master(1, 0.06, mget=(1000, 3000.0), incrby=(1000, 1000.0), pexpireat=(1000, 500.0)),
            _master(2, 0.04, mget=(1000, 3000.0), incrby=(500, 500.0), pexpireat=(500, 250.0)),
            _master(3, 0.04, mget=(1000, 3000.0), incrby=(500, 500.0), pexpireat=(500, 250.0)),
        ],
    )
    floor = fleet.ShardedWindow(4.0, 1000, [_master(p, 0.03, get=(333, 333.0)) for p in (1, 2, 3)])
    waits = [float(i) / 1000 for i in range(1000)]
    cell = fleet.CounterCell("cluster", 64, 250.0, idle, load, floor, waits)
    figures = cell.figures()
    assert figures["decisions_per_s"] == 250.0
    assert figures["mget_calls_per_decision"] == 3
    assert figures["incrby_calls_per_decision"] == 2
    # (0.04 + 0.02 + 0.02) CPU-seconds over 1,000 decisions: 80 µs, 40 on the busiest master.
    assert figures["cpu_us_per_decision"] == pytest.approx(80.0)
    assert figures["busiest_cpu_us_per_decision"] == pytest.approx(40.0)
    assert figures["busiest_master_share"] == pytest.approx(0.5)
    assert figures["command_usec_per_decision"] == pytest.approx(12.0)
    # 20,000 decisions a second at 80 µs each: 1.6 cores, 0.8 on the busiest master.
    assert figures["target_cores"] == pytest.approx(1.6)
    assert figures["target_busiest_cores"] == pytest.approx(0.8)
    assert figures["floor_cpu_us_per_call"] == pytest.approx(30.0)
    assert figures["wait_p99_ms"] == pytest.approx(0.989)


@pytest.mark.system
async def test_counter_reservations_on_a_real_redis_cost_a_read_and_two_pipelines_a_decision(
    redis_server: RedisServer,
) -> None:
    store = fleet.Store("redis", redis_server.url, (redis_server.port,), cluster=False)
    args = fleet.main_parser().parse_args(
        ["--reservations", "counters", "--idle-s", "0.2", "--load-s", "0.5", "--hold-ms", "50"]
    )
    cell = await fleet.counter_cell(store, 24, 40.0, args, random.Random(4))
    figures = cell.figures()
    assert cell.load.count == 20
    assert figures["failed"] == 0
    # One MGET a read; an INCRBY and a PEXPIREAT for the reservation, as many for its release.
    assert cell.load.calls("mget") == 20
    assert cell.load.calls("incrby") == 40
    assert cell.load.calls("pexpireat") == 40
    assert len(cell.waits_ms) == 20
    # As above: the CPU was read; less the idle's share, 20 decisions' figure is only >= 0.
    assert sum(m.cpu_s for m in cell.load.masters) > 0
    assert figures["cpu_us_per_decision"] >= 0
    assert figures["skipped"] == 0
    assert cell.left == 0
    assert fleet.counter_errors([cell]) == []


def test_a_counter_run_fails_when_its_last_read_still_counts_or_skips() -> None:
    window = fleet.ShardedWindow(1.0, 10, [_master(1, 0.01)])
    clean = fleet.CounterCell("redis", 8, 10.0, window, window, window)
    assert fleet.counter_errors([clean]) == []
    left = fleet.CounterCell("redis", 8, 10.0, window, window, window, left=2)
    skipped = fleet.CounterCell("redis", 8, 10.0, window, window, window, skipped=1)
    assert fleet.counter_errors([left, skipped]) == [
        "redis N 8 at 10/s: 2 endpoints still counted after the last release",
        "redis N 8 at 10/s: 1 keys skipped or clamped",
    ]
