"""A decode engine that does not accept a connection in time: nothing was sent, so the sidecar
tries once more before it answers 503.

The engine sits behind a gate (``devkit.gate``) that can hold its listener shut: a connection
then hangs in ``connect`` (the kernel drops its SYN) until ``SIDECAR_CONNECT_TIMEOUT_S``, as
toward an engine whose listen queue is full or whose SYN was lost. Once on CI, under load, the
decode legs and prefill calls of one moment all timed out connecting; the prefills were retried,
the decode legs answered 503.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from devkit.gate import Gate
from sidecar.connectors.background import BackgroundWork
from sidecar.emulator import RunningEmulator
from sidecar.engines.monitor import EngineMonitor, MonitorOptions
from sidecar.engines.readiness import Readiness, Thresholds
from sidecar.engines.upstream import Engines
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.ranks import DecodeRanks
from tests.conftest import (
    StartSidecar,
    completion,
    engine_requests,
    eventually,
    get_json,
    metric,
    staged_blocks,
)

pytestmark = pytest.mark.system  # connects that time out: seconds of wall time

PROMPT = "A passage about prefill and decode disaggregation. " * 40  # ~500 tokens
CONNECT_TIMEOUT_S = 3.5
"""The second try's SYN, dropped while the gate is held, is sent again after 1 s, then (Linux
6.x) every second: opened within about 2.5 s of the second try, the gate answers one of them in
time, however slowly a loaded machine notices that try."""
ATTEMPTS = 'pd_sidecar_decode_rank_requests_total{rank="0"}'


@pytest.fixture
async def gate(decode: RunningEmulator) -> AsyncIterator[Gate]:
    async with Gate("127.0.0.1", decode.port) as running:
        yield running


async def _ready(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(url + "/ready") as response:
        return response.status == 200


@pytest.mark.timeout(30)
async def test_a_decode_leg_whose_connection_timed_out_is_sent_once_more(
    http, gate: Gate, start_sidecar_with: StartSidecar, prefill: RunningEmulator
) -> None:
    """The first connection times out, the second is taken: the client gets its answer, and the
    KV the prefill staged was pulled. The rank keeps what its prefix index holds: an engine slow
    to accept has not lost its cache (one that refuses has)."""
    # Polled once, while the gate is open: a poll that hung later would make the engine unready.
    sidecar = await start_sidecar_with(
        decode_url=gate.url, ready_interval_s=3600, connect_timeout_s=CONNECT_TIMEOUT_S
    )
    await eventually(lambda: _ready(http, sidecar.url))
    await gate.hold()

    async def post() -> tuple[int, bytes]:
        headers = {"x-prefiller-host-port": prefill.endpoint, "x-request-id": "held-once"}
        body = completion(PROMPT, max_tokens=3)
        async with http.post(sidecar.url + "/v1/completions", json=body, headers=headers) as r:
            return r.status, await r.read()

    answer = asyncio.create_task(post())

    async def second_attempt() -> bool:
        return await metric(http, sidecar.url, ATTEMPTS) == 2

    await eventually(second_attempt, within=10)
    await gate.open()  # the second attempt's SYN, sent again, is taken
    status, raw = await answer
    assert status == 200, raw
    assert orjson.loads(raw)["choices"][0]["text"]
    record = await get_json(http, f"{sidecar.url}/debug/requests/held-once")
    assert record["state"] == "completed"
    assert record["decision"] == "remote"
    assert await staged_blocks(http, prefill) == 0
    assert await metric(http, sidecar.url, ATTEMPTS) == 2
    [rank] = (await get_json(http, sidecar.url + "/debug/scheduler"))["decode_ranks"]
    assert rank["prefix_index_blocks"] > 0


@pytest.mark.timeout(30)
async def test_a_decode_engine_that_never_accepts_is_a_503_after_the_second_try(
    http, gate: Gate, start_sidecar_with: StartSidecar
) -> None:
    sidecar = await start_sidecar_with(
        decode_url=gate.url, ready_interval_s=3600, connect_timeout_s=0.3
    )
    await eventually(lambda: _ready(http, sidecar.url))
    await gate.hold()
    headers = {"x-request-id": "never-accepted"}
    async with http.post(
        sidecar.url + "/v1/completions", json=completion(max_tokens=3), headers=headers
    ) as response:
        status, answer = response.status, await response.json()
    assert status == 503
    assert answer["error"]["message"] == (
        f"the decode engine at 127.0.0.1:{gate.port} is unreachable: "
        "no connection within SIDECAR_CONNECT_TIMEOUT_S"
    )
    assert await metric(http, sidecar.url, ATTEMPTS) == 2  # once more, not again and again


@pytest.mark.timeout(30)
async def test_a_release_whose_connection_timed_out_is_sent_once_more(
    http, gate: Gate, decode: RunningEmulator, prefill: RunningEmulator, caplog
) -> None:
    """A KV release goes the same way: its first connection times out, the second is taken, and
    the prefill engine's blocks are freed at once rather than at their expiry."""
    caplog.set_level(logging.INFO, logger="sidecar.connectors.background")
    engines = Engines(connect_timeout_s=CONNECT_TIMEOUT_S)
    await engines.open()
    metrics = Metrics()
    background = BackgroundWork(engines=engines, metrics=metrics, enabled=True, timeout_s=10)
    try:
        async with http.post(
            prefill.url + "/v1/completions",
            json=completion(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        ) as response:
            params = (await response.json())["kv_transfer_params"]
        assert await staged_blocks(http, prefill) > 0
        await gate.hold()
        body = completion(max_tokens=1, kv_transfer_params=params)
        headers = {"x-request-id": "held-release"}
        url = gate.url + "/v1/completions"
        background.release("held", [url], headers, orjson.dumps(body))

        async def second_attempt() -> bool:
            return "trying it once more" in caplog.text

        await eventually(second_attempt, within=10)
        await gate.open()
        await background.close(10)
        assert 'pd_sidecar_kv_releases_total{outcome="sent"} 1.0' in metrics.render().decode()
        assert await staged_blocks(http, prefill) == 0
        assert "held-release" in [
            r["headers"].get("x-request-id") for r in await engine_requests(http, decode)
        ]
    finally:
        await engines.close()


@pytest.mark.timeout(30)
async def test_a_health_poll_whose_connection_timed_out_keeps_the_ranks_history(
    gate: Gate,
) -> None:
    """A /health poll that could not connect in time makes the rank unready, as one that got no
    answer does, and keeps its prefix index: a host slow to accept has not lost its cache."""
    decode = DecodeRanks(
        [gate.url],
        block_tokens=16,
        capacity_blocks=1024,
        stale_after_s=3.0,
        rng=random.Random(1),
    )
    engines = Engines(connect_timeout_s=0.3)
    await engines.open()
    monitor = EngineMonitor(
        MonitorOptions(ready_interval_s=1.0, scrape_interval_s=1.0, thresholds=Thresholds(1)),
        engines=engines,
        ranks=decode,
        readiness=Readiness(ranks=decode, metrics=Metrics()),
    )
    rank = decode[0]
    try:
        assert await monitor.poll_health()
        decode.claim(PROMPT, 500)[0].end()
        remembered = len(rank.prefix)
        assert remembered > 0
        await engines.polls.close()  # the next poll opens a connection: held
        await engines.polls.open()
        await gate.hold()
        assert not await monitor.poll_health()
        assert "no connection within SIDECAR_CONNECT_TIMEOUT_S" in (decode.down() or "")
        assert len(rank.prefix) == remembered
    finally:
        await engines.close()


@pytest.mark.timeout(30)
async def test_a_release_tried_once_more_keeps_its_time_budget(gate: Gate, caplog) -> None:
    """Both tries of a release share its one budget (``SIDECAR_DECODE_FIRST_BYTE_TIMEOUT_S``):
    the second gets what the first left, not a budget of its own."""
    engines = Engines(connect_timeout_s=0.4)
    await engines.open()
    metrics = Metrics()
    background = BackgroundWork(engines=engines, metrics=metrics, enabled=True, timeout_s=0.5)
    try:
        await gate.hold()
        body = completion(max_tokens=1, kv_transfer_params={"remote_block_ids": [1]})
        background.release("late", [gate.url + "/v1/completions"], {}, orjson.dumps(body))
        await background.close(10)
        assert 'pd_sidecar_kv_releases_total{outcome="failed"} 1.0' in metrics.render().decode()
        [failure] = [r.getMessage() for r in caplog.records if "releasing" in r.getMessage()]
        # The second try ran out of the budget, 0.1 s, before its own connect timeout, 0.4 s.
        assert "no connection within" not in failure, failure
        assert "timed out" in failure, failure
    finally:
        await engines.close()
