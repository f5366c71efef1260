"""The request's token ids from the local engine's ``/tokenize``: the emulator on a real port,
and the None paths (an engine that refuses, one that never answers, bad answers, bounds)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.emulator.text import prompt_from_messages, text_prompt
from sidecar.emulator.tokenize import prompt_token_ids, prompt_units, unit_token_id
from sidecar.engines.upstream import HttpClient
from sidecar.kvevents.events import BlockStored, EventBatch
from sidecar.kvevents.index import Hit, KVIndex, PromptKeys
from sidecar.kvevents.tokens import TokenSource, tokenize_request
from tests.conftest import StartEmulator

LONG = "The KV cache moves from prefill to decode, block by block. " * 40


@pytest.fixture
async def client() -> AsyncIterator[HttpClient]:
    http = HttpClient(connect_timeout_s=1.0)
    await http.open()
    yield http
    await http.close()


async def test_the_emulator_tokenizes_like_vllm(start_engine: StartEmulator) -> None:
    engine = await start_engine(max_model_len=8192)
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{engine.url}/tokenize", json={"prompt": "abcdefghij", "return_token_strs": True}
        ) as response:
            assert response.status == 200
            answer = await response.json()
        assert answer == {
            "count": 3,
            "max_model_len": 8192,
            "tokens": [unit_token_id("abcd"), unit_token_id("efgh"), unit_token_id("ij")],
            "token_strs": ["abcd", "efgh", "ij"],
        }
        messages = [{"role": "user", "content": "hi there"}]
        async with http.post(f"{engine.url}/tokenize", json={"messages": messages}) as response:
            chat = await response.json()
        assert chat["tokens"] == list(prompt_token_ids(prompt_from_messages(messages)))
        assert chat["count"] == prompt_from_messages(messages).num_tokens
        assert chat["token_strs"] is None
        async with http.post(f"{engine.url}/tokenize", json={"prompt": 3}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["type"] == "BadRequestError"
        async with http.post(
            f"{engine.url}/tokenize", json={"model": "other", "prompt": "x"}
        ) as response:
            assert response.status == 404


def test_token_ids_follow_the_emulators_blocks() -> None:
    """Each prefix-cache block of the emulator holds the units whose ids ``/tokenize`` gives:
    block k of 16 tokens is ids [16k, 16k + 16) (the rule a KV-event publisher must use)."""
    for prompt in (text_prompt(LONG), text_prompt(LONG, "words")):
        ids = prompt_token_ids(prompt)
        assert len(ids) == prompt.num_tokens
        blocks = prompt.full_blocks(16)
        assert len(blocks) == len(ids) // 16
        for k, block in enumerate(blocks):
            text = block.decode()
            units = text.split() if prompt.words else [text[i : i + 4] for i in range(0, 64, 4)]
            assert [unit_token_id(u) for u in units] == list(ids[16 * k : 16 * k + 16])
    assert prompt_units(text_prompt("", "words")) == [""]


async def test_the_source_gets_the_engines_ids(
    start_engine: StartEmulator, client: HttpClient
) -> None:
    engine = await start_engine()
    source = TokenSource(client, engine.url, timeout_s=2.0)
    model = engine.config.model
    ids = await source.token_ids({"model": model, "prompt": LONG, "max_tokens": 5})
    assert ids == list(prompt_token_ids(text_prompt(LONG)))
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "Why?"}]
    chat = await source.token_ids({"model": model, "messages": messages})
    assert chat == list(prompt_token_ids(prompt_from_messages(messages)))
    # Token ids need no call; a batch of one is that prompt.
    assert await source.token_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert await source.token_ids({"prompt": [[5, 6]]}) == [5, 6]
    assert await source.token_ids({"prompt": ["abcd"]}) == [unit_token_id("abcd")]
    assert (source.stats.answered, source.stats.given) == (3, 2)
    # An engine that does not serve the model answers 404: None.
    assert await source.token_ids({"model": "not-served", "prompt": "x"}) is None
    assert source.stats.failed == 1


async def test_what_ids_cannot_stand_for_is_none_without_a_call(client: HttpClient) -> None:
    source = TokenSource(client, "http://127.0.0.9:1", timeout_s=1.0)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for body in (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, image]}]},
        {"messages": [{"role": "user", "content": "x"}], "documents": [{"text": "d"}]},
        {"prompt": ["one", "two"]},
        {"prompt": [[1], [2]]},
        {"prompt": [1, -2]},
        {"prompt": [True]},
        {"prompt": [1, False]},
        {"prompt": [1, 1 << 32]},
        {"prompt": [1.0]},
        {"prompt_embeds": "AAAA", "prompt": ""},
        {"max_tokens": 3},
    ):
        assert await source.token_ids(body) is None, body
    assert source.stats.unsupported == 11
    assert source.stats.refused == 0  # none of them was sent


def test_the_tokenize_request_carries_the_chat_options_vllm_reads() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "temperature": 0.5,
        "stream": True,
    }
    assert tokenize_request(body) == {
        "model": "m",
        "messages": body["messages"],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": body["tools"],
    }
    assert tokenize_request({"prompt": "p", "add_special_tokens": False, "n": 2}) == {
        "prompt": "p",
        "add_special_tokens": False,
    }


async def test_a_refusing_engine_is_none(client: HttpClient) -> None:
    source = TokenSource(client, "http://127.0.0.9:1", timeout_s=1.0)
    assert await source.token_ids({"prompt": "hello"}) is None
    assert source.stats.refused == 1


class Silent:
    """A loopback server that accepts and never answers, until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.connected = 0
        self.both = asyncio.Event()
        self.url = ""

    async def hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connected += 1
        if self.connected == 2:
            self.both.set()
        await self.release.wait()
        writer.close()


