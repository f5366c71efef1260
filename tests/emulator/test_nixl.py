"""Prefill -> decode KV pulls between two real emulators, in strict and lenient mode."""

from __future__ import annotations

import socket
from typing import Any

import aiohttp
import pytest

from devkit.processes import free_port
from sidecar.emulator import RunningEmulator

from .conftest import MakeEmulator
from .helpers import FakeClock, get_json, metric_value, metrics_text, post_json, read_sse

PROMPT = "Disaggregated serving moves the KV cache from a prefill engine to a decode engine. " * 3
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(**overrides: Any) -> dict[str, Any]:
    body = {
        "model": "emulated-model",
        "prompt": PROMPT,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    body.update(overrides)
    return body


async def do_prefill(
    session: aiohttp.ClientSession, emu: RunningEmulator, **overrides: Any
) -> dict[str, Any]:
    status, body = await post_json(session, f"{emu.url}/v1/completions", prefill_body(**overrides))
    assert status == 200, body
    params = body["kv_transfer_params"]
    assert params is not None
    return dict(params)


async def decode(
    session: aiohttp.ClientSession, emu: RunningEmulator, params: dict[str, Any] | None
) -> tuple[int, Any]:
    body = {"prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params}
    return await post_json(session, f"{emu.url}/v1/completions", body)


async def kv_state(session: aiohttp.ClientSession, emu: RunningEmulator) -> Any:
    return await get_json(session, f"{emu.url}/emulator/kv")


@pytest.fixture
async def pair(make_emulator: MakeEmulator) -> tuple[RunningEmulator, RunningEmulator]:
    prefill = await make_emulator(prompt_tokens_details=True)
    decode_ = await make_emulator(prompt_tokens_details=True)
    return prefill, decode_


@pytest.fixture
async def lenient_pair(make_emulator: MakeEmulator) -> tuple[RunningEmulator, RunningEmulator]:
    prefill = await make_emulator(mode="lenient", prompt_tokens_details=True)
    decode_ = await make_emulator(mode="lenient", prompt_tokens_details=True)
    return prefill, decode_


async def test_full_prefill_decode_pull(
    pair: tuple[RunningEmulator, RunningEmulator], session: aiohttp.ClientSession
) -> None:
    prefill, decoder = pair
    status, answer = await post_json(session, f"{prefill.url}/v1/completions", prefill_body())
    assert status == 200
    params = answer["kv_transfer_params"]
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert prompt_tokens == 63  # 252 characters
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_engine_id": prefill.engine_id,
        "remote_request_id": answer["id"],
        "remote_host": "127.0.0.1",
        "remote_port": prefill.side_channel_port,
        "tp_size": 1,
    }
    assert answer["usage"]["completion_tokens"] == 1
    before = await kv_state(session, prefill)
    assert (before["staged_requests"], before["staged_blocks"]) == (1, 4)
    assert before["staged"][0]["request_id"] == answer["id"]

    status, decoded = await decode(session, decoder, params)
    assert status == 200, decoded
    assert decoded["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt_tokens}
    assert decoded["kv_transfer_params"] is None
    _, local = await post_json(
        session, f"{prefill.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 8}
    )
    assert decoded["choices"][0]["text"] == local["choices"][0]["text"]

    after = await kv_state(session, prefill)
    assert (after["staged_requests"], after["staged_blocks"], after["pulled_total"]) == (0, 0, 1)
    decode_metrics = await metrics_text(session, decoder)
    assert metric_value(decode_metrics, "vllm:nixl_xfer_time_seconds_count") == 1
    assert metric_value(decode_metrics, "vllm:nixl_num_failed_transfers_total") == 0
    prefill_metrics = await metrics_text(session, prefill)
    assert metric_value(prefill_metrics, "emulator_kv_pulled_requests_total") == 1
    assert metric_value(prefill_metrics, "emulator_kv_staged_requests") == 0


async def test_streamed_chat_decode_with_pull(
    pair: tuple[RunningEmulator, RunningEmulator], session: aiohttp.ClientSession
) -> None:
    prefill, decoder = pair
    messages = [{"role": "user", "content": PROMPT}]
    status, answer = await post_json(
        session,
        f"{prefill.url}/v1/chat/completions",
        prefill_body(prompt=None, messages=messages),
    )
    assert status == 200, answer
    assert answer["kv_transfer_params"]["remote_request_id"].startswith("chatcmpl-")
    body = {
        "messages": messages,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": answer["kv_transfer_params"],
    }
    async with session.post(f"{decoder.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        events = await read_sse(resp)
    usage = events[-2]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert (await kv_state(session, prefill))["pulled_total"] == 1


async def test_transfer_latency_is_observed(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    prefill = await make_emulator()
    decoder = await make_emulator(kv_transfer_s_per_block=0.01)
    params = await do_prefill(session, prefill)
    status, _ = await decode(session, decoder, params)
    assert status == 200
    text = await metrics_text(session, decoder)
    assert metric_value(text, "vllm:nixl_xfer_time_seconds_sum") >= 0.04  # four blocks


# --- strict mode --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"stream": True}, "must not stream"),
        ({"max_tokens": 2}, "max_tokens=1"),
        ({"max_completion_tokens": 5}, "max_completion_tokens"),
        ({"max_tokens": None, "max_completion_tokens": None}, "no token limit"),
        ({"n": 2}, "n=1"),
    ],
)
async def test_strict_rejects_bad_prefill_legs(
    pair: tuple[RunningEmulator, RunningEmulator],
    session: aiohttp.ClientSession,
    overrides: dict[str, Any],
    fragment: str,
) -> None:
    prefill, _ = pair
    status, body = await post_json(
        session, f"{prefill.url}/v1/completions", prefill_body(**overrides)
    )
    assert status == 400
    assert body["error"]["type"] == "BadRequestError"
    assert fragment in body["error"]["message"]
    assert (await kv_state(session, prefill))["staged_requests"] == 0


async def test_strict_double_pull_fails(
    pair: tuple[RunningEmulator, RunningEmulator], session: aiohttp.ClientSession
) -> None:
    prefill, decoder = pair
    params = await do_prefill(session, prefill)
    assert (await decode(session, decoder, params))[0] == 200
    status, body = await decode(session, decoder, params)
    assert status == 500
    assert body["error"]["type"] == "InternalServerError"
    assert "already pulled" in body["error"]["message"]
    text = await metrics_text(session, decoder)
    assert metric_value(text, "vllm:nixl_num_failed_transfers_total") == 1
    assert metric_value(text, "vllm:nixl_xfer_time_seconds_count") == 1
    assert (await kv_state(session, decoder))["failed_pulls_total"] == 1


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"remote_engine_id": "not-the-engine"}, "engine_mismatch"),
        ({"remote_request_id": "cmpl-unknown"}, "no staged KV"),
        ({"remote_block_ids": [[4242]]}, "block ids"),
    ],
)
async def test_strict_bad_params_fail_with_500(
    pair: tuple[RunningEmulator, RunningEmulator],
    session: aiohttp.ClientSession,
    change: dict[str, Any],
    fragment: str,
) -> None:
    prefill, decoder = pair
    params = await do_prefill(session, prefill)
    status, body = await decode(session, decoder, {**params, **change})
    assert status == 500
    assert fragment in body["error"]["message"]
    assert (await kv_state(session, prefill))["staged_requests"] == 1  # nothing was freed


