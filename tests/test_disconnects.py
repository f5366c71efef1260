"""Clients that leave at random moments: nothing staged, nothing in flight, nothing left running."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from sidecar.observability.tracking import REQUEST_TASK_PREFIX
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
"""~22,000 tokens, about 1.1 s of prefill here: far from done when its client leaves."""
LEAVE = {"never": 0.3, "timer": 0.3, "prefilling": 0.25, "decoding": 0.15}
"""When a client leaves: never; at a random moment from its start (anywhere, before the sidecar
saw it included); once the sidecar's record shows it in that state (a condition, not a timer:
on a loaded machine a timer lands before the sidecar has read the request)."""


@pytest.mark.system
@pytest.mark.timeout(180)
async def test_random_disconnects_leak_nothing(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    """300 requests, 50 at a time, through two sidecars sharing the engines: one with the
    default disconnect policy (auto), one that finishes every prefill; streamed or not,
    header-driven or scheduled. Afterwards nothing is staged, in flight, running or left behind
    as a task.

    ``abort`` is not run here: a prefill that ends just as its client leaves keeps its KV until
    the engine's expiry under ``abort`` (docs/behavior.md, "The residual race"), and clients
    that leave on the "prefilling" condition hit that instant a few times in 300 on a busy
    machine. tests/test_contract.py holds abort, and auto's aborts, to account one by one."""
    latency = {"prefill_s_per_token": 0.00005, "kv_transfer_s_per_block": 0.0005}
    prefills = [await start_engine(**latency) for _ in range(2)]
    decode = await start_engine(decode_s_per_token=0.004, **latency)
    pool = ",".join(p.endpoint for p in prefills)
    sidecars = [
        await start_sidecar_with(decode_url=decode.url, prefill_endpoints=pool),
        await start_sidecar_with(
            decode_url=decode.url, prefill_endpoints=pool, prefill_on_disconnect="finish"
        ),
    ]
    rng = random.Random(20261130)
    outcomes = {"completed": 0, "cancelled": 0}

    async def state_of(url: str, request_id: str) -> str | None:
        async with http.get(f"{url}/debug/requests/{request_id}") as response:
            return (await response.json())["state"] if response.status == 200 else None

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        url = sidecars[index % 2].url
        prompt = VERY_LONG if rng.random() < 0.2 else LONG
        body = completion(f"{index} {prompt}", stream=rng.random() < 0.6, max_tokens=20)
        request_id = f"d-{index}"
        headers = {"x-request-id": request_id}
        if rng.random() < 0.5:  # half header-driven, half scheduled by the sidecar
            headers["x-prefiller-host-port"] = rng.choice(prefills).endpoint
        leave = rng.choices(list(LEAVE), weights=list(LEAVE.values()))[0]
        lag = rng.uniform(0, 0.15 if leave == "timer" else 0.05)

        async def send() -> None:
            async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
                await r.read()

        call = asyncio.ensure_future(send())
        if leave in ("prefilling", "decoding"):
            # The record lives in the sidecar, seen only over HTTP: there is no event to await.
            while True:
                if call.done() or await state_of(url, request_id) == leave:
                    break
                await asyncio.sleep(0.01)
        if leave != "never":
            await asyncio.wait({call}, timeout=lag)
            call.cancel()  # the client leaves: its connection closes
        try:
            await call
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():  # the test itself is stopped
                raise
            outcomes["cancelled"] += 1
            return
        outcomes["completed"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for wave in range(6):  # 6 x 50 = 300 requests, 50 at a time
            await asyncio.gather(*(client(wave * 50 + i, session) for i in range(50)))

    assert outcomes["cancelled"] > 100, outcomes
    assert outcomes["completed"] > 50, outcomes

    state: dict[str, object] = {}

    async def settled() -> bool:
        inflight = [
            len((await get_json(http, s.url + "/debug/requests?limit=1"))["inflight"])
            for s in sidecars
        ]
        staged = [(await get_json(http, p.url + "/emulator/kv"))["staged_blocks"] for p in prefills]
        running = [
            await metric(http, e.url, "vllm:num_requests_running") for e in [*prefills, decode]
        ]
        stuck = tasks_in_request_code()
        state.update(inflight=inflight, staged=staged, running=running, stuck=stuck)
        return inflight == [0, 0] and staged == [0, 0] and running == [0, 0, 0] and not stuck

    try:
        await eventually(settled, within=20)
    except TimeoutError:
        pytest.fail(f"did not settle: {state}")
    disconnects = "pd_sidecar_prefill_disconnects_total"
    for sidecar in sidecars:
        assert await metric(http, sidecar.url, "pd_sidecar_inflight_requests") == 0
        cancelled = await get_json(http, sidecar.url + "/debug/requests?state=cancelled&limit=1000")
        assert len(cancelled["recent"]) > 25
    # Clients left during their prefill on both, and their prefills were finished (auto finishes
    # the short ones; whether it aborts a long one depends on the speed it has fitted by then).
    for sidecar in sidecars:
        assert await metric(http, sidecar.url, f'{disconnects}{{action="finish"}}') > 0


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