@pytest.fixture
async def silent() -> AsyncIterator[Silent]:
    state = Silent()
    server = await asyncio.start_server(state.hold, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    yield state
    state.release.set()
    server.close()
    await server.wait_closed()


async def test_a_silent_engine_costs_the_timeout_and_is_none(
    client: HttpClient, silent: Silent
) -> None:
    source = TokenSource(client, silent.url, timeout_s=0.05)
    started = time.monotonic()
    assert await source.token_ids({"prompt": "hello"}) is None
    assert time.monotonic() - started < 1.0
    assert source.stats.timeout == 1


async def test_calls_beyond_the_bound_are_none_at_once(client: HttpClient, silent: Silent) -> None:
    source = TokenSource(client, silent.url, timeout_s=5.0, max_inflight=2)
    held = [asyncio.create_task(source.token_ids({"prompt": f"p{i}"})) for i in range(2)]
    await asyncio.wait_for(silent.both.wait(), 5.0)  # both calls reached the engine
    started = time.monotonic()
    assert await source.token_ids({"prompt": "third"}) is None
    assert time.monotonic() - started < 1.0
    assert source.stats.busy == 1
    silent.release.set()  # the silent server closes: both held calls end, as failures
    assert await asyncio.gather(*held) == [None, None]
    assert source.stats.failed == 2


async def _fake_engine(answer: web.Response) -> web.AppRunner:
    async def tokenize(request: web.Request) -> web.Response:
        return answer

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


@pytest.mark.parametrize(
    ("answer", "counter"),
    [
        (web.json_response({"error": {"message": "no"}}, status=404), "failed"),
        (web.Response(body=b"not json"), "invalid"),
        (web.json_response({"tokens": [1, "2"]}), "invalid"),
        (web.json_response({"tokens": [1, True]}), "invalid"),
        (web.json_response({"tokens": [1, 2.0]}), "invalid"),
        (web.json_response({"tokens": [1, 1 << 32]}), "invalid"),
        (web.json_response({"tokens": []}), "invalid"),
        (web.json_response({"tokens": [1, 2, 3, 4, 5]}), "invalid"),
        (web.json_response({"tokens": list(range(5000))}), "invalid"),
    ],
)
async def test_bad_answers_are_none(client: HttpClient, answer: web.Response, counter: str) -> None:
    runner = await _fake_engine(answer)
    try:
        port = runner.addresses[0][1]
        source = TokenSource(client, f"http://127.0.0.1:{port}", timeout_s=2.0, max_tokens=4)
        assert await source.token_ids({"prompt": "x"}) is None
        stats: dict[str, Any] = {
            name: getattr(source.stats, name) for name in ("failed", "invalid", "answered")
        }
        assert stats[counter] == 1
        assert stats["answered"] == 0
    finally:
        await runner.cleanup()


async def test_the_ids_key_the_blocks_the_emulators_events_announce(
    start_engine: StartEmulator, client: HttpClient
) -> None:
    """A publisher following the emulator's rule (block k holds ids [16k, 16k + 16)) and the
    ids ``/tokenize`` gives meet in the index: the chat's cached blocks are found."""
    engine = await start_engine()
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "Why?"}]
    prompt = prompt_from_messages(messages)
    ids = prompt_token_ids(prompt)
    blocks = len(prompt.full_blocks(16))
    index = KVIndex(max_blocks=1000)
    stored = BlockStored(
        block_hashes=tuple(range(1, blocks + 1)),
        parent_block_hash=None,
        token_ids=ids[: blocks * 16],
        block_size=16,
    )
    index.apply(EventBatch(seq=0, ts=0.0, events=(stored,)))
    source = TokenSource(client, engine.url, timeout_s=2.0)
    asked = await source.token_ids({"messages": messages})
    assert asked is not None
    expected = min(blocks, (len(asked) - 1) // 16) * 16
    assert expected > 0
    assert index.lookup(PromptKeys(asked)) == Hit(gpu=expected)
    # Another conversation's system prompt shares nothing.
    other = await source.token_ids({"messages": [{"role": "system", "content": "x" + LONG}]})
    assert other is not None
    assert index.lookup(PromptKeys(other)) == Hit()