async def test_strict_unreachable_side_channel(
    pair: tuple[RunningEmulator, RunningEmulator], session: aiohttp.ClientSession
) -> None:
    prefill, decoder = pair
    params = await do_prefill(session, prefill)
    status, body = await decode(session, decoder, {**params, "remote_port": free_port()})
    assert status == 500
    assert "unreachable" in body["error"]["message"]


@pytest.mark.parametrize("missing", ["remote_block_ids", "remote_engine_id", "remote_port"])
async def test_strict_incomplete_params(
    pair: tuple[RunningEmulator, RunningEmulator], session: aiohttp.ClientSession, missing: str
) -> None:
    prefill, decoder = pair
    params = await do_prefill(session, prefill)
    del params[missing]
    status, body = await decode(session, decoder, params)
    assert status == 400
    assert missing in body["error"]["message"]


async def test_strict_expired_pull_fails(
    make_emulator: MakeEmulator, fake_clock: FakeClock, session: aiohttp.ClientSession
) -> None:
    prefill = await make_emulator(clock=fake_clock, kv_expiry_s=30.0)
    decoder = await make_emulator()
    params = await do_prefill(session, prefill)
    fake_clock.advance(31)
    status, body = await decode(session, decoder, params)
    assert status == 500
    assert "expired" in body["error"]["message"]
    state = await kv_state(session, prefill)
    assert (state["staged_requests"], state["expired_total"]) == (0, 1)
    text = await metrics_text(session, prefill)
    assert metric_value(text, "vllm:nixl_num_kv_expired_reqs_total") == 1


