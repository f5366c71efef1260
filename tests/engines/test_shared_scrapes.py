"""Shared prefill scrapes: who scrapes an endpoint, what the others read, and what a sidecar does
when the publications are missing, stale, hostile or unreadable — through a real redis-server."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import random
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from sidecar.engines.shared_scrapes import (
    EXPIRE_MIN_S,
    MAX_VALUE_BYTES,
    ScrapeShare,
    decode,
    encode,
    member_weight,
    owners,
)
from sidecar.fleet.load import EngineLoad
from sidecar.fleet.snapshot import EngineSnapshot
from sidecar.scheduling.state.redis import RedisState
from tests.conftest import eventually
from tests.processes import RedisCluster, RedisServer
from tests.scheduling.test_state_resp import documented_acl

ENDPOINTS = [f"127.0.0.{i}:8000" for i in range(1, 33)]
LOAD = EngineLoad(
    waiting=3.0,
    running=5.0,
    kv_usage=0.25,
    at=123.0,
    cache_tokens=65536,
    itl_sum_s=1.5,
    itl_count=60.0,
)
WALL = 1_800_000_000.0
UNREACHABLE = "redis://127.0.0.9:1/0"


def test_a_publication_says_what_the_scrape_found() -> None:
    for snapshot in (
        EngineSnapshot(load=LOAD, at=1.0),
        EngineSnapshot(load=None, unreachable=True, at=1.0),
        EngineSnapshot(load=None, at=1.0),
        EngineSnapshot(load=EngineLoad(waiting=0.0, running=None, kv_usage=None, at=1.0), at=1.0),
    ):
        published = decode(encode(WALL, snapshot, "me").encode())
        assert published is not None
        assert published.wall == WALL
        assert published.unreachable == snapshot.unreachable
        if snapshot.load is None:
            assert published.load is None
        else:
            assert published.load is not None
            assert published.load == dataclasses.replace(snapshot.load, at=0.0)


def test_gauges_a_reader_would_refuse_are_published_as_unknown() -> None:
    """An engine's odd gauges (negative, infinite, over range): the rest of the scrape still
    reaches the readers, rather than a line every reader refuses."""
    odd = EngineLoad(
        waiting=-1.0,
        running=float("inf"),
        kv_usage=1.2,
        at=1.0,
        cache_tokens=-5,
        itl_sum_s=float("nan"),
        itl_count=7.0,
    )
    published = decode(encode(WALL, EngineSnapshot(load=odd, at=1.0), "me").encode())
    assert published is not None
    assert published.load == EngineLoad(
        waiting=None, running=None, kv_usage=None, at=0.0, cache_tokens=None, itl_count=7.0
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"garbage",
        b"2 1800000000.0 -l me 1.0 1.0 0.5 100 1.0 1.0",  # another version
        b"1 1800000000.0 -l 1.0 1.0 0.5 100 1.0 1.0",  # no publisher
        b"1 1800000000.0 -x me 1.0 1.0 0.5 100 1.0 1.0",  # flags
        b"1 1800000000.0 -l me 1.0 1.0 0.5 100 1.0",  # a field short
        b"1 1800000000.0 -l me 1.0 1.0 0.5 100 1.0 1.0 1.0",  # a field over
        b"1 nan -l me 1.0 1.0 0.5 100 1.0 1.0",
        b"1 inf -l me 1.0 1.0 0.5 100 1.0 1.0",
        b"1 -5 -l me 1.0 1.0 0.5 100 1.0 1.0",
        b"1 1800000000.0 -l me -1.0 1.0 0.5 100 1.0 1.0",  # negative queue
        b"1 1800000000.0 -l me 1e12 1.0 0.5 100 1.0 1.0",  # no engine queues that much
        b"1 1800000000.0 -l me 1.0 1.0 1.5 100 1.0 1.0",  # usage over 1
        b"1 1800000000.0 -l me 1.0 1.0 0.5 100.5 1.0 1.0",  # half a token
        b"1 1800000000.0 -l me 1.0 1.0 0.5 1e13 1.0 1.0",
        b"1 1800000000.0 -l me 1.0 1.0 0.5 100 nan 1.0",
        b"1 1800000000.0 -l me 1.0 1.0 0.5 100 1.0 inf",
        b"1 1800000000.0 -- me 1.0 - - - - -",  # no load, yet a gauge
        "1 1800000000.0 -l me 1.0 1.0 0.5 100 1.0 1.0é".encode(),
        b"1 1800000000.0 -l me 1.0 1.0 0.5 100 1.0 " + b"1" * MAX_VALUE_BYTES,
    ],
)
def test_a_publication_that_is_not_ours_is_refused(raw: bytes) -> None:
    assert decode(raw) is None


def test_every_endpoint_has_its_owners_and_they_spread() -> None:
    """k owners per endpoint among the members, the same whatever order the members come in;
    over 1,000 members nobody owns more than a few of 32 endpoints' 64 places."""
    members = [member_weight(f"sidecar-{i}") for i in range(1000)]
    shuffled = random.Random(7).sample(members, len(members))
    held: collections.Counter[int] = collections.Counter()
    for endpoint in ENDPOINTS:
        chosen = owners(members, endpoint, 2)
        assert len(set(chosen)) == 2
        assert set(chosen) <= set(members)
        assert owners(shuffled, endpoint, 2) == chosen
        held.update(chosen)
    assert sum(held.values()) == 64
    assert max(held.values()) <= 3


