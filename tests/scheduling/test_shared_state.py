"""Shared state through a real redis-server, with real sidecar processes."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis.asyncio as aioredis

from sidecar.config import Settings
from sidecar.scheduling.model import Speed
from sidecar.scheduling.state import Load
from sidecar.scheduling.state.prefix_share import stream_key
from sidecar.scheduling.state.protocol import MAX_ENTRIES, SCRIPT, keys
from sidecar.scheduling.state.redis import RedisState
from sidecar.server.runner import start_sidecar
from tests.conftest import StartEmulator, completion, eventually, get_json, inject
from tests.processes import RedisServer, sidecar_process
from tests.scheduling.test_state_resp import documented_acl

LONG_PROMPT = "Retrieved passage about KV caches and their transfer. " * 45  # ~600 tokens
PAUSE_MS = 3000
"""How long Redis plays dead in the slow-Redis test: far longer than one request takes."""


def _shared(redis: RedisServer, decode_url: str, **extra: str) -> dict[str, str]:
    return {
        "decode_url": decode_url,
        "state_backend": "redis",
        "redis_url": redis.url,
        "redis_key_prefix": "test",
        "scrape_interval_s": "0.2",
        "disagg_ttft_ratio": "1000",
        **extra,
    }


async def _prefills(http: aiohttp.ClientSession, engine) -> int:
    kv = await get_json(http, engine.url + "/emulator/kv")
    return int(kv["pulled_total"])


async def _evalsha_calls(client: aioredis.Redis) -> int:
    stats = await client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_eval"))


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_slow_endpoint_receives_fewer_prefills(
    http, redis_server, start_engine: StartEmulator, decode
) -> None:
    fast = [await start_engine(prefill_s_per_token=0.00005) for _ in range(2)]
    slow = await start_engine(prefill_s_per_token=0.0005)  # ten times slower
    pool = ",".join(e.endpoint for e in [*fast, slow])
    settings = _shared(redis_server, decode.url, prefill_endpoints=pool)
    async with (
        sidecar_process(settings, scheduler_seed="1") as one,
        sidecar_process(settings, scheduler_seed="2") as two,
    ):
        # Both synced with Redis and scraped every endpoint: every request is scheduled, none
        # decided on a partial view of a sidecar that is still starting.
        for sidecar in (one, two):
            await eventually(functools.partial(_scheduling, http, sidecar.url, 3), within=15)

        async def client(sidecar_url: str, index: int) -> int:
            async with http.post(
                sidecar_url + "/v1/completions",
                json=completion(f"{index} {LONG_PROMPT}", max_tokens=2),
            ) as response:
                await response.read()
                return response.status

        statuses = []
        for batch in range(6):  # waves of 8 concurrent requests over both sidecars
            statuses += await asyncio.gather(
                *(client((one, two)[i % 2].url, batch * 8 + i) for i in range(8))
            )
        assert statuses == [200] * 48
        counts = [await _prefills(http, e) for e in [*fast, slow]]
        records = (await get_json(http, one.url + "/debug/requests"))["recent"]
        assert {r["reason"] for r in records} == {"scheduled"}
    # Round robin would give the slow endpoint a third (16); observed speed keeps it well below.
    assert sum(counts) == 48
    assert counts[2] <= 8, counts
    assert counts[2] < min(counts[:2]) / 2, counts


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_dead_sidecar_stops_counting_within_the_lease(
    http, redis_server, prefill, decode
) -> None:
    settings = _shared(
        redis_server, decode.url, prefill_endpoints=prefill.endpoint, state_lease_s="1"
    )
    async with sidecar_process(settings) as watcher, sidecar_process(settings) as victim:
        await inject(http, prefill, kind="hang", role="prefill", count=2)

        async def post(index: int) -> None:
            async with http.post(
                victim.url + "/v1/completions", json=completion(f"{index} {LONG_PROMPT}")
            ) as response:
                await response.read()

        pending = [asyncio.create_task(post(i)) for i in range(2)]

        async def reserved(count: int) -> bool:
            snapshot = await get_json(http, watcher.url + "/debug/scheduler")
            # The watcher's view refreshes with its own syncs (heartbeat: lease / 3).
            return snapshot["endpoints"][0]["reserved_requests"] == count

        await eventually(lambda: reserved(2), within=10)
        victim.kill()
        await victim.process.wait()
        for task in pending:  # the victim's clients lose their connection
            with pytest.raises(aiohttp.ClientError):
                await task
        # Lease 1 s; the watcher's heartbeat comes every third of it: 1.33 s at most on an idle
        # machine. Without the lease the count would stay at 2 for good; 10 s leaves a loaded
        # CI room to schedule three processes.
        await eventually(lambda: reserved(0), within=10)
        async with http.post(decode.url + "/emulator/release") as response:
            assert response.status in (200, 204)


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_a_rolling_upgrade_to_counters_counts_every_reservation_once(
    http, redis_server, prefill, decode
) -> None:
    """A sidecar on the script's reservations and one on counters, side by side: each counts
    the other's held prefill, once; the old one gone, the new one reads the counters alone
    and keeps serving."""
    settings = _shared(
        redis_server, decode.url, prefill_endpoints=prefill.endpoint, state_lease_s="1"
    )

    async def snapshot(url: str) -> dict:
        return await get_json(http, url + "/debug/scheduler")

    async def reserved(url: str, count: int) -> bool:
        return (await snapshot(url))["endpoints"][0]["reserved_requests"] == count

    async def bridging(url: str, expected: bool) -> bool:
        return (await snapshot(url))["state_backend"]["reservations"]["bridging"] is expected

    async def post(url: str, index: int) -> int:
        async with http.post(
            url + "/v1/completions", json=completion(f"{index} {LONG_PROMPT}", max_tokens=2)
        ) as response:
            await response.read()
            return response.status

    async with sidecar_process(settings, state_reservations="counters") as new:
        async with sidecar_process(settings) as old:
            await eventually(lambda: bridging(new.url, True), within=10)
            await inject(http, prefill, kind="hang", role="prefill", count=2)
            held = [asyncio.create_task(post(s.url, i)) for i, s in enumerate((old, new))]
            for url in (old.url, new.url):
                await eventually(functools.partial(reserved, url, 2), within=10)
            async with http.post(prefill.url + "/emulator/release") as response:
                assert response.status == 200
            assert await asyncio.gather(*held) == [200, 200]
            for url in (old.url, new.url):
                await eventually(functools.partial(reserved, url, 0), within=10)
        await eventually(lambda: bridging(new.url, False), within=10)
        state = (await snapshot(new.url))["state_backend"]
        assert state["reservations"]["script_sidecars"] == 0
        await inject(http, prefill, kind="hang", role="prefill", count=1)
        hung = asyncio.create_task(post(new.url, 2))
        await eventually(lambda: reserved(new.url, 1), within=10)
        async with http.post(prefill.url + "/emulator/release") as response:
            assert response.status == 200
        assert await hung == 200
        assert [await post(new.url, i) for i in range(3, 6)] == [200] * 3
        await eventually(lambda: reserved(new.url, 0), within=10)
        state = (await snapshot(new.url))["state_backend"]["reservations"]
        assert (state["lost_writes"], state["lost_releases"]) == (0, 0)


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_redis_down_costs_no_request_and_reconnects(
    http, redis_server, prefill, decode
) -> None:
    settings = _shared(redis_server, decode.url, prefill_endpoints=prefill.endpoint)
    async with sidecar_process(settings) as sidecar:
        sent = 0

        async def send(count: int) -> list[int]:
            nonlocal sent
            statuses = []
            for index in range(sent, sent + count):  # new prompts: none is cached locally
                async with http.post(
                    sidecar.url + "/v1/completions",
                    json=completion(f"{index} {LONG_PROMPT}", max_tokens=2),
                ) as response:
                    await response.read()
                    statuses.append(response.status)
            sent += count
            return statuses

        async def connected(expected: bool) -> bool:
            snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
            return snapshot["state_backend"]["connected"] is expected

        assert await send(3) == [200] * 3
        await eventually(lambda: connected(True))
        await redis_server.stop()
        assert await send(10) == [200] * 10
        await eventually(lambda: connected(False))
        records = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][:10]
        assert {r["decision"] for r in records} == {"remote"}
        async with http.get(sidecar.url + "/metrics") as response:
            assert "pd_sidecar_state_backend_errors_total" in await response.text()
        await redis_server.start()  # same port: the backend finds it again by itself
        await eventually(lambda: connected(True), within=15)
        assert await send(2) == [200] * 2


@pytest.mark.system
@pytest.mark.timeout(30)
async def test_one_round_trip_to_decide_the_reservation_published_off_the_path(
    http, redis_server, prefill, decode
) -> None:
    settings = _shared(
        redis_server, decode.url, prefill_endpoints=prefill.endpoint, state_lease_s="600"
    )
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        async with sidecar_process(settings) as sidecar:
            await inject(http, prefill, kind="hang", role="prefill")

            await eventually(lambda: _connected(http, sidecar.url))
            sidecar_id = (await get_json(http, sidecar.url + "/debug/scheduler"))["state_backend"][
                "sidecar_id"
            ]
            before = await _evalsha_calls(client)
            request = asyncio.create_task(
                http.post(sidecar.url + "/v1/completions", json=completion(LONG_PROMPT))
            )

            async def prefilling() -> bool:
                inflight = (await get_json(http, sidecar.url + "/debug/requests"))["inflight"]
                return [r["state"] for r in inflight] == ["prefilling"]

            async def published() -> bool:
                held = await client.hget("{test}:reservations", sidecar_id)
                return held is not None and _text(held).startswith(prefill.endpoint + " ")

            await eventually(prefilling)
            await eventually(published)
            # The prefill is hanging on the engine: two script calls were made for it, the
            # decision's refresh and the worker's publication of the reservation.
            assert await _evalsha_calls(client) - before == 2

            async def hung() -> bool:  # the sidecar's "prefilling" comes before the engine has it
                return (await get_json(http, prefill.url + "/emulator/faults"))["held"] == 1

            await eventually(hung)  # a release before that wakes nothing: the prefill would hang
            async with http.post(prefill.url + "/emulator/release") as response:
                assert response.status in (200, 204)
            response = await request
            assert response.status == 200
            await response.read()
    finally:
        await client.aclose()


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_each_decision_reads_the_reservations_of_a_moment_ago(
    http, redis_server, start_engine: StartEmulator, decode
) -> None:
    """Before each decision the sidecar syncs with Redis: a reservation another sidecar made just
    before is seen, not the state of this sidecar's last sync. Another sidecar's heavy
    reservation moves between the two endpoints before every request; each request goes to the
    other one. (Deciding on the previous sync's view would pick exactly the wrong one: it would
    still see the reservation where it was for the request before.)"""
    engines = [await start_engine(), await start_engine()]
    endpoints = [e.endpoint for e in engines]
    settings = _shared(
        redis_server,
        decode.url,
        prefill_endpoints=",".join(endpoints),
        state_lease_s="600",  # heartbeats 200 s apart: only requests make this sidecar sync
        state_timeout_ms="1000",  # a loaded machine's slow answer would leave the view stale
        scheduler_choices="2",
    )
    client = aioredis.Redis.from_url(redis_server.url)
    # The other sidecar syncs as every sidecar does, through the script (which keeps the pool's
    # totals as tables change): its whole table, one heavy reservation, and a lease.
    script = client.register_script(SCRIPT)

    async def other_sidecar_reserves(endpoint: str) -> None:
        table = f"{endpoint} 1000000 50"
        await script(keys=keys("test"), args=["other-sidecar", time.time(), 600, table, 0, 0])

    try:
        async with sidecar_process(settings) as sidecar:
            await eventually(functools.partial(_scheduling, http, sidecar.url, 2), within=15)
            chosen = []
            for index in range(6):
                busy = endpoints[index % 2]
                await other_sidecar_reserves(busy)
                async with http.post(
                    sidecar.url + "/v1/completions",
                    json=completion(f"{index} {LONG_PROMPT}", max_tokens=2),
                    headers={"x-request-id": f"fresh-{index}"},
                ) as response:
                    assert response.status == 200
                    await response.read()
                entry = await get_json(http, f"{sidecar.url}/debug/requests/fresh-{index}")
                assert entry["reason"] == "scheduled", entry
                chosen.append((busy, entry["prefill_endpoint"]))
    finally:
        await client.aclose()
    assert all(busy != endpoint for busy, endpoint in chosen), chosen


@pytest.mark.system
@pytest.mark.timeout(30)
async def test_slow_redis_does_not_hold_requests(http, redis_server, prefill, decode) -> None:
    # A long lease: no heartbeat sync falls into the pause (a request arriving during a sync
    # decides on the local view without waiting, and counts no timeout).
    settings = _shared(
        redis_server,
        decode.url,
        prefill_endpoints=prefill.endpoint,
        state_timeout_ms="20",
        state_lease_s="600",
    )
    client = aioredis.Redis.from_url(redis_server.url)
    probe = aioredis.Redis.from_url(redis_server.url)
    try:
        async with sidecar_process(settings) as sidecar:
            await eventually(lambda: _connected(http, sidecar.url))
            await probe.ping()  # connected before the pause
            # Redis answers no client for PAUSE_MS from the moment it says OK.
            assert await client.execute_command("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
            paused = asyncio.ensure_future(probe.ping())  # answered when the pause ends
            async with http.post(
                sidecar.url + "/v1/completions", json=completion("slow " + LONG_PROMPT)
            ) as response:
                assert response.status == 200
                await response.read()
            # The request did not wait for Redis: it was answered within the pause.
            assert not paused.done()
            records = (await get_json(http, sidecar.url + "/debug/requests"))["recent"]
            assert records[0]["decision"] == "remote"
            async with http.get(sidecar.url + "/metrics") as response:
                text = await response.text()
            assert 'pd_sidecar_state_backend_errors_total{kind="timeout"} 1.0' in text
            await paused
    finally:
        await client.aclose()
        await probe.aclose()


async def _scheduling(http: aiohttp.ClientSession, url: str, endpoints: int) -> bool:
    """The sidecar has synced with Redis and scraped each of its ``endpoints`` at least once."""
    snapshot = await get_json(http, url + "/debug/scheduler")
    scraped = [e for e in snapshot["endpoints"] if e["scraped"] is not None]
    return bool(snapshot["state_backend"]["connected"]) and len(scraped) == endpoints


async def _connected(http: aiohttp.ClientSession, url: str) -> bool:
    """The sidecar's Redis backend has synced at least once (script loaded, lease taken)."""
    snapshot = await get_json(http, url + "/debug/scheduler")
    return bool(snapshot["state_backend"]["connected"])


