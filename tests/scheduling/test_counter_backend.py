"""The Redis backend with counters (``counter_state.CounterState``) on a real redis-server: a
decision's one read, the view counting its own reservations once, and the rolling upgrade from
the script's reservations (``RedisState``), both ways, without counting a reservation twice or
missing one."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from sidecar.scheduling.state import Load, StateBackend
from sidecar.scheduling.state.counter_state import GROUPS, CounterState
from sidecar.scheduling.state.counters import EPOCH_S, EPOCHS_KEPT, Counters
from sidecar.scheduling.state.redis import RedisState
from sidecar.scheduling.state.sharded import connect
from tests.conftest import eventually
from tests.processes import RedisCluster, RedisServer, free_port
from tests.scheduling.test_state_contract import synced
from tests.scheduling.test_state_resp import documented_acl

A, B = "127.0.0.11:8000", "127.0.0.12:8000"
POOL = (A, B)
LEASE_S = 600.0
"""Heartbeats 200 s apart: syncs and checks happen when a case makes them."""
TIMEOUT_S = 5.0

Start = Callable[..., Awaitable[StateBackend]]
HOUR_S = 3_600.0


class MovedClock:
    """The counters' monotonic clock, moved by the test: with the offset not learnt again
    (``relearn_s`` an hour), moving it moves the sidecar through Redis's epochs."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def start(redis_server: RedisServer) -> AsyncIterator[Start]:
    """Start a sidecar's backend on one pool: ``counters`` or the script; all closed at the end."""
    prefix = f"bridge-{uuid.uuid4().hex[:8]}"
    started: list[StateBackend] = []

    async def begin(*, counters: bool, url: str | None = None) -> StateBackend:
        kind = CounterState if counters else RedisState
        backend = kind(url or redis_server.url, prefix=prefix, lease_s=LEASE_S, timeout_s=TIMEOUT_S)
        await backend.start()
        started.append(backend)
        return backend

    yield begin
    for backend in started:
        await backend.close()


async def checked(*backends: CounterState) -> None:
    """Each counters backend's check of the fleet, after a sync of its own."""
    for backend in backends:
        await backend.published()
        await backend.check_fleet()


async def test_alone_it_counts_its_own_once_and_shares_no_table(start, redis_server) -> None:
    new = await start(counters=True)
    assert isinstance(new, CounterState)
    assert new.bridging  # until the first check says otherwise
    await checked(new)
    assert (new.bridging, new.script_sidecars) == (False, 0)
    held = new.reserve(A, 100)
    await synced(new)
    assert new.view().loads == {A: Load(100, 1)}  # read back from Redis, counted once
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        tables = await client.hgetall(new.keys[3])
    finally:
        await client.aclose()
    assert tables == {}  # the script's table is not written: nobody reads it
    new.release(held)
    await synced(new)
    assert new.view().loads == {}
    status = new.status()["reservations"]
    assert status["kind"] == "counters"
    assert (status["lost_writes"], status["lost_releases"], status["bridging"]) == (0, 0, False)


async def test_another_counters_sidecar_sees_a_reservation_after_one_read(start) -> None:
    one, two = await start(counters=True), await start(counters=True)
    await checked(one, two)
    held = one.reserve(A, 100)
    await synced(one, two)
    assert two.view().loads == {A: Load(100, 1)}
    mine = two.reserve(A, 10)
    assert mine.ahead_tokens == 100
    await synced(two)
    assert two.view().loads == {A: Load(110, 2)}
    one.release(held)
    await synced(one, two)
    assert two.view().loads == {A: Load(10, 1)}


async def test_script_sidecars_live_make_it_share_both_ways(start) -> None:
    """Upgrading: an old sidecar (the script's) and a new one (counters) each see the other's
    reservation, once."""
    old = await start(counters=False)
    new = await start(counters=True)
    await synced(old)
    await checked(new)
    assert (new.bridging, new.script_sidecars) == (True, 1)
    old.reserve(A, 100)
    new.reserve(A, 10)
    await synced(new, old, new)
    assert old.view().loads == {A: Load(110, 2)}
    assert new.view().loads == {A: Load(110, 2)}


