"""Background work that outlives its request: a KV release never loses its place to prefills
adopted for clients who left, and releases beyond the ones sent at once wait, counted."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any

import aiohttp
import orjson
import pytest

from sidecar.connectors.background import RELEASES_AT_ONCE, BackgroundWork
from sidecar.emulator import RunningEmulator
from sidecar.engines.upstream import Engines
from sidecar.observability.metrics import Metrics
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    completion,
    eventually,
    get_json,
    inject,
    metric,
    staged_blocks,
)

ABANDONED = 1024
"""Prefills adopted at once at most (sidecar.connectors.background.MAX_ADOPTED; before it, the one
bound on all background work, releases included)."""
BATCH = 64
"""Clients that connect at once: well under a listener's backlog (128), so that no connection
waits for a SYN to be sent again."""


async def _held(http: aiohttp.ClientSession, engine: RunningEmulator) -> int:
    return int((await get_json(http, engine.url + "/emulator/faults"))["held"])


@pytest.mark.timeout(300)
async def test_adopted_prefills_cannot_crowd_out_another_clients_release(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    start_sidecar_with: StartSidecar,
    decode: RunningEmulator,
) -> None:
    """A client abandons 1,024 requests to a prefill that sends its status line and then holds
    its body (a drip): each call is finished in the background to free its KV, filling the
    adopted prefills' place. Another client's decode is refused: its KV release still goes out,
    and nothing stays staged."""
    dripping, healthy = await start_engine(), await start_engine()
    # Nothing here may time out while the drip lasts, on a machine as slow as it may be.
    sidecar = await start_sidecar_with(prefill_timeout_s=600, connect_timeout_s=10)
    await inject(http, dripping, kind="stall", role="prefill", after_chunks=1, count=ABANDONED)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as clients:

        async def abandoned(index: int) -> None:
            async with clients.post(
                sidecar.url + "/v1/completions",
                json=completion(f"abandoned {index}", max_tokens=2),
                headers={"x-prefiller-host-port": dripping.endpoint},
            ) as response:
                await response.read()

        leaving: list[asyncio.Task[None]] = []
        for start in range(0, ABANDONED, BATCH):
            leaving += [asyncio.create_task(abandoned(i)) for i in range(start, start + BATCH)]
            sent = start + BATCH
            await eventually(functools.partial(_all_held, http, dripping, sent), within=60)
        for client in leaving:
            client.cancel()
        for client in leaving:
            with contextlib.suppress(asyncio.CancelledError):
                await client
    finishing = 'pd_sidecar_prefill_disconnects_total{action="finish"}'
    await eventually(lambda: _metric_is(http, sidecar.url, finishing, ABANDONED), within=60)

    # Another client: prefilled on a healthy engine, its decode refused, its KV to release.
    await inject(http, decode, kind="status", status=500, role="decode")
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion("another client's request", max_tokens=2),
        headers={"x-prefiller-host-port": healthy.endpoint},
    ) as response:
        assert response.status == 500
        await response.read()
    released = 'pd_sidecar_kv_releases_total{outcome="sent"}'
    await eventually(lambda: _metric_is(http, sidecar.url, released, 1))
    skipped = 'pd_sidecar_kv_releases_total{outcome="skipped"}'
    assert await metric(http, sidecar.url, skipped) == 0
    assert await staged_blocks(http, healthy) == 0

    # The drip ends: every abandoned prefill's KV is released too.
    async with http.post(dripping.url + "/emulator/release") as response:
        assert response.status == 200
    await eventually(lambda: _metric_is(http, sidecar.url, released, ABANDONED + 1), within=120)
    assert await metric(http, sidecar.url, skipped) == 0
    assert await staged_blocks(http, dripping) == 0


async def _all_held(http: aiohttp.ClientSession, engine: RunningEmulator, count: int) -> bool:
    return await _held(http, engine) == count


async def _metric_is(http: aiohttp.ClientSession, url: str, sample: str, value: float) -> bool:
    return await metric(http, url, sample) == value


@pytest.mark.timeout(120)
async def test_releases_beyond_those_sent_at_once_wait_counted(
    http: aiohttp.ClientSession, start_engine: StartEmulator
) -> None:
    """RELEASES_AT_ONCE releases held by a stuck decode engine: the next one waits for a place
    (counted), and goes out once one is free."""
    decode = await start_engine()
    metrics = Metrics()
    # 256 connections opened at once pass the listener's backlog (128): a few SYNs are retried
    # after a second.
    engines = Engines(connect_timeout_s=10)
    await engines.open()
    background = BackgroundWork(engines=engines, metrics=metrics, enabled=True, timeout_s=30)
    try:
        await inject(http, decode, kind="hang", count=RELEASES_AT_ONCE)
        body = orjson.dumps(completion("a release", max_tokens=1))
        urls = [decode.url + "/v1/completions"]
        for index in range(RELEASES_AT_ONCE):
            background.release(f"r{index}", urls, {"x-request-id": f"r{index}-release"}, body)
        await eventually(lambda: _all_held(http, decode, RELEASES_AT_ONCE), within=30)
        assert _sample(metrics, "pd_sidecar_kv_release_waits_total") == 0
        background.release("last", urls, {"x-request-id": "last-release"}, body)
        await asyncio.sleep(0)  # the release's task starts and finds every place taken
        assert _sample(metrics, "pd_sidecar_kv_release_waits_total") == 1
        async with http.post(decode.url + "/emulator/release") as response:
            assert response.status == 200
        await background.close(30)
        sent = 'pd_sidecar_kv_releases_total{outcome="sent"}'
        assert _sample(metrics, sent) == RELEASES_AT_ONCE + 1
    finally:
        await engines.close()


def _sample(metrics: Metrics, sample: str) -> float:
    lines: Any = metrics.render().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(sample + " "))