def test_a_member_leaving_moves_only_the_endpoints_it_owned() -> None:
    members = [member_weight(f"sidecar-{i}") for i in range(50)]
    before = {endpoint: owners(members, endpoint, 2) for endpoint in ENDPOINTS}
    gone = before[ENDPOINTS[0]][0]
    after = {
        endpoint: owners([m for m in members if m != gone], endpoint, 2) for endpoint in ENDPOINTS
    }
    for endpoint in ENDPOINTS:
        if gone in before[endpoint]:
            assert gone not in after[endpoint]
            assert set(before[endpoint]) - {gone} <= set(after[endpoint])
        else:
            assert after[endpoint] == before[endpoint]


class Sidecars:
    """Several sidecars' Redis backends and shares in one process, on one redis-server."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.states: list[RedisState] = []
        self.skipped: collections.Counter[str] = collections.Counter()
        self.errors = 0
        """Failed reads and publications, every share's."""

    async def add(
        self,
        *,
        per_endpoint: int = 1,
        interval_s: float = 1.0,
        members_every_s: float = 0.0,
        url: str | None = None,
        timeout_s: float = 1.0,
    ) -> ScrapeShare:
        """A sidecar's backend and share, on the fleet's Redis (its first sync waited for) or
        at ``url`` (unreachable, or a user the sync may not run as: not waited for)."""
        state = RedisState(url or self.url, prefix="scrapes", lease_s=30, timeout_s=timeout_s)
        await state.start()
        self.states.append(state)
        if url is None:
            await eventually(lambda: _true(state.connected))
        return ScrapeShare(
            state,
            per_endpoint=per_endpoint,
            interval_s=interval_s,
            members_every_s=members_every_s,  # 0: every read (the test's sidecars register)
            timeout_s=timeout_s,
            on_skipped=lambda kind, count: self.skipped.update({kind: count}),
            on_error=self._error,
        )

    def _error(self) -> None:
        self.errors += 1

    async def close(self) -> None:
        for state in self.states:
            await state.close()


async def _true(value: bool) -> bool:
    return value


async def _user(redis_server: RedisServer, name: str, denied: str) -> str:
    """The URL of a Redis user allowed everything on the test's keys but ``denied``."""
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        rules = ["on", ">pw", "~{scrapes}:*", "+@all", f"-{denied}"]
        await admin.execute_command("ACL", "SETUSER", name, *rules)
    finally:
        await admin.aclose()
    return f"redis://{name}:pw@127.0.0.1:{redis_server.port}/0"


async def _connected(state: RedisState) -> bool:
    return state.connected


@pytest.fixture
async def sidecars(redis_server: RedisServer) -> AsyncIterator[Sidecars]:
    fleet = Sidecars(redis_server.url)
    yield fleet
    await fleet.close()


