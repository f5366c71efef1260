"""Reservations as per-endpoint counters by epoch (``sidecar.scheduling.state.counters``) on a
real redis-server: reserve, release and read; a release across an epoch boundary; the keys'
lifetime; the checks of what is read back; and the endpoints spread over a real 3-master Redis
Cluster."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import RedisError

from sidecar.scheduling.state import Load
from sidecar.scheduling.state.counters import (
    CLEAR_AFTER_MS,
    EPOCH_S,
    EPOCHS_KEPT,
    MAX_DEFERRED,
    MAX_REQUESTS,
    PACK,
    RELEARN_BACKOFF_S,
    SKEW_MS,
    CounterReservations,
    Counters,
    Held,
    decode_count,
    pack,
    unpack,
)
from sidecar.scheduling.state.sharded import connect
from tests.processes import RedisCluster, RedisServer

ENDPOINTS = [f"127.0.1.{i}:8000" for i in range(8)]


HOUR_S = 3_600.0


class Clock:
    """A sidecar's monotonic clock, moved by the test: the epoch is this clock plus the offset
    learnt from Redis's, so moving it (the offset not learnt again: ``relearn_s`` an hour)
    moves the sidecar through epochs as Redis's clock would, without waiting."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def mid_epoch(clock: Clock, *sidecars: CounterReservations) -> None:
    """Each sidecar's offset learnt, then ``clock`` moved to the middle of an epoch: reads and
    writes in one epoch, however far the test is from a boundary of Redis's clock."""
    for sidecar in sidecars:
        await sidecar.learn_clock()
    epoch_ms = sidecars[0].epoch() * EPOCH_S * 1000
    clock.now += (epoch_ms + EPOCH_S * 500 - sidecars[0].now_ms()) / 1000


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    redis = connect(redis_server.url, cluster=False)
    assert isinstance(redis, aioredis.Redis)
    yield redis
    await redis.aclose()