@pytest.mark.timeout(30)
async def test_the_script_touches_only_the_keys_it_is_given(
    http, redis_server, prefill, decode
) -> None:
    """On a Redis Cluster a script may only use the keys it declares (``KEYS``), or slot
    redirections and failovers cannot follow them: a Redis user allowed those keys alone runs
    every step of it — registration, reservations, a dead sidecar dropped, speeds, the lease
    given up at shutdown."""
    keys = RedisState("redis://unused", prefix="test", lease_s=1, timeout_s=1).keys
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        patterns = [f"~{key}" for key in keys]
        await admin.execute_command("ACL", "SETUSER", "sidecar", "on", ">pw", *patterns, "+@all")
        # A sidecar that died holding a reservation: its lease ran out long ago.
        await admin.zadd(keys[0], {"dead-sidecar": 1.0})
        await admin.hset(keys[3], "dead-sidecar", f"{prefill.endpoint} 900 3")
        sidecar = await start_sidecar(
            Settings(
                host="127.0.0.1",
                port=0,
                decode_url=decode.url,
                state_backend="redis",
                redis_url=f"redis://sidecar:pw@127.0.0.1:{redis_server.port}/0",
                redis_key_prefix="test",
                prefill_endpoints=prefill.endpoint,
                disagg_ttft_ratio=1000,
                # What is checked is what the script may touch, not how fast: on a loaded
                # machine the first sync can take longer than the 5 ms decision budget.
                state_timeout_ms=1000,
            )
        )
        try:
            await _serve_once(http, sidecar.url)
            # Its speed, published by the sync that follows the release.
            await eventually(lambda: _stored(admin, keys[1], prefill.endpoint))
            snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
        finally:
            await sidecar.close()  # gives its lease up: both of its entries go
        assert snapshot["state_backend"]["last_error"] is None
        assert snapshot["endpoints"][0]["reserved_requests"] == 0  # the dead one's dropped
        assert await admin.hget(keys[3], "dead-sidecar") is None
        assert {_text(key) for key in await admin.keys("*")} <= set(keys)
        sidecar_id = snapshot["state_backend"]["sidecar_id"]
        assert await admin.zscore(keys[0], sidecar_id) is None
        assert await admin.hget(keys[3], sidecar_id) is None
    finally:
        await admin.aclose()