async def test_once_the_last_script_sidecar_left_the_counters_alone_count(
    start, redis_server
) -> None:
    old = await start(counters=False)
    one, two = await start(counters=True), await start(counters=True)
    await synced(old)
    await checked(one, two)
    assert one.bridging
    assert two.bridging
    one.reserve(A, 100)
    two.reserve(B, 50)
    await synced(one, two, one)
    assert one.view().loads == {A: Load(100, 1), B: Load(50, 1)}
    await old.close()
    await checked(one, two)
    assert (one.bridging, two.bridging) == (False, False)
    assert one.script_sidecars == 0
    await synced(one, two, one)  # the tables leave the script's totals; the counters stay
    assert one.view().loads == {A: Load(100, 1), B: Load(50, 1)}
    assert two.view().loads == {A: Load(100, 1), B: Load(50, 1)}
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await client.hgetall(one.keys[3]) == {}  # no table left in the script's keys
    finally:
        await client.aclose()


async def test_a_script_sidecar_that_comes_back_is_shared_with_again(start) -> None:
    """Rolled back: a script sidecar starts beside counters sidecars that stopped sharing their
    table; their next check shares it again."""
    new = await start(counters=True)
    await checked(new)
    assert not new.bridging
    held = new.reserve(A, 100)
    old = await start(counters=False)
    await synced(old)
    assert old.view().loads == {}  # not seen before the counters sidecar's check
    await checked(new)
    assert (new.bridging, new.script_sidecars) == (True, 1)
    await synced(new, old)
    assert old.view().loads == {A: Load(100, 1)}
    new.release(held)
    await synced(new, old)
    assert old.view().loads == {}


async def test_a_counters_sidecar_leaving_is_never_taken_for_none(start, redis_server) -> None:
    """A closing counters sidecar leaves ``counting`` before the script's ``sidecars`` (as
    Redis ran the commands): in between, the others count one script sidecar too many, never
    one too few."""
    old = await start(counters=False)
    one, two = await start(counters=True), await start(counters=True)
    await synced(old)
    await checked(one, two)
    assert one.script_sidecars == 1
    assert isinstance(two, CounterState)
    watcher = aioredis.Redis.from_url(redis_server.url)
    removed: list[str] = []
    try:
        async with watcher.monitor() as monitor:
            closing = asyncio.create_task(two.close())
            async with asyncio.timeout(10):
                while len(removed) < 2:
                    command = (await monitor.next_command())["command"]
                    if command.startswith("ZREM ") and two.member_id in command:
                        removed.append(command.split()[1])
            await closing
    finally:
        await watcher.aclose()
    assert removed == [two.counting_key, two.keys[0]]
    await checked(one)
    assert (one.bridging, one.script_sidecars) == (True, 1)


async def test_a_reservation_held_past_its_epochs_hides_nobody_elses(redis_server) -> None:
    """A prefill held longer than the counters keep it (a hung one): Redis stops counting it,
    and so does this sidecar's subtraction of its own, during and after its late release."""
    clock = MovedClock()
    prefix = f"held-{uuid.uuid4().hex[:8]}"
    one, two = (
        CounterState(
            redis_server.url,
            prefix=prefix,
            lease_s=LEASE_S,
            timeout_s=TIMEOUT_S,
            counters_clock=clock,
            relearn_s=HOUR_S,
        )
        for _ in range(2)
    )
    await one.start()
    await two.start()
    try:
        await checked(one, two)
        held = one.reserve(A, 100)
        await synced(one, two)  # both learnt Redis's clock, on the clock moved next
        clock.now += EPOCHS_KEPT * EPOCH_S  # its epoch's key has expired by now
        two.reserve(A, 10)
        await synced(two, one)
        assert one.view().loads == {A: Load(110, 2)}
        one.release(held)
        await synced(one)
        assert one.status()["reservations"]["late_releases"] == 1
        assert one.view().loads == {A: Load(10, 1)}
    finally:
        await one.close()
        await two.close()


