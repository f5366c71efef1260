"""Real processes: graceful drain on SIGTERM, and chaos (engines killed and restarted)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.conftest import completion, eventually, get_json, sse_events
from tests.processes import EmulatorProcess, sidecar_process


@pytest.fixture
async def engines() -> AsyncIterator[tuple[EmulatorProcess, EmulatorProcess]]:
    prefill = EmulatorProcess("--side-channel-port", "0")
    decode = EmulatorProcess("--decode-s-per-token", "0.02")
    await prefill.start()
    await decode.start()
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


@pytest.mark.system
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("drain_s", "finished", "cancelled"), [(10, 1, 0), (0.3, 0, 1)])
async def test_sigterm_drains_streams_in_flight(
    http, engines, drain_s: float, finished: int, cancelled: int
) -> None:
    prefill, decode = engines
    async with sidecar_process(
        capture_log=True,
        until="/ready",
        decode_url=decode.url,
        ready_interval_s="0.05",
        drain_timeout_s=str(drain_s),
    ) as sidecar:
        url = sidecar.url
        async with http.post(
            url + "/v1/completions",
            json=completion(stream=True, max_tokens=60),  # about 1.2 s of tokens
            headers={"x-prefiller-host-port": prefill.endpoint},
        ) as response:
            assert response.status == 200
            first = await response.content.readuntil(b"\n\n")
            sidecar.process.send_signal(signal.SIGTERM)

            async def not_ready() -> bool:
                try:
                    async with http.get(url + "/ready") as probe:
                        return probe.status == 503
                except aiohttp.ClientConnectionError:
                    return True  # already not accepting connections

            await eventually(not_ready)
            with pytest.raises(aiohttp.ClientConnectionError):
                async with aiohttp.ClientSession() as fresh, fresh.get(url + "/health"):
                    pass  # new connections are refused while the stream drains
            try:
                rest = await response.read()
            except aiohttp.ClientPayloadError:
                rest = b""
        events = sse_events(first + rest)
        assert (events[-1] == b"[DONE]") is (finished == 1)
        assert await asyncio.wait_for(sidecar.process.wait(), 20) == 0
        log = await sidecar.log()
    assert f"drained: {finished} request(s) finished, {cancelled} cancelled" in log


@pytest.mark.system
@pytest.mark.timeout(90)
async def test_prefill_killed_and_restarted(http, engines) -> None:
    prefill, decode = engines
    async with sidecar_process(
        decode_url=decode.url,
        prefill_endpoints=prefill.endpoint,
        disagg_min_tokens="0",
        disagg_ttft_ratio="1000",
        scrape_interval_s="0.1",
        eject_base_s="0.5",
        eject_after_failures="2",
    ) as sidecar:

        async def send(index: int) -> int:
            async with http.post(
                sidecar.url + "/v1/completions", json=completion(f"chaos {index}")
            ) as response:
                await response.read()
                return response.status

        async def endpoint_state() -> str:
            snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
            return str(snapshot["endpoints"][0]["state"])

        assert [await send(i) for i in range(3)] == [200] * 3
        prefill.kill()
        # Requests keep succeeding through the local fallback while the pod is gone.
        assert [await send(i) for i in range(3, 8)] == [200] * 5

        async def ejected() -> bool:
            return await endpoint_state() in ("ejected", "probing")

        await eventually(ejected)
        assert prefill.process is not None
        await prefill.process.wait()
        await prefill.start()  # back on the same port

        async def healthy() -> bool:
            return await endpoint_state() == "healthy"

        await eventually(healthy, within=15)
        assert await send(100) == 200
        records = (await get_json(http, sidecar.url + "/debug/requests"))["recent"]
        assert records[0]["decision"] == "remote"
        assert "prefill_unreachable" in {r["fallback_reason"] for r in records}
        assert "pool_empty" in {r["reason"] for r in records}  # while it was ejected


@pytest.mark.system
@pytest.mark.timeout(90)
async def test_decode_restart(http, engines) -> None:
    _, decode = engines
    async with sidecar_process(decode_url=decode.url, ready_interval_s="0.05") as sidecar:

        async def ready(status: int) -> bool:
            async with http.get(sidecar.url + "/ready") as response:
                return response.status == status

        await eventually(lambda: ready(200))
        decode.kill()
        await eventually(lambda: ready(503))
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with http.post(sidecar.url + "/v1/completions", json=completion()) as response:
            assert response.status == 503
            assert (await response.json())["error"]["type"] == "ServiceUnavailableError"
        assert loop.time() - started < 2  # refused at once, no hang
        assert decode.process is not None
        await decode.process.wait()
        await decode.start()
        await eventually(lambda: ready(200), within=15)
        async with http.post(sidecar.url + "/v1/completions", json=completion()) as response:
            assert response.status == 200