async def _serve_once(http: aiohttp.ClientSession, url: str) -> None:
    """Synced with Redis, then one request prefilled remotely: reserved and released there."""
    await eventually(lambda: _connected(http, url))
    async with http.post(url + "/v1/completions", json=completion(f"acl {LONG_PROMPT}")) as answer:
        assert answer.status == 200
        await answer.read()
    records = (await get_json(http, url + "/debug/requests"))["recent"]
    assert records[0]["decision"] == "remote"


async def _stored(client: aioredis.Redis, key: str, field: str) -> bool:
    return await client.hget(key, field) is not None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def test_what_does_not_parse_is_skipped_and_counted_not_the_sync(redis_server) -> None:
    """Another version of the sidecar (or a person) wrote entries this one cannot believe: not
    numbers, NaN, negative, absurdly large, an ejection that never ends. Each is skipped and
    counted by kind; the sync succeeds and the valid entries beside them are read (a speed that
    did not parse used to fail every sync, leaving the sidecar on its local view)."""
    skipped: collections.Counter[str] = collections.Counter()
    state = RedisState(
        redis_server.url,
        prefix="odd",
        lease_s=3,
        timeout_s=1,
        max_ejection_s=60,
        on_skipped=lambda kind, count: skipped.update({kind: count}),
    )
    sidecars, speeds, ejections, reservations, _totals = state.keys
    admin = aioredis.Redis.from_url(redis_server.url)
    now = time.time()
    try:
        await admin.hset(
            speeds,
            mapping={
                "127.0.0.1:9": "not a speed",
                "127.0.0.1:10": "nan 0.1",
                "127.0.0.1:11": "-1 0.5",
                "127.0.0.1:12": "1e18 1e18",
                "127.0.0.1:13": "0.0001 0.05",
            },
        )
        await admin.hset(
            ejections,
            mapping={
                "127.0.0.1:14": "1e18",
                "127.0.0.1:15": "not a time",
                "127.0.0.1:16": repr(now + 30),
            },
        )
        await admin.zadd(sidecars, {"junk": now + 60})
        await admin.hset(
            reservations,
            "junk",
            "127.0.0.1:17 -5 1\n127.0.0.1:18 99999999999999999999 1\n127.0.0.1:19 100 2\nx",
        )
        await state.start()
        await eventually(lambda: _true(state.connected))
        view = state.view()
        assert set(view.speeds) == {"127.0.0.1:13"}
        assert view.speeds["127.0.0.1:13"].overhead_s == 0.05
        assert set(view.ejected_until) == {"127.0.0.1:16"}
        assert view.loads == {"127.0.0.1:19": Load(100, 2)}
        assert skipped == {"speed": 4, "ejection": 2, "load": 1}
        assert state.status()["last_error"] is None
    finally:
        await state.close()
        await admin.aclose()


