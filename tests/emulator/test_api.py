"""The OpenAI-compatible API against real sockets: shapes, streaming, determinism, errors."""

from __future__ import annotations

import asyncio
import io
import socket

import aiohttp
import orjson
import pytest

from sidecar.emulator import RunningEmulator
from sidecar.server.binding import CannotListen

from .conftest import MakeEmulator
from .helpers import eventually, get_json, metric_value, metrics_text, post_json, read_sse

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."  # 62 chars -> 16 tokens


async def test_public_attributes(emulator: RunningEmulator) -> None:
    assert emulator.port > 0
    assert emulator.url == f"http://127.0.0.1:{emulator.port}"
    assert emulator.endpoint == f"127.0.0.1:{emulator.port}"
    assert emulator.side_channel_port > 0
    assert emulator.side_channel_port != emulator.port


async def test_completion_shape(emulator: RunningEmulator, session: aiohttp.ClientSession) -> None:
    status, body = await post_json(
        session,
        f"{emulator.url}/v1/completions",
        {"model": "emulated-model", "prompt": PROMPT, "max_tokens": 5, "temperature": 0.7},
    )
    assert status == 200
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == "emulated-model"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert len(choice["text"].split()) == 5
    assert choice["text"].startswith(" ")
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    assert choice["stop_reason"] is None
    assert choice["prompt_logprobs"] is None
    assert body["usage"] == {
        "prompt_tokens": 16,
        "total_tokens": 21,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["kv_transfer_params"] is None


async def test_chat_shape(emulator: RunningEmulator, session: aiohttp.ClientSession) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    status, body = await post_json(
        session, f"{emulator.url}/v1/chat/completions", {"messages": messages, "max_tokens": 3}
    )
    assert status == 200
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 3
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 5  # "user: hello there" = 17 chars
    assert body["kv_transfer_params"] is None


async def test_chat_token_limits_take_the_smaller(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    url = f"{emulator.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "x"}]
    _, body = await post_json(session, url, {"messages": messages, "max_completion_tokens": 4})
    assert body["usage"]["completion_tokens"] == 4
    _, body = await post_json(
        session, url, {"messages": messages, "max_completion_tokens": 4, "max_tokens": 2}
    )
    assert body["usage"]["completion_tokens"] == 2
    _, body = await post_json(session, url, {"messages": messages})
    assert body["usage"]["completion_tokens"] == 16  # default_max_tokens


async def test_prompt_tokens_details_off_by_default(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    emu = await make_emulator()
    _, body = await post_json(session, f"{emu.url}/v1/completions", {"prompt": [1, 2, 3]})
    assert body["usage"]["prompt_tokens"] == 3
    assert body["usage"]["prompt_tokens_details"] is None


async def test_n_choices(emulator: RunningEmulator, session: aiohttp.ClientSession) -> None:
    url = f"{emulator.url}/v1/completions"
    _, single = await post_json(session, url, {"prompt": PROMPT, "max_tokens": 4})
    _, multi = await post_json(session, url, {"prompt": PROMPT, "max_tokens": 4, "n": 3})
    assert [c["index"] for c in multi["choices"]] == [0, 1, 2]
    assert multi["choices"][0]["text"] == single["choices"][0]["text"]
    assert multi["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_equals_non_stream(
    emulator: RunningEmulator, session: aiohttp.ClientSession, path: str
) -> None:
    chat = "chat" in path
    base: dict[str, object] = (
        {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    )
    body = {**base, "max_tokens": 6}
    _, full = await post_json(session, emulator.url + path, body)
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(emulator.url + path, json=stream_body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    usage_event = events[-2]
    assert usage_event["choices"] == []
    streamed_usage = usage_event["usage"]
    streamed_usage.pop("prompt_tokens_details")  # the second request hits the prefix cache
    full["usage"].pop("prompt_tokens_details")
    assert streamed_usage == full["usage"]
    chunks = events[:-2]
    assert all(e["id"] == chunks[0]["id"] for e in chunks)
    if chat:
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        words = [e["choices"][0]["delta"]["content"] for e in chunks[1:]]
        expected = full["choices"][0]["message"]["content"]
    else:
        assert chunks[0]["object"] == "text_completion"
        words = [e["choices"][0]["text"] for e in chunks]
        expected = full["choices"][0]["text"]
    assert len(words) == 6
    assert "".join(words) == expected
    assert [e["choices"][0]["finish_reason"] for e in chunks][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])


async def test_stream_without_usage(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True}
    async with session.post(f"{emulator.url}/v1/completions", json=body) as resp:
        events = await read_sse(resp)
    assert len(events) == 3
    assert "usage" not in events[1]


async def test_first_event_arrives_before_generation_ends(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    emu = await make_emulator(decode_s_per_token=0.05)
    body = {"prompt": PROMPT, "max_tokens": 10, "stream": True}
    loop = asyncio.get_running_loop()
    async with session.post(f"{emu.url}/v1/completions", json=body) as resp:
        started = loop.time()
        first = await resp.content.readuntil(b"\n\n")
        first_at = loop.time() - started
        await resp.read()
        total = loop.time() - started
    assert first.startswith(b"data: {")
    assert first_at < 0.3
    assert total >= 0.4  # nine decode steps of 50 ms follow the first token


async def test_request_id_header_is_used_and_echoed(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    headers = {"x-request-id": "abc123"}
    async with session.post(
        f"{emulator.url}/v1/completions", json={"prompt": "hi"}, headers=headers
    ) as resp:
        assert resp.headers["x-request-id"] == "abc123"
        assert (await resp.json())["id"] == "cmpl-abc123"
    async with session.post(f"{emulator.url}/v1/completions", json={"prompt": "hi"}) as resp:
        generated = resp.headers["x-request-id"]
        assert (await resp.json())["id"] == f"cmpl-{generated}"
        assert len(generated) == 32


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"prompt": "x", "model": "other"}, 404, "The model `other` does not exist."),
        ({}, 400, "prompt is required"),
        ({"prompt": 5}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream=True"),
        ({"prompt": "x", "stream": True, "stream_options": 3}, 400, "stream_options"),
        ({"prompt": "x", "max_tokens": 1, "min_tokens": 2}, 400, "min_tokens"),
        ({"prompt": "x", "kv_transfer_params": [1]}, 400, "kv_transfer_params"),
        ({"prompt": "x" * 200_000}, 400, "maximum context length"),
        ([1, 2], 400, "JSON object"),
    ],
)
async def test_errors_have_vllm_shape(
    emulator: RunningEmulator,
    session: aiohttp.ClientSession,
    body: object,
    status: int,
    fragment: str,
) -> None:
    got, answer = await post_json(session, f"{emulator.url}/v1/completions", body)
    assert got == status
    error = answer["error"]
    assert fragment in error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert error["param"] is None
    assert error["code"] == status
    assert set(answer) == {"error"}


async def test_large_bodies_are_accepted(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    body = {"prompt": "x", "max_tokens": 1, "user": "u" * 2_000_000}  # beyond aiohttp's 1 MiB
    # A BytesIO payload: aiohttp warns about large raw bytes bodies (warnings are errors here).
    payload = io.BytesIO(orjson.dumps(body))
    headers = {"Content-Type": "application/json"}
    url = f"{emulator.url}/v1/completions"
    async with session.post(url, data=payload, headers=headers) as resp:
        assert resp.status == 200


async def test_invalid_json_and_unknown_route(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    async with session.post(f"{emulator.url}/v1/chat/completions", data=b"{nope") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "BadRequestError"
    async with session.get(f"{emulator.url}/v1/nothing") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "NotFoundError"


async def test_models_health_metrics(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    models = await get_json(session, f"{emulator.url}/v1/models")
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == card["root"] == "emulated-model"
    assert card["owned_by"] == "vllm"
    assert card["parent"] is None
    assert card["max_model_len"] == 32768
    async with session.get(f"{emulator.url}/health") as resp:
        assert resp.status == 200
        assert await resp.read() == b""
    text = await metrics_text(session, emulator)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:nixl_xfer_time_seconds_count",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:nixl_num_kv_expired_reqs_total",
        "emulator_kv_staged_requests",
        "emulator_kv_staged_blocks",
        "emulator_kv_pulled_requests_total",
    ):
        metric_value(text, name)
    assert 'vllm:num_requests_running{model_name="emulated-model"} 0.0' in text


async def test_prefix_cache(emulator: RunningEmulator, session: aiohttp.ClientSession) -> None:
    url = f"{emulator.url}/v1/completions"
    prompt = "p" * 4 * 40  # 40 tokens: two full blocks and a partial one
    _, first = await post_json(session, url, {"prompt": prompt, "max_tokens": 1})
    _, second = await post_json(session, url, {"prompt": prompt, "max_tokens": 1})
    _, other = await post_json(session, url, {"prompt": "q" + prompt[1:], "max_tokens": 1})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    exact = "e" * 4 * 32  # a prompt of exactly two blocks: the last one is always recomputed
    await post_json(session, url, {"prompt": exact, "max_tokens": 1})
    _, again = await post_json(session, url, {"prompt": exact, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    text = await metrics_text(session, emulator)
    assert metric_value(text, "vllm:prefix_cache_queries_total") == 40 * 3 + 32 * 2
    assert metric_value(text, "vllm:prefix_cache_hits_total") == 32 + 16


async def test_polls_are_counted(emulator: RunningEmulator, session: aiohttp.ClientSession) -> None:
    """``/emulator/polls`` counts the ``/metrics`` scrapes and ``/health`` polls served: what a
    test reads to see how often the sidecars poll an engine."""
    assert await get_json(session, f"{emulator.url}/emulator/polls") == {"metrics": 0, "health": 0}
    for path in ("/metrics", "/metrics", "/health"):
        async with session.get(emulator.url + path) as resp:
            assert resp.status == 200
    assert await get_json(session, f"{emulator.url}/emulator/polls") == {"metrics": 2, "health": 1}


async def test_request_log(emulator: RunningEmulator, session: aiohttp.ClientSession) -> None:
    body = {"prompt": "logged", "max_tokens": 1}
    await post_json(session, f"{emulator.url}/v1/completions", body, headers={"X-Custom": "yes"})
    async with session.post(f"{emulator.url}/v1/completions", data=b"not json") as resp:
        assert resp.status == 400
    async with session.get(f"{emulator.url}/health") as resp:  # not logged: outside /v1/
        assert resp.status == 200
    log = await get_json(session, f"{emulator.url}/emulator/requests")
    first, second = log["requests"]
    assert first["method"] == "POST"
    assert first["path"] == "/v1/completions"
    assert first["body"] == body
    assert first["headers"]["x-custom"] == "yes"
    assert second["body"] is None
    async with session.delete(f"{emulator.url}/emulator/requests") as resp:
        assert resp.status == 200
    assert (await get_json(session, f"{emulator.url}/emulator/requests"))["requests"] == []


async def test_request_log_is_bounded(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    emu = await make_emulator(request_log_size=2)
    for i in range(4):
        await post_json(session, f"{emu.url}/v1/completions", {"prompt": f"p{i}"})
    log = await get_json(session, f"{emu.url}/emulator/requests")
    assert [r["body"]["prompt"] for r in log["requests"]] == ["p2", "p3"]


async def test_running_gauge_and_concurrency_limit(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    emu = await make_emulator(max_num_seqs=1)
    await post_json(session, f"{emu.url}/emulator/faults", {"kind": "stall", "after_chunks": 1})
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    async with session.post(f"{emu.url}/v1/completions", json=body) as stalled:
        await stalled.content.readuntil(b"\n\n")  # the first event: now it is stalled
        second = asyncio.create_task(
            post_json(session, f"{emu.url}/v1/completions", {"prompt": "x", "max_tokens": 1})
        )

        async def one_waiting() -> bool:
            text = await metrics_text(session, emu)
            return metric_value(text, "vllm:num_requests_waiting") == 1

        await eventually(one_waiting)
        text = await metrics_text(session, emu)
        assert metric_value(text, "vllm:num_requests_running") == 1
        assert metric_value(text, "vllm:kv_cache_usage_perc") > 0
        await post_json(session, f"{emu.url}/emulator/release", {})
        assert len(await read_sse(stalled)) == 3  # two more tokens and [DONE]
    status, _ = await second
    assert status == 200
    text = await metrics_text(session, emu)
    assert metric_value(text, "vllm:num_requests_running") == 0
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0


async def test_a_host_list_listens_on_every_address(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    """``--host 0.0.0.0,::`` as the sidecar's SIDECAR_HOST: both families, one port. Here on
    the loopback of each (``::1`` skipped where the kernel has no IPv6)."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        emulator = await make_emulator(host="127.0.0.1,[::1]")
    except CannotListen:
        pytest.skip("cannot bind ::1")
    assert emulator.url == f"http://127.0.0.1:{emulator.port}"
    for host in ("127.0.0.1", "[::1]"):
        async with session.get(f"http://{host}:{emulator.port}/health") as response:
            assert response.status == 200, host
