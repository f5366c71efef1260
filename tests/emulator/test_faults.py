"""Fault injection over HTTP: every kind, roles, counts, release and clean shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from sidecar.emulator import FaultKind, FaultRole, FaultSpec, RunningEmulator

from .conftest import MakeEmulator
from .helpers import eventually, get_json, metric_value, metrics_text, post_json

BODY = {"prompt": "fault injection target", "max_tokens": 3}
STREAM_BODY = {**BODY, "stream": True}


async def arm(session: aiohttp.ClientSession, emu: RunningEmulator, **fault: Any) -> None:
    status, body = await post_json(session, f"{emu.url}/emulator/faults", fault)
    assert status == 201, body


async def release(session: aiohttp.ClientSession, emu: RunningEmulator) -> None:
    status, _ = await post_json(session, f"{emu.url}/emulator/release", {})
    assert status == 200


async def until_held(session: aiohttp.ClientSession, emu: RunningEmulator, count: int = 1) -> None:
    """Wait until ``count`` requests are hung or stalled (no fixed sleeps)."""

    async def held() -> bool:
        state = await get_json(session, f"{emu.url}/emulator/faults")
        return bool(state["held"] >= count)

    await eventually(held)


async def completion(session: aiohttp.ClientSession, emu: RunningEmulator) -> int:
    status, _ = await post_json(session, f"{emu.url}/v1/completions", BODY)
    return status


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (500, "InternalServerError"),
        (503, "ServiceUnavailableError"),
        (429, "TooManyRequestsError"),
        (400, "BadRequestError"),
    ],
)
async def test_status_fault(
    emulator: RunningEmulator, session: aiohttp.ClientSession, status: int, error_type: str
) -> None:
    await arm(session, emulator, kind="status", status=status, count=2)
    for _ in range(2):
        got, body = await post_json(session, f"{emulator.url}/v1/completions", BODY)
        assert got == status
        assert body["error"]["type"] == error_type
        assert body["error"]["code"] == status
    assert await completion(session, emulator) == 200


async def test_fault_roles_and_listing(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    await arm(session, emulator, kind="status", role="decode")
    listed = await get_json(session, f"{emulator.url}/emulator/faults")
    assert listed["faults"][0]["kind"] == "status"
    assert listed["faults"][0]["remaining"] == 1
    assert await completion(session, emulator) == 200  # plain: not a decode request
    async with session.delete(f"{emulator.url}/emulator/faults") as resp:
        assert resp.status == 200
    assert (await get_json(session, f"{emulator.url}/emulator/faults"))["faults"] == []


async def test_bad_fault_body(emulator: RunningEmulator, session: aiohttp.ClientSession) -> None:
    status, body = await post_json(session, f"{emulator.url}/emulator/faults", {"kind": "boom"})
    assert status == 400
    assert body["error"]["type"] == "BadRequestError"


async def test_invalid_requests_do_not_consume_faults(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    await arm(session, emulator, kind="status", status=503)
    status, _ = await post_json(session, f"{emulator.url}/v1/completions", {"prompt": 1})
    assert status == 400
    assert await completion(session, emulator) == 503


async def test_reset_fault(emulator: RunningEmulator, session: aiohttp.ClientSession) -> None:
    await arm(session, emulator, kind="reset")
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await completion(session, emulator)
    assert await completion(session, emulator) == 200


async def test_hang_then_release(emulator: RunningEmulator, session: aiohttp.ClientSession) -> None:
    await arm(session, emulator, kind="hang")
    pending = asyncio.create_task(completion(session, emulator))
    await until_held(session, emulator)
    assert not pending.done()
    text = await metrics_text(session, emulator)
    assert metric_value(text, "vllm:num_requests_running") == 1  # a stuck engine is busy
    await release(session, emulator)
    assert await pending == 200


async def test_hang_ends_when_client_goes(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    await arm(session, emulator, kind="hang")
    pending = asyncio.create_task(completion(session, emulator))
    await until_held(session, emulator)
    pending.cancel()  # the client goes away
    with pytest.raises(asyncio.CancelledError):
        await pending

    # The emulator notices the disconnect and drops the hung handler.
    async def dropped() -> bool:
        return not (emulator.inflight_requests or emulator.faults.held)

    await eventually(dropped)


async def test_close_with_a_hung_request(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    emu = await make_emulator(faults=(FaultSpec(FaultKind.HANG),))
    pending = asyncio.create_task(completion(session, emu))
    await until_held(session, emu)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await emu.close()
    await emu.close()  # idempotent
    assert loop.time() - started < 1.0
    with pytest.raises(aiohttp.ClientError):
        await pending


async def read_stream_lines(
    session: aiohttp.ClientSession, url: str, received: list[bytes]
) -> None:
    async with session.post(url, json=STREAM_BODY) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.strip():
                received.append(line)


async def test_disconnect_mid_stream(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    await arm(session, emulator, kind="disconnect", after_chunks=2)
    received: list[bytes] = []
    url = f"{emulator.url}/v1/completions"
    with pytest.raises(aiohttp.ClientPayloadError):
        await read_stream_lines(session, url, received)
    assert len(received) == 2
    assert all(b"[DONE]" not in line for line in received)


async def read_body(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.post(url, json=BODY) as resp:
        assert resp.status == 200
        return await resp.read()


async def test_disconnect_non_streamed(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    await arm(session, emulator, kind="disconnect")
    with pytest.raises(aiohttp.ClientPayloadError):
        await read_body(session, f"{emulator.url}/v1/completions")


async def test_stall_then_release(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    await arm(session, emulator, kind="stall", after_chunks=1)
    async with session.post(f"{emulator.url}/v1/completions", json=STREAM_BODY) as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        await until_held(session, emulator)  # stalled after the first token, deterministically
        rest = asyncio.create_task(resp.content.read())
        await release(session, emulator)
        tail = await rest
    assert tail.count(b"data: ") == 3  # two more tokens and [DONE]
    assert tail.endswith(b"data: [DONE]\n\n")


async def test_stall_non_streamed(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    await arm(session, emulator, kind="stall")
    pending = asyncio.create_task(completion(session, emulator))
    await until_held(session, emulator)
    assert not pending.done()
    await release(session, emulator)
    assert await pending == 200


async def test_health_down(emulator: RunningEmulator, session: aiohttp.ClientSession) -> None:
    await arm(session, emulator, kind="health_down", count=5)
    async with session.get(f"{emulator.url}/health") as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "ServiceUnavailableError"
    assert await completion(session, emulator) == 200  # only /health is affected
    async with session.delete(f"{emulator.url}/emulator/faults") as resp:
        assert resp.status == 200
    async with session.get(f"{emulator.url}/health") as resp:
        assert resp.status == 200


async def test_faults_from_config(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    emu = await make_emulator(faults=(FaultSpec.parse_cli("status:503:1"),))
    assert await completion(session, emu) == 503
    assert await completion(session, emu) == 200


async def test_bloat_fault_pads_the_answer_and_counts_what_it_wrote(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    await arm(session, emulator, kind="bloat", size=200_000)
    async with session.post(f"{emulator.url}/v1/completions", json=BODY) as resp:
        assert resp.status == 200
        assert resp.content_length is None  # chunked: nothing says how long it is
        answer = await resp.json()
    assert answer["padding"] == "x" * 200_000
    assert answer["choices"][0]["text"]  # the answer's own fields follow
    state = await get_json(session, f"{emulator.url}/emulator/faults")
    assert state["padding_sent"] == 200_000
    assert FaultSpec.parse_cli("bloat:1000@prefill") == FaultSpec(
        FaultKind.BLOAT, size=1000, role=FaultRole.PREFILL
    )
