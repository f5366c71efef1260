"""The prefix cache of a prefill engine against real sockets: hits, their latency, their counters,
LRU eviction at ``--num-gpu-blocks``, and the cache config vLLM exports."""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from sidecar.emulator import RunningEmulator
from sidecar.emulator.config import ATTENTION_CROSSOVER_TOKENS
from sidecar.emulator.engine import prefill_seconds

from .conftest import MakeEmulator
from .helpers import get_json, metric_value, metrics_text, post_json

BLOCK = 16  # the emulator's default block size
A = 0.0002  # prefill seconds per uncached token


async def prefill(
    session: aiohttp.ClientSession, emulator: RunningEmulator, prompt: str
) -> dict[str, Any]:
    """A prefill leg, as a sidecar sends it; its answer's body."""
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    status, answer = await post_json(session, f"{emulator.url}/v1/completions", body)
    assert status == 200, answer
    assert answer["kv_transfer_params"]["do_remote_prefill"] is True  # served as a prefill
    return dict(answer)


def cached_tokens(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def counters(session: aiohttp.ClientSession, emulator: RunningEmulator) -> tuple[int, int]:
    """``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``."""
    text = await metrics_text(session, emulator)
    return (
        int(metric_value(text, "vllm:prefix_cache_queries_total")),
        int(metric_value(text, "vllm:prefix_cache_hits_total")),
    )


async def test_a_shared_1000_token_prefix_hits_and_its_prefill_is_faster(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    emulator = await make_emulator(prompt_tokens_details=True, prefill_s_per_token=A)
    system = ("You are a careful assistant. " * 200)[: 1000 * 4]  # 1,000 tokens
    first_user = ("What is the first question? " * 10)[:200]  # 50 tokens each
    second_user = ("Here is another question. " * 10)[:200]
    assert first_user[:32] != second_user[:32]  # the block across the boundary differs

    timings, answers, deltas = [], [], []
    for user in (first_user, second_user):
        before = await counters(session, emulator)
        started = time.perf_counter()
        answers.append(await prefill(session, emulator, system + user))
        timings.append(time.perf_counter() - started)
        after = await counters(session, emulator)
        deltas.append((after[0] - before[0], after[1] - before[1]))

    shared = 1000 // BLOCK * BLOCK  # 992: the block holding both prefix and question differs
    assert [cached_tokens(answer) for answer in answers] == [0, shared]
    assert [answer["usage"]["prompt_tokens"] for answer in answers] == [1050, 1050]
    # The counters count tokens: every prompt token queried, the cached ones hit.
    assert deltas == [(1050, 0), (1050, shared)]
    # The latency model charges only the uncached tokens (and their attention over the cached).
    cold = prefill_seconds(A, ATTENTION_CROSSOVER_TOKENS, 1050)
    warm = prefill_seconds(A, ATTENTION_CROSSOVER_TOKENS, 1050 - shared, shared)
    assert warm < cold / 10
    assert timings[0] >= cold
    assert warm <= timings[1] < cold


async def test_the_cache_evicts_least_recently_used_blocks_at_num_gpu_blocks(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    """Eight blocks hold two 4-block prompts. A hit makes a prompt recent; a third prompt evicts
    the least recent one; a partial eviction takes a prompt's tail and leaves its head."""
    emulator = await make_emulator(prompt_tokens_details=True, num_gpu_blocks=8)

    def prompt(letter: str, blocks: int) -> str:
        return letter * (blocks * BLOCK + 1) * 4  # full blocks and one token more

    sequence = [
        ("a", 4),  # cache (least recent first): A
        ("b", 4),  # A B: full
        ("a", 4),  # hit: B A
        ("c", 4),  # B evicted: A C
        ("a", 4),  # hit: C A
        ("b", 4),  # B was evicted: miss, evicts C: A B
        ("e", 2),  # evicts the two least recent blocks: A's last two
        ("a", 4),  # A's first two blocks are left
        ("c", 4),  # C was evicted
    ]
    before = await counters(session, emulator)
    found = [cached_tokens(await prefill(session, emulator, prompt(*item))) for item in sequence]
    after = await counters(session, emulator)
    assert found == [0, 0, 64, 0, 64, 0, 0, 32, 0]
    assert after[1] - before[1] == sum(found)
    state = await get_json(session, f"{emulator.url}/emulator/kv")
    assert state["prefix_cache_blocks"] == 8
    # inserted: 4+4+4+4+2 new blocks, then A's 2 evicted ones again, then C's 4 = 24 in all
    assert state["prefix_cache_evicted_total"] == 24 - 8


async def test_the_cache_config_is_exported_as_vllm_does(
    make_emulator: MakeEmulator, session: aiohttp.ClientSession
) -> None:
    emulator = await make_emulator(block_size=32, num_gpu_blocks=1234)
    text = await metrics_text(session, emulator)
    [line] = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert 'block_size="32"' in line
    assert 'num_gpu_blocks="1234"' in line
    assert 'engine="0"' in line
    assert "model_name" not in line  # vLLM's info gauge has none
    assert line.endswith(" 1.0")


async def test_reset_prefix_cache_forgets_every_block(
    emulator: RunningEmulator, session: aiohttp.ClientSession
) -> None:
    prompt = "r" * 4 * 40
    await prefill(session, emulator, prompt)
    assert cached_tokens(await prefill(session, emulator, prompt)) == 32
    async with session.post(f"{emulator.url}/reset_prefix_cache") as response:
        assert response.status == 200
        assert await response.read() == b""
    assert (await get_json(session, f"{emulator.url}/emulator/kv"))["prefix_cache_blocks"] == 0
    assert cached_tokens(await prefill(session, emulator, prompt)) == 0