async def test_a_closing_counters_sidecar_takes_back_what_it_held(start) -> None:
    one, two = await start(counters=True), await start(counters=True)
    await checked(one, two)
    one.reserve(A, 100)
    one.reserve(B, 30)  # its write may still be in flight when closing
    await one.close()
    await synced(two)
    assert two.view().loads == {}


async def test_a_release_before_its_write_answered_is_taken_back_after_it(start) -> None:
    one, two = await start(counters=True), await start(counters=True)
    await checked(one, two)
    one.release(one.reserve(A, 100))  # released at once: the write is in flight
    await synced(one, two)
    assert two.view().loads == {}
    assert one.status()["reservations"]["lost_releases"] == 0


async def test_without_redis_a_decision_waits_for_nothing(start) -> None:
    """Redis refuses: the writes fail and back the counters off; a refresh then returns at
    once, and the sidecar's own reservations still count."""
    backend = await start(counters=True, url=f"redis://127.0.0.1:{free_port()}/0")
    assert isinstance(backend, CounterState)
    held = backend.reserve(A, 100)
    await backend.published()
    assert backend.lost_writes == 1
    began = time.monotonic()
    await backend.refresh(POOL)
    assert time.monotonic() - began < TIMEOUT_S / 2  # backed off: nothing waited for
    assert backend.view().loads == {A: Load(100, 1)}
    backend.release(held)
    assert backend.view().loads == {}
    assert backend.status()["connected"] is False


async def test_a_stalled_redis_costs_a_decision_its_budget_only(redis_server) -> None:
    """Redis frozen: the read is given up at the decision's budget, the view kept."""
    backend = CounterState(redis_server.url, prefix="stall", lease_s=LEASE_S, timeout_s=0.05)
    await backend.start()
    try:
        await backend.published()
        await backend.check_fleet()
        backend.reserve(A, 100)
        await backend.published()
        await backend.refresh(POOL)
        assert redis_server.process is not None
        redis_server.process.send_signal(signal.SIGSTOP)  # frozen: reads no command
        try:
            began = time.monotonic()
            await backend.refresh(POOL)
            waited = time.monotonic() - began
            assert backend.view().loads == {A: Load(100, 1)}
            assert backend.last_error is not None
            assert backend.last_error.startswith("timeout")
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
        assert waited < 0.5
        await backend.refresh(POOL)  # the read given up answers; the next one too
        await backend.refresh(POOL)
        assert backend.view().loads == {A: Load(100, 1)}
        assert backend.status()["reservations"]["lost_writes"] == 0
    finally:
        await backend.close()


async def test_without_decisions_the_heartbeat_reads_the_pool_again(redis_server) -> None:
    """A sidecar that stopped deciding still sees the others' reservations come and go (its
    ``/debug/scheduler`` and gauges): its heartbeat reads the pool it last read."""
    prefix = f"idle-{uuid.uuid4().hex[:8]}"
    idle = CounterState(redis_server.url, prefix=prefix, lease_s=0.3, timeout_s=TIMEOUT_S)
    busy = CounterState(redis_server.url, prefix=prefix, lease_s=LEASE_S, timeout_s=TIMEOUT_S)
    await idle.start()
    await busy.start()

    async def sees(loads: dict[str, Load]) -> bool:
        return idle.view().loads == loads

    try:
        await idle.refresh(POOL)  # its last decision
        held = busy.reserve(A, 100)
        await busy.published()
        await eventually(lambda: sees({A: Load(100, 1)}))
        busy.release(held)
        await busy.published()
        await eventually(lambda: sees({}))
    finally:
        await busy.close()
        await idle.close()


