"""A prefill server frozen under load, then thawed and left idle, regains its share.

Real processes: the sidecar (``python -m sidecar``) and two equal emulated prefill servers, one
of which is frozen whole with SIGSTOP while four clients keep the sidecar busy. Its prefills
hung by the freeze answer after the thaw, seconds late: the fit of its speed carries the freeze.
Then it is left idle, its scrapes showing nothing waiting and nothing running, for as many idle
half-lives as 60 s are at the default (twelve); the next 40 requests at concurrency 4 must give
it its share back (at least 20 %), by the ageing of that evidence toward its best measured
speed: re-tests are off.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from sidecar.defaults import SPEED_IDLE_HALF_LIFE_S
from tests.conftest import completion, eventually, get_json
from tests.processes import EmulatorProcess, SidecarProcess, sidecar_process

LONG = "A retrieved passage about prefill and decode disaggregation. " * 40  # ~600 tokens
PREFILL_S_PER_TOKEN = 5e-5
"""The emulated servers' speed: 20,000 tokens/s (30 ms a prompt), twice the sidecar's prior, so
that ageing toward the prior alone would leave the thawed server slower than the other."""
FREEZE_S = 5.0
IDLE_HALF_LIFE_S = 0.125
IDLE_S = 60.0 / SPEED_IDLE_HALF_LIFE_S * IDLE_HALF_LIFE_S
"""60 s idle at the default idle half-life, in the test's: the same ageing, in 1.5 s."""
REQUESTS, CONCURRENCY = 40, 4
MIN_SHARE = 0.2


@dataclass(frozen=True, slots=True)
class Outcome:
    share: float
    """The thawed server's share of the remote prefills after the idle spell."""
    reasons: dict[str, int]
    """Those requests' decision reasons (``scheduled``, ``retest``, ...)."""
    frozen_in_freeze: int
    """Prefills the frozen server was sent while frozen (they answered after the thaw)."""
    predicted_s: tuple[float, float]
    """Seconds each server's speed estimate predicted for a prompt of ~600 tokens after the
    idle spell (``/debug/scheduler``), the thawed one's first."""


async def _send(
    http: aiohttp.ClientSession, sidecar: SidecarProcess, prompt: str, to: str | None = None
) -> Any:
    """One request (``to``: the prefill server named by the gateway's header); its record."""
    headers = {} if to is None else {"x-prefiller-host-port": to}
    async with http.post(
        sidecar.url + "/v1/completions", json=completion(prompt), headers=headers
    ) as response:
        assert response.status == 200, await response.text()
        await response.read()
        request_id = response.headers["x-request-id"]
    return await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")


async def _endpoint(http: aiohttp.ClientSession, sidecar: SidecarProcess, key: str) -> Any:
    snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
    return next(e for e in snapshot["endpoints"] if e["endpoint"] == key)


@asynccontextmanager
async def _servers() -> AsyncIterator[tuple[EmulatorProcess, EmulatorProcess]]:
    """Two equal prefill servers, each computing one prompt at a time."""
    flags = ("--prefill-s-per-token", str(PREFILL_S_PER_TOKEN), "--max-num-seqs", "1")
    servers = (EmulatorProcess(*flags), EmulatorProcess(*flags))
    async with AsyncExitStack() as stack:
        for server in servers:
            stack.push_async_callback(server.stop)
        await asyncio.gather(*(server.start() for server in servers))
        yield servers


