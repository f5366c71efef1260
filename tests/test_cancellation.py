"""A client that leaves cancels its request's engine calls at once, whatever the phase."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from sidecar.observability.tracking import task_name
from tests.conftest import completion, eventually, get_json, inject, metric


async def _running(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


@pytest.mark.parametrize("phase", ["prefilling", "decoding"])
async def test_client_gone_cancels_the_engine_call(
    http, start_sidecar_with, prefill, decode, phase
) -> None:
    # abort: the default (auto) would let a prefill predicted to end soon finish.
    sidecar = await start_sidecar_with(prefill_on_disconnect="abort")
    engine = prefill if phase == "prefilling" else decode
    await inject(http, engine, kind="hang", role="prefill" if phase == "prefilling" else "decode")

    async def send() -> None:
        # A session of its own: cancelling closes it, which drops the client's connection.
        async with (
            aiohttp.ClientSession() as own,
            own.post(
                sidecar.url + "/v1/completions",
                json=completion(),
                headers={"x-prefiller-host-port": prefill.endpoint, "x-request-id": "leaver"},
            ) as response,
        ):
            await response.read()

    client = asyncio.create_task(send())

    async def in_phase() -> bool:
        inflight = (await get_json(http, sidecar.url + "/debug/requests"))["inflight"]
        return [r["state"] for r in inflight] == [phase]

    await eventually(in_phase)
    await eventually(lambda: _running_is(http, engine.url, 1))
    # The request's tasks carry its id (REQUEST_TASK_PREFIX): a task left behind is found by it.
    names = {task.get_name() for task in asyncio.all_tasks()}
    parts = {"handler", "prefill"} if phase == "prefilling" else {"handler"}
    assert {task_name("leaver", part) for part in parts} <= names, names
    client.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await client

    async def cancelled() -> bool:
        debug = await get_json(http, sidecar.url + "/debug/requests")
        return not debug["inflight"] and debug["recent"][0]["state"] == "cancelled"

    await eventually(cancelled)
    # The engine saw its connection close: the hung request is gone there too.
    await eventually(lambda: _running_is(http, engine.url, 0))
    async with http.get(sidecar.url + "/metrics") as response:
        assert (
            'pd_sidecar_requests_total{decision="remote",outcome="cancelled",route="completions"}'
            " 1.0" in await response.text()
        )


async def _running_is(http: aiohttp.ClientSession, url: str, count: int) -> bool:
    return await _running(http, url) == count


async def test_a_stream_left_midway_records_the_status_it_sent(
    http, start_sidecar_with, decode
) -> None:
    """The 200 and some events went out before the client left: the record says 200, not null
    (the status is what the client was sent, docs/observability.md)."""
    sidecar = await start_sidecar_with()
    await inject(http, decode, kind="stall", after_chunks=2, role="plain")
    async with (
        aiohttp.ClientSession() as own,
        own.post(
            sidecar.url + "/v1/completions",
            json=completion(stream=True, max_tokens=8),
            headers={"x-request-id": "left-midway"},
        ) as response,
    ):
        assert response.status == 200
        await response.content.readuntil(b"\n\n")
    # The session closed: the client is gone while the engine holds the rest of the stream.

    async def recorded() -> bool:
        debug = await get_json(http, sidecar.url + "/debug/requests")
        return not debug["inflight"]

    await eventually(recorded)
    entry = await get_json(http, sidecar.url + "/debug/requests/left-midway")
    assert (entry["state"], entry["status"]) == ("cancelled", 200), entry
    assert "first_byte" in entry["phases"], entry


async def test_auto_aborts_even_a_short_prefill_when_releases_are_off(
    http, start_sidecar_with, prefill, decode
) -> None:
    """``auto`` lets a prefill predicted to end soon finish only to release its KV: with
    releases off, finishing would stage KV that nobody releases, so it aborts."""
    sidecar = await start_sidecar_with(release_on_disconnect=False)
    await inject(http, prefill, kind="hang", role="prefill")

    async def send() -> None:
        async with (
            aiohttp.ClientSession() as own,
            own.post(
                sidecar.url + "/v1/completions",
                json=completion(),  # a short prompt: auto would finish it, releases on
                headers={"x-prefiller-host-port": prefill.endpoint},
            ) as response,
        ):
            await response.read()

    client = asyncio.create_task(send())
    await eventually(lambda: _held_is(http, prefill.url, 1))
    client.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await client
    aborted = 'pd_sidecar_prefill_disconnects_total{action="abort"}'
    await eventually(lambda: _metric_is(http, sidecar.url, aborted, 1))
    await eventually(lambda: _held_is(http, prefill.url, 0))  # the engine dropped it
    finished = 'pd_sidecar_prefill_disconnects_total{action="finish"}'
    assert await metric(http, sidecar.url, finished) == 0


async def _held_is(http: aiohttp.ClientSession, url: str, count: int) -> bool:
    return (await get_json(http, url + "/emulator/faults"))["held"] == count


async def _metric_is(http: aiohttp.ClientSession, url: str, sample: str, value: float) -> bool:
    return await metric(http, url, sample) == value
