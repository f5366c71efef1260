"""Readiness judged from consecutive /health polls (``sidecar.engines.readiness``), through real
sockets: the sidecar's /ready, its log and its gauge, in front of a small engine whose /health
answers what the test says — 200, another status, or nothing until the poll times out.

The sidecars here poll once at start and then every hour; each further poll is the test's own
``poll()`` (the monitor's ``poll_health``), so a test counts polls without sleeping."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from sidecar.app import MONITOR, SCHEDULER
from sidecar.config import Settings
from sidecar.engines.monitor import EngineMonitor, MonitorOptions
from sidecar.engines.readiness import Readiness
from sidecar.engines.upstream import Engines
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.ranks import DecodeRanks
from sidecar.server.runner import RunningSidecar, start_sidecar
from tests.conftest import eventually, metric

LONG_S = 3600.0
"""The poll interval: after the first poll at start, the test polls."""
HANG = 0
"""A /health answer that never comes: the poll times out (after 1 s, its least)."""


class Engine:
    """``/health`` answers ``status`` (``HANG``: nothing, until closed)."""

    def __init__(self) -> None:
        self.status = 200
        self.polls = 0
        self.polls_answered = 0
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Nothing listens any more: polls are refused."""
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        self.polls += 1
        if self.status == HANG:
            await self._closing.wait()
        self.polls_answered += 1
        return web.Response(status=self.status or 503)


Start = Callable[..., Awaitable[RunningSidecar]]


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    engine = Engine()
    await engine.start()
    yield engine
    await engine.stop()


@pytest.fixture
async def start(engine: Engine) -> AsyncIterator[Start]:
    started: list[RunningSidecar] = []

    async def start(**overrides: Any) -> RunningSidecar:
        values: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "decode_url": engine.url,
            "ready_interval_s": LONG_S,
        }
        values.update(overrides)
        sidecar = await start_sidecar(Settings(**values))
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        await sidecar.close()


async def ready(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> tuple[int, str]:
    """/ready's status, and its error message (the body when 200)."""
    async with http.get(sidecar.url + "/ready") as response:
        body = await response.read()
    if response.status == 200:
        return 200, body.decode()
    return response.status, str(orjson.loads(body)["error"]["message"])


async def started_ready(http: aiohttp.ClientSession, start: Start, **overrides: Any) -> Any:
    """A sidecar whose first polls found the engine ready: the one at start, and as many more as
    SIDECAR_READY_SUCCESS_THRESHOLD asks."""
    sidecar = await start(**overrides)
    rank = sidecar.app[SCHEDULER].ranks[0]

    async def first_polled() -> bool:
        return rank.engine.health_at is not None

    await eventually(first_polled)
    for _ in range(overrides.get("ready_success_threshold", 1) - 1):
        await poll(sidecar)
    assert (await ready(http, sidecar))[0] == 200
    return sidecar


async def poll(sidecar: RunningSidecar) -> None:
    await sidecar.app[MONITOR].poll_health()


def lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "sidecar.engines.readiness" and r.levelno >= level
    ]


