"""vLLM's NIXL push mode between two real emulators: the decode registers under its own id."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from sidecar.emulator import RunningEmulator

from .conftest import MakeEmulator
from .helpers import eventually, get_json, metric_value, metrics_text, post_json, read_sse

PROMPT = "Push mode: the prefill engine writes the KV into blocks the decode engine allocated. " * 3
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def prefill_body() -> dict[str, Any]:
    return {
        "prompt": PROMPT,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
    }


async def prefill(
    session: aiohttp.ClientSession, emu: RunningEmulator, request_id: str
) -> dict[str, Any]:
    status, body = await post_json(
        session, f"{emu.url}/v1/completions", prefill_body(), {"x-request-id": request_id}
    )
    assert status == 200, body
    return dict(body["kv_transfer_params"])


async def decode(
    session: aiohttp.ClientSession, emu: RunningEmulator, params: dict[str, Any], request_id: str
) -> tuple[int, Any]:
    body = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
    return await post_json(session, f"{emu.url}/v1/completions", body, {"x-request-id": request_id})


async def kv_state(session: aiohttp.ClientSession, emu: RunningEmulator) -> Any:
    return await get_json(session, f"{emu.url}/emulator/kv")


async def test_push_prefill_then_decode_with_the_same_request_id(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    prefiller = await make_emulator(kv_protocol="nixl-push")
    decoder = await make_emulator(kv_protocol="nixl-push", prompt_tokens_details=True)
    params = await prefill(session, prefiller, "push-1")
    assert params["transfer_mode"] == "push"
    assert params["remote_request_id"] == "cmpl-push-1"
    assert params["remote_port"] == prefiller.side_channel_port
    assert (await kv_state(session, prefiller))["staged_blocks"] == 4

    status, body = await decode(session, decoder, params, "push-1")
    assert status == 200, body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == body["usage"]["prompt_tokens"]
    state = await kv_state(session, prefiller)
    assert (state["staged_blocks"], state["pulled_total"], state["registrations_waiting"]) == (
        0,
        1,
        0,
    )
    assert metric_value(await metrics_text(session, decoder), "vllm:nixl_xfer_time_seconds_count")


async def test_push_decode_registered_first_waits_for_the_prefill(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    prefiller = await make_emulator(kv_protocol="nixl-push")
    decoder = await make_emulator(kv_protocol="nixl-push")
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": prefiller.engine_id,
        "remote_request_id": "cmpl-early",
        "remote_host": "127.0.0.1",
        "remote_port": prefiller.side_channel_port,
        "transfer_mode": "push",
    }
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "kv_transfer_params": params}

    async def stream() -> list[Any]:
        async with session.post(
            f"{decoder.url}/v1/completions", json=body, headers={"x-request-id": "early"}
        ) as resp:
            assert resp.status == 200
            return await read_sse(resp)

    async def registered() -> bool:
        return bool((await kv_state(session, prefiller))["registrations_waiting"] == 1)

    task = asyncio.create_task(stream())
    await eventually(registered)
    text = await metrics_text(session, decoder)
    assert metric_value(text, "vllm:num_requests_waiting") == 1
    assert metric_value(text, "vllm:num_requests_running") == 0
    await prefill(session, prefiller, "early")
    async with asyncio.timeout(10):
        events = await task
    assert events[-1] == "[DONE]"
    state = await kv_state(session, prefiller)
    assert (state["staged_blocks"], state["registrations_waiting"]) == (0, 0)


async def test_push_decode_with_another_request_id_times_out(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    prefiller = await make_emulator(kv_protocol="nixl-push")
    decoder = await make_emulator(kv_protocol="nixl-push", push_registration_timeout_s=0.2)
    params = await prefill(session, prefiller, "push-2")
    status, body = await decode(session, decoder, params, "push-2-release")
    assert status == 500
    assert body["error"]["type"] == "InternalServerError"
    assert "cmpl-push-2-release" in body["error"]["message"]
    state = await kv_state(session, prefiller)
    assert (state["staged_blocks"], state["registrations_waiting"]) == (4, 0)
    assert (await kv_state(session, decoder))["failed_pulls_total"] == 1
    # The right id still finds the KV.
    status, _ = await decode(session, decoder, params, "push-2")
    assert status == 200


async def test_push_chat_and_completions_ids_differ(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    prefiller = await make_emulator(kv_protocol="nixl-push")
    decoder = await make_emulator(kv_protocol="nixl-push", push_registration_timeout_s=0.1)
    params = await prefill(session, prefiller, "same-id")
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 2,
        "kv_transfer_params": params,
    }
    status, _ = await post_json(
        session, f"{decoder.url}/v1/chat/completions", body, {"x-request-id": "same-id"}
    )
    assert status == 500  # chatcmpl-same-id is not cmpl-same-id, as in vLLM


async def test_cancelled_push_decode_drops_its_registration(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    prefiller = await make_emulator(kv_protocol="nixl-push")
    decoder = await make_emulator(kv_protocol="nixl-push")
    params = await prefill(session, prefiller, "staged")
    task = asyncio.create_task(decode(session, decoder, params, "leaves"))

    async def waiting(count: int) -> bool:
        return bool((await kv_state(session, prefiller))["registrations_waiting"] == count)

    await eventually(lambda: waiting(1))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await eventually(lambda: waiting(0))
    await eventually(lambda: _idle(session, decoder))
    assert (await kv_state(session, prefiller))["staged_blocks"] == 4


async def _idle(session: aiohttp.ClientSession, emu: RunningEmulator) -> bool:
    text = await metrics_text(session, emu)
    return (
        metric_value(text, "vllm:num_requests_waiting") == 0
        and metric_value(text, "vllm:num_requests_running") == 0
    )


async def test_push_decode_refuses_pull_mode_params(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    prefiller = await make_emulator()  # pull mode
    decoder = await make_emulator(kv_protocol="nixl-push", push_registration_timeout_s=0.1)
    params = await prefill(session, prefiller, "mixed")
    assert "transfer_mode" not in params
    status, body = await decode(session, decoder, params, "mixed")
    assert status == 500
    assert "not in push mode" in body["error"]["message"]
    params["transfer_mode"] = "pull"
    status, body = await decode(session, decoder, params, "mixed")
    assert status == 500
    assert "cannot pair" in body["error"]["message"]


async def test_pull_decode_refuses_push_mode_params(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    prefiller = await make_emulator(kv_protocol="nixl-push")
    decoder = await make_emulator()  # pull mode
    params = await prefill(session, prefiller, "mixed-2")
    status, body = await decode(session, decoder, params, "mixed-2")
    assert status == 500
    assert "cannot pair" in body["error"]["message"]
    assert (await kv_state(session, prefiller))["staged_blocks"] == 4
