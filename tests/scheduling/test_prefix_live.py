"""Prefix-aware prefill placement in running sidecars: emulated prefill engines with prefix caches,
the engines' cached_tokens as feedback, and the index shared through a real redis-server."""

from __future__ import annotations

import logging

import aiohttp
import pytest
import redis.asyncio as aioredis

from sidecar.config import Settings
from sidecar.scheduling.state.prefix_share import stream_key
from sidecar.server.runner import start_sidecar
from tests.conftest import StartEmulator, StartSidecar, completion, eventually, get_json, metric
from tests.processes import RedisServer

KEY = "a-test-key-of-32-characters-long"
SYSTEM = "".join(
    f"System prompt paragraph {n:04d}: answer with care. ".ljust(100) for n in range(80)
)
"""8,000 characters: 2,000 tokens as the emulator counts them (and as the sidecar estimates)."""


def user(n: int) -> str:
    """A distinct user part of 2,400 characters (600 tokens): enough uncached tokens after the
    shared prefix (which the local decode engine holds after the first request) to go remote."""
    return "".join(f"Question {n} line {k}: what do you make of it? ".ljust(100) for k in range(24))


async def send(http: aiohttp.ClientSession, url: str, prompt: str) -> dict:
    async with http.post(url + "/v1/completions", json=completion(prompt)) as response:
        assert response.status == 200, await response.text()
        await response.read()
        request_id = response.headers["x-request-id"]
    return await get_json(http, f"{url}/debug/requests/{request_id}")


async def hits(http: aiohttp.ClientSession, url: str) -> float:
    return await metric(http, url, "vllm:prefix_cache_hits_total")


async def test_a_shared_prefix_goes_to_the_prefill_server_that_holds_it(
    http: aiohttp.ClientSession, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    one = await start_engine(prompt_tokens_details=True)
    two = await start_engine(prompt_tokens_details=True)
    engines = {one.endpoint: one, two.endpoint: two}
    sidecar = await start_sidecar_with(prefill_endpoints=f"{one.endpoint},{two.endpoint}")

    first = await send(http, sidecar.url, SYSTEM + user(0))
    assert (first["decision"], first["reason"]) == ("remote", "scheduled")
    holder = engines[first["prefill_endpoint"]]
    before = {key: await hits(http, engine.url) for key, engine in engines.items()}
    assert first["prefill_predicted_cached_tokens"] == 0
    for n in range(1, 6):
        record = await send(http, sidecar.url, SYSTEM + user(n))
        assert (record["decision"], record["prefill_endpoint"]) == ("remote", holder.endpoint)
        assert record["prefill_predicted_cached_tokens"] == 31 * 64  # the system prompt's blocks
    # The holder found the 2,000-token system prompt cached on each of the five.
    assert await hits(http, holder.url) - before[holder.endpoint] == 5 * 2000
    other = next(key for key in engines if key != holder.endpoint)
    assert await hits(http, engines[other].url) == before[other]

    snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
    index = snapshot["prefill_prefixes"]
    assert index["enabled"]
    assert index["feedback"] == "closed"
    held = index["endpoints"][holder.endpoint]
    assert held["answers_with_cached_tokens"] == 6
    assert held["held_less_than_predicted"] == 0
    # 31 blocks of 64 estimated tokens predicted (1,984 of 2,600) against 2,000 reported: within
    # one block of the prefix.
    assert 0 < held["mean_abs_error_tokens"] <= 64
    family = "pd_sidecar_prefill_cached_tokens_total"
    reported = await metric(http, sidecar.url, family + '{source="reported"}')
    predicted = await metric(http, sidecar.url, family + '{source="predicted"}')
    assert reported == 5 * 2000
    assert predicted == pytest.approx(reported, rel=0.1)


async def test_the_prefix_blind_setting_spreads_a_shared_prefix(
    http: aiohttp.ClientSession, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    one = await start_engine(prompt_tokens_details=True)
    two = await start_engine(prompt_tokens_details=True)
    sidecar = await start_sidecar_with(
        prefill_endpoints=f"{one.endpoint},{two.endpoint}",
        prefill_prefix_index=False,
        scheduler_policy="round_robin",
        # Blind, a remote prefill of the whole prompt looks 4x a local one of the user part:
        # never worth it at the default ratio (which is why the index matters).
        disagg_ttft_ratio=1000,
    )
    endpoints = {
        (await send(http, sidecar.url, SYSTEM + user(n)))["prefill_endpoint"] for n in range(4)
    }
    assert endpoints == {one.endpoint, two.endpoint}
    snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
    assert snapshot["prefill_prefixes"] == {"enabled": False}


async def test_without_prompt_tokens_details_the_index_runs_open_loop_and_says_so(
    http: aiohttp.ClientSession,
    start_sidecar_with: StartSidecar,
    prefill,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.scheduling")
    sidecar = await start_sidecar_with(prefill_endpoints=prefill.endpoint)
    assert any("runs open-loop without them" in r.getMessage() for r in caplog.records)
    await send(http, sidecar.url, SYSTEM + user(0))
    await send(http, sidecar.url, SYSTEM + user(1))
    snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
    index = snapshot["prefill_prefixes"]
    assert index["feedback"] == "open"
    assert index["endpoints"][prefill.endpoint]["answers_without"] == 2
    warnings = [r for r in caplog.records if "runs open-loop (start vLLM prefill" in r.getMessage()]
    assert len(warnings) == 1  # said once, not per request


@pytest.mark.timeout(60)
async def test_sidecars_share_what_they_placed_through_redis_as_keyed_digests(
    http: aiohttp.ClientSession, start_engine: StartEmulator, redis_server: RedisServer
) -> None:
    decode = await start_engine()
    one = await start_engine(prompt_tokens_details=True)
    two = await start_engine(prompt_tokens_details=True)

    def settings() -> Settings:
        return Settings(
            host="127.0.0.1",
            port=0,
            decode_url=decode.url,
            prefill_endpoints=f"{one.endpoint},{two.endpoint}",
            state_backend="redis",
            redis_url=redis_server.url,
            redis_key_prefix="test",
            prefix_hash_key=KEY,
        )

    first, second = await start_sidecar(settings()), await start_sidecar(settings())
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        placed = await send(http, first.url, SYSTEM + user(0))
        holder = placed["prefill_endpoint"]

        async def learnt() -> bool:
            snapshot = await get_json(http, second.url + "/debug/scheduler")
            return snapshot["prefill_prefixes"]["endpoints"].get(holder, {}).get("blocks", 0) > 0

        await eventually(learnt)
        # The second sidecar never sent this prompt, yet sends it where the first did.
        record = await send(http, second.url, SYSTEM + user(1))
        assert (record["decision"], record["prefill_endpoint"]) == ("remote", holder)

        # Redis holds digests, never the prompt's text.
        entries = await client.xrange(stream_key("test"))
        assert entries
        for _, fields in entries:
            assert fields is not None
            assert fields[b"e"] in (one.endpoint.encode(), two.endpoint.encode())
            assert len(fields[b"h"]) % 8 == 0
            assert b"System prompt" not in fields[b"h"]
        # A malformed entry (whoever can write Redis) is skipped and counted, never applied.
        await client.xadd(stream_key("test"), {"s": "intruder", "e": holder, "h": b"odd"})

        async def skipped() -> bool:
            sample = 'pd_sidecar_state_entries_skipped_total{kind="prefix"}'
            return await metric(http, first.url, sample) >= 1

        await eventually(skipped)
    finally:
        await client.aclose()
        await first.close()
        await second.close()