async def test_a_user_granted_the_documented_commands_alone_runs_the_counters(
    redis_server,
) -> None:
    """docs/deploy.md's ACL line covers the counters: reservations, reads, releases, the
    upgrade's check and the goodbye, with nothing refused."""
    admin = aioredis.Redis.from_url(redis_server.url)
    await admin.execute_command(*documented_acl("counters-secret"))
    url = f"redis://sidecar:counters-secret@127.0.0.1:{redis_server.port}/3"
    one = CounterState(url, prefix="pd-sidecar", lease_s=LEASE_S, timeout_s=TIMEOUT_S)
    two = CounterState(url, prefix="pd-sidecar", lease_s=LEASE_S, timeout_s=TIMEOUT_S)
    try:
        await one.start()
        await two.start()
        await checked(one, two)
        held = one.reserve(A, 70)
        await synced(one, two)
        assert two.view().loads == {A: Load(70, 1)}
        one.release(held)
        await synced(one, two)
        assert two.view().loads == {}
        assert (one.lost_writes, one.status()["reservations"]["lost_releases"]) == (0, 0)
        assert (one.last_error, two.last_error) == (None, None)
        await one.close()
        denied = {entry["object"] for entry in await admin.acl_log()}
        assert denied <= {"client|setname", "client|setinfo"}
    finally:
        await one.close()
        await two.close()
        await admin.aclose()


async def test_a_dead_counters_sidecar_hides_no_script_sidecar_from_a_clock_behind(
    redis_server,
) -> None:
    """A counters sidecar dies (no goodbye); a script sidecar whose clock is past its deadline
    drops it from ``sidecars``, while its ``counting`` entry stays. A checker whose clock is
    half a second behind must still count the script sidecar."""
    t = time.time()
    clocks = {name: UnixClock(t) for name in ("old", "dead", "checker")}
    prefix = f"skew-{uuid.uuid4().hex[:8]}"

    def backend(name: str) -> StateBackend:
        kind = RedisState if name == "old" else CounterState
        return kind(
            redis_server.url,
            prefix=prefix,
            lease_s=LEASE_S,
            timeout_s=TIMEOUT_S,
            clock=clocks[name],
        )

    old, dead, checker = backend("old"), backend("dead"), backend("checker")
    assert isinstance(dead, CounterState)
    assert isinstance(checker, CounterState)
    for each in (old, dead, checker):
        await each.start()
    try:
        await synced(old)
        await checked(dead, checker)
        assert (checker.bridging, checker.script_sidecars) == (True, 1)
        # ``dead`` goes silent. The script sidecar syncs just past its deadline (and the
        # checker's): both leave ``sidecars``; ``dead`` stays in ``counting``.
        clocks["old"].now = t + LEASE_S + 0.4
        await synced(old)
        clocks["checker"].now = t + LEASE_S - 0.1
        await checked(checker)
        assert (checker.bridging, checker.script_sidecars) == (True, 1)
    finally:
        for each in (old, dead, checker):
            await each.close()


class UnixClock:
    """A sidecar's Unix clock (the script's leases), moved by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.system
@pytest.mark.timeout(90)
async def test_on_a_cluster_a_master_down_stops_its_endpoints_alone() -> None:
    """One master of three killed: the writes of its endpoints fail and back off, the others'
    are written and read as before; a read keeps the lost endpoints' others as last read."""
    nodes = RedisCluster(3)
    endpoints = tuple(f"127.0.2.{i}:8000" for i in range(12))
    prefix = f"down-{uuid.uuid4().hex[:8]}"
    try:
        await nodes.start()
        url = nodes.url(nodes.ports[0])
        one, two = (
            CounterState(url, prefix=prefix, cluster=True, lease_s=LEASE_S, timeout_s=TIMEOUT_S)
            for _ in range(2)
        )
        await one.start()
        await two.start()
        try:
            await checked(one, two)
            for endpoint in endpoints:
                two.reserve(endpoint, 10)
            await synced(two, one, pool=endpoints)
            assert one.view().loads == {e: Load(10, 1) for e in endpoints}
            # A master holding some endpoints' counters, not the pool's own keys.
            pool = (await nodes.slot_owner(one.keys[0]))[0]
            tags = Counters(one_client := connect(url, cluster=True), prefix, groups=GROUPS)
            try:
                owner = {e: (await nodes.slot_owner(tags.tag(e) + ":0"))[0] for e in endpoints}
            finally:
                await one_client.aclose()
            down = next(port for port in owner.values() if port != pool)
            lost = {e for e in endpoints if owner[e] == down}
            assert 0 < len(lost) < len(endpoints)
            nodes.kill(down)
            first = min(lost)
            one.reserve(first, 5)  # fails first: the others' writes go on all the same
            await one.published()
            for endpoint in endpoints:
                if endpoint != first:
                    one.reserve(endpoint, 5)
            await synced(one, two, pool=endpoints)
            assert one.lost_writes == len(lost)
            # The lost endpoints: two's as last read, and one's own; the others read anew.
            assert one.view().loads == {e: Load(15, 2) for e in endpoints}
            assert two.view().loads == {
                e: Load(10, 1) if e in lost else Load(15, 2) for e in endpoints
            }
        finally:
            await one.close()
            await two.close()
    finally:
        await nodes.stop()


