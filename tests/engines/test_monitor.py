"""The engine monitor through real sockets: one place polls each engine, and readiness, the
scheduler and /debug/scheduler read the snapshots it publishes.

The engines here are small fake servers on port 0 (the emulator does not log its ``/health`` and
``/metrics`` polls): each counts the polls it receives and notes which sidecar code sent them —
the module where the await chain of every task then waiting in ``HttpClient.send`` enters the
sidecar (the sidecar runs in this process, on this loop).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.app import SCHEDULER
from sidecar.config import Settings
from sidecar.engines.monitor import EngineMonitor, MonitorOptions
from sidecar.engines.readiness import Readiness
from sidecar.engines.upstream import Engines
from sidecar.fleet.polls import PrefillPoll
from sidecar.fleet.snapshot import EngineSnapshot
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.ranks import DecodeRanks
from sidecar.server.runner import RunningSidecar, start_sidecar
from tests.conftest import awaiting, eventually, get_json
from tests.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
MONITOR = "sidecar/engines/monitor.py"
SEND = "sidecar/engines/upstream.py:send"
LONG_S = 3600.0
"""An interval no test outlasts: what it governs happens once, at start."""


def sidecar_pollers() -> set[str]:
    """The sidecar modules waiting on an engine's answer right now: for every task inside
    ``HttpClient.send``, the first module of the sidecar along its await chain."""
    found: set[str] = set()
    for task in asyncio.all_tasks():
        chain = [_relative(link) for link in awaiting(task)]
        if SEND in chain:
            found.add(next(link for link in chain if link.startswith("sidecar/")).split(":")[0])
    return found


def _relative(link: str) -> str:
    """``file:function`` with the file relative to the project (as is outside it)."""
    path, _, function = link.rpartition(":")
    return f"{_project_path(path)}:{function}"


@functools.cache
def _project_path(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:  # outside the project (asyncio, aiohttp)
        return path


class FakeEngine:
    """``/health`` answers ``health_status``; ``/metrics`` serves vLLM's waiting and running
    gauges (``waiting``, 1) and, when ``itl`` is set, the inter-token latency histogram's sum
    and count."""

    def __init__(self) -> None:
        self.health_status = 200
        self.waiting = 7.0
        self.itl: tuple[float, float] | None = None
        self.polls: Counter[str] = Counter()
        self.pollers: set[str] = set()
        """Every sidecar module that had a poll in flight when this engine got one."""
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _polled(self, path: str) -> None:
        self.polls[path] += 1
        self.pollers |= sidecar_pollers()

    async def _health(self, request: web.Request) -> web.Response:
        self._polled("/health")
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        self._polled("/metrics")
        text = f"vllm:num_requests_waiting {self.waiting}\nvllm:num_requests_running 1.0\n"
        if self.itl is not None:
            itl = "vllm:inter_token_latency_seconds"
            text += f"{itl}_sum {self.itl[0]}\n{itl}_count {self.itl[1]}\n"
        return web.Response(text=text, content_type="text/plain")


Start = Callable[..., Awaitable[RunningSidecar]]


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeEngine]]:
    """Started fake engines go here; closed at teardown."""
    engines: list[FakeEngine] = []
    yield engines
    for engine in engines:
        await engine.close()


async def fake(fakes: list[FakeEngine], port: int = 0) -> FakeEngine:
    engine = FakeEngine()
    await engine.start(port)
    fakes.append(engine)
    return engine


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """A sidecar in front of ``decode``; keywords override Settings."""
    started: list[RunningSidecar] = []

    async def start(decode: FakeEngine, **overrides: Any) -> RunningSidecar:
        values: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "decode_url": decode.url}
        values.update(overrides)
        sidecar = await start_sidecar(Settings(**values))
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        await sidecar.close()


async def ready_status(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> int:
    async with http.get(sidecar.url + "/ready") as response:
        await response.read()
        return response.status


async def scheduler_view(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> Any:
    return await get_json(http, sidecar.url + "/debug/scheduler")


async def test_one_monitor_polls_every_engine(
    http: aiohttp.ClientSession, fakes: list[FakeEngine], start: Start
) -> None:
    """The decode engine's /health and /metrics, a prefill endpoint's /metrics and, after it was
    ejected, its /health probe: every poll comes from the engine monitor (before it, readiness
    polled /health and the scheduler /metrics and the probes: two pollers of each engine)."""
    decode = await fake(fakes)
    prefill_port = free_port()  # nothing listens there yet: its scrapes are refused
    sidecar = await start(
        decode,
        prefill_endpoints=f"127.0.0.1:{prefill_port}",
        ready_interval_s=0.05,
        scrape_interval_s=0.05,
        eject_after_failures=1,
        eject_base_s=0.05,
    )

    async def endpoint_state() -> str:
        return str((await scheduler_view(http, sidecar))["endpoints"][0]["state"])

    async def out_of_service() -> bool:
        return await endpoint_state() in ("ejected", "probing")

    await eventually(out_of_service)
    prefill = await fake(fakes, prefill_port)  # it comes up: probed, re-admitted, scraped

    async def polled_both_ways() -> bool:
        healthy = await endpoint_state() == "healthy"
        return healthy and all(
            engine.polls["/health"] >= 1 and engine.polls["/metrics"] >= 2
            for engine in (decode, prefill)
        )

    await eventually(polled_both_ways)
    assert decode.pollers == {MONITOR}
    assert prefill.pollers == {MONITOR}


async def test_readiness_and_the_scheduler_read_one_snapshot(
    http: aiohttp.ClientSession, fakes: list[FakeEngine], start: Start
) -> None:
    """One /health poll and one scrape, at start (the intervals outlast the test): /ready, the
    scheduler and /debug/scheduler all answer from the snapshot they made, whatever the engine
    says afterwards."""
    decode = await fake(fakes)
    sidecar = await start(decode, ready_interval_s=LONG_S, scrape_interval_s=LONG_S)
    rank = sidecar.app[SCHEDULER].ranks[0]

    async def both_polled() -> bool:
        return rank.ready and rank.load is not None

    await eventually(both_polled)
    snapshot = rank.engine
    assert (decode.polls["/health"], decode.polls["/metrics"]) == (1, 1)
    decode.health_status, decode.waiting = 503, 9.0  # unseen: nobody polls it again
    assert await ready_status(http, sidecar) == 200
    [described] = (await scheduler_view(http, sidecar))["decode_ranks"]
    assert described["ready"] is True
    assert described["scraped"]["waiting"] == 7.0
    assert rank.engine is snapshot  # what the three of them read
    assert snapshot.ready
    assert snapshot.load is not None
    assert snapshot.load.waiting == 7.0
    assert sidecar.app[SCHEDULER].ranks.waiting(rank) == 7.0  # what the rank choice weighs
    assert (decode.polls["/health"], decode.polls["/metrics"]) == (1, 1)
    assert decode.pollers == {MONITOR}


@pytest.mark.parametrize("fast", ["health", "scrape"])
async def test_each_poll_keeps_its_interval(
    http: aiohttp.ClientSession, fakes: list[FakeEngine], start: Start, fast: str
) -> None:
    """SIDECAR_READY_INTERVAL_S paces the /health polls and SIDECAR_SCRAPE_INTERVAL_S the
    scrapes, one poller each: with the other interval outlasting the test, an engine gets one
    poll of that kind while the other kind comes every few milliseconds. A snapshot made by one
    kind keeps what the other kind last found."""
    decode = await fake(fakes)
    ready_s, scrape_s = (0.05, LONG_S) if fast == "health" else (LONG_S, 0.05)
    sidecar = await start(decode, ready_interval_s=ready_s, scrape_interval_s=scrape_s)

    async def agreed(ready: int, waiting: float) -> bool:
        [described] = (await scheduler_view(http, sidecar))["decode_ranks"]
        scraped = described["scraped"]
        return (
            await ready_status(http, sidecar) == ready
            and described["ready"] is (ready == 200)
            and scraped is not None
            and scraped["waiting"] == waiting
        )

    await eventually(lambda: agreed(200, 7.0))
    decode.health_status, decode.waiting = 503, 9.0
    if fast == "health":  # /ready follows the engine; the one scrape stays in the snapshot
        await eventually(lambda: agreed(503, 7.0))
        slow, many = "/metrics", "/health"
    else:  # the scrape follows the engine; the one /health poll still says ready
        await eventually(lambda: agreed(200, 9.0))
        slow, many = "/health", "/metrics"
    await eventually(lambda: _at_least(decode, many, 5))
    assert decode.polls[slow] == 1
    assert decode.pollers == {MONITOR}


async def _at_least(engine: FakeEngine, path: str, count: int) -> bool:
    return engine.polls[path] >= count


async def test_debug_scheduler_shows_each_decode_ranks_stall_budget(
    http: aiohttp.ClientSession, fakes: list[FakeEngine], start: Start
) -> None:
    """Each rank's stall budget, as decode_budget weighs it: the refill rate in force, the step
    time it follows and the credit left. 100 tokens in 2 s between two scrapes: a 20 ms step,
    half the time to spare under 0.8 x the 50 ms TPOT SLO."""
    decode = await fake(fakes)
    decode.itl = (0.0, 0.0)
    sidecar = await start(decode, ready_interval_s=LONG_S, scrape_interval_s=0.05)
    rank = sidecar.app[SCHEDULER].ranks[0]

    async def scraped(count: float) -> bool:
        return rank.load is not None and rank.load.itl_count == count

    await eventually(functools.partial(scraped, 0.0))
    [described] = (await scheduler_view(http, sidecar))["decode_ranks"]
    assert described["stall_budget"] == {"share": 1.0, "step_ms": None, "credit_s": 3.0}
    decode.itl = (2.0, 100.0)
    await eventually(functools.partial(scraped, 100.0))
    [described] = (await scheduler_view(http, sidecar))["decode_ranks"]
    assert described["stall_budget"] == {"share": 0.5, "step_ms": 20.0, "credit_s": 3.0}


class FailingPool:
    """A prefill pool whose first scrape rounds raise ``raised``, one each, as they ask for
    their polls (what a bug anywhere in a round does); ``asked`` is set once a round after them
    has asked."""

    def __init__(self, raised: list[Exception]) -> None:
        self.raised = raised
        self.rounds = 0
        self.asked = asyncio.Event()

    def prefill_polls(self) -> list[PrefillPoll]:
        self.rounds += 1
        if self.rounds <= len(self.raised):
            raise self.raised[self.rounds - 1]
        self.asked.set()
        return []

    def prefill_polled(self, poll: PrefillPoll, snapshot: EngineSnapshot) -> None:
        raise AssertionError("no prefill endpoint was polled")


async def test_a_round_that_raises_does_not_end_the_polling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three scrape rounds in a row raise: the fourth runs all the same. The first failure is
    logged with its traceback, the second (the same kind) only counted, the third (another
    kind) logged too, and the round that works again says how many failed."""
    caplog.set_level(logging.INFO, logger="sidecar.engines.monitor")
    ranks = DecodeRanks(
        ["http://127.0.0.9:1"],
        block_tokens=16,
        capacity_blocks=16,
        stale_after_s=3.0,
        rng=random.Random(1),
    )
    engines = Engines(connect_timeout_s=1.0)
    await engines.open()
    pool = FailingPool([RuntimeError("round 1 broke"), RuntimeError("again"), KeyError("other")])
    monitor = EngineMonitor(
        MonitorOptions(ready_interval_s=LONG_S, scrape_interval_s=0.001),
        engines=engines,
        ranks=ranks,
        readiness=Readiness(ranks=ranks, metrics=Metrics()),
        pool=pool,
    )

    def logged() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "sidecar.engines.monitor"]

    async def recovered() -> bool:
        return any(r.levelno == logging.WARNING for r in logged())

    monitor.start()
    try:
        await asyncio.wait_for(pool.asked.wait(), timeout=10)
        await eventually(recovered)
        await monitor.close()
    finally:
        await engines.close()

    assert [(r.levelno, r.getMessage()) for r in logged()] == [
        (logging.ERROR, "engine monitor: the scrape round failed"),
        (logging.ERROR, "engine monitor: the scrape round failed"),
        (logging.WARNING, "engine monitor: the scrape round works again after 3 failure(s)"),
    ]
    tracebacks = [r.exc_info[1] for r in logged() if r.exc_info is not None]
    assert [str(exc) for exc in tracebacks] == ["round 1 broke", "'other'"]
