"""SGLang mode between two real emulators: prefill and decode rendezvous on a bootstrap room."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from devkit.processes import free_port
from sidecar.emulator import FaultKind, FaultRole, FaultSpec, RunningEmulator

from .conftest import MakeEmulator
from .helpers import eventually, get_json, metric_value, metrics_text, post_json, read_sse

PROMPT = "SGLang sends the same request to the prefill and the decode server at once. " * 3
Pair = tuple[RunningEmulator, RunningEmulator]


def sglang_body(
    prefiller: RunningEmulator, room: int | list[int], **overrides: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": PROMPT,
        "max_tokens": 5,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefiller.bootstrap_port,
        "bootstrap_room": room,
    }
    body.update(overrides)
    return body


async def kv_state(session: aiohttp.ClientSession, emu: RunningEmulator) -> Any:
    return await get_json(session, f"{emu.url}/emulator/kv")


async def completion(
    session: aiohttp.ClientSession, emu: RunningEmulator, body: dict[str, Any]
) -> tuple[int, Any]:
    return await post_json(session, f"{emu.url}/v1/completions", body)


@pytest.fixture
async def pair(make_emulator: MakeEmulator) -> Pair:
    prefiller = await make_emulator(
        kv_protocol="sglang", disaggregation_mode="prefill", bootstrap_timeout_s=10
    )
    decoder = await make_emulator(
        kv_protocol="sglang",
        disaggregation_mode="decode",
        waiting_timeout_s=10,
        prompt_tokens_details=True,
    )
    return prefiller, decoder


async def test_both_legs_at_once_meet_on_the_room(
    pair: Pair, session: aiohttp.ClientSession
) -> None:
    prefiller, decoder = pair
    body = sglang_body(prefiller, 2**63 - 1)
    async with asyncio.timeout(10):
        (p_status, p_body), (d_status, d_body) = await asyncio.gather(
            completion(session, prefiller, body), completion(session, decoder, body)
        )
    assert (p_status, d_status) == (200, 200), (p_body, d_body)
    assert p_body["usage"]["completion_tokens"] == 1  # the prefill generates the first token
    assert d_body["usage"]["completion_tokens"] == 5
    assert d_body["usage"]["prompt_tokens_details"]["cached_tokens"] == 57
    assert d_body["kv_transfer_params"] is None
    state = await kv_state(session, prefiller)
    assert (state["staged_blocks"], state["claims_waiting"], state["pulled_total"]) == (0, 0, 1)
    assert (await kv_state(session, decoder))["rooms_waiting"] == 0


async def test_decode_first_then_prefill_streamed_chat(
    pair: Pair, session: aiohttp.ClientSession
) -> None:
    prefiller, decoder = pair
    body = sglang_body(
        prefiller,
        [11, 12],
        prompt=None,
        messages=[{"role": "user", "content": PROMPT}],
        n=2,
        stream=True,
        rid="chat-1",
    )

    async def stream(emu: RunningEmulator) -> list[Any]:
        async with session.post(f"{emu.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            return await read_sse(resp)

    decoding = asyncio.create_task(stream(decoder))

    async def waiting() -> bool:
        return bool((await kv_state(session, decoder))["rooms_waiting"] == 1)

    await eventually(waiting)
    assert (await kv_state(session, prefiller))["claims_waiting"] == 1
    async with asyncio.timeout(10):
        prefilled = await stream(prefiller)
        decoded = await decoding
    assert prefilled[-1] == decoded[-1] == "[DONE]"
    assert len([e for e in decoded[:-1] if e["choices"][0]["delta"].get("content")]) == 10


async def test_prefill_first_holds_its_room_until_claimed(
    pair: Pair, session: aiohttp.ClientSession
) -> None:
    prefiller, decoder = pair
    body = sglang_body(prefiller, 5)
    prefilling = asyncio.create_task(completion(session, prefiller, body))

    async def staged() -> bool:
        return bool((await kv_state(session, prefiller))["staged_blocks"] == 4)

    await eventually(staged)
    (room,) = (await kv_state(session, prefiller))["staged"]
    assert room["room"] == 5
    status, _ = await completion(session, decoder, body)
    assert status == 200
    async with asyncio.timeout(10):
        assert (await prefilling)[0] == 200
    assert (await kv_state(session, prefiller))["staged_blocks"] == 0


async def test_decode_alone_times_out(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    prefiller = await make_emulator(kv_protocol="sglang", disaggregation_mode="prefill")
    decoder = await make_emulator(
        kv_protocol="sglang", disaggregation_mode="decode", waiting_timeout_s=0.2
    )
    status, body = await completion(session, decoder, sglang_body(prefiller, 9))
    assert status == 500
    assert body["error"]["type"] == "InternalServerError"
    assert "WaitingForInput" in body["error"]["message"]
    assert (await kv_state(session, decoder))["rooms_waiting"] == 0
    assert (await kv_state(session, prefiller))["claims_waiting"] == 0


async def test_prefill_alone_times_out_and_drops_the_room(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    prefiller = await make_emulator(
        kv_protocol="sglang", disaggregation_mode="prefill", bootstrap_timeout_s=0.2
    )
    status, body = await completion(session, prefiller, sglang_body(prefiller, 3))
    assert status == 500
    assert "bootstrap timeout" in body["error"]["message"]
    state = await kv_state(session, prefiller)
    assert (state["staged_blocks"], state["expired_total"]) == (0, 1)


async def test_cancelled_decode_leaves_no_room_waiting(
    pair: Pair, session: aiohttp.ClientSession
) -> None:
    prefiller, decoder = pair
    task = asyncio.create_task(completion(session, decoder, sglang_body(prefiller, 21)))

    async def rooms_waiting(emu: RunningEmulator, field: str, count: int) -> bool:
        return bool((await kv_state(session, emu))[field] == count)

    await eventually(lambda: rooms_waiting(decoder, "rooms_waiting", 1))
    text = await metrics_text(session, decoder)
    assert metric_value(text, "vllm:num_requests_waiting") == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await eventually(lambda: rooms_waiting(decoder, "rooms_waiting", 0))
    await eventually(lambda: rooms_waiting(prefiller, "claims_waiting", 0))


async def test_cancelled_prefill_drops_its_room(pair: Pair, session: aiohttp.ClientSession) -> None:
    prefiller, _ = pair
    task = asyncio.create_task(completion(session, prefiller, sglang_body(prefiller, 22)))

    async def staged(count: int) -> bool:
        return bool((await kv_state(session, prefiller))["staged_requests"] == count)

    await eventually(lambda: staged(1))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await eventually(lambda: staged(0))


async def test_abort_request_by_rid(pair: Pair, session: aiohttp.ClientSession) -> None:
    prefiller, decoder = pair
    task = asyncio.create_task(
        completion(session, decoder, sglang_body(prefiller, 23, rid="to-abort"))
    )

    async def waiting(count: int) -> bool:
        return bool((await kv_state(session, decoder))["rooms_waiting"] == count)

    await eventually(lambda: waiting(1))
    status, body = await post_json(session, f"{decoder.url}/abort_request", {"rid": "to-abort"})
    assert (status, body) == (200, {"aborted": 1})
    await eventually(lambda: waiting(0))
    with pytest.raises(aiohttp.ClientError):
        async with asyncio.timeout(10):
            await task


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_requests_without_bootstrap_fields_are_refused(
    pair: Pair, session: aiohttp.ClientSession, role: str
) -> None:
    emu = pair[0] if role == "prefill" else pair[1]
    status, body = await completion(session, emu, {"prompt": PROMPT, "max_tokens": 2})
    assert status == 400
    assert body["error"]["type"] == "BadRequestError"
    assert "bootstrap_host/bootstrap_port/bootstrap_room required" in body["error"]["message"]


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"bootstrap_room": -1}, "bootstrap_room must be in"),
        ({"bootstrap_room": 2**63}, "bootstrap_room must be in"),
        ({"bootstrap_room": [1, 2]}, "expected 1"),
        ({"bootstrap_port": "8998"}, "bootstrap_port must be a int"),
        ({"bootstrap_host": None}, "bootstrap_host required"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "not used with sglang"),
    ],
)
async def test_bad_bootstrap_fields(
    pair: Pair, session: aiohttp.ClientSession, overrides: dict[str, Any], fragment: str
) -> None:
    prefiller, decoder = pair
    status, body = await completion(session, decoder, sglang_body(prefiller, 1, **overrides))
    assert status == 400
    assert fragment in body["error"]["message"]


async def test_room_list_for_an_array_prompt(pair: Pair, session: aiohttp.ClientSession) -> None:
    prefiller, decoder = pair
    body = sglang_body(prefiller, [31, 32], prompt=[PROMPT, "second prompt"])
    async with asyncio.timeout(10):
        results = await asyncio.gather(
            completion(session, prefiller, body), completion(session, decoder, body)
        )
    assert [status for status, _ in results] == [200, 200]


async def test_unreachable_bootstrap_server_fails_the_decode(
    pair: Pair, session: aiohttp.ClientSession
) -> None:
    prefiller, decoder = pair
    body = sglang_body(prefiller, 4, bootstrap_port=free_port())
    status, answer = await completion(session, decoder, body)
    assert status == 500
    assert "unreachable" in answer["error"]["message"]


async def test_faults_apply_by_server_role(pair: Pair, session: aiohttp.ClientSession) -> None:
    prefiller, decoder = pair
    prefiller.faults.add(FaultSpec(FaultKind.STATUS, status=503, role=FaultRole.PREFILL))
    decoder.faults.add(FaultSpec(FaultKind.STATUS, status=502, role=FaultRole.DECODE))
    body = sglang_body(prefiller, 41)
    assert (await completion(session, prefiller, body))[0] == 503
    assert (await completion(session, decoder, body))[0] == 502


async def test_a_second_prefill_with_the_same_room_replaces_the_first(
    pair: Pair, session: aiohttp.ClientSession
) -> None:
    prefiller, decoder = pair
    body = sglang_body(prefiller, 51)
    first = asyncio.create_task(completion(session, prefiller, body))

    async def staged(count: int) -> bool:
        return bool((await kv_state(session, prefiller))["staged_requests"] == count)

    await eventually(lambda: staged(1))
    second = asyncio.create_task(completion(session, prefiller, body))
    async with asyncio.timeout(10):
        status, answer = await first
    assert status == 500
    assert "another prefill took the room" in answer["error"]["message"]
    assert (await completion(session, decoder, body))[0] == 200
    async with asyncio.timeout(10):
        assert (await second)[0] == 200


async def test_closing_the_prefill_ends_a_waiting_claim_at_once(
    pair: Pair, session: aiohttp.ClientSession
) -> None:
    prefiller, decoder = pair
    task = asyncio.create_task(completion(session, decoder, sglang_body(prefiller, 61)))

    async def claimed() -> bool:
        return bool((await kv_state(session, prefiller))["claims_waiting"] == 1)

    await eventually(claimed)
    async with asyncio.timeout(5):
        await prefiller.close()
        status, body = await task
    assert status == 500, body
    assert (await kv_state(session, decoder))["rooms_waiting"] == 0