async def _round(share: ScrapeShare, wall: float, now: float = 50.0) -> list[str]:
    """One scrape round of ``share`` at ``wall``: the endpoints it scrapes itself (each found
    with LOAD, published)."""
    await share.read(ENDPOINTS, now=now, wall=wall)
    mine = [endpoint for endpoint in ENDPOINTS if share.scrapes(endpoint, wall=wall)]
    for endpoint in mine:
        share.found(endpoint, EngineSnapshot(load=LOAD, at=now), wall=wall)
    await share.publish(now=now)
    return mine


async def _owner_and_backup(
    sidecars: Sidecars, *, interval_s: float = 1.0
) -> tuple[ScrapeShare, ScrapeShare, float, list[str]]:
    """Two sidecars, one owner per endpoint: ``one`` has published a round, ``two`` has read
    it. Returns both, the time, and the endpoints ``one`` owns (``two`` backs them up)."""
    one = await sidecars.add(interval_s=interval_s)
    two = await sidecars.add(interval_s=interval_s)
    wall = time.time()
    for share in (one, two):
        await share.read(ENDPOINTS, now=0.0, wall=wall)
    await _round(one, wall)
    await two.read(ENDPOINTS, now=0.0, wall=wall)
    theirs = [e for e in ENDPOINTS if not two.scrapes(e, wall=wall)]
    assert theirs  # `one` owns some
    return one, two, wall, theirs


async def test_each_endpoint_is_scraped_by_its_owners_alone_and_read_by_the_others(
    sidecars: Sidecars,
) -> None:
    """Eight sidecars, one owner per endpoint: once each knows the others and something was
    published (two first rounds, in which backups scrape too), every endpoint is
    scraped by exactly one of them in a round, and every other sidecar is handed that scrape
    once, dated by its age."""
    shares = [await sidecars.add() for _ in range(8)]
    wall = time.time()
    for turn in range(2):  # the members read, the first publications (backups' included)
        for share in shares:
            await _round(share, wall + 0.3 * turn)
    wall += 0.6
    scraped: collections.Counter[str] = collections.Counter()
    for share in shares:
        scraped.update(await _round(share, wall))
    assert set(scraped) == set(ENDPOINTS)
    assert set(scraped.values()) == {1}
    assert all(share.describe()["members"] == 8 for share in shares)
    later = wall + 0.4
    handed = 0
    for share in shares:
        await share.read(ENDPOINTS, now=100.0, wall=later)
        for endpoint in ENDPOINTS:
            if share.scrapes(endpoint, wall=later):
                continue
            found = share.take(endpoint, now=100.0, wall=later)
            assert found is not None
            assert found.load is not None
            assert found.load.waiting == LOAD.waiting
            assert found.load.cache_tokens == LOAD.cache_tokens
            assert found.at == pytest.approx(100.0 - 0.4)
            assert found.load.at == found.at
            assert share.take(endpoint, now=100.0, wall=later) is None  # once
            handed += 1
    assert handed == 7 * len(ENDPOINTS)


async def test_a_stale_publication_is_scraped_by_whoever_reads_it(sidecars: Sidecars) -> None:
    """Its owner gone silent: two intervals after its last publication, the other sidecar (its
    backup) scrapes the endpoint itself, and publishes."""
    _, two, wall, theirs = await _owner_and_backup(sidecars, interval_s=0.5)
    await two.read(ENDPOINTS, now=0.0, wall=wall + 0.9)
    assert not any(two.scrapes(e, wall=wall + 0.9) for e in theirs)
    await two.read(ENDPOINTS, now=0.0, wall=wall + 1.1)
    assert all(two.scrapes(e, wall=wall + 1.1) for e in theirs)
    assert len(await _round(two, wall + 1.1)) == len(ENDPOINTS)
    assert two.counts["backup"] == len(theirs)
    assert two.counts["unread"] == 0


