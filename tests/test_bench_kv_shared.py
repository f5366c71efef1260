"""bench/kv_shared.py: the figures it derives from the servers' readings, and a run on a real
redis-server (the quick run is ``make bench-smoke``'s)."""

from __future__ import annotations

import random

import pytest

from bench import kv_shared
from bench.fleet import Store
from bench.kv_shared import ServerReading, Window
from tests.processes import RedisServer


def test_a_window_charges_each_query_what_the_idle_masters_did_not_spend() -> None:
    # 2 s, 1,000 queries over three masters: 0.5 CPU-seconds, of which idle 0.05 a second.
    servers = [
        ServerReading(1, 0.25, {"mget": (4000, 20_000.0)}),
        ServerReading(2, 0.15, {"mget": (4000, 15_000.0)}),
        ServerReading(3, 0.10, {"mget": (3000, 10_000.0)}),
    ]
    window = Window("cluster", "queries", 500.0, 8192, 2.0, 1000, servers, 0.8, 0.05)
    window.rounds_ms = [float(i) / 100 for i in range(1000)]
    figures = window.figures()
    assert figures["achieved_per_s"] == 500.0
    assert figures["redis_cpu_us"] == pytest.approx((0.5 - 0.1) * 1e6 / 1000)
    assert figures["redis_cmd_us"] == pytest.approx(45.0)
    assert figures["commands"] == pytest.approx(11.0)
    assert figures["busiest_share"] == pytest.approx(0.5)
    assert figures["own_cpu_us"] == pytest.approx(800.0)
    assert figures["round_p50_ms"] == pytest.approx(4.99)
    assert figures["round_p99_ms"] == pytest.approx(9.89)
    assert window.sound
    window.failed = 11  # over 1 %: this process fell behind; left out of the extrapolation
    assert not window.sound


@pytest.mark.system
async def test_a_run_on_a_real_redis_writes_blocks_and_finds_them(
    redis_server: RedisServer,
) -> None:
    store = Store("redis", redis_server.url, (redis_server.port,), cluster=False)
    args = kv_shared.main_parser().parse_args(
        [
            "--event-rates", "2000", "--query-rates", "40", "--prompt-tokens", "1024",
            "--stored-tokens", "2048", "--capacity", "512", "--engines", "2",
            "--window-s", "0.4", "--idle-s", "0.1", "--saturate-n", "500",
        ]
    )  # fmt: skip
    run = await kv_shared.measure(store, args, random.Random(1))
    events, queries = run.windows
    assert events.count >= 800
    # Every stored or removed block is two commands (SETBIT, PEXPIRE; NX for a removal), one
    # when another op of the flush already set the key's expiry.
    assert 1.0 <= events.figures()["commands"] <= 2.0
    # The master's CPU was read over the window. Less the idle's share, the per-event figure is
    # only >= 0 here: a 0.1 s idle reading (a cron, a key expiring) can outweigh a 0.4 s
    # window's few ms of work. The first test checks that arithmetic.
    assert sum(s.cpu_s for s in events.servers) > 0
    assert events.figures()["redis_cpu_us"] >= 0
    # One MGET per query, each answered within the budget.
    assert queries.count == 16
    assert queries.failed == 0
    assert len(queries.rounds_ms) == 16
    assert queries.figures()["commands"] == pytest.approx(1.0)
    assert run.bytes_per_block > 0
    assert run.blocks > 0
    assert len(run.visible_ms) == 5
    # redis-benchmark played many sidecars asking the one master at once.
    [(port, per_s, cpu_us)] = run.saturated
    assert port == redis_server.port
    assert per_s > 0
    assert cpu_us > 0
    assert kv_shared.extrapolate([run], args)


def test_an_owners_bytes_per_held_block_are_measured_with_its_hashes() -> None:
    small = kv_shared.owner_bytes_per_block(3200, hash_bytes=None)
    wide = kv_shared.owner_bytes_per_block(3200, hash_bytes=32)
    # A block's digest, its entry and a dict slot at least; a 32-byte hash costs more than an int.
    assert 100 < small < wide < 1000
