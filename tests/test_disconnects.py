"""Clients that leave at random moments: nothing staged, nothing in flight, nothing left running."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from sidecar.tracking import REQUEST_TASK_PREFIX
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    completion,
    eventually,
    get_json,
    metric,
    tasks_in_request_code,
)

LONG = "Passage retrieved for the question at hand. " * 50  # ~560 tokens: scheduled remote
VERY_LONG = LONG * 40
"""~22,000 tokens, about 1.1 s of prefill here: far from done when its client leaves, so the
default policy (auto) aborts it, where it lets the short ones finish."""


@pytest.mark.timeout(120)
async def test_random_disconnects_leak_nothing(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    latency = {"prefill_s_per_token": 0.00005, "kv_transfer_s_per_block": 0.0005}
    prefills = [await start_engine(**latency) for _ in range(2)]
    decode = await start_engine(decode_s_per_token=0.004, **latency)
    sidecar = await start_sidecar_with(
        decode_url=decode.url, prefill_endpoints=",".join(p.endpoint for p in prefills)
    )
    rng = random.Random(20261130)
    outcomes = {"completed": 0, "cancelled": 0}

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        prompt = VERY_LONG if rng.random() < 0.2 else LONG
        body = completion(f"{index} {prompt}", stream=rng.random() < 0.6, max_tokens=20)
        headers = {}
        if rng.random() < 0.5:  # half header-driven, half scheduled by the sidecar
            headers["x-prefiller-host-port"] = rng.choice(prefills).endpoint
        async with session.post(
            sidecar.url + "/v1/completions", json=body, headers=headers
        ) as response:
            await response.read()
        outcomes["completed"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for wave in range(6):  # 6 x 50 = 300 requests, 50 at a time
            tasks = [asyncio.create_task(client(wave * 50 + i, session)) for i in range(50)]
            # Each client leaves at its own random moment: before, during or after its prefill,
            # while its decode streams, or never.
            loop = asyncio.get_running_loop()
            for task in tasks:
                if rng.random() < 0.7:
                    loop.call_later(rng.uniform(0, 0.15), task.cancel)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            outcomes["cancelled"] += sum(isinstance(r, asyncio.CancelledError) for r in results)
            assert not [r for r in results if isinstance(r, Exception)]

    assert outcomes["cancelled"] > 100
    assert outcomes["completed"] > 50

    state: dict[str, object] = {}

    async def settled() -> bool:
        debug = await get_json(http, sidecar.url + "/debug/requests?limit=1")
        staged = [(await get_json(http, p.url + "/emulator/kv"))["staged_blocks"] for p in prefills]
        running = [
            await metric(http, e.url, "vllm:num_requests_running") for e in [*prefills, decode]
        ]
        stuck = tasks_in_request_code()
        state.update(inflight=len(debug["inflight"]), staged=staged, running=running, stuck=stuck)
        return not debug["inflight"] and staged == [0, 0] and running == [0, 0, 0] and not stuck

    try:
        await eventually(settled, within=20)
    except TimeoutError:
        pytest.fail(f"did not settle: {state}")
    assert await metric(http, sidecar.url, "pd_sidecar_inflight_requests") == 0
    # Clients left during their prefill, and auto took both ways.
    disconnects = "pd_sidecar_prefill_disconnects_total"
    for action in ("abort", "finish"):
        assert await metric(http, sidecar.url, f'{disconnects}{{action="{action}"}}') > 0, action
    cancelled = await get_json(http, sidecar.url + "/debug/requests?state=cancelled&limit=1000")
    assert len(cancelled["recent"]) > 50


async def test_a_task_named_for_a_request_counts_as_left_running() -> None:
    """The naming contract with the sidecar: a task named for a request is that request's
    work, wherever its code lives."""
    gate = asyncio.Event()
    name = f"{REQUEST_TASK_PREFIX}req-1:prefill"
    task = asyncio.create_task(gate.wait(), name=name)
    assert name in tasks_in_request_code()
    gate.set()
    await task
    assert name not in tasks_in_request_code()