async def test_a_stale_publication_is_scraped_by_the_owner_and_its_backup_alone(
    sidecars: Sidecars,
) -> None:
    """Every publication over two intervals old (the owners silent): of eight sidecars, the
    owner and the next one ranked (its backup) scrape each endpoint, never the whole fleet."""
    shares = [await sidecars.add() for _ in range(8)]
    wall = time.time()
    for share in shares:
        await _round(share, wall)
    wall += 2.5
    scraping: collections.Counter[str] = collections.Counter()
    for share in shares:
        await share.read(ENDPOINTS, now=0.0, wall=wall)
        scraping.update(e for e in ENDPOINTS if share.scrapes(e, wall=wall))
    assert scraping == {endpoint: 2 for endpoint in ENDPOINTS}
    assert sum(len(share.describe()["backup"]) for share in shares) == len(ENDPOINTS)


async def test_a_publication_that_is_not_ours_is_counted_and_the_endpoint_scraped(
    sidecars: Sidecars, redis_server: RedisServer
) -> None:
    _, two, wall, theirs = await _owner_and_backup(sidecars)
    state = sidecars.states[0]
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await admin.set(state.scrape_key(theirs[0]), b"1 nan -l me 1 1 1 1 1 1")
    finally:
        await admin.aclose()
    await two.read(ENDPOINTS, now=0.0, wall=wall)
    assert sidecars.skipped["scrape"] == 1
    assert two.scrapes(theirs[0], wall=wall)
    assert not any(two.scrapes(e, wall=wall) for e in theirs[1:])


async def test_a_publication_expires(sidecars: Sidecars, redis_server: RedisServer) -> None:
    share = await sidecars.add(interval_s=0.01)
    wall = time.time()
    await _round(share, wall)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        ttl_ms = await admin.pttl(sidecars.states[0].scrape_key(ENDPOINTS[0]))
    finally:
        await admin.aclose()
    assert 0 < ttl_ms <= EXPIRE_MIN_S * 1000


async def test_a_sidecar_that_cannot_read_scrapes_everything_and_never_raises(
    sidecars: Sidecars,
) -> None:
    """Redis unreachable: the sidecar serves on its own scrapes, as it does on its own view."""
    wall = time.time()
    share = await sidecars.add(url=UNREACHABLE, timeout_s=0.5)
    mine = await _round(share, wall)
    assert mine == ENDPOINTS
    assert not share.readable
    assert share.describe()["last_error"]
    # Counted apart from a backup's take-overs: an alert on those is not an alert on Redis.
    assert share.counts == {"own": 0, "shared": 0, "backup": 0, "unread": len(ENDPOINTS)}


async def test_the_documented_redis_user_may_share_scrapes(redis_server: RedisServer) -> None:
    """docs/deploy.md's least-privilege user reads and writes the publications and reads the
    members."""
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await admin.execute_command(*documented_acl("pw"))
    finally:
        await admin.aclose()
    url = f"redis://sidecar:pw@127.0.0.1:{redis_server.port}/0"
    wall = time.time()
    states = [RedisState(url, prefix="pd-sidecar", lease_s=30, timeout_s=1) for _ in range(2)]
    try:
        for state in states:
            await state.start()
            await eventually(functools.partial(_connected, state))
        shares = [
            ScrapeShare(s, per_endpoint=1, interval_s=1.0, members_every_s=0.0, timeout_s=1.0)
            for s in states
        ]
        for turn in range(2):
            for share in shares:
                await _round(share, wall + 0.3 * turn)
        wall += 0.6
        scraped = [len(await _round(share, wall)) for share in shares]
        assert sum(scraped) == len(ENDPOINTS)
        assert all(share.readable for share in shares), shares[1].last_error
        assert all(share.describe()["last_error"] is None for share in shares)
    finally:
        for state in states:
            await state.close()