async def test_one_slow_poll_does_not_flip_readiness(
    http: aiohttp.ClientSession, engine: Engine, start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """A /health that answers too late once (a busy engine under CPU load): /ready stays 200,
    the slow poll is logged with its count (before: /ready 503 until the next poll). The polls
    are the sidecar's own here, a second apart, each waiting a second (the least)."""
    caplog.set_level(logging.INFO, logger="sidecar.engines.readiness")
    sidecar = await started_ready(http, start, ready_interval_s=1.0)
    slow = (
        f"decode engine at 127.0.0.1:{engine.port}: no answer to /health within 1 s "
        "(1 of 3 failed /health polls before it counts as not ready)"
    )

    async def timed_out() -> bool:
        return slow in lines(caplog)

    engine.status = HANG
    await eventually(timed_out)
    engine.status = 200  # the next poll, a second later, is answered
    assert await ready(http, sidecar) == (200, '{"status":"ready"}')
    assert await metric(http, sidecar.url, "pd_sidecar_decode_ready") == 1
    polls = engine.polls

    async def polled_again() -> bool:
        return engine.polls > polls and engine.polls_answered >= polls + 1

    await eventually(polled_again)
    assert await ready(http, sidecar) == (200, '{"status":"ready"}')
    assert lines(caplog) == ["decode engine ready", slow]


@pytest.mark.parametrize("failures", [3, 2])
async def test_consecutive_failed_polls_turn_it_unready_saying_why(
    http: aiohttp.ClientSession,
    engine: Engine,
    start: Start,
    caplog: pytest.LogCaptureFixture,
    failures: int,
) -> None:
    """SIDECAR_READY_FAILURE_THRESHOLD polls in a row: not ready, /ready's 503 and one warning
    give the reason; a success between failures starts the count again."""
    caplog.set_level(logging.INFO, logger="sidecar.engines.readiness")
    sidecar = await started_ready(http, start, ready_failure_threshold=failures)
    reason = f"decode engine at 127.0.0.1:{engine.port}: /health answered 500"
    engine.status = 500
    for _ in range(failures - 1):
        await poll(sidecar)
    engine.status = 200
    await poll(sidecar)  # the count starts again
    engine.status = 500
    for _ in range(failures - 1):
        await poll(sidecar)
        assert (await ready(http, sidecar))[0] == 200
    await poll(sidecar)
    assert await ready(http, sidecar) == (503, reason)
    assert await metric(http, sidecar.url, "pd_sidecar_decode_ready") == 0
    assert lines(caplog, logging.WARNING) == [f"decode engine not ready: {reason}"]


@pytest.mark.parametrize("successes", [1, 2])
async def test_successes_turn_it_ready_again(
    http: aiohttp.ClientSession,
    engine: Engine,
    start: Start,
    caplog: pytest.LogCaptureFixture,
    successes: int,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.engines.readiness")
    sidecar = await started_ready(
        http, start, ready_failure_threshold=1, ready_success_threshold=successes
    )
    engine.status = 503
    await poll(sidecar)
    reason = f"decode engine at 127.0.0.1:{engine.port}: /health answered 503"
    assert await ready(http, sidecar) == (503, reason)
    engine.status = 200
    for count in range(1, successes):
        await poll(sidecar)
        assert await ready(http, sidecar) == (
            503,
            f"decode engine at 127.0.0.1:{engine.port}: {count} of {successes} /health polls "
            "in a row answered 200 so far",
        )
    await poll(sidecar)
    assert (await ready(http, sidecar))[0] == 200
    assert lines(caplog)[-1].startswith("decode engine ready again (not ready for ")


async def test_a_refused_connection_is_unready_at_once(
    http: aiohttp.ClientSession, engine: Engine, start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens (the engine's process is gone): one poll is enough."""
    caplog.set_level(logging.INFO, logger="sidecar.engines.readiness")
    sidecar = await started_ready(http, start)
    await engine.stop()
    await poll(sidecar)
    reason = f"decode engine at 127.0.0.1:{engine.port}: connection refused"
    assert await ready(http, sidecar) == (503, reason)
    assert lines(caplog, logging.WARNING) == [f"decode engine not ready: {reason}"]


async def test_a_never_ready_engine_is_logged_at_once_and_not_at_every_poll(
    http: aiohttp.ClientSession, start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """SIDECAR_DECODE_URL naming nothing that listens (before: not a line in the log)."""
    caplog.set_level(logging.INFO, logger="sidecar.engines.readiness")
    sidecar = await start(decode_url="http://127.0.0.1:1")
    reason = "decode engine at 127.0.0.1:1: connection refused"

    async def said_why() -> bool:
        return await ready(http, sidecar) == (503, reason)

    await eventually(said_why)
    for _ in range(20):
        await poll(sidecar)
    assert lines(caplog) == [f"decode engine not ready: {reason}"]


def one_rank(url: str) -> DecodeRanks:
    return DecodeRanks(
        [url], block_tokens=16, capacity_blocks=16, stale_after_s=3.0, rng=random.Random(1)
    )


def test_before_the_first_poll_the_reason_says_so() -> None:
    readiness = Readiness(ranks=one_rank("http://127.0.0.1:1"), metrics=Metrics())
    assert readiness.reason == "decode engine at 127.0.0.1:1: not polled yet"


async def test_a_never_ready_engine_is_reminded_every_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reminder's pace, on an injected clock: at the first failed poll, then once per
    interval whatever the number of polls in between."""
    caplog.set_level(logging.INFO, logger="sidecar.engines.readiness")
    now = [1000.0]
    ranks = one_rank("http://127.0.0.1:1")
    readiness = Readiness(ranks=ranks, metrics=Metrics(), clock=lambda: now[0], remind_every_s=30.0)
    engines = Engines(connect_timeout_s=1.0)
    await engines.open()
    monitor = EngineMonitor(
        MonitorOptions(ready_interval_s=LONG_S, scrape_interval_s=LONG_S),
        engines=engines,
        ranks=ranks,
        readiness=readiness,
    )
    reason = "decode engine at 127.0.0.1:1: connection refused"
    try:
        for step in (0.0, 10.0, 29.0, 30.0, 45.0, 59.0, 60.0):
            now[0] = 1000.0 + step
            await monitor.poll_health()
    finally:
        await engines.close()
    assert lines(caplog) == [
        f"decode engine not ready: {reason}",
        f"decode engine still not ready after 30 s: {reason}",
        f"decode engine still not ready after 60 s: {reason}",
    ]