async def test_close_returns_though_the_watcher_missed_its_cancel(redis_server) -> None:
    """A cancel that meets a Redis answer can be lost (Python 3.11's ``asyncio.wait_for``,
    which redis-py uses): the watcher, its check swallowing the cancel, still ends at close.
    (Before, 1 close in a few hundred never returned at 1,024 sidecars.)"""
    # A short lease: heartbeats, and the watcher's checks, every 0.1 s.
    backend = CounterState(redis_server.url, prefix="swallow", lease_s=0.3, timeout_s=TIMEOUT_S)
    await backend.start()
    checking = asyncio.Event()

    async def swallowing() -> None:
        checking.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # the answer that never comes, the cancel lost

    backend.check_fleet = swallowing  # type: ignore[method-assign]
    try:
        await checking.wait()  # the watcher's next check, after a heartbeat's sync
    finally:
        async with asyncio.timeout(5):
            await backend.close()


async def test_a_dead_counters_sidecar_is_not_taken_for_a_script_sidecar(redis_server) -> None:
    """A counters sidecar dies (no goodbye): in the last half of its lease its ``counting``
    entry no longer counts at once, but it is still live in ``sidecars``: looked up, it is
    a counters sidecar, and nobody starts sharing through the script for it."""
    t = time.time()
    clocks = {name: UnixClock(t) for name in ("dead", "checker")}
    prefix = f"dead-{uuid.uuid4().hex[:8]}"
    dead, checker = (
        CounterState(
            redis_server.url,
            prefix=prefix,
            lease_s=LEASE_S,
            timeout_s=TIMEOUT_S,
            clock=clocks[name],
        )
        for name in ("dead", "checker")
    )
    await dead.start()
    await checker.start()
    try:
        await checked(dead, checker)
        assert (checker.bridging, checker.script_sidecars) == (False, 0)
        clocks["checker"].now = t + LEASE_S * 2 / 3  # ``dead`` silent since t
        await checked(checker)
        assert (checker.bridging, checker.script_sidecars) == (False, 0)
    finally:
        await dead.close()
        await checker.close()


async def test_what_the_counters_refuse_backs_nothing_off(start) -> None:
    """An endpoint name that cannot be in a key: its write and a read naming it are refused
    before anything is sent, said as such, and the next read goes at once."""
    one, two = await start(counters=True), await start(counters=True)
    assert isinstance(one, CounterState)
    await checked(one, two)
    bad = "127.0.0.13:{8000}"
    one.reserve(bad, 10)
    await one.published()
    assert one.lost_writes == 1
    two.reserve(A, 100)
    await two.published()
    await one.refresh((A, bad))
    assert one.last_error is not None
    assert one.last_error.startswith("refused")
    await one.refresh((A,))  # not backed off: read at once
    assert one.view().loads == {A: Load(100, 1), bad: Load(10, 1)}
