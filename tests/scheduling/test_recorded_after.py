"""A placement is recorded in the prefix indexes after its decision: in the loop's next turn, and
before the next decision reads them. Emulated engines on real ports; the scheduler as the sidecar
runs it (in a sidecar for the concurrent requests)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

import aiohttp
import pytest

from sidecar.app import SCHEDULER
from sidecar.config import Settings
from sidecar.connectors.decode import on_a_rank
from sidecar.discovery import Discovery
from sidecar.engines.monitor import EngineMonitor, MonitorOptions
from sidecar.engines.readiness import HealthPoll, Readiness, Thresholds, judge
from sidecar.engines.upstream import Engines
from sidecar.fleet.endpoints import Endpoint
from sidecar.fleet.snapshot import EngineHealth
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.prefixes import PrefixHasher
from sidecar.scheduling.prompts import PrefixIndex, leading_blocks
from sidecar.scheduling.scheduler import Scheduler, SchedulerOptions
from sidecar.scheduling.state import MemoryState, StateBackend
from sidecar.scheduling.state.redis import RedisState
from tests.conftest import StartEmulator, StartSidecar, completion, get_json
from tests.processes import RedisServer, free_port

KEY = "a-test-key-of-32-characters-long"
SYSTEM = "".join(
    f"System prompt paragraph {n:04d}: answer with care. ".ljust(100) for n in range(80)
)
"""8,000 characters: 125 local blocks of 16 tokens, 31 prefill blocks of 64."""
LOCAL_BLOCKS, PREFILL_BLOCKS = 162, 40
"""Of a prompt (the system prompt and a user part: 10,400 characters, 2,600 tokens)."""


def user(n: int) -> str:
    return "".join(f"Question {n} line {k}: what do you make of it? ".ljust(100) for k in range(24))


class FailingPublish(MemoryState):
    """A backend whose prefix publishing fails (as a broken share would)."""

    def publish_prefix(self, endpoint: str, hashes: Sequence[bytes]) -> None:
        raise RuntimeError("the share is broken")


class YieldingState(MemoryState):
    """The memory backend whose refresh gives the loop a turn, as a Redis round trip does."""

    async def refresh(self, endpoints: Collection[str] = ()) -> None:
        await asyncio.sleep(0)


def scheduler_for(
    endpoints: Sequence[Endpoint], backend: StateBackend | None = None, **settings: Any
) -> Scheduler:
    values: dict[str, Any] = {
        **({} if "decode_urls" in settings else {"decode_url": "http://127.0.0.1:1"}),
        "prefill_endpoints": tuple(endpoints),
        "scrape_interval_s": 60,
        "scheduler_seed": 0,
        "prefix_hash_key": KEY,
        **settings,
    }
    configured = Settings(**values)
    return Scheduler(
        SchedulerOptions.from_settings(configured),
        discovery=Discovery(configured.prefill_endpoints, None),
        backend=backend or MemoryState(),
        metrics=Metrics(),
    )


@pytest.fixture
async def two_engines(start_engine) -> tuple[Endpoint, Endpoint]:
    one, two = await start_engine(), await start_engine()
    return Endpoint("127.0.0.1", one.port), Endpoint("127.0.0.1", two.port)


@pytest.fixture
async def scheduler(two_engines) -> AsyncIterator[Scheduler]:
    scheduler = scheduler_for(two_engines)
    await scheduler.start()
    yield scheduler
    await scheduler.close()


def held(scheduler: Scheduler, key: str, prompt: str) -> int:
    """Blocks of ``prompt`` the prefill index holds for ``key``."""
    assert scheduler._prefixes is not None
    hashes = PrefixHasher(KEY.encode(), block_tokens=64).hashes(prompt)
    return scheduler._prefixes.matched_blocks(key, hashes)


async def test_a_placement_is_recorded_in_the_loops_next_turn(scheduler: Scheduler) -> None:
    placement, _ = await scheduler.place_request(completion(SYSTEM + user(0)), None)
    key = placement.decision.endpoint
    assert key is not None
    rank = placement.rank.rank
    # Decided on the first block alone (a prompt no index holds): the rest is not hashed yet.
    assert placement.prefix is not None
    assert placement.prefix.matched_blocks == 0
    assert len(rank.prefix) == 0
    await asyncio.sleep(0)  # the loop's next turn
    assert len(rank.prefix) == LOCAL_BLOCKS
    assert held(scheduler, key, SYSTEM + user(0)) == len(placement.prefix.hashes) == PREFILL_BLOCKS
    assert scheduler._unrecorded == []
    assert scheduler._recording is None  # nothing left scheduled


async def test_a_request_right_after_another_sees_it_without_a_loop_turn(
    scheduler: Scheduler,
) -> None:
    first, _ = await scheduler.place_request(completion(SYSTEM + user(0)), None)
    scheduler.prefill_finished(first, ok=None)  # its reservation no longer weighs
    second, _ = await scheduler.place_request(completion(SYSTEM + user(1)), None)  # no turn between
    assert second.rank.rank is first.rank.rank
    assert second.decision.uncached_tokens == 2600 - 125 * 16  # the rank holds the system prompt
    assert second.decision.endpoint == first.decision.endpoint
    assert second.decision.remote_cached_tokens == 31 * 64
    assert second.prefix is not None
    assert second.prefix.matched_blocks == 31
    # Bounded: the second decision recorded the first; only its own is left.
    assert len(scheduler._unrecorded) == 2


async def test_the_header_path_and_a_retry_record_their_endpoint(
    scheduler: Scheduler, two_engines: tuple[Endpoint, Endpoint]
) -> None:
    one, two = two_engines
    named, _ = await scheduler.place_request(completion(SYSTEM + user(0)), one)
    assert named.decision.reason == "header"
    await asyncio.sleep(0)
    assert held(scheduler, str(one), SYSTEM) == 31
    scheduler.prefill_finished(named, ok=None)
    # The prefill failed transiently: retried on the other endpoint, which holds it next.
    placement, _ = await scheduler.place_request(completion(SYSTEM + user(1)), None)
    assert placement.decision.endpoint == str(one)  # it holds the system prompt
    retried = await scheduler.retry(placement, {str(one)})
    assert retried is not None
    assert retried.endpoint == two
    assert held(scheduler, str(two), SYSTEM) == 0
    await asyncio.sleep(0)
    assert held(scheduler, str(two), SYSTEM + user(1)) == PREFILL_BLOCKS


async def test_close_records_what_is_left(two_engines: tuple[Endpoint, Endpoint]) -> None:
    scheduler = scheduler_for(two_engines)
    await scheduler.start()
    placement, _ = await scheduler.place_request(completion(SYSTEM + user(0)), None)
    await scheduler.close()
    assert len(placement.rank.rank.prefix) == LOCAL_BLOCKS
    assert scheduler._recording is None


async def test_a_failing_record_is_logged_not_raised(
    two_engines: tuple[Endpoint, Endpoint], caplog: pytest.LogCaptureFixture
) -> None:
    loop = asyncio.get_running_loop()
    raised: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: raised.append(context))
    scheduler = scheduler_for(two_engines, FailingPublish())
    await scheduler.start()
    try:
        with caplog.at_level(logging.ERROR, logger="sidecar.scheduling"):
            first, _ = await scheduler.place_request(completion(SYSTEM + user(0)), None)
            await asyncio.sleep(0)
        [record] = [r for r in caplog.records if "recording a placement" in r.getMessage()]
        assert record.exc_info is not None
        assert raised == []
        # What could be recorded was: the rank's index and the endpoint's (publishing failed).
        assert len(first.rank.rank.prefix) == LOCAL_BLOCKS
        scheduler.prefill_finished(first, ok=None)
        second, _ = await scheduler.place_request(completion(SYSTEM + user(1)), None)
        assert second.decision.endpoint == first.decision.endpoint
        assert second.decision.remote_cached_tokens == 31 * 64
    finally:
        await scheduler.close()
        loop.set_exception_handler(None)


async def test_concurrent_requests_with_one_prefix_go_where_the_first_went(
    http: aiohttp.ClientSession, start_sidecar_with: StartSidecar, start_engine
) -> None:
    one, two = await start_engine(), await start_engine()
    sidecar = await start_sidecar_with(
        prefill_endpoints=f"{one.endpoint},{two.endpoint}", prefix_hash_key=KEY
    )

    async def send(n: int) -> dict[str, Any]:
        body = completion(SYSTEM + user(n))
        async with http.post(sidecar.url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()
            request_id = response.headers["x-request-id"]
        return await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")

    records = await asyncio.gather(*(send(n) for n in range(6)))
    remote: dict[str, list[int]] = {}
    for record in records:
        if record["decision"] == "remote":
            remote.setdefault(record["prefill_endpoint"], []).append(
                record["prefill_predicted_cached_tokens"]
            )
    assert remote
    # Every decision saw the placements decided before it, recorded or not yet: only the first
    # placed on an endpoint found nothing of the system prompt predicted there.
    for predicted in remote.values():
        assert sorted(predicted) == [0] + [31 * 64] * (len(predicted) - 1)
    scheduler = sidecar.app[SCHEDULER]
    assert scheduler._unrecorded == []


def test_lazy_hashes_are_the_whole_prompts_read_as_far_as_needed() -> None:
    index = PrefixIndex(block_tokens=16, capacity_blocks=1000)
    hasher = PrefixHasher(KEY.encode(), block_tokens=64)
    for whole, lazy in (
        (index.hashes(SYSTEM), index.blocks(SYSTEM)),
        (list(hasher.hashes(SYSTEM)), hasher.blocks(SYSTEM)),
    ):
        assert len(lazy) == len(whole)
        assert leading_blocks({}, lazy) == 0
        assert len(lazy._done) == 1  # a miss at the first block reads one
        assert lazy[3] == whole[3]
        assert len(lazy._done) == 4
        assert lazy[-1] == whole[-1]
        assert list(lazy) == whole == lazy[:]
        assert lazy.all() == whole
        with pytest.raises(IndexError):
            lazy[len(whole)]
    index.insert(index.blocks(SYSTEM))
    assert index.cached_tokens(index.blocks(SYSTEM + "more")) == 125 * 16


@pytest.fixture(params=["yielding", "redis"])
async def yielding_backend(request: pytest.FixtureRequest) -> AsyncIterator[StateBackend]:
    """A backend whose refresh awaits: the memory one given a loop turn, or a real Redis (one
    sync that every waiting decision joins, all of them woken by its answer)."""
    if request.param == "yielding":
        yield YieldingState()
        return
    server = RedisServer(free_port())
    await server.start()
    try:
        yield RedisState(
            server.url, prefix=f"after-{uuid.uuid4().hex[:8]}", lease_s=30, timeout_s=1.0
        )
    finally:
        await server.stop()


@pytest.fixture
async def remote_scheduler(
    two_engines: tuple[Endpoint, Endpoint], yielding_backend: StateBackend
) -> AsyncIterator[Scheduler]:
    """Every request prefilled remotely (SGLang's decode server cannot prefill): what each
    decision predicted on the endpoint it chose is in its placement."""
    scheduler = scheduler_for(two_engines, yielding_backend, connector="sglang")
    await scheduler.start()
    yield scheduler
    await scheduler.close()


async def test_decisions_woken_by_one_refresh_see_each_others_placements(
    remote_scheduler: Scheduler, two_engines: tuple[Endpoint, Endpoint]
) -> None:
    """Two prompts sharing a system prompt, placed at once: both decisions wait for the same
    refresh and wake in one loop turn. The second sees the first's placement (it recorded
    nothing after the refresh, and saw no block of the system prompt anywhere). The other
    endpoint is busy, so both go to the same one whatever they predict there."""
    remote_scheduler.backend.reserve(str(two_engines[1]), 100_000)
    (first, _), (second, _) = await asyncio.gather(
        remote_scheduler.place_request(completion(SYSTEM + user(0)), None),
        remote_scheduler.place_request(completion(SYSTEM + user(1)), None),
    )
    assert first.decision.endpoint == str(two_engines[0])
    assert first.decision.remote_cached_tokens == 0
    assert second.prefix is not None
    assert second.prefix.matched_blocks == 31
    assert second.decision.endpoint == first.decision.endpoint
    assert second.decision.remote_cached_tokens == 31 * 64


async def test_retries_woken_by_one_refresh_see_each_others_placements(
    remote_scheduler: Scheduler,
) -> None:
    """Two prefills on one endpoint failed; their retries, decided at once, both go to the other
    endpoint: the second is predicted to find there the system prompt the first took."""
    failed = []
    for n in range(2):
        placement, _ = await remote_scheduler.place_request(completion(SYSTEM + user(n)), None)
        remote_scheduler.prefill_finished(placement, ok=None)
        failed.append(placement)
    assert failed[0].endpoint is not None
    assert failed[1].endpoint == failed[0].endpoint
    tried = {str(failed[0].endpoint)}
    one, two = await asyncio.gather(*(remote_scheduler.retry(p, tried) for p in failed))
    assert one is not None
    assert two is not None
    assert one.endpoint == two.endpoint != failed[0].endpoint
    assert one.decision.remote_cached_tokens == 0
    assert two.decision.remote_cached_tokens == 31 * 64


async def test_a_rank_that_lost_its_cache_forgets_a_prompt_placed_there_just_before(
    start_engine: StartEmulator,
    two_engines: tuple[Endpoint, Endpoint],
) -> None:
    """A placement on rank 0, then — in the same loop turn, before its recording — the engine
    monitor's /health poll finds rank 0's engine gone (refused) and forgets its index. The
    request's decode leg then goes to rank 1, which holds the prompt next; rank 0 must not
    remember a prompt it never got. (The monitor's publication is made here in that turn, as
    ``_poll_health`` makes it: no socket can be made to deliver the poll's answer there.)"""
    decode = [await start_engine(), await start_engine()]
    scheduler = scheduler_for(two_engines, decode_urls=tuple(e.url for e in decode))
    await scheduler.start()
    ranks = scheduler.ranks
    engines = Engines(connect_timeout_s=1.0)
    await engines.open()
    thresholds = Thresholds(1)
    monitor = EngineMonitor(
        MonitorOptions(ready_interval_s=0.2, scrape_interval_s=1.0, thresholds=thresholds),
        engines=engines,
        ranks=ranks,
        readiness=Readiness(ranks=ranks, metrics=Metrics()),
    )
    busy = None
    try:
        assert await monitor.poll_health()
        assert all(rank.ready for rank in ranks)
        busy = ranks.claim_any(pinned=1)  # rank 1 busier: the choice goes to rank 0
        await decode[0].close()
        prompt = SYSTEM + user(0)
        placement, _ = await scheduler.place_request(
            completion(prompt), None, local_reason="batched_prompt"
        )
        lost = ranks[0]
        assert placement.rank.rank is lost
        poll = HealthPoll(
            EngineHealth.LOST, time.monotonic(), "decode engine", "connection refused", True
        )
        ranks.publish(lost, judge(lost.engine, poll, thresholds))
        assert not lost.ready
        answer, _ = await on_a_rank(
            ranks,
            placement.rank,
            engines,
            Metrics(),
            "POST",
            "/v1/completions",
            headers={},
            data=b'{"model": "m", "prompt": "hi", "max_tokens": 1}',
            by=asyncio.get_running_loop().time() + 5,
            limit="5s",
        )
        answer.close()
        assert placement.rank.rank is ranks[1]
        placement.rank.end()
        hashes = lost.prefix.hashes(prompt)
        assert lost.prefix.cached_tokens(hashes) == 0
        assert ranks[1].prefix.cached_tokens(hashes) == LOCAL_BLOCKS * 16
    finally:
        if busy is not None:
            busy.end()
        await scheduler.close()
        await engines.close()