async def test_ranking_a_thousand_members_lets_the_loop_run(sidecars: Sidecars) -> None:
    """The owners of 32 endpoints over 1,000 members are ranked endpoint by endpoint, the loop
    free in between: a task scheduled meanwhile runs before the read ends."""
    share = await sidecars.add()
    state = sidecars.states[0]
    wall = time.time()
    admin = aioredis.Redis.from_url(sidecars.url)
    try:
        await admin.zadd(state.scrapers_key, {f"sidecar-{i:04d}": wall + 60 for i in range(1000)})
    finally:
        await admin.aclose()
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    began = time.perf_counter()
    try:
        await share.read(ENDPOINTS, now=0.0, wall=wall)
        ticks.append(time.perf_counter())  # the read's last stretch ends here
    finally:
        ticker.cancel()
    took = time.perf_counter() - began
    assert share.describe()["members"] == 1001
    # Ranked in one go, the read's longest pause of the loop would be nearly all of it.
    longest = max(b - a for a, b in itertools.pairwise(ticks))
    assert longest < took / 2, (longest, took)


@pytest.mark.system
@pytest.mark.timeout(60)
async def test_the_scrapes_are_shared_through_a_redis_cluster() -> None:
    """On a Redis Cluster (3 masters): the publications and the member list share the pool's
    hash tag, so a round's read is one command on one node (redis-py refuses a pipelined
    ``mget`` there: it is sent as a plain ``MGET``)."""
    nodes = RedisCluster(3)
    states: list[RedisState] = []
    try:
        await nodes.start()
        for _ in range(3):
            state = RedisState(
                nodes.url(nodes.ports[0]), prefix="pool", cluster=True, lease_s=30, timeout_s=1
            )
            states.append(state)
            await state.start()
            await eventually(functools.partial(_connected, state), within=15)
        # The member list read every round for the first 60 s, then a plain MGET.
        shares = [
            ScrapeShare(s, per_endpoint=1, interval_s=1.0, members_every_s=60.0, timeout_s=1.0)
            for s in states
        ]
        wall = time.time()
        for share in shares:
            await share.read(ENDPOINTS, now=0.0, wall=wall)
        for share in shares:
            await _round(share, wall, now=59.0)
        wall += 0.3
        scraped: collections.Counter[str] = collections.Counter()
        for share in shares:
            scraped.update(await _round(share, wall, now=61.0))
        assert all(share.readable for share in shares), [s.last_error for s in shares]
        assert all(share.describe()["members"] == 3 for share in shares)
        assert sorted(scraped) == sorted(ENDPOINTS)
        assert set(scraped.values()) == {1}
    finally:
        for state in states:
            await state.close()
        await nodes.stop()


async def test_what_one_owner_alone_saw_is_not_taken_for_the_engine(
    sidecars: Sidecars, redis_server: RedisServer
) -> None:
    """A publication that could not reach the engine is handed as one without gauges, never as
    unreachable (each reader would eject an engine only one owner could not reach); unanswered
    ones are handed once two owners said so in a row, or three lines of one (one owner's slow
    loop is not the engine's stall); a good one ends the run; none is handed twice."""
    share = await sidecars.add()
    endpoint = ENDPOINTS[0]
    key = sidecars.states[0].scrape_key(endpoint)
    admin = aioredis.Redis.from_url(redis_server.url)
    wall = time.time()
    at = iter(wall + 0.1 * i for i in range(100))

    async def publish_and_take(snapshot: EngineSnapshot, by: str) -> EngineSnapshot | None:
        when = next(at)
        await admin.set(key, encode(when, snapshot, by))
        await share.read([endpoint], now=100.0, wall=when)
        return share.take(endpoint, now=100.0, wall=when)

    silent, good = EngineSnapshot(at=0.0), EngineSnapshot(load=LOAD, at=0.0)
    try:
        assert await publish_and_take(EngineSnapshot(unreachable=True, at=0.0), "a") is None
        cut_off = await publish_and_take(EngineSnapshot(unreachable=True, at=0.0), "b")
        assert cut_off is not None
        assert (cut_off.unreachable, cut_off.load) == (False, None)
        await share.read([endpoint], now=100.0, wall=wall + 5)
        assert share.take(endpoint, now=100.0, wall=wall + 5) is None  # the same line: once
        answered = await publish_and_take(good, "a")
        assert answered is not None
        assert answered.load is not None
        # One owner alone, its lines read twice in a row (the other's answers unseen): no stall.
        assert await publish_and_take(silent, "a") is None
        assert await publish_and_take(silent, "a") is None
        alone = await publish_and_take(silent, "a")  # a third: an owner alone, k = 1
        assert alone is not None
        assert alone.load is None
        assert await publish_and_take(good, "b") is not None
        assert await publish_and_take(silent, "a") is None
        assert await publish_and_take(silent, "b") is not None
    finally:
        await admin.aclose()