# --- lenient mode -------------------------------------------------------------------------------


async def test_lenient_streamed_prefill_strands_blocks_until_expiry(
    make_emulator: MakeEmulator, fake_clock: FakeClock, session: aiohttp.ClientSession
) -> None:
    prefill = await make_emulator(clock=fake_clock, mode="lenient")
    body = prefill_body(stream=True)
    async with session.post(f"{prefill.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    assert all("kv_transfer_params" not in e for e in events[:-1])
    assert (await kv_state(session, prefill))["staged_requests"] == 1
    fake_clock.advance(29)
    assert (await kv_state(session, prefill))["staged_requests"] == 1
    fake_clock.advance(2)
    state = await kv_state(session, prefill)
    assert (state["staged_requests"], state["expired_total"]) == (0, 1)
    text = await metrics_text(session, prefill)
    assert metric_value(text, "vllm:nixl_num_kv_expired_reqs_total") == 1


async def test_lenient_long_prefill_still_returns_params(
    lenient_pair: tuple[RunningEmulator, RunningEmulator], session: aiohttp.ClientSession
) -> None:
    prefill, _ = lenient_pair
    status, body = await post_json(
        session,
        f"{prefill.url}/v1/completions",
        prefill_body(max_tokens=3, max_completion_tokens=None),
    )
    assert status == 200
    assert body["usage"]["completion_tokens"] == 3
    assert body["kv_transfer_params"]["do_remote_prefill"] is True


async def test_lenient_incomplete_params_recompute(
    lenient_pair: tuple[RunningEmulator, RunningEmulator], session: aiohttp.ClientSession
) -> None:
    prefill, decoder = lenient_pair
    params = await do_prefill(session, prefill)
    del params["remote_host"]
    status, body = await decode(session, decoder, params)
    assert status == 200
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed locally
    assert (await kv_state(session, prefill))["staged_requests"] == 1


async def test_lenient_double_pull_serves_stale(
    lenient_pair: tuple[RunningEmulator, RunningEmulator], session: aiohttp.ClientSession
) -> None:
    prefill, decoder = lenient_pair
    params = await do_prefill(session, prefill)
    status1, first = await decode(session, decoder, params)
    status2, second = await decode(session, decoder, params)
    assert (status1, status2) == (200, 200)
    assert first["choices"] == second["choices"]
    text = await metrics_text(session, decoder)
    assert metric_value(text, "vllm:nixl_num_failed_transfers_total") == 0


@pytest.mark.parametrize("change", ["engine", "port"])
async def test_lenient_engine_mismatch_and_unreachable_still_fail(
    lenient_pair: tuple[RunningEmulator, RunningEmulator],
    session: aiohttp.ClientSession,
    change: str,
) -> None:
    prefill, decoder = lenient_pair
    params = await do_prefill(session, prefill)
    if change == "engine":
        params["remote_engine_id"] = "bogus"
    else:
        params["remote_port"] = free_port()
    status, body = await decode(session, decoder, params)
    assert status == 500
    assert body["error"]["type"] == "InternalServerError"
    text = await metrics_text(session, decoder)
    assert metric_value(text, "vllm:nixl_num_failed_transfers_total") == 1


async def test_ipv6_side_channel(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        prefill = await make_emulator(host="::1", side_channel_host="::1")
    except OSError:
        pytest.skip("cannot bind ::1")
    assert prefill.url == f"http://[::1]:{prefill.port}"
    decoder = await make_emulator()
    params = await do_prefill(session, prefill)
    assert params["remote_host"] == "::1"
    status, _ = await decode(session, decoder, params)
    assert status == 200