async def freeze_idle_then_measure(
    http: aiohttp.ClientSession,
    decode_url: str,
    settings: Mapping[str, str],
    idle_s: float,
) -> Outcome:
    """The scenario: warm up, freeze one server for ``FREEZE_S`` under load at concurrency 4,
    thaw it, wait until its scrapes have shown it idle for ``idle_s``, then send ``REQUESTS``
    at ``CONCURRENCY`` and count where they prefilled."""
    async with (
        _servers() as (frozen, other),
        sidecar_process(
            {
                "decode_url": decode_url,
                "prefill_endpoints": f"{frozen.endpoint},{other.endpoint}",
                # Remote whatever the local engine's speed: the pool is compared.
                "disagg_ttft_ratio": "1000",
                "scheduler_seed": "1",
                **settings,
            }
        ) as sidecar,
    ):
        for i in range(2 * CONCURRENCY):  # both servers measured alike
            await _send(http, sidecar, f"warm {i} {LONG}", (frozen, other)[i % 2].endpoint)
        assert frozen.process is not None
        stop = asyncio.Event()

        async def client(worker: int) -> list[Any]:
            records, n = [], 0
            while not stop.is_set():
                records.append(await _send(http, sidecar, f"load {worker} {n} {LONG}"))
                n += 1
            return records

        load = [asyncio.create_task(client(worker)) for worker in range(CONCURRENCY)]
        await asyncio.sleep(0.3)  # under load before it freezes
        frozen.process.send_signal(signal.SIGSTOP)
        frozen_at = asyncio.get_running_loop().time()
        # One prefill is held for certain, whatever the policy does meanwhile: named by the
        # gateway's header, sent once the server is stopped (the kernel accepts the connection).
        held = asyncio.create_task(_send(http, sidecar, f"held {LONG}", frozen.endpoint))
        try:
            await asyncio.sleep(FREEZE_S)  # the freeze itself
        finally:
            frozen.process.send_signal(signal.SIGCONT)
        stop.set()
        during = [record for records in await asyncio.gather(*load) for record in records]
        during.append(await held)
        frozen_in_freeze = sum(
            r["prefill_endpoint"] == frozen.endpoint and r["durations_ms"]["prefill"] > 1000
            for r in during
        )
        assert frozen_in_freeze >= 1, "no prefill was held by the freeze"
        assert asyncio.get_running_loop().time() - frozen_at >= FREEZE_S

        # Idle: nothing sent, until its scrapes have said so for ``idle_s``.
        loop = asyncio.get_running_loop()
        idle_from: list[float] = []

        async def idle_long_enough() -> bool:
            scraped = (await _endpoint(http, sidecar, frozen.endpoint))["scraped"]
            idle = scraped is not None and scraped["waiting"] == 0 and scraped["running"] == 0
            if not idle:
                idle_from.clear()
            elif not idle_from:
                idle_from.append(loop.time())
            return bool(idle_from) and loop.time() - idle_from[0] >= idle_s

        await eventually(idle_long_enough, within=idle_s + 10.0)
        await _send(http, sidecar, f"short {'x' * 40}")  # a local prefill: no ageing, a decision
        speeds = [(await _endpoint(http, sidecar, s.endpoint))["speed"] for s in (frozen, other)]
        thawed_s, other_s = (
            round(speed["overhead_s"] + 600 * speed["s_per_token"], 4) for speed in speeds
        )

        queue = asyncio.Queue[int]()
        for i in range(REQUESTS):
            queue.put_nowait(i)
        after: list[Any] = []

        async def measured() -> None:
            while not queue.empty():
                after.append(await _send(http, sidecar, f"after {queue.get_nowait()} {LONG}"))

        await asyncio.gather(*(measured() for _ in range(CONCURRENCY)))
    assert all(r["decision"] == "remote" for r in after)
    reasons: dict[str, int] = {}
    for record in after:
        reasons[record["reason"]] = reasons.get(record["reason"], 0) + 1
    share = sum(r["prefill_endpoint"] == frozen.endpoint for r in after) / len(after)
    return Outcome(share, reasons, frozen_in_freeze, (thawed_s, other_s))


@pytest.mark.system
@pytest.mark.timeout(60)  # three processes to start on a busy machine, then about 10 s
async def test_a_thawed_server_left_idle_regains_its_share(http, decode) -> None:
    settings = {
        "scrape_interval_s": "0.05",
        "speed_idle_half_life_s": str(IDLE_HALF_LIFE_S),
        "scheduler_retest_s": "0",  # the ageing alone
    }
    outcome = await freeze_idle_then_measure(http, decode.url, settings, IDLE_S)
    print(outcome)  # shown with pytest -rP: the share of each run
    assert outcome.share >= MIN_SHARE, outcome