async def test_a_publication_dated_ahead_of_the_clock_is_refused(
    sidecars: Sidecars, redis_server: RedisServer
) -> None:
    """A line dated an hour ahead (a writer's clock, or a hand): refused and counted, and the
    next genuine one is handed (it used to be taken as fresh and to hide every later one)."""
    share = await sidecars.add()
    endpoint = ENDPOINTS[0]
    key = sidecars.states[0].scrape_key(endpoint)
    admin = aioredis.Redis.from_url(redis_server.url)
    wall = time.time()
    try:
        await admin.set(key, encode(wall + 3600, EngineSnapshot(load=LOAD, at=0.0), "other"))
        await share.read([endpoint], now=0.0, wall=wall)
        assert share.take(endpoint, now=0.0, wall=wall) is None
        assert sidecars.skipped["scrape"] == 1
        await admin.set(key, encode(wall + 0.1, EngineSnapshot(load=LOAD, at=0.0), "other"))
        await share.read([endpoint], now=0.0, wall=wall + 0.2)
        assert share.take(endpoint, now=0.0, wall=wall + 0.2) is not None
    finally:
        await admin.aclose()


async def test_after_a_failed_read_the_next_waits_out_a_backoff(sidecars: Sidecars) -> None:
    """Redis unreachable: one failed read, counted; the reads within the backoff send nothing
    (every endpoint scraped here meanwhile); after it, another attempt."""
    share = await sidecars.add(url=UNREACHABLE, timeout_s=0.5)
    wall = time.time()
    await share.read(ENDPOINTS, now=10.0, wall=wall)
    await share.read(ENDPOINTS, now=10.4, wall=wall)
    assert (sidecars.errors, share.readable) == (1, False)
    assert all(share.scrapes(e, wall=wall) for e in ENDPOINTS)
    await share.read(ENDPOINTS, now=10.6, wall=wall)
    assert sidecars.errors == 2


async def test_an_answer_scraped_here_ends_a_run_of_unanswered_publications(
    sidecars: Sidecars, redis_server: RedisServer
) -> None:
    """A backup takes an owner's unanswered line, then scrapes an answer itself: the other
    owner's unanswered line starts a new run (not the second of two owners: no stall)."""
    share = await sidecars.add()
    endpoint = ENDPOINTS[0]
    key = sidecars.states[0].scrape_key(endpoint)
    admin = aioredis.Redis.from_url(redis_server.url)
    wall = time.time()
    try:
        await admin.set(key, encode(wall, EngineSnapshot(at=0.0), "one"))
        await share.read([endpoint], now=0.0, wall=wall)
        assert share.take(endpoint, now=0.0, wall=wall) is None
        share.found(endpoint, EngineSnapshot(load=LOAD, at=0.0), wall=wall + 0.1)
        await admin.set(key, encode(wall + 0.2, EngineSnapshot(at=0.0), "two"))
        await share.read([endpoint], now=0.0, wall=wall + 0.2)
        assert share.take(endpoint, now=0.0, wall=wall + 0.2) is None
    finally:
        await admin.aclose()


async def test_an_older_publication_written_later_is_not_handed(
    sidecars: Sidecars, redis_server: RedisServer
) -> None:
    """Two owners write in any order: a line older than one already handed is left alone."""
    share = await sidecars.add()
    endpoint = ENDPOINTS[0]
    key = sidecars.states[0].scrape_key(endpoint)
    admin = aioredis.Redis.from_url(redis_server.url)
    wall = time.time()
    try:
        await admin.set(key, encode(wall, EngineSnapshot(load=LOAD, at=0.0), "one"))
        await share.read([endpoint], now=0.0, wall=wall)
        assert share.take(endpoint, now=0.0, wall=wall) is not None
        await admin.set(key, encode(wall - 0.5, EngineSnapshot(load=LOAD, at=0.0), "two"))
        await share.read([endpoint], now=0.0, wall=wall + 0.1)
        assert share.take(endpoint, now=0.0, wall=wall + 0.1) is None
    finally:
        await admin.aclose()


