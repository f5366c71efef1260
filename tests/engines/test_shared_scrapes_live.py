"""Shared prefill scrapes on real processes: eight sidecars, four prefill emulators, a real
redis-server. Each engine is scraped at most three times a second, however many sidecars there
are, and every sidecar still sees every engine's load."""

from __future__ import annotations

import asyncio
import functools
import time
from contextlib import AsyncExitStack

import aiohttp
import pytest

from sidecar.emulator import RunningEmulator
from tests.conftest import StartEmulator, eventually, get_json
from tests.processes import RedisServer, sidecar_process

SIDECARS = 8
ENGINES = 4
INTERVAL_S = 1.0
"""The default scrape interval: two owners per engine (the default) scrape it twice a second."""
WINDOW_S = 5.0
"""The measured window: five scrape rounds of every sidecar."""
LEASE_S = 10.0
"""The default lease (``SIDECAR_STATE_LEASE_S``): how long a dead sidecar stays a member."""


async def _polls(http: aiohttp.ClientSession, engines: list[RunningEmulator]) -> list[int]:
    return [int((await get_json(http, e.url + "/emulator/polls"))["metrics"]) for e in engines]


async def _fresh(http: aiohttp.ClientSession, url: str) -> int:
    """The engines whose load the sidecar knows, no older than the planner believes."""
    snapshot = await get_json(http, url + "/debug/scheduler")
    return sum(
        1
        for e in snapshot["endpoints"]
        if e["scraped"] is not None and e["scraped"]["age_s"] <= 3 * INTERVAL_S
    )


async def _settled(http: aiohttp.ClientSession, url: str, members: int = SIDECARS) -> bool:
    """The sidecar knows every sharing sidecar and every engine's load, fresh."""
    snapshot = await get_json(http, url + "/debug/scheduler")
    listed = snapshot["state_backend"]["shared_scrapes"]["members"]
    return listed == members and await _fresh(http, url) == ENGINES


async def _fallbacks(http: aiohttp.ClientSession, url: str) -> int:
    snapshot = await get_json(http, url + "/debug/scheduler")
    return int(snapshot["state_backend"]["shared_scrapes"]["scrapes"]["backup"])


@pytest.mark.system
@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "each-its-own"])
async def test_each_prefill_engine_is_scraped_a_few_times_a_second_whatever_the_fleet(
    http: aiohttp.ClientSession,
    redis_server: RedisServer,
    start_engine: StartEmulator,
    decode: RunningEmulator,
    shared: bool,
) -> None:
    engines = [await start_engine() for _ in range(ENGINES)]
    settings = {
        "decode_url": decode.url,
        "prefill_endpoints": ",".join(e.endpoint for e in engines),
        "state_backend": "redis",
        "redis_url": redis_server.url,
        "redis_key_prefix": "fanout",
        "scrape_interval_s": str(INTERVAL_S),
        "shared_scrapes": "true" if shared else "false",
    }
    async with AsyncExitStack() as stack:
        sidecars = [
            await stack.enter_async_context(sidecar_process(settings)) for _ in range(SIDECARS)
        ]
        if shared:
            for sidecar in sidecars:
                await eventually(functools.partial(_settled, http, sidecar.url), within=30)
        before, start = await _polls(http, engines), time.monotonic()
        await asyncio.sleep(WINDOW_S)  # the measurement: real processes scraping on their own
        after, elapsed = await _polls(http, engines), time.monotonic() - start
        rates = [(b - a) / elapsed for a, b in zip(before, after, strict=True)]
        print(f"/metrics scrapes per engine per second, {SIDECARS} sidecars: {rates}")
        if shared:
            assert max(rates) <= 3.0, rates
            for sidecar in sidecars:  # every sidecar still sees every engine's load
                assert await _settled(http, sidecar.url)
            # A sidecar dies (SIGKILL: its lease runs on for 10 s): the engines it scraped are
            # scraped by their other owner meanwhile, and by a new one after; no survivor's
            # view of any engine goes stale at any time.
            sidecars[0].kill()
            survivors = sidecars[1:]
            before, start = await _polls(http, engines), time.monotonic()
            while time.monotonic() - start < LEASE_S + 2 * INTERVAL_S:
                for sidecar in survivors:
                    assert await _fresh(http, sidecar.url) == ENGINES
                await asyncio.sleep(INTERVAL_S / 2)
            after, elapsed = await _polls(http, engines), time.monotonic() - start
            rates = [(b - a) / elapsed for a, b in zip(before, after, strict=True)]
            print(f"after one sidecar's death, {SIDECARS - 1} left: {rates}")
            assert max(rates) <= 3.0, rates
        else:
            # Each sidecar scrapes each engine every interval: what sharing saves.
            assert min(rates) >= 0.8 * SIDECARS / INTERVAL_S, rates


@pytest.mark.system
@pytest.mark.timeout(120)
async def test_in_a_rolling_upgrade_the_sidecars_that_do_not_share_own_nothing(
    http: aiohttp.ClientSession,
    redis_server: RedisServer,
    start_engine: StartEmulator,
    decode: RunningEmulator,
) -> None:
    """Four sidecars share scrapes and two do not (the setting off, as in a version from before
    it), on one pool: only the four are members, so every engine has two sharing owners, no
    backup has to stand in, and each engine answers the owners' two scrapes a second and the
    two others' own."""
    engines = [await start_engine() for _ in range(ENGINES)]
    settings = {
        "decode_url": decode.url,
        "prefill_endpoints": ",".join(e.endpoint for e in engines),
        "state_backend": "redis",
        "redis_url": redis_server.url,
        "redis_key_prefix": "upgrade",
        "scrape_interval_s": str(INTERVAL_S),
    }
    async with AsyncExitStack() as stack:
        sharing = [
            await stack.enter_async_context(sidecar_process(settings, shared_scrapes="true"))
            for _ in range(4)
        ]
        for _ in range(2):
            await stack.enter_async_context(sidecar_process(settings))
        for sidecar in sharing:
            await eventually(functools.partial(_settled, http, sidecar.url, 4), within=30)
        fallbacks = [await _fallbacks(http, sidecar.url) for sidecar in sharing]
        before, start = await _polls(http, engines), time.monotonic()
        await asyncio.sleep(WINDOW_S)  # the measurement: real processes scraping on their own
        after, elapsed = await _polls(http, engines), time.monotonic() - start
        rates = [(b - a) / elapsed for a, b in zip(before, after, strict=True)]
        print(f"/metrics scrapes per engine per second, 4 sharing and 2 not: {rates}")
        assert max(rates) <= 2 + 2 + 1, rates
        assert [await _fallbacks(http, sidecar.url) for sidecar in sharing] == fallbacks
        for sidecar in sharing:
            assert await _fresh(http, sidecar.url) == ENGINES
