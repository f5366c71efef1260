"""The ``StateBackend`` contract: the same cases on every backend — the memory backend, a real
``redis-server`` and a real Redis Cluster (3 masters + 3 replicas: a system test, its six
processes take seconds to start; ``make test-system``), each with the script's reservations and
with counters.

Each case runs one or two sidecars' backends on one store. The memory backend has none: it
shares nothing, so what one sidecar does the other never sees (``Store.shared``), while
everything a sidecar does is in its own view at once, on every backend. The clock is an input of
the protocol (the script judges leases and ejections by the sender's): a lease or an ejection
runs out by moving a sidecar's clock, not by waiting.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as ClusterClient

from sidecar.scheduling.model import Speed
from sidecar.scheduling.state import Load, MemoryState, Reservation, StateBackend
from sidecar.scheduling.state.counter_state import CounterState
from sidecar.scheduling.state.protocol import keys
from sidecar.scheduling.state.redis import RedisState
from tests.processes import RedisCluster, RedisServer, free_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

LEASE_S = 600.0
"""Heartbeats 200 s apart: a sidecar syncs only when a case makes it (a change, a refresh)."""
TIMEOUT_S = 5.0
"""How long a refresh waits for its sync: on a loaded machine an answer can take a while."""
A, B = "127.0.0.11:8000", "127.0.0.12:8000"
SPEED = Speed(0.0001, 0.02)


class Clock:
    """A sidecar's clock (Unix time), moved by the case."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class Store(Protocol):
    shared: bool
    """Whether one sidecar sees what another did."""
    leases: bool
    """Whether a silent sidecar's reservations stop counting with its lease, and a store that
    lost everything is written whole again by the next syncs (the counters do neither: a dead
    sidecar's count until their epoch ends, a lost one is not written again)."""

    def backend(self, clock: Clock, *, reachable: bool = True) -> StateBackend: ...

    async def lose_everything(self) -> None:
        """What a restart without persistence, or a failover that lost the last writes, does."""
        ...


class MemoryStore:
    shared = False
    leases = True

    def backend(self, clock: Clock, *, reachable: bool = True) -> StateBackend:
        return MemoryState()

    async def lose_everything(self) -> None:
        return None  # nothing kept outside the sidecar


class RedisStore:
    """A pool of its own (a key prefix) on a standalone Redis or a Redis Cluster."""

    shared = True

    def __init__(self, url: str, *, cluster: bool, counters: bool = False) -> None:
        self._url = url
        self._cluster = cluster
        self._prefix = f"contract-{uuid.uuid4().hex[:8]}"
        self._counters = counters
        self.leases = not counters

    def backend(self, clock: Clock, *, reachable: bool = True) -> StateBackend:
        url = self._url if reachable else f"redis://127.0.0.1:{free_port()}/0"
        kind = CounterState if self._counters else RedisState
        return kind(
            url,
            prefix=self._prefix,
            cluster=self._cluster,
            lease_s=LEASE_S,
            timeout_s=TIMEOUT_S,
            clock=clock,
        )

    async def lose_everything(self) -> None:
        admin = (
            ClusterClient.from_url(self._url)
            if self._cluster
            else aioredis.Redis.from_url(self._url)
        )
        try:
            for key in keys(self._prefix):
                await admin.delete(key)
            async for key in admin.scan_iter(match=f"*{self._prefix}*"):
                await admin.delete(key)  # the counters, the members
        finally:
            await admin.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def redis_server() -> AsyncIterator[RedisServer]:
    """One redis-server for the module's cases, each on a key prefix of its own."""
    server = RedisServer(free_port())
    await server.start()
    yield server
    await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def redis_cluster() -> AsyncIterator[RedisCluster]:
    nodes = RedisCluster(3)
    try:
        await nodes.start()
        yield nodes
    finally:
        await nodes.stop()


@pytest.fixture(
    params=[
        "memory",
        "redis",
        "redis-counters",
        pytest.param("cluster", marks=[pytest.mark.system, pytest.mark.timeout(90)]),
        pytest.param("cluster-counters", marks=[pytest.mark.system, pytest.mark.timeout(90)]),
    ]
)
def store(request: pytest.FixtureRequest) -> Store:
    counters = request.param.endswith("-counters")
    if request.param.startswith("redis"):
        server: RedisServer = request.getfixturevalue("redis_server")
        return RedisStore(server.url, cluster=False, counters=counters)
    if request.param.startswith("cluster"):
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        return RedisStore(cluster.url(cluster.ports[0]), cluster=True, counters=counters)
    return MemoryStore()


StartBackend = Callable[..., Awaitable[StateBackend]]


@pytest_asyncio.fixture(loop_scope="module")
async def start_backend(store: Store) -> AsyncIterator[StartBackend]:
    """Start one sidecar's backend on the store (``clock``, ``reachable``); all closed at the
    end."""
    started: list[StateBackend] = []

    async def start(clock: Clock | None = None, *, reachable: bool = True) -> StateBackend:
        backend = store.backend(clock or Clock(), reachable=reachable)
        await backend.start()
        started.append(backend)
        return backend

    yield start
    for backend in started:
        await backend.close()