def test_two_counters_pack_in_one_integer_and_come_back_negative_or_not() -> None:
    for tokens, requests in [(0, 0), (8192, 1), (10**12, 3), (-8192, -1), (5, -2), (-5, 2)]:
        assert unpack(pack(tokens, requests)) == (tokens, requests)
    assert unpack(pack(100, 1) + pack(-100, -1)) == (0, 0)
    assert unpack(PACK // 2 - 1) == (0, PACK // 2 - 1)


async def test_a_reservation_counts_until_its_release(client) -> None:
    clock = Clock()
    counters = Counters(client, "pool")
    first = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    second = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    await mid_epoch(clock, first, second)
    one = await first.reserve(ENDPOINTS[0], 8192)
    two = await second.reserve(ENDPOINTS[0], 100)
    three = await second.reserve(ENDPOINTS[1], 7)
    counts = await first.read(ENDPOINTS)
    assert counts.loads == {ENDPOINTS[0]: Load(8292, 2), ENDPOINTS[1]: Load(7, 1)}
    assert (counts.skipped, counts.clamped) == (0, 0)
    assert await second.release(two)
    assert await first.release(one)
    counts = await second.read(ENDPOINTS)
    assert counts.loads == {ENDPOINTS[1]: Load(7, 1)}
    await second.release(three)
    assert (await first.read(ENDPOINTS)).loads == {}
    # One key per endpoint and epoch, whatever the sidecars.
    assert sorted(await client.keys("*")) == sorted(
        counters.key(e, counts.epoch).encode() for e in ENDPOINTS[:2]
    )


async def test_a_release_lands_on_the_epoch_its_reservation_was_made_in(client) -> None:
    clock = Clock()
    counters = Counters(client, "pool", epoch_s=10.0)
    sidecar = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    reader = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    held = await sidecar.reserve(ENDPOINTS[0], 500)
    assert (await reader.read(ENDPOINTS)).loads == {ENDPOINTS[0]: Load(500, 1)}
    # The next epoch: a new reservation goes to the new epoch's key, the old one is still read.
    clock.now += 10.0
    assert sidecar.epoch() == held.epoch + 1
    later = await sidecar.reserve(ENDPOINTS[0], 20)
    assert later.epoch == held.epoch + 1
    assert (await reader.read(ENDPOINTS)).loads == {ENDPOINTS[0]: Load(520, 2)}
    # Released in the new epoch, it leaves the old epoch's key, not the new one's.
    assert await sidecar.release(held)
    assert int(await client.get(counters.key(ENDPOINTS[0], held.epoch))) == 0
    assert int(await client.get(counters.key(ENDPOINTS[0], later.epoch))) == pack(20, 1)
    assert (await reader.read(ENDPOINTS)).loads == {ENDPOINTS[0]: Load(20, 1)}


async def test_a_dead_sidecars_reservation_goes_with_its_key(client) -> None:
    clock = Clock()
    counters = Counters(client, "pool", epoch_s=10.0)
    dead = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    reader = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    held = await dead.reserve(ENDPOINTS[2], 300)
    key = counters.key(ENDPOINTS[2], held.epoch)
    # The key expires at the start of the third epoch after its own, on Redis's clock.
    expire_at = await client.execute_command("PEXPIRETIME", key)
    assert expire_at == counters.expire_at_ms(held.epoch) == (held.epoch + EPOCHS_KEPT) * 10_000
    assert (await reader.read(ENDPOINTS)).loads == {ENDPOINTS[2]: Load(300, 1)}
    # Counted through the next epoch, not after: its sidecar never released it.
    clock.now += 10.0
    assert (await reader.read(ENDPOINTS)).loads == {ENDPOINTS[2]: Load(300, 1)}
    clock.now += 10.0
    assert (await reader.read(ENDPOINTS)).loads == {}


async def test_a_release_after_its_key_expired_leaves_nothing_behind(client) -> None:
    counters = Counters(client, "pool", epoch_s=10.0)
    sidecar = CounterReservations(counters)
    await sidecar.read(ENDPOINTS)  # the clock's offset learnt
    old = Held(ENDPOINTS[3], 800, sidecar.epoch() - EPOCHS_KEPT)
    # Its key has expired by the sidecar's reckoning: nothing is sent.
    assert not await sidecar.release(old)
    assert sidecar.late == 1
    # Sent anyway (a sidecar a little behind Redis's clock): the negative count is created and,
    # its expiry being past, deleted at once.
    await counters.add(
        counters.key(old.endpoint, old.epoch),
        -pack(old.tokens, 1),
        counters.expire_at_ms(old.epoch),
    )
    assert await client.exists(counters.key(old.endpoint, old.epoch)) == 0


async def test_epochs_follow_redis_clock_not_the_sidecars(client) -> None:
    ahead, behind = Clock(), Clock()
    ahead.now += HOUR_S  # an hour apart: the same epoch, from the offsets learnt
    counters = Counters(client, "pool")
    one = CounterReservations(counters, clock=ahead)
    two = CounterReservations(counters, clock=behind)
    held = await one.reserve(ENDPOINTS[0], 10)
    await two.read(ENDPOINTS)
    assert abs(two.epoch() - held.epoch) <= 1  # 1: a boundary between the two calls
    assert (await two.read(ENDPOINTS)).loads == {ENDPOINTS[0]: Load(10, 1)}


def test_a_value_is_checked_before_it_counts() -> None:
    assert decode_count(str(pack(100, 2)).encode()) is not None
    for raw in [
        None,
        "text",
        b"",
        b"12a",
        b"1.5",
        b"+5",
        b" 5",
        b"\xd9\xa3",  # a digit, not ASCII
        b"9" * 21,  # over 20 bytes
        b"99999999999999999999",  # beyond 64 bits
        str(pack(10**12 + 1, 1)).encode(),  # beyond any engine
        str(pack(5, MAX_REQUESTS + 1)).encode(),  # requests near the field's edge
        str(pack(5, PACK // 2 - 1)).encode(),
    ]:
        assert decode_count(raw) is None, raw
    negative = decode_count(str(pack(-5, 1)).encode())
    assert negative is not None
    assert negative.clamped
    assert negative.load == Load(0, 1)


async def test_bad_values_written_by_a_hostile_hand_are_skipped_or_clamped_and_counted(
    client,
) -> None:
    clock = Clock()
    counters = Counters(client, "pool")
    reader = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    await mid_epoch(clock, reader)
    epoch = reader.epoch()
    good = await reader.reserve(ENDPOINTS[0], 100)
    assert good.epoch == epoch
    await client.set(counters.key(ENDPOINTS[1], epoch), "not a count")
    await client.set(counters.key(ENDPOINTS[2], epoch), "9" * 4096)  # long
    await client.set(counters.key(ENDPOINTS[3], epoch - 1), str(pack(-50, -1)))  # negative
    await client.set(counters.key(ENDPOINTS[3], epoch), str(pack(30, 1)))
    await client.set(counters.key(ENDPOINTS[4], epoch), str(pack(10**13, 1)))  # out of range
    await client.hset(counters.key(ENDPOINTS[5], epoch), "a", "hash")  # MGET: no string
    counts = await reader.read(ENDPOINTS)
    # The negative epoch read as 0, the rest of the endpoint still counted.
    assert counts.loads == {ENDPOINTS[0]: Load(100, 1), ENDPOINTS[3]: Load(30, 1)}
    assert (counts.skipped, counts.clamped) == (3, 1)
    assert (reader.skipped, reader.clamped) == (3, 1)


async def test_names_that_would_break_a_hash_tag_are_refused(client) -> None:
    with pytest.raises(ValueError, match="brace"):
        Counters(client, "po{ol")
    for groups in (0, -1):
        with pytest.raises(ValueError, match="at least one hash tag"):
            Counters(client, "pool", groups=groups)
    sidecar = CounterReservations(Counters(client, "pool"))
    for name in ["a}b:8000", "a b:8000", "", "x" * 400]:
        with pytest.raises(ValueError, match="not an endpoint"):
            await sidecar.reserve(name, 1)
    assert await client.dbsize() == 0


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_on_a_cluster_the_endpoints_spread_over_the_masters_and_a_read_sums_them() -> None:
    nodes = RedisCluster(3)
    try:
        await nodes.start()
        client = connect(nodes.url(nodes.ports[0]), cluster=True)
        try:
            endpoints = [f"127.0.2.{i}:8000" for i in range(32)]
            for groups in (None, 3):
                counters = Counters(client, f"pool{groups}", groups=groups)
                sidecars = [CounterReservations(counters) for _ in range(4)]
                held = [
                    await sidecars[i % 4].reserve(endpoint, 10 + i)
                    for i, endpoint in enumerate(endpoints)
                ]
                owners = {
                    (await nodes.slot_owner(counters.key(h.endpoint, h.epoch)))[0] for h in held
                }
                assert len(owners) == 3
                counts = await sidecars[0].read(endpoints)
                assert counts.loads == {e: Load(10 + i, 1) for i, e in enumerate(endpoints)}
                for index, reservation in enumerate(held):
                    await sidecars[index % 4].release(reservation)
                assert (await sidecars[1].read(endpoints)).loads == {}
        finally:
            await client.aclose()
    finally:
        await nodes.stop()


async def test_a_reservation_just_before_a_boundary_is_read_by_a_reader_a_little_behind(
    client,
) -> None:
    writer_clock, reader_clock = Clock(), Clock()
    counters = Counters(client, "pool", epoch_s=10.0)
    writer = CounterReservations(counters, clock=writer_clock, relearn_s=HOUR_S)
    reader = CounterReservations(counters, clock=reader_clock, relearn_s=HOUR_S)
    await writer.read(ENDPOINTS)
    await reader.read(ENDPOINTS)
    # The reader 2 ms before a boundary, the writer's reckoning 5 ms ahead of it: past it.
    boundary_ms = (reader.epoch() + 1) * 10_000
    reader_clock.now += (boundary_ms - 2 - reader.now_ms()) / 1000
    writer_clock.now += (boundary_ms + 3 - writer.now_ms()) / 1000
    assert writer.epoch() == reader.epoch() + 1
    held = await writer.reserve(ENDPOINTS[0], 700)
    assert held.epoch == reader.epoch()
    assert (await reader.read(ENDPOINTS)).loads == {ENDPOINTS[0]: Load(700, 1)}


class Ticking:
    """A clock that moves ``tick`` seconds at each reading: a ``TIME`` answered that late."""

    def __init__(self, tick: float) -> None:
        self.now = 1_000.0
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


async def test_a_time_answered_slowly_is_not_learnt_from(client) -> None:
    clock = Ticking(0.0)
    sidecar = CounterReservations(Counters(client, "pool"), clock=clock)
    await sidecar.learn_clock()
    learnt = sidecar.now_ms() - clock.now * 1000
    clock.tick = 2 * SKEW_MS / 1000  # the round trip one tick, over SKEW_MS
    await sidecar.learn_clock()
    clock.tick = 0.0
    assert sidecar.now_ms() - clock.now * 1000 == pytest.approx(learnt, abs=1e-3)
    assert sidecar.slow_clocks == 1


async def time_refused(admin: aioredis.Redis) -> int:
    """``TIME`` calls Redis refused (its ACL), in all."""
    stats = await admin.info("commandstats")
    return int(stats.get("cmdstat_time", {}).get("rejected_calls", 0))


async def test_a_time_that_fails_leaves_the_reads_answering(redis_server, client) -> None:
    await client.execute_command("ACL", "SETUSER", "sidecar", "on", ">pw", "~*", "+@all")
    url = redis_server.url.replace("redis://", "redis://sidecar:pw@")
    limited = connect(url, cluster=False)
    try:
        clock = Clock()
        counters = Counters(limited, "pool")
        writer = CounterReservations(counters, clock=clock)
        reader = CounterReservations(counters, clock=clock, relearn_s=2.0)  # within an epoch
        await writer.reserve(ENDPOINTS[0], 40)
        await reader.read(ENDPOINTS)
        await client.execute_command("ACL", "SETUSER", "sidecar", "-time")
        # The relearning due: the reads sent with it answer, one TIME sent for all of them.
        clock.now += 2.0
        reads = await asyncio.gather(*(reader.read(ENDPOINTS) for _ in range(4)))
        assert [r.loads for r in reads] == [{ENDPOINTS[0]: Load(40, 1)}] * 4
        assert (reader.clock_failures, await time_refused(client)) == (1, 1)
        # The next tries after a backoff, not at every read.
        assert (await reader.read(ENDPOINTS)).loads == {ENDPOINTS[0]: Load(40, 1)}
        assert await time_refused(client) == 1
        clock.now += RELEARN_BACKOFF_S
        assert (await reader.read(ENDPOINTS)).loads == {ENDPOINTS[0]: Load(40, 1)}
        assert (reader.clock_failures, await time_refused(client)) == (2, 2)
        await client.execute_command("ACL", "SETUSER", "sidecar", "+time")
        clock.now += 2 * RELEARN_BACKOFF_S
        assert (await reader.read(ENDPOINTS)).loads == {ENDPOINTS[0]: Load(40, 1)}
        assert (reader.clock_failures, await time_refused(client)) == (2, 2)
    finally:
        await limited.aclose()


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_on_a_cluster_a_master_down_leaves_the_others_endpoints_read() -> None:
    nodes = RedisCluster(3)
    try:
        await nodes.start()
        client = connect(nodes.url(nodes.ports[0]), cluster=True)
        try:
            endpoints = [f"127.0.2.{i}:8000" for i in range(32)]
            counters = Counters(client, "pool")
            sidecar = CounterReservations(counters)
            held = [await sidecar.reserve(e, 10 + i) for i, e in enumerate(endpoints)]
            owner = {
                h.endpoint: (await nodes.slot_owner(counters.key(h.endpoint, h.epoch)))[0]
                for h in held
            }
            down = owner[endpoints[0]]
            # A release deferred on each master: the one on the master down is lost with it.
            firsts = {owner[e]: h for e, h in zip(endpoints, held, strict=True)}
            for reservation in firsts.values():
                assert sidecar.defer_release(reservation)
            nodes.kill(down)
            counts = await sidecar.read(endpoints)
            lost = tuple(e for e in endpoints if owner[e] == down)
            assert 0 < len(lost) < len(endpoints)
            assert counts.missing == lost
            released = {h.endpoint for h in firsts.values()}
            assert counts.loads == {
                e: Load(10 + i, 1)
                for i, e in enumerate(endpoints)
                if e not in lost and e not in released
            }
            assert sidecar.lost_releases == 1
        finally:
            await client.aclose()
    finally:
        await nodes.stop()


async def test_a_write_whose_expiry_fails_leaves_no_key(redis_server, client) -> None:
    await client.execute_command("ACL", "SETUSER", "sidecar", "on", ">pw", "~*", "+@all")
    await client.execute_command("ACL", "SETUSER", "sidecar", "-pexpireat")
    limited = connect(redis_server.url.replace("redis://", "redis://sidecar:pw@"), cluster=False)
    try:
        sidecar = CounterReservations(Counters(limited, "pool"))
        with pytest.raises(RedisError):
            await sidecar.reserve(ENDPOINTS[0], 10)
        # The increment went with its expiry: no key lives without one.
        assert await client.dbsize() == 0
    finally:
        await limited.aclose()


async def exec_calls(client: aioredis.Redis) -> tuple[int, int]:
    """How many transactions and ``MGET``s Redis has run."""
    stats = await client.info("commandstats")
    return tuple(  # type: ignore[return-value]
        int(stats.get(f"cmdstat_{name}", {"calls": 0})["calls"]) for name in ("exec", "mget")
    )


async def test_a_deferred_release_goes_with_the_sidecars_next_read(client) -> None:
    clock = Clock()
    counters = Counters(client, "pool")
    sidecar = CounterReservations(counters, clock=clock, relearn_s=HOUR_S, release_delay_s=HOUR_S)
    other = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    await mid_epoch(clock, sidecar, other)
    one = await sidecar.reserve(ENDPOINTS[0], 8192)
    two = await sidecar.reserve(ENDPOINTS[1], 100)
    assert sidecar.defer_release(one)
    assert sidecar.defer_release(two)
    # Not sent yet: the others still count both.
    assert (await other.read(ENDPOINTS)).loads == {
        ENDPOINTS[0]: Load(8192, 1),
        ENDPOINTS[1]: Load(100, 1),
    }
    await client.config_resetstat()
    # The sidecar's own read takes both back before it reads, in one transaction with its MGET.
    assert (await sidecar.read(ENDPOINTS)).loads == {}
    assert await exec_calls(client) == (1, 1)
    assert (await other.read(ENDPOINTS)).loads == {}
    assert sidecar.lost_releases == 0
    # Nothing was left for the sender: it sends nothing more once its delay is over.
    await sidecar.close()
    assert await exec_calls(client) == (1, 2)


async def test_a_deferred_release_goes_alone_once_its_delay_is_over(client) -> None:
    counters = Counters(client, "pool")
    sidecar = CounterReservations(counters, release_delay_s=0.05)
    other = CounterReservations(counters)
    held = await sidecar.reserve(ENDPOINTS[0], 500)
    assert sidecar.defer_release(held)
    assert (await other.read(ENDPOINTS)).loads == {ENDPOINTS[0]: Load(500, 1)}
    await sidecar.sent()
    assert (await other.read(ENDPOINTS)).loads == {}
    assert sidecar.lost_releases == 0


@pytest.mark.timeout(10)
async def test_too_many_deferred_releases_go_at_once(client) -> None:
    counters = Counters(client, "pool")
    sidecar = CounterReservations(counters, release_delay_s=HOUR_S)
    other = CounterReservations(counters)
    held = [await sidecar.reserve(ENDPOINTS[i % 8], 10) for i in range(MAX_DEFERRED)]
    for reservation in held[:-1]:
        assert sidecar.defer_release(reservation)
    counted = (await other.read(ENDPOINTS)).loads.values()
    assert sum(load.requests for load in counted) == MAX_DEFERRED
    await client.config_resetstat()
    assert sidecar.defer_release(held[-1])
    # The last one filled the queue: all go now, in one transaction, not an hour later.
    await sidecar.sent()
    assert await exec_calls(client) == (1, 0)
    assert (await other.read(ENDPOINTS)).loads == {}


async def test_a_read_that_fails_loses_its_releases_and_says_so(redis_server, client) -> None:
    await client.execute_command("ACL", "SETUSER", "sidecar", "on", ">pw", "~*", "+@all")
    limited = connect(redis_server.url.replace("redis://", "redis://sidecar:pw@"), cluster=False)
    try:
        counters = Counters(limited, "pool")
        sidecar = CounterReservations(counters, release_delay_s=HOUR_S)
        held = await sidecar.reserve(ENDPOINTS[0], 10)
        assert sidecar.defer_release(held)
        await client.execute_command("ACL", "SETUSER", "sidecar", "-mget")
        with pytest.raises(RedisError):
            await sidecar.read(ENDPOINTS)
        # The transaction was refused whole: the reservation is still counted, and the sidecar
        # says it lost a release rather than send it twice.
        assert sidecar.lost_releases == 1
        assert int(await client.get(counters.key(ENDPOINTS[0], held.epoch))) == pack(10, 1)
        await sidecar.close()
    finally:
        await limited.aclose()


async def test_closing_sends_what_was_deferred(client) -> None:
    counters = Counters(client, "pool")
    sidecar = CounterReservations(counters, release_delay_s=HOUR_S)
    held = await sidecar.reserve(ENDPOINTS[3], 42)
    assert sidecar.defer_release(held)
    await sidecar.close()
    assert int(await client.get(counters.key(ENDPOINTS[3], held.epoch))) == 0


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_on_a_cluster_deferred_releases_go_before_the_reads_of_their_master(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_thread(self: threading.Thread) -> None:
        raise AssertionError("a thread started: redis-py's Cluster transactions block the loop")

    nodes = RedisCluster(3)
    try:
        await nodes.start()
        client = connect(nodes.url(nodes.ports[0]), cluster=True)
        try:
            await client.ping()
            monkeypatch.setattr(threading.Thread, "start", no_thread)
            endpoints = [f"127.0.2.{i}:8000" for i in range(32)]
            masters = [port for port in nodes.ports if await nodes.is_master(port)]
            for groups in (None, 3):
                counters = Counters(client, f"deferred{groups}", groups=groups)
                sidecar = CounterReservations(counters, release_delay_s=HOUR_S)
                other = CounterReservations(counters)
                held = [await sidecar.reserve(e, 10 + i) for i, e in enumerate(endpoints)]
                for reservation in held:
                    assert sidecar.defer_release(reservation)
                assert len((await other.read(endpoints)).loads) == len(endpoints)
                for port in masters:
                    await nodes.command(port, "CONFIG", "RESETSTAT")
                # Each master's releases go first in its read's pipeline, one script per slot:
                # the read counts them taken back, in its one round.
                assert (await sidecar.read(endpoints)).loads == {}
                scripts = 0
                for port in masters:
                    stats = await nodes.command(port, "INFO", "commandstats")
                    scripts += int(stats.get("cmdstat_eval", {}).get("calls", 0))
                slots = {key_slot(counters.key(h.endpoint, h.epoch).encode()) for h in held}
                assert scripts == len(slots)
                if groups == 3:
                    assert scripts == 3  # a tag per master
                assert (await other.read(endpoints)).loads == {}
                assert sidecar.lost_releases == 0
                await sidecar.close()
        finally:
            monkeypatch.undo()
            await client.aclose()
    finally:
        await nodes.stop()


async def test_a_release_redis_refuses_is_lost_alone(client) -> None:
    counters = Counters(client, "pool")
    sidecar = CounterReservations(counters, release_delay_s=HOUR_S)
    kept = await sidecar.reserve(ENDPOINTS[0], 10)
    broken = await sidecar.reserve(ENDPOINTS[1], 20)
    key = counters.key(ENDPOINTS[1], broken.epoch)
    await client.delete(key)
    await client.hset(key, "not", "a counter")  # a hand's write: INCRBY answers WRONGTYPE
    assert sidecar.defer_release(kept)
    assert sidecar.defer_release(broken)
    counts = await sidecar.read(ENDPOINTS)
    # The other release of the transaction was applied; the refused one is counted lost.
    assert counts.loads == {}
    assert counts.skipped == 0
    assert sidecar.lost_releases == 1
    assert int(await client.get(counters.key(ENDPOINTS[0], kept.epoch))) == 0


@pytest.mark.timeout(10)
async def test_a_read_given_up_on_still_takes_back_what_it_carries(client) -> None:
    counters = Counters(client, "pool")
    sidecar = CounterReservations(counters, release_delay_s=HOUR_S)
    held = await sidecar.reserve(ENDPOINTS[0], 9)
    await sidecar.read(ENDPOINTS)  # the clock learnt: the next read sends only its fetch
    assert sidecar.defer_release(held)
    await client.execute_command("CLIENT", "PAUSE", "300", "WRITE")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await sidecar.read(ENDPOINTS)
    await sidecar.close()  # waits for the fetch that carries it
    assert sidecar.lost_releases == 0
    assert int(await client.get(counters.key(ENDPOINTS[0], held.epoch))) == 0


@pytest.mark.timeout(10)
async def test_closing_waits_for_a_send_in_flight(client) -> None:
    counters = Counters(client, "pool")
    sidecar = CounterReservations(counters, release_delay_s=0.0)
    held = await sidecar.reserve(ENDPOINTS[0], 9)
    await client.execute_command("CLIENT", "PAUSE", "300", "WRITE")
    assert sidecar.defer_release(held)
    # Until the sender took it (a few turns of the loop): its send is in flight, held.
    while sidecar.deferred:  # noqa: ASYNC110 - a state, no event to wait on
        await asyncio.sleep(0)
    await sidecar.close()
    assert sidecar.lost_releases == 0
    assert int(await client.get(counters.key(ENDPOINTS[0], held.epoch))) == 0


async def test_a_reader_leaves_out_a_previous_epoch_seen_empty_late_enough(client) -> None:
    clock = Clock()
    counters = Counters(client, "pool")
    reader = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    writer = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    await reader.learn_clock()
    await writer.learn_clock()
    # A reservation in the last second of an epoch.
    epoch = reader.epoch()
    clock.now += ((epoch + 1) * EPOCH_S * 1000 - 1000 - reader.now_ms()) / 1000
    held = await writer.reserve(ENDPOINTS[0], 100)
    assert held.epoch == epoch
    every = 2 * len(ENDPOINTS)
    # A second into the next epoch: too early to leave any key out.
    clock.now += 2.0
    counts = await reader.read(ENDPOINTS)
    assert (counts.epoch, counts.keys) == (epoch + 1, every)
    assert counts.loads == {ENDPOINTS[0]: Load(100, 1)}
    # Past CLEAR_AFTER_MS: this read finds the other endpoints' previous keys empty, and the
    # reads after it leave them out; the held reservation's key is still read.
    clock.now += CLEAR_AFTER_MS / 1000
    assert (await reader.read(ENDPOINTS)).keys == every
    later = await writer.reserve(ENDPOINTS[5], 7)  # the current epoch's, after the spans
    counts = await reader.read(ENDPOINTS)
    assert counts.keys == len(ENDPOINTS) + 1
    assert counts.loads == {ENDPOINTS[0]: Load(100, 1), ENDPOINTS[5]: Load(7, 1)}
    assert await writer.release(later)
    # Released: found empty, then left out too.
    assert await writer.release(held)
    assert (await reader.read(ENDPOINTS)).loads == {}
    assert (await reader.read(ENDPOINTS)).keys == len(ENDPOINTS)
    # A new epoch reads both again.
    clock.now += EPOCH_S
    assert (await reader.read(ENDPOINTS)).keys == every


async def test_a_reservation_whose_write_returns_late_is_moved_into_the_new_epoch(
    client, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    counters = Counters(client, "pool")
    writer = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    reader = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    await writer.learn_clock()
    await reader.learn_clock()
    epoch = writer.epoch()
    # 20 ms before a boundary: the write goes to this epoch (that of SKEW_MS ago), then the
    # writer's loop stalls 3 s before it sees the answer.
    clock.now += ((epoch + 1) * EPOCH_S * 1000 - 20 - writer.now_ms()) / 1000
    add = counters.add

    async def stalled(key: str, delta: int, expire_at_ms: int) -> None:
        await add(key, delta, expire_at_ms)
        clock.now += 3.0

    monkeypatch.setattr(counters, "add", stalled)
    held = await writer.reserve(ENDPOINTS[0], 100)
    monkeypatch.undo()
    # A reader may have left the old key out by then: the reservation moved to the new epoch.
    assert (held.epoch, writer.moved) == (epoch + 1, 1)
    assert int(await client.get(counters.key(ENDPOINTS[0], epoch))) == 0
    assert int(await client.get(counters.key(ENDPOINTS[0], epoch + 1))) == pack(100, 1)
    assert (await reader.read(ENDPOINTS)).keys == 2 * len(ENDPOINTS)
    counts = await reader.read(ENDPOINTS)
    assert counts.keys == len(ENDPOINTS)
    assert counts.loads == {ENDPOINTS[0]: Load(100, 1)}
    # Its release takes it back from where it is now.
    assert await writer.release(held)
    assert (await reader.read(ENDPOINTS)).loads == {}


async def test_a_reader_whose_offset_is_not_known_closely_leaves_nothing_out(
    client, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    counters = Counters(client, "pool")
    reader = CounterReservations(counters, clock=clock, relearn_s=HOUR_S)
    redis_ms = counters.redis_ms

    async def slow() -> float:
        answer = await redis_ms()
        clock.now += 0.2  # a 200 ms round trip: the offset known within 100 ms only
        return answer

    monkeypatch.setattr(counters, "redis_ms", slow)  # every TIME, the first and the next
    await reader.learn_clock()
    epoch = reader.epoch() + 1  # 3 s into the next epoch
    clock.now += (epoch * EPOCH_S * 1000 + 3000 - reader.now_ms()) / 1000
    every = 2 * len(ENDPOINTS)
    for _ in range(3):
        assert (await reader.read(ENDPOINTS)).keys == every
    # It keeps trying to learn its offset closely: a TIME a RELEARN_BACKOFF_S, not an epoch.
    await client.config_resetstat()
    clock.now += RELEARN_BACKOFF_S
    await reader.read(ENDPOINTS)
    assert (await client.info("commandstats"))["cmdstat_time"]["calls"] == 1
    assert reader.slow_clocks >= 1