async def test_one_sync_reads_a_bounded_number_of_entries(redis_server) -> None:
    """Thousands of fields in the speeds hash (100,000 stalled /health for 0.75 s when each was
    parsed on the loop): one sync reads at most MAX_ENTRIES of them; the rest are counted."""
    skipped: collections.Counter[str] = collections.Counter()
    state = RedisState(
        redis_server.url,
        prefix="many",
        lease_s=3,
        timeout_s=1,
        on_skipped=lambda kind, count: skipped.update({kind: count}),
    )
    admin = aioredis.Redis.from_url(redis_server.url)
    junk = MAX_ENTRIES + 4000
    try:
        await admin.hset(state.keys[1], mapping={f"junk-{i}:1": "2e-4 0.01" for i in range(junk)})
        await state.start()
        await eventually(lambda: _true(state.connected))
        assert len(state.view().speeds) == MAX_ENTRIES
        assert skipped == {"over_limit": junk - MAX_ENTRIES}
    finally:
        await state.close()
        await admin.aclose()


async def _true(value: bool) -> bool:
    return value


@pytest.mark.timeout(30)
async def test_close_while_the_worker_waits_for_a_stalled_sync(redis_server) -> None:
    """Shutdown while Redis stalls the worker's sync: ``close`` returns (it used to swallow the
    worker's cancellation there, and then wait for the next heartbeat: a third of the lease)."""
    state = RedisState(redis_server.url, prefix="close", lease_s=600, timeout_s=0.005)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await state.start()
        await eventually(lambda: _true(state.connected))
        assert await admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")
        state.release(state.reserve("127.0.0.1:9", 10))  # wakes the worker: it syncs, stalled
        await eventually(lambda: _true(state._sync is not None))
        started = time.monotonic()
        await state.close()
        # The best-effort goodbye takes up to 0.5 s against the paused Redis; the rest, nothing.
        # (Measured, not bounded with asyncio.timeout: close() swallowed that cancellation too.)
        assert time.monotonic() - started < 2.0
    finally:
        await admin.aclose()