async def synced(*backends: StateBackend, pool: tuple[str, ...] = (A, B)) -> None:
    """Each backend, in turn, synced after every change made before the call: a refresh joins
    the sync in flight, which may have been sent before the change; the second joins or begins
    one sent after it. A counters backend publishes its changes off the decisions' path (its
    writes answered, its releases sent, a sync of its speeds and ejections) first, and reads
    ``pool``."""
    for backend in backends:
        if isinstance(backend, CounterState):
            await backend.published()
        await backend.refresh(pool)
        await backend.refresh(pool)


def seen(store: Store, loads: dict[str, Load]) -> dict[str, Load]:
    """What another sidecar sees of ``loads``."""
    return loads if store.shared else {}


async def test_a_reservation_counts_at_once_and_its_release_stops_it(start_backend) -> None:
    one = await start_backend()
    first = one.reserve(A, 100)
    assert first == Reservation(A, 100, 0)
    second = one.reserve(A, 50)
    assert second.ahead_tokens == 100  # its queue at send
    assert one.view().loads == {A: Load(150, 2)}
    await synced(one)
    assert one.view().loads == {A: Load(150, 2)}  # not counted twice once published
    assert one.status()["backend"] == one.name
    assert one.status()["connected"] is True
    one.release(first)
    assert one.view().loads == {A: Load(50, 1)}
    one.release(second)
    assert one.view().loads == {}
    await synced(one)
    assert one.view().loads == {}


async def test_what_one_sidecar_reserves_another_sees_after_a_refresh(store, start_backend) -> None:
    one, two = await start_backend(), await start_backend()
    held = one.reserve(A, 100)
    await synced(one, two)
    assert two.view().loads == seen(store, {A: Load(100, 1)})
    # The other's reservations are ahead of this one's, as they are in the engine's queue.
    mine = two.reserve(A, 10)
    assert mine.ahead_tokens == (100 if store.shared else 0)
    assert two.view().loads == {A: Load(110 if store.shared else 10, 2 if store.shared else 1)}
    one.release(held)
    await synced(one, two)
    assert two.view().loads == {A: Load(10, 1)}
    await synced(two, one)
    assert one.view().loads == seen(store, {A: Load(10, 1)})


async def test_speeds_and_ejections_count_at_once_and_reach_the_others(
    store, start_backend
) -> None:
    clock = Clock()
    one, two = await start_backend(clock), await start_backend(clock)
    until = clock.now + 30
    one.publish_speed(A, SPEED)
    one.publish_ejection(B, until)
    view = one.view()
    assert (view.speeds, view.ejected_until) == ({A: SPEED}, {B: until})
    await synced(one, two)
    view = one.view()
    assert (view.speeds, view.ejected_until) == ({A: SPEED}, {B: until})
    view = two.view()
    assert view.speeds == ({A: SPEED} if store.shared else {})
    assert view.ejected_until == ({B: until} if store.shared else {})


async def test_an_ejection_that_ended_is_not_read_back(start_backend) -> None:
    clock, later = Clock(), Clock()
    one, two = await start_backend(clock), await start_backend(later)
    one.publish_ejection(B, clock.now + 30)
    await synced(one)
    later.now = clock.now + 31
    await synced(two)
    assert two.view().ejected_until == {}


async def test_a_sidecar_that_closes_stops_counting_at_once(store, start_backend) -> None:
    one, two = await start_backend(), await start_backend()
    one.reserve(A, 100)
    await synced(one, two)
    assert two.view().loads == seen(store, {A: Load(100, 1)})
    await one.close()
    await synced(two)
    assert two.view().loads == {}


async def test_a_sidecar_whose_lease_ran_out_stops_counting(store, start_backend) -> None:
    """Its lease is renewed by its syncs; without one for a lease (a dead sidecar), the others
    stop counting its reservations. The counters count them until their epoch ends, by Redis's
    clock (``tests/scheduling/test_counter_state.py``), not by a sidecar's lease."""
    clock, later = Clock(), Clock()
    one, two = await start_backend(clock), await start_backend(later)
    one.reserve(A, 100)
    await synced(one, two)
    assert two.view().loads == seen(store, {A: Load(100, 1)})
    later.now = clock.now + LEASE_S + 1
    await synced(two)
    assert two.view().loads == ({} if store.leases else {A: Load(100, 1)})


async def test_a_store_that_lost_everything_is_restored_by_the_next_syncs(
    store, start_backend
) -> None:
    """Each sync sends its sidecar's reservations whole, not as changes. Counters are changes:
    what Redis lost stays lost (until the release, or the epoch's end), and says so."""
    one, two = await start_backend(), await start_backend()
    one.reserve(A, 100)
    two.reserve(B, 50)
    await synced(one, two)
    await store.lose_everything()
    await synced(one, two)
    restored = seen(store, {A: Load(100, 1)}) if store.leases else {}
    assert two.view().loads == {B: Load(50, 1), **restored}


async def test_without_its_store_a_backend_decides_on_its_own_view(start_backend) -> None:
    """The store cannot be reached: a refresh returns, never raises, and this sidecar's own
    changes still count."""
    backend = await start_backend(reachable=False)
    held = backend.reserve(A, 100)
    backend.publish_speed(A, SPEED)
    await synced(backend)
    view = backend.view()
    assert view.loads == {A: Load(100, 1)}
    assert view.speeds == {A: SPEED}
    backend.release(held)
    await synced(backend)
    assert backend.view().loads == {}
