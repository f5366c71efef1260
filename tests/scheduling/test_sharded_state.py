"""The sharded reservations (``sidecar.scheduling.state.sharded``) on a real redis-server: the
script's tables and totals, the expiry of lapsed sidecars, a shard started anew, the checks of
what is read back; and the shards spread over a real 3-master Redis Cluster."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ResponseError

from sidecar.scheduling.state import Load
from sidecar.scheduling.state.sharded import (
    EXPIRE_PER_SYNC,
    MAX_ENTRIES,
    MAX_TOTALS_BYTES,
    ShardedReservations,
    Shards,
    connect,
    even_split,
    shard_of,
    shard_tags,
)
from tests.processes import RedisCluster, RedisServer

NOW = 1_000.0
"""The sidecars' clock, for their heartbeats only: the script judges leases by Redis's. A lapsed
lease is written as such (a score in the past), not waited for."""
ENDPOINTS = [f"127.0.1.{i}:8000" for i in range(8)]


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    redis = connect(redis_server.url, cluster=False)
    assert isinstance(redis, aioredis.Redis)
    yield redis
    await redis.aclose()


def _sidecars(shards: Shards, count: int, *, lease_s: float = 10.0) -> list[ShardedReservations]:
    return [ShardedReservations(shards, f"sidecar-{i}", lease_s=lease_s) for i in range(count)]


async def _lapse(
    client: aioredis.Redis, shards: Shards, sidecars: list[ShardedReservations]
) -> None:
    """The sidecars' leases ended: their scores set in the past of Redis's clock."""
    for sidecar in sidecars:
        await client.zadd(shards.keys[sidecar.shard][0], {sidecar.sidecar: 1.0}, xx=True)


def _sum(tables: list[dict[str, Load]]) -> dict[str, Load]:
    sums: dict[str, Load] = {}
    for table in tables:
        for endpoint, load in table.items():
            was = sums.get(endpoint, Load())
            sums[endpoint] = Load(was.tokens + load.tokens, was.requests + load.requests)
    return {endpoint: load for endpoint, load in sums.items() if load.requests}


async def test_a_sync_replaces_the_sidecars_table_and_the_totals_follow(client) -> None:
    shards = Shards(client, "pool", shards=1)
    first, second = _sidecars(shards, 2)
    await first.sync({ENDPOINTS[0]: Load(100, 2), ENDPOINTS[1]: Load(5, 1)}, NOW)
    await second.sync({ENDPOINTS[0]: Load(10, 1)}, NOW)
    await first.sync({ENDPOINTS[1]: Load(7, 2)}, NOW + 1)
    # The first table is gone: only the one sent last counts, with the second sidecar's.
    tables = await client.hgetall(shards.keys[0][1])
    assert tables[b"sidecar-0"] == f"{ENDPOINTS[1]} 7 2".encode()
    totals = await second.read()
    assert totals.loads == {ENDPOINTS[0]: Load(10, 1), ENDPOINTS[1]: Load(7, 2)}
    assert first.sent == {ENDPOINTS[1]: Load(7, 2)}
    await first.leave()
    assert (await second.read()).loads == {ENDPOINTS[0]: Load(10, 1)}
    assert await client.zscore(shards.keys[0][0], "sidecar-0") is None


async def test_a_sidecar_that_leaves_leaves_the_others_totals_their_expiry(client) -> None:
    shards = Shards(client, "pool", shards=1)
    first, second = _sidecars(shards, 2)
    await first.sync({ENDPOINTS[0]: Load(100, 1)}, NOW)
    await second.sync({ENDPOINTS[1]: Load(200, 2)}, NOW)
    await first.leave()
    # Every key of the shard still lives about a lease (10 s), not a moment.
    for key in shards.keys[0]:
        assert await client.pttl(key) > 5_000, key
    assert (await second.read()).loads == {ENDPOINTS[1]: Load(200, 2)}


async def test_a_table_holding_an_empty_entry_is_not_due_again(client) -> None:
    shards = Shards(client, "pool", shards=1)
    [sidecar] = _sidecars(shards, 1)
    table = {ENDPOINTS[0]: Load(100, 1), ENDPOINTS[1]: Load()}  # one released, still held
    await sidecar.sync(table, NOW)
    assert not sidecar.due(table, NOW + 1)
    assert sidecar.due({ENDPOINTS[0]: Load(100, 2)}, NOW + 1)


async def test_every_key_a_shard_leaves_expires_within_a_lease(client) -> None:
    shards = Shards(client, "pool", shards=1)
    first, second = _sidecars(shards, 2)
    await first.sync({}, NOW)  # the expiry renewed, no table yet
    await first.sync({ENDPOINTS[0]: Load(100, 1)}, NOW + 1)  # the tables' key created
    await second.sync({ENDPOINTS[1]: Load(200, 2)}, NOW + 1)
    for sidecar in (first, second):
        await sidecar.leave()
    # The sums and totals outlive the last leave (a lease at most), and nothing lives longer.
    assert await client.exists(shards.keys[0][2], shards.keys[0][3]) == 2
    for key in shards.keys[0]:
        if await client.exists(key):
            assert 0 < await client.pttl(key) <= 10_000, key


async def test_the_totals_are_the_live_tables_summed_through_replaces_and_expiry(client) -> None:
    shards = Shards(client, "pool", shards=3)
    sidecars = _sidecars(shards, 12)
    tables: list[dict[str, Load]] = [{} for _ in sidecars]
    rng = random.Random(7)
    for step in range(300):
        index = rng.randrange(len(sidecars))
        tables[index] = {
            endpoint: Load(rng.randrange(1, 9000), rng.randrange(1, 4))
            for endpoint in rng.sample(ENDPOINTS, rng.randrange(0, 4))
        }
        await sidecars[index].sync(tables[index], NOW + step / 100)
    assert (await sidecars[0].read()).loads == _sum(tables)
    # Half of them stop syncing and their leases end; the others' syncs drop the lapsed ones,
    # rows and all.
    await _lapse(client, shards, sidecars[:6])
    for sidecar, table in zip(sidecars[6:], tables[6:], strict=True):
        await sidecar.sync(table, NOW + 4)
    totals = await sidecars[6].read()
    assert totals.loads == _sum(tables[6:])
    assert totals.skipped == 0


async def test_callers_clocks_apart_drop_no_live_peer(client) -> None:
    shards = Shards(client, "pool", shards=1)
    first, second = _sidecars(shards, 2)
    one, two = {ENDPOINTS[0]: Load(100, 1)}, {ENDPOINTS[1]: Load(200, 2)}
    await first.sync(one, NOW)
    # The second sidecar's clock runs 30 s ahead, three leases: the first one lives on.
    synced = await second.sync(two, NOW + 30)
    assert synced.expired == 0
    assert (await first.read()).loads == _sum([one, two])
    assert await client.zcard(shards.keys[0][0]) == 2


async def test_a_sync_drops_at_most_a_bounded_number_of_lapsed_sidecars(client) -> None:
    shards = Shards(client, "pool", shards=1)
    lapsed = _sidecars(shards, 20)
    for sidecar in lapsed:
        await sidecar.sync({ENDPOINTS[0]: Load(100, 1), ENDPOINTS[1]: Load(1, 1)}, NOW)
    await _lapse(client, shards, lapsed)
    live = ShardedReservations(shards, "live", lease_s=10.0)
    table = {ENDPOINTS[1]: Load(50, 1)}
    dropped = []
    for _ in range(4):
        synced = await live.sync(table, NOW + 5)
        dropped.append(synced.expired)
        left = 20 - sum(dropped)
        # Exact after every call: the lapsed ones not yet dropped still count.
        assert (await live.read()).loads == _sum([table] + [lapsed[0].sent] * left)
        assert synced.tables == 1 + left
    assert dropped == [EXPIRE_PER_SYNC, EXPIRE_PER_SYNC, 20 - 2 * EXPIRE_PER_SYNC, 0]
    assert await client.zcard(shards.keys[0][0]) == 1


async def test_a_shard_whose_sums_were_lost_starts_anew_and_its_sidecars_send_again(
    client,
) -> None:
    shards = Shards(client, "pool", shards=1)
    first, second = _sidecars(shards, 2)
    one, two = {ENDPOINTS[0]: Load(100, 1)}, {ENDPOINTS[1]: Load(200, 2)}
    await first.sync(one, NOW)
    before = await second.sync(two, NOW)
    assert not first.due(one, NOW + 1)
    await client.delete(shards.keys[0][2])  # the sums (an eviction, a hand's DEL)
    # The next sync cannot trust the rest: the shard starts anew, under a new generation.
    synced = await second.sync(two, NOW + 1)
    assert synced.fresh
    assert synced.generation != before.generation
    assert (await first.read()).loads == two
    # The first sidecar read the new generation: it owes a sync, though its table is the same.
    assert first.due(one, NOW + 1)
    await first.sync(one, NOW + 1)
    assert (await second.read()).loads == _sum([one, two])
    assert not first.due(one, NOW + 1)


async def test_a_lost_totals_string_is_written_again_by_the_next_sync(client) -> None:
    shards = Shards(client, "pool", shards=1)
    first, second = _sidecars(shards, 2)
    one, two = {ENDPOINTS[0]: Load(100, 1)}, {ENDPOINTS[1]: Load(200, 2)}
    await first.sync(one, NOW)
    await second.sync(two, NOW)
    await client.delete(shards.keys[0][3])  # the totals (an eviction, a hand's DEL)
    # A heartbeat that changes nothing in the sums still writes them out again.
    synced = await second.sync(two, NOW + 1)
    assert not synced.fresh
    assert (await first.read()).loads == _sum([one, two])
    assert await client.pttl(shards.keys[0][3]) > 5_000


async def _dump(client: aioredis.Redis, keys: tuple[str, ...]) -> list[bytes | None]:
    return [await client.dump(key) for key in keys]


async def test_a_row_over_the_cap_is_refused_before_anything_is_written(client) -> None:
    shards = Shards(client, "pool", shards=1)
    first, second = _sidecars(shards, 2)
    await first.sync({ENDPOINTS[0]: Load(100, 1)}, NOW)
    before = await _dump(client, shards.keys[0])
    table = {f"127.2.{i // 256}.{i % 256}:8000": Load(1, 1) for i in range(MAX_ENTRIES + 1)}
    with pytest.raises(ValueError, match="lines"):
        await second.sync(table, NOW)
    # The script refuses such a row too, whoever sends it, before its first write.
    row = "\n".join(f"{endpoint} 1 1" for endpoint in table)
    with pytest.raises(ResponseError, match="refused"):
        await shards.run(0, ["sidecar-1", "10.0", row, EXPIRE_PER_SYNC, 0])
    assert await _dump(client, shards.keys[0]) == before
    assert second.sent == {}


async def test_a_sync_dropping_thousands_of_endpoints_keeps_the_sums_exact(client) -> None:
    shards = Shards(client, "pool", shards=1)
    lapsed = _sidecars(shards, EXPIRE_PER_SYNC)
    for index, sidecar in enumerate(lapsed):
        table = {f"127.3.{index}.{i % 256}:{8000 + i // 256}": Load(5, 1) for i in range(1000)}
        await sidecar.sync(table, NOW)
    # Their leases lapsed (scores in the past): one sync drops all eight, 8,000 endpoints.
    await _lapse(client, shards, lapsed)
    live = ShardedReservations(shards, "live", lease_s=10.0)
    table = {ENDPOINTS[0]: Load(50, 1)}
    synced = await live.sync(table, NOW + 1)
    assert (synced.expired, synced.tables) == (EXPIRE_PER_SYNC, 1)
    assert (await live.read()).loads == table
    assert await client.hlen(shards.keys[0][2]) == 1 + 3  # its endpoint and the shard's fields


async def test_an_endpoint_named_like_the_shards_own_fields_is_refused(client) -> None:
    shards = Shards(client, "pool", shards=1)
    [sidecar] = _sidecars(shards, 1)
    synced = await sidecar.sync({ENDPOINTS[0]: Load(1, 1)}, NOW)
    with pytest.raises(ValueError, match="#"):
        await sidecar.sync({"#generation": Load(1, 1)}, NOW)
    with pytest.raises(ResponseError, match="refused"):
        await shards.run(0, ["sidecar-0", "10.0", "#generation 7 1", 8, 0])
    totals = await sidecar.read()
    assert totals.generations == (synced.generation,)
    assert totals.loads == {ENDPOINTS[0]: Load(1, 1)}


async def test_a_shard_of_the_longest_endpoints_reads_whole_up_to_the_cap(client) -> None:
    shards = Shards(client, "pool", shards=1)
    first, second = _sidecars(shards, 2)

    def longest(sidecar: int) -> dict[str, Load]:
        # Names of MAX_KEY_BYTES - 1 bytes, the longest counts a row takes.
        return {
            f"{'h' * 289}{sidecar}{i:04d}:8000": Load(10**12, 10**12) for i in range(MAX_ENTRIES)
        }

    await first.sync(longest(1), NOW)
    totals = await first.read()
    assert totals.loads == longest(1)
    assert totals.skipped == 0
    # Twice as many endpoints in the shard: the totals hold MAX_ENTRIES of them, still read.
    await second.sync(longest(2), NOW)
    raw = await client.get(shards.keys[0][3])
    assert len(raw) <= MAX_TOTALS_BYTES
    totals = await first.read()
    assert len(totals.loads) == MAX_ENTRIES
    assert totals.skipped == 0
    assert totals.generations != (None,)


async def test_a_key_of_another_type_starts_the_shard_anew(client) -> None:
    shards = Shards(client, "pool", shards=1)
    [sidecar] = _sidecars(shards, 1)
    await client.set(shards.keys[0][1], "not a hash")  # the tables
    synced = await sidecar.sync({ENDPOINTS[0]: Load(1, 1)}, NOW)
    assert synced.fresh
    assert (await sidecar.read()).loads == {ENDPOINTS[0]: Load(1, 1)}


async def test_what_is_read_back_is_checked_and_a_bad_entry_skipped_and_counted(client) -> None:
    shards = Shards(client, "pool", shards=4)
    [reader] = _sidecars(shards, 1)
    good = [f"{ENDPOINTS[0]}\n100 2", f"{ENDPOINTS[1]}\n5 1"]
    bad = [
        "an endpoint\n1 1",  # a space in it
        f"{ENDPOINTS[2]}\n-1 1",  # not a count
        f"{ENDPOINTS[3]}\n1 0",  # held by nobody
        f"{ENDPOINTS[4]}\n{10**13} 1",  # beyond any engine
        f"{ENDPOINTS[5]}\n1.5 1",
        f"{ENDPOINTS[6]}\nnan 1",
        f"{ENDPOINTS[0]}\n1 1",  # a second line for one endpoint
    ]
    totals_keys = shards.totals_keys
    await client.set(totals_keys[0], "\n".join(["#generation", "1", *good, *bad]))
    await client.set(totals_keys[1], "#generation\n2\n" + "x" * MAX_TOTALS_BYTES)  # too long
    await client.set(totals_keys[2], "\n".join(["#generation", "3", f"{ENDPOINTS[7]}\n\xe9 1"]))
    await client.hset(totals_keys[3], "not", "a string")  # MGET reads it as missing
    totals = await reader.read()
    assert totals.loads == {ENDPOINTS[0]: Load(100, 2), ENDPOINTS[1]: Load(5, 1)}
    # Seven bad lines; the long and the non-ASCII shards, each one.
    assert totals.skipped == len(bad) + 2
    assert totals.generations == ("1", None, None, None)
    assert reader.skipped == totals.skipped


async def test_reading_in_groups_fetches_a_group_a_read_and_sums_the_rest_as_last_read(
    client,
) -> None:
    shards = Shards(client, "pool", shards=6)
    writers = [_member(shards, shard) for shard in range(6)]
    for index, writer in enumerate(writers):
        await writer.sync({ENDPOINTS[index]: Load(10, 1)}, NOW)
    reader = ShardedReservations(shards, "reader", lease_s=10.0, read_groups=3)
    # The first read fetches every shard: nothing is held yet.
    totals = await reader.read()
    assert totals.loads == {endpoint: Load(10, 1) for endpoint in ENDPOINTS[:6]}
    # Then a group a read (shards 0 and 3, 1 and 4 or 2 and 5): a change in a shard shows once
    # its group is read again, not before, and every group is read within three reads.
    for index, writer in enumerate(writers):
        await writer.sync({ENDPOINTS[index]: Load(99, 3)}, NOW)
    seen: list[set[int]] = []
    for _ in range(3):
        loads = (await reader.read()).loads
        moved = {index for index in range(6) if loads[ENDPOINTS[index]] == Load(99, 3)}
        seen.append(moved - set().union(*seen))
    assert sorted(sorted(group) for group in seen) == [[0, 3], [1, 4], [2, 5]]
    stats = await client.info("commandstats")
    assert stats["cmdstat_mget"]["calls"] == 4


async def test_sidecars_reading_in_groups_start_on_different_groups(client) -> None:
    shards = Shards(client, "pool", shards=6)
    writers = [_member(shards, shard) for shard in range(6)]
    for index, writer in enumerate(writers):
        await writer.sync({ENDPOINTS[index]: Load(10, 1)}, NOW)
    readers = [
        ShardedReservations(shards, f"reader-{i}", lease_s=10.0, read_groups=3) for i in range(30)
    ]
    for reader in readers:
        await reader.read()
    for index, writer in enumerate(writers):
        await writer.sync({ENDPOINTS[index]: Load(99, 3)}, NOW)
    # Each reader's second read fetches one group: which one, its changed shards say.
    first: list[int] = []
    for reader in readers:
        loads = (await reader.read()).loads
        first.append(min(i for i in range(6) if loads[ENDPOINTS[i]] == Load(99, 3)))
    assert sorted(set(first)) == [0, 1, 2]
    assert max(first.count(group) for group in range(3)) <= 20


def _member(shards: Shards, shard: int) -> ShardedReservations:
    """A sidecar of ``shard``: the first id of ``writer-0``, ``writer-1``, ... hashed there."""
    for attempt in range(10_000):
        if shard_of(f"writer-{attempt}", len(shards.tags)) == shard:
            return ShardedReservations(shards, f"writer-{attempt}", lease_s=10.0)
    raise AssertionError(f"no id for shard {shard}")


def test_the_shards_tags_put_as_many_shards_on_each_master_of_an_even_split() -> None:
    tags = shard_tags("pool")
    assert tags == shard_tags("pool")  # every sidecar finds the same
    slots = [key_slot(tag.encode()) for tag in tags]
    assert len(set(slots)) == len(tags) == 12
    ranges = even_split(3)
    assert ranges == [(0, 5460), (5461, 10922), (10923, 16383)]  # redis-cli's split
    held = [sum(low <= slot <= high for slot in slots) for low, high in ranges]
    assert held == [4, 4, 4]
    # The sidecars of a pool spread over the shards.
    counts = [0] * 12
    for i in range(1200):
        counts[shard_of(f"{i:032x}", 12)] += 1
    assert min(counts) > 60


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_on_a_cluster_the_shards_spread_over_the_masters_and_a_read_sums_them() -> None:
    nodes = RedisCluster(3)
    try:
        await nodes.start()
        client = connect(nodes.url(nodes.ports[0]), cluster=True)
        try:
            shards = Shards(client, "pool")
            owners = [(await nodes.slot_owner(keys[3]))[0] for keys in shards.keys]
            assert sorted(owners.count(port) for port in set(owners)) == [4, 4, 4]
            sidecars = _sidecars(shards, 48)
            tables = [{ENDPOINTS[i % 8]: Load(10 + i, 1)} for i in range(48)]
            for sidecar, table in zip(sidecars, tables, strict=True):
                await sidecar.sync(table, NOW)
            assert {sidecar.shard for sidecar in sidecars} == set(range(12))
            totals = await sidecars[0].read()
            assert totals.loads == _sum(tables)
            assert None not in totals.generations
        finally:
            await client.aclose()
    finally:
        await nodes.stop()