HONEST = "127.0.0.11:8000"


class Synced:
    """A backend, run as the Redis user of docs/deploy.md's ACL line on the pool
    ``pd-sidecar`` (sharing prefixes), once it synced after ``written`` wrote the keys."""

    def __init__(self, redis: RedisServer) -> None:
        self.redis = redis
        self.admin = aioredis.Redis.from_url(redis.url)
        self.skipped: collections.Counter[str] = collections.Counter()
        url = f"redis://sidecar:pw@127.0.0.1:{redis.port}/0"
        self.state = RedisState(
            url,
            prefix="pd-sidecar",
            lease_s=30,
            timeout_s=1,
            on_skipped=lambda kind, count: self.skipped.update({kind: count}),
        )
        self.state.share_prefixes(lambda endpoint, hashes: None)
        self.keys = dict(zip(("sidecars", "speeds", "ejections"), self.state.keys, strict=False))
        self.keys["prefixes"] = stream_key("pd-sidecar")

    async def start(self) -> None:
        await self.admin.execute_command(*documented_acl("pw"))
        await self.state.start()
        await eventually(lambda: _true(self.state.connected))
        assert self.state.status()["last_error"] is None

    async def close(self) -> None:
        await self.state.close()
        await self.admin.aclose()


@pytest.fixture
async def synced(redis_server) -> AsyncIterator[Synced]:
    backend = Synced(redis_server)
    yield backend
    await backend.close()