async def test_a_backup_that_took_over_keeps_scraping(sidecars: Sidecars) -> None:
    """Its owner silent, a backup scrapes and publishes; its own line being the one there, it
    goes on scraping every round rather than letting the line age past two intervals again."""
    _, two, wall, theirs = await _owner_and_backup(sidecars)
    later = wall + 2.5  # `one` silent since
    assert set(theirs) <= set(await _round(two, later))
    await two.read(ENDPOINTS, now=0.0, wall=later + 0.5)
    assert all(two.scrapes(e, wall=later + 0.5) for e in theirs)


async def test_a_sidecar_that_cannot_publish_goes_on_reading(
    sidecars: Sidecars, redis_server: RedisServer
) -> None:
    """Writes refused, reads answered (a replica promoted read-only, a full Redis): the failure
    is counted and said, and the publications are still read, without backoff."""
    share = await sidecars.add(url=await _user(redis_server, "ro", "set"))
    wall = time.time()
    await _round(share, wall)
    assert sidecars.errors == 1
    assert share.readable
    assert "publish" in (share.last_error or "")
    assert not share.describe()["publishing"]
    await share.read(ENDPOINTS, now=50.1, wall=wall)
    assert share.readable


async def test_between_member_reads_a_round_reads_the_publications_alone(
    sidecars: Sidecars, redis_server: RedisServer
) -> None:
    """The member list read every round for a first period (the fleet registering), then once
    a period: the rounds in between send a plain MGET, and take what was published."""
    one = await sidecars.add(members_every_s=60.0)
    two = await sidecars.add(members_every_s=60.0)
    wall = time.time()
    for share in (one, two):
        await share.read(ENDPOINTS, now=0.0, wall=wall)  # the first period: members read
    await one.read(ENDPOINTS, now=59.0, wall=wall)
    await two.read(ENDPOINTS, now=59.0, wall=wall)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        before = (await admin.info("commandstats")).get("cmdstat_zrangebyscore", {})
        mine = await _round(one, wall, now=61.0)  # past the first period, within one period
        await two.read(ENDPOINTS, now=61.0, wall=wall + 0.1)
        after = (await admin.info("commandstats")).get("cmdstat_zrangebyscore", {})
    finally:
        await admin.aclose()
    assert after.get("calls", 0) == before.get("calls", 0)  # no member list read
    assert two.describe()["members"] == 2
    taken = [e for e in ENDPOINTS if two.take(e, now=61.0, wall=wall + 0.1) is not None]
    assert sorted(taken) == sorted(mine)


async def test_a_refused_membership_write_does_not_fail_the_read(
    sidecars: Sidecars, redis_server: RedisServer
) -> None:
    """A user that may read but not write the member list (or Redis read-only): the
    publications and the members are still read; only this sidecar's membership lapses."""
    share = await sidecars.add(url=await _user(redis_server, "nozadd", "zadd"))
    await share.read(ENDPOINTS, now=0.0, wall=time.time())
    assert share.readable, share.last_error


async def test_a_reader_whose_clock_runs_ahead_deletes_no_live_member(
    sidecars: Sidecars, redis_server: RedisServer
) -> None:
    """A reader thirty seconds ahead does not list a member whose membership it thinks over, but
    leaves it there for the readers on time."""
    one, two = await sidecars.add(), await sidecars.add()
    wall = time.time()
    await one.read(ENDPOINTS, now=0.0, wall=wall)
    await two.read(ENDPOINTS, now=0.0, wall=wall + 30.0)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        state = sidecars.states[0]
        assert await admin.zscore(state.scrapers_key, state.member_id) is not None
    finally:
        await admin.aclose()
    await one.read(ENDPOINTS, now=1.0, wall=wall)
    assert one.describe()["members"] == 2
