"""The shared-state protocol without I/O (sidecar/scheduling/state/protocol.py): its rules, with
the clock and the answers as inputs; and the simulator's model of the script (bench/sim/state.py)
held to the real script on a real redis-server."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from bench.sim.state import RedisServer as ModelledScript
from sidecar.scheduling.model import Speed
from sidecar.scheduling.state import Load, Reservation
from sidecar.scheduling.state.protocol import (
    MAX_ENTRIES,
    SCRIPT,
    Reply,
    Sync,
    SyncProtocol,
    decode_reply,
    keys,
)
from sidecar.scheduling.state.redis import RedisState

A, B, C = "127.0.0.11:8000", "127.0.0.12:8000", "127.0.0.13:8000"
SPEED = Speed(0.0001, 0.02)


class Wakes:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def protocol(sidecar: str = "me", lease_s: float = 30.0) -> SyncProtocol:
    return SyncProtocol(sidecar, lease_s=lease_s, wake=lambda: None)


def answer(sync: Sync, **totals: Load) -> Reply:
    """An answer to ``sync``: the pool's totals (this sidecar's as sent included)."""
    return Reply(totals, {}, {})


def test_a_sync_sends_the_whole_table_and_what_was_published_since() -> None:
    state = protocol()
    state.reserve(A, 100)
    state.reserve(A, 50)
    state.reserve(B, 10)
    state.publish_speed(A, SPEED)
    state.publish_ejection(C, 130.5)
    sync = state.begin(100.0)
    assert sync.number == 1
    assert sync.args() == [
        "me", "100.0", "30.0", f"{A} 150 2\n{B} 10 1", 1, A, "0.0001 0.02", 1, C, "130.5",
    ]  # fmt: skip
    state.received(sync, Reply({A: Load(150, 2), B: Load(10, 1)}, {A: SPEED}, {C: 130.5}))
    # Published once: the next sync carries the table alone.
    assert state.begin(101.0).args() == ["me", "101.0", "30.0", f"{A} 150 2\n{B} 10 1", 0, 0]


def test_the_view_is_the_others_as_last_answered_and_this_sidecars_own_as_now() -> None:
    state = protocol()
    first = state.reserve(A, 100)
    sync = state.begin(0.0)
    state.reserve(A, 10)  # after the send: not in the answer's totals
    # Another sidecar holds 40 tokens of A, one request, and B.
    state.received(sync, Reply({A: Load(140, 2), B: Load(5, 1)}, {B: SPEED}, {C: 9.0}))
    view = state.view()
    assert view.loads == {A: Load(150, 3), B: Load(5, 1)}
    assert (view.speeds, view.ejected_until) == ({B: SPEED}, {C: 9.0})
    assert state.reserve(B, 1) == Reservation(B, 1, 5)  # the others' tokens are ahead of it
    state.release(first)
    assert state.view().loads == {A: Load(50, 2), B: Load(6, 2)}


def test_a_change_to_publish_wakes_the_worker_a_speed_waits_for_the_next_sync() -> None:
    wakes = Wakes()
    state = SyncProtocol("me", lease_s=30.0, wake=wakes)
    state.release(state.reserve(A, 100))
    state.publish_ejection(A, 10.0)
    assert wakes.count == 3
    state.publish_speed(A, SPEED)
    assert wakes.count == 3
    assert state.view().speeds == {A: SPEED}


def test_one_sync_at_a_time() -> None:
    state = protocol()
    sync = state.begin(0.0)
    with pytest.raises(RuntimeError):
        state.begin(0.0)
    state.received(sync, answer(sync))
    assert state.begin(0.0).number == 2


def test_a_failed_sync_backs_off_and_its_publications_go_with_the_next() -> None:
    state = protocol()
    state.publish_speed(A, Speed(0.0001, 0.02))
    state.publish_ejection(C, 50.0)
    sync = state.begin(10.0)
    newer = Speed(0.0002, 0.03)
    state.publish_speed(A, newer)  # published while the sync was in flight: it wins
    state.publish_speed(B, SPEED)
    state.failed(sync, 10.0)
    assert state.in_flight is None
    assert not state.decision_waits(10.4)  # Redis is down: a decision does not wait for it
    assert state.backoff_left(10.2) == pytest.approx(0.3)
    assert state.decision_waits(10.5)
    retry = state.begin(10.5)
    assert (retry.speeds, retry.ejections) == ({A: newer, B: SPEED}, {C: 50.0})
    # The backoff doubles with each failure, up to 5 s; an answer resets it.
    backoffs = []
    for now in (20.0, 30.0, 40.0, 50.0, 60.0):
        state.failed(retry, now)
        backoffs.append(state.backoff_left(now))
        retry = state.begin(now)
    assert backoffs == [1.0, 2.0, 4.0, 5.0, 5.0]
    state.received(retry, answer(retry))
    state.failed(state.begin(70.0), 70.0)
    assert state.backoff_left(70.0) == 0.5


def test_a_cancelled_sync_keeps_its_publications_without_backing_off() -> None:
    state = protocol()
    state.publish_speed(A, SPEED)
    sync = state.begin(0.0)
    state.cancelled(sync)
    assert state.decision_waits(0.0)
    assert state.begin(0.0).speeds == {A: SPEED}


def test_the_worker_is_owed_a_sync_begun_after_the_one_in_flight() -> None:
    """A sync in flight when the worker wakes may have been sent before the change that woke
    it: the worker waits for it, then for one more (its own, or one a decision began)."""
    state = protocol()
    assert not state.worker_owed
    # Nothing in flight: the worker's own sync is the one it is owed.
    state.worker_woke(syncing=False)
    own = state.begin(0.0)
    assert state.worker_owed
    state.received(own, answer(own))
    assert not state.worker_owed
    # A decision's sync in flight: owed the one after it, whoever begins it.
    earlier = state.begin(1.0)
    state.worker_woke(syncing=True)
    state.received(earlier, answer(earlier))
    assert state.worker_owed
    later = state.begin(1.1)
    state.failed(later, 1.2)  # ended all the same
    assert not state.worker_owed


Fields = tuple[str | bytes, ...]


def answer_of(
    totals: Fields = (),
    speeds: Fields = (),
    ejections: Fields = (),
    over: int = 0,
    repaired: Fields = (),
) -> bytes:
    """An answer as the script gives it: a line of counts, a line of sizes, the fields joined
    by newlines."""
    kinds = (totals, speeds, ejections, repaired)
    data = [f.encode() if isinstance(f, str) else f for kind in kinds for f in kind]
    counts = " ".join(str(n) for n in (over, *(len(kind) for kind in kinds)))
    sizes = " ".join(str(len(field)) for field in data)
    return f"{counts}\n{sizes}\n".encode() + b"\n".join(data)


def test_an_answer_is_checked_entry_by_entry() -> None:
    reply = decode_reply(
        answer_of(
            (A, "100 2", B, "-1 1", C, "5", b"\xff:1", "1 1"),
            (A, "0.0001 0.02", B, "nan 0.1", C, "0 0.1", "x\n1", "0.0001 0.02"),
            (A, repr(time.time() + 10), B, "1e18", C, "soon", C, b"\xff"),
            over=3,
            repaired=("{p}:speeds", "string"),
        ),
        now=time.time(),
        max_ejection_s=60,
    )
    assert reply.totals == {A: Load(100, 2)}
    assert reply.speeds == {A: SPEED}
    assert set(reply.ejections) == {A}
    assert reply.skipped == {
        "over_limit": 3, "load": 3, "speed": 3, "ejection": 3, "wrong_type": 1
    }  # fmt: skip
    assert reply.repaired == (("{p}:speeds", "string"),)


@pytest.mark.parametrize(
    "raw",
    [
        b"0 2 0 0 0\n1 1\na\n\nbc",  # sizes that do not add up
        b"0 1 0 0 0\n1\na",  # half a pair
        b"0 2 0 0 0\n-1 2\na\nb",
        b"0 %d 0 0 0\n\n" % (2 * MAX_ENTRIES + 2),  # more than the script sends
        b"0 0 0 0 0\n\norphan",
        b"0 0 0 0\n\n",
        [b"not", b"one string"],
        b"no lines",
    ],
)
def test_an_answer_not_the_scripts_fails_the_sync(raw: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        decode_reply(raw, now=0.0, max_ejection_s=60)


async def test_the_simulators_script_answers_as_the_real_one(redis_server) -> None:
    """The same syncs of two sidecars, sent to the real script and to the simulator's model of
    it: the same answers (reservations replaced whole, speeds, an ejection kept at its latest
    end and forgotten once ended, a sidecar that holds nothing)."""
    client = aioredis.Redis.from_url(redis_server.url)
    script = client.register_script(SCRIPT)
    model = ModelledScript()
    now = time.time()
    one, two = protocol("one", lease_s=600), protocol("two", lease_s=600)

    async def both(state: SyncProtocol, at: float) -> Reply:
        sync = state.begin(at)
        raw = await script(keys=keys("model"), args=sync.args())
        real = decode_reply(raw, now=at, max_ejection_s=3600)
        assert model.script(sync) == real, sync
        state.received(sync, real)
        return real

    try:
        held = one.reserve(A, 100)
        one.reserve(B, 50)
        one.publish_speed(A, SPEED)
        one.publish_ejection(B, now + 30)
        await both(one, now)
        mine = two.reserve(A, 10)
        two.publish_ejection(B, now + 10)  # ends earlier than the one stored: not kept
        two.publish_ejection(C, now + 1)
        reply = await both(two, now + 0.5)
        assert reply.totals == {A: Load(110, 2), B: Load(50, 1)}
        assert reply.ejections == {B: now + 30, C: now + 1}
        one.release(held)
        one.publish_speed(A, Speed(0.0002, 0.01))
        reply = await both(one, now + 2)  # C's ejection has ended
        assert reply.ejections == {B: now + 30}
        two.release(mine)
        reply = await both(two, now + 3)  # two holds nothing now
        assert reply.totals == {B: Load(50, 1)}
    finally:
        await client.aclose()


class Pool:
    """Syncs of several sidecars through the real script, and the totals hash it keeps."""

    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.keys = keys(prefix)
        self.script = client.register_script(SCRIPT)

    async def sync(self, state: SyncProtocol, at: float) -> Reply:
        sync = state.begin(at)
        raw = await self.script(keys=self.keys, args=sync.args())
        reply = decode_reply(raw, now=at, max_ejection_s=3600)
        state.received(sync, reply)
        return reply

    async def stored_totals(self) -> dict[str, Load]:
        """The totals hash as Redis holds it (its own fields, ``#tables`` and ``#built``, aside)."""
        stored = await self.client.hgetall(self.keys[4])
        totals = {}
        for field, value in stored.items():
            name = field.decode() if isinstance(field, bytes) else field
            if not name.startswith("#"):
                tokens, requests = value.split()
                totals[name] = Load(int(tokens), int(requests))
        return totals


@pytest.fixture
async def pool(redis_server) -> AsyncIterator[Pool]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield Pool(client, "totals")
    await client.aclose()


async def test_the_totals_follow_reservations_and_releases_of_two_sidecars(pool) -> None:
    """Redis keeps the pool's totals, changed by each table's difference to the one stored; the
    answer is what they hold."""
    now = time.time()
    one, two = protocol("one", lease_s=600), protocol("two", lease_s=600)
    first = one.reserve(A, 100)
    one.reserve(B, 40)
    await pool.sync(one, now)
    two.reserve(A, 10)
    reply = await pool.sync(two, now + 0.1)
    assert reply.totals == {A: Load(110, 2), B: Load(40, 1)}
    assert await pool.stored_totals() == reply.totals
    one.release(first)
    one.reserve(C, 7)
    reply = await pool.sync(one, now + 0.2)
    assert reply.totals == {A: Load(10, 1), B: Load(40, 1), C: Load(7, 1)}
    assert await pool.stored_totals() == reply.totals
    assert await pool.client.hget(pool.keys[4], "#tables") == b"2"


async def test_a_dead_sidecars_share_leaves_the_totals_with_its_lease(pool) -> None:
    """A sidecar that stops syncing: once its lease has run out, the next sync of another one
    takes its reservations off the totals (and its table and lease go)."""
    now = time.time()
    alive, dying = protocol("alive", lease_s=600), protocol("dying", lease_s=2)
    alive.reserve(A, 5)
    await pool.sync(alive, now)
    dying.reserve(A, 300)
    dying.reserve(B, 30)
    await pool.sync(dying, now)
    reply = await pool.sync(alive, now + 1)  # within its lease: still counted
    assert reply.totals == {A: Load(305, 2), B: Load(30, 1)}
    reply = await pool.sync(alive, now + 2.5)
    assert reply.totals == {A: Load(5, 1)}
    assert await pool.stored_totals() == {A: Load(5, 1)}
    assert await pool.client.hget(pool.keys[3], "dying") is None
    assert await pool.client.zscore(pool.keys[0], "dying") is None


async def test_totals_that_cannot_be_trusted_are_rebuilt_from_the_live_tables(pool) -> None:
    """Totals gone (a restart, an expiry) or counting other tables than Redis holds (a table
    written behind the script's back, one without a lease): the next sync sums every live
    sidecar's table anew, and a table without a lease is dropped."""
    now = time.time()
    one, two = protocol("one", lease_s=600), protocol("two", lease_s=600)
    one.reserve(A, 100)
    await pool.sync(one, now)
    two.reserve(B, 20)
    await pool.sync(two, now)
    await pool.client.delete(pool.keys[4])
    reply = await pool.sync(one, now + 0.1)
    assert reply.totals == {A: Load(100, 1), B: Load(20, 1)}
    # Written by hand: a live sidecar's table, and a table whose sidecar holds no lease.
    await pool.client.zadd(pool.keys[0], {"by-hand": now + 600})
    await pool.client.hset(pool.keys[3], mapping={"by-hand": f"{C} 9 1", "orphan": f"{A} 1 1"})
    reply = await pool.sync(two, now + 0.2)
    assert reply.totals == {A: Load(100, 1), B: Load(20, 1), C: Load(9, 1)}
    assert await pool.stored_totals() == reply.totals
    assert await pool.client.hget(pool.keys[3], "orphan") is None


async def test_a_closing_backend_takes_its_reservations_off_the_totals(redis_server) -> None:
    """``RedisState.close`` says goodbye through the script: the totals lose its share at once,
    not after its lease, and stay consistent (no rebuild needed)."""
    client = aioredis.Redis.from_url(redis_server.url)
    pool = Pool(client, "goodbye")
    other = protocol("other", lease_s=600)
    other.reserve(A, 50)
    state = RedisState(redis_server.url, prefix="goodbye", lease_s=600, timeout_s=1)
    try:
        await pool.sync(other, time.time())
        await state.start()
        state.reserve(A, 70)
        state.reserve(B, 8)
        await state.refresh()
        assert (await pool.stored_totals())[A] == Load(120, 2)
        await state.close()
        assert await pool.stored_totals() == {A: Load(50, 1)}
        assert await client.hget(pool.keys[4], "#tables") == b"1"
    finally:
        await client.aclose()


async def test_a_change_behind_the_scripts_back_counts_within_a_lease(pool) -> None:
    """A table changed by anything but the script (an older sidecar during a rolling upgrade
    writes its table by itself), the count of tables unchanged: the totals miss it until they
    are a lease old, then they are summed anew."""
    now = time.time()
    one, two = protocol("one", lease_s=10), protocol("two", lease_s=10)
    one.reserve(A, 100)
    await pool.sync(one, now)
    two.reserve(B, 20)
    await pool.sync(two, now)
    await pool.client.hset(pool.keys[3], "two", f"{B} 50 2")  # the old script's way
    reply = await pool.sync(one, now + 1)
    assert reply.totals == {A: Load(100, 1), B: Load(20, 1)}  # within the lease: not seen yet
    await pool.sync(two, now + 5)  # renews its lease; the stored table is what it sends
    await pool.client.hset(pool.keys[3], "two", f"{B} 50 2")
    reply = await pool.sync(one, now + 10.5)
    assert reply.totals == {A: Load(100, 1), B: Load(50, 2)}
    assert await pool.stored_totals() == reply.totals