async def test_a_field_holding_newlines_sets_no_other_endpoints_speed(synced) -> None:
    """A speed whose value holds newlines and another endpoint's name, after an honest speed:
    the answer's lines used to pair it with the honest endpoint (0.99 s a token, 599 s of
    overhead: in range, so believed). Each field now stands alone: the one entry is skipped."""
    await synced.admin.hset(synced.keys["speeds"], HONEST, "0.0001 0.05")
    await synced.admin.hset(synced.keys["speeds"], "127.0.0.1:9", f"1\n{HONEST}\n0.99 599")
    await synced.admin.hset(synced.keys["speeds"], f"127.0.0.1:10\n{HONEST}", "0.99 599")
    await synced.start()
    assert synced.state.view().speeds == {HONEST: Speed(0.0001, 0.05)}
    assert synced.skipped == {"speed": 2}


async def test_speeds_that_are_not_utf8_are_skipped_alone(synced) -> None:
    """A field and a value that are not UTF-8 used to fail the whole sync of every sidecar."""
    await synced.admin.hset(synced.keys["speeds"], HONEST, "0.0001 0.05")
    await synced.admin.hset(synced.keys["speeds"], b"\xff\xfe", "0.0001 0.05")
    await synced.admin.hset(synced.keys["speeds"], "127.0.0.1:10", b"\xff\xfe")
    await synced.start()
    assert synced.state.view().speeds == {HONEST: Speed(0.0001, 0.05)}
    assert synced.skipped == {"speed": 2}


async def test_a_pool_key_of_another_type_is_deleted_and_logged(synced, caplog) -> None:
    """The ejections and the prefix stream written as strings (``WRONGTYPE`` used to fail every
    sync and every share of every sidecar): deleted, logged and counted, within the pool's own
    keys — another pool's key of the wrong type is left alone."""
    await synced.admin.set(synced.keys["ejections"], "not a hash")
    await synced.admin.set(synced.keys["prefixes"], "not a stream")
    await synced.admin.set("{other-pool}:speeds", "not a hash")
    with caplog.at_level(logging.WARNING, logger="sidecar.scheduling.state"):
        await synced.start()
        await eventually(lambda: _true(synced.skipped["wrong_type"] == 2))
    assert synced.skipped == {"wrong_type": 2}
    for name in ("ejections", "prefixes"):
        assert _text(await synced.admin.type(synced.keys[name])) in ("none", "hash", "stream")
    assert _text(await synced.admin.type("{other-pool}:speeds")) == "string"
    repaired = sorted(r.getMessage() for r in caplog.records if "deleted" in r.getMessage())
    assert repaired == [
        f"redis state backend: {synced.keys[name]} was a string, not what the pool keeps there: "
        "deleted"
        for name in ("ejections", "prefixes")
    ]


async def test_thousands_of_dead_sidecars_go_a_bounded_number_per_sync(redis_server) -> None:
    """10,000 sidecars whose lease ran out (written by hand: Lua's unpack of them all failed
    every sync): each sync drops at most MAX_ENTRIES of them, and syncs meanwhile."""
    state = RedisState(redis_server.url, prefix="dead", lease_s=600, timeout_s=1)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await admin.zadd(state.keys[0], {f"dead-{i}": 1.0 for i in range(10_000)})
        await state.start()
        await eventually(lambda: _true(state.connected))
        assert state.status()["last_error"] is None
        left = await admin.zcard(state.keys[0])
        assert 10_000 - MAX_ENTRIES + 1 >= left > 0  # this sidecar, and the dead not yet dropped
    finally:
        await state.close()
        await admin.aclose()


async def test_an_oversized_prefix_entry_is_passed_not_read(redis_server) -> None:
    """An entry of the prefix share of 8 MiB (a placement's hashes are 32 KiB at most): the
    script leaves it out, counted, and the cursor moves past it to the next entry, which is
    learnt — without the entry crossing the wire (the share used to take the first entry whole,
    past its 64 KiB budget: 200 MiB of it added ~400 MiB to the sidecar; one larger than the
    sidecar could read stalled the share for good)."""
    skipped: collections.Counter[str] = collections.Counter()
    learnt: list[tuple[str, list[bytes]]] = []
    state = RedisState(
        redis_server.url,
        prefix="big",
        lease_s=30,
        timeout_s=1,
        on_skipped=lambda kind, count: skipped.update({kind: count}),
    )
    state.share_prefixes(lambda endpoint, hashes: learnt.append((endpoint, list(hashes))))
    admin = aioredis.Redis.from_url(redis_server.url)
    stream = stream_key("big")
    blocks = [bytes([1]) * 8, bytes([2]) * 8]
    try:
        await admin.xadd(stream, {"s": "other", "e": HONEST, "h": b"\x07" * (8 << 20)})
        after = await admin.xadd(stream, {"s": "other", "e": HONEST, "h": b"".join(blocks)})
        sent = (await admin.info("stats"))["total_net_output_bytes"]
        await state.start()
        await eventually(lambda: _true(bool(learnt)))
        sent = (await admin.info("stats"))["total_net_output_bytes"] - sent
        assert learnt == [(HONEST, blocks)]
        assert skipped == {"prefix": 1}
        assert state.status()["prefix_share"]["cursor"] == _text(after)
        assert sent < 1 << 20  # the 8 MiB never left Redis
    finally:
        await state.close()
        await admin.aclose()
