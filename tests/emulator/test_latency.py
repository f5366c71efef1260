"""The latency model's prefill term, a·n + b·((c + n)² − c²), and the words tokenizer."""

from __future__ import annotations

import aiohttp
import pytest

from sidecar.emulator import EmulatorConfig, RunningEmulator
from sidecar.emulator.config import ATTENTION_CROSSOVER_TOKENS, config_from_args
from sidecar.emulator.engine import LatencyModel, prefill_seconds
from sidecar.emulator.text import prompt_from_completion, prompt_from_messages

from .conftest import MakeEmulator
from .helpers import metric_value, metrics_text


def test_prefill_is_linear_plus_attention() -> None:
    a, crossover = 1e-4, 50_000
    assert prefill_seconds(a, crossover, 1000) == pytest.approx(a * 1000 + a / crossover * 1e6)
    # At the crossover length the quadratic term is as large as the linear one.
    assert prefill_seconds(a, crossover, crossover) == pytest.approx(2 * a * crossover)
    # Cached tokens are not computed, but attending to them is paid by the ones that are.
    cached = prefill_seconds(a, crossover, 1000, cached_tokens=4000)
    assert cached == pytest.approx(a * 1000 + a / crossover * (5000**2 - 4000**2))
    assert cached > prefill_seconds(a, crossover, 1000)
    assert prefill_seconds(a, 0, 8000) == pytest.approx(a * 8000)  # 0: linear
    assert prefill_seconds(a, crossover, 0, cached_tokens=4000) == 0.0


def test_the_default_is_super_linear_and_documented() -> None:
    config = EmulatorConfig(prefill_s_per_token=1e-4)
    assert config.prefill_crossover_tokens == ATTENTION_CROSSOVER_TOKENS
    model = LatencyModel(config)
    short, long = model.prefill(1000, running=1), model.prefill(8000, running=1)
    x = ATTENTION_CROSSOVER_TOKENS
    assert long / short == pytest.approx(8 * (1 + 8000 / x) / (1 + 1000 / x))
    assert long > 8 * short
    # Without the linear term there is no latency at all (the tests' default).
    assert LatencyModel(EmulatorConfig()).prefill(8000, running=1) == 0.0


def test_concurrency_slows_both_terms() -> None:
    model = LatencyModel(EmulatorConfig(prefill_s_per_token=1e-4, concurrency_slowdown=0.5))
    assert model.prefill(4000, running=3) == pytest.approx(2 * model.prefill(4000, running=1))


def test_cli_flags() -> None:
    config = config_from_args(["--prefill-crossover-tokens", "0", "--tokenizer", "words"])
    assert (config.prefill_crossover_tokens, config.tokenizer) == (0, "words")
    with pytest.raises(SystemExit):
        config_from_args(["--prefill-crossover-tokens", "-1"])
    with pytest.raises(SystemExit):
        config_from_args(["--tokenizer", "bpe"])


def test_the_words_tokenizer_counts_words_and_blocks_them() -> None:
    text = "word " * 40  # 40 words, 200 characters
    assert prompt_from_completion(text).num_tokens == 50  # characters / 4
    words = prompt_from_completion(text, "words")
    assert words.num_tokens == 40
    blocks = words.full_blocks(16)
    assert len(blocks) == 2
    assert blocks[0] == " ".join(text.split()[:16]).encode()
    chat = prompt_from_messages([{"role": "user", "content": "one two three"}], "words")
    assert chat.num_tokens == 4  # "user:" is a word too
    assert prompt_from_completion("", "words").num_tokens == 1


async def test_a_words_emulator_reports_word_counts_and_caches_by_word_blocks(
    make_emulator: MakeEmulator,
) -> None:
    emulator: RunningEmulator = await make_emulator(tokenizer="words", prompt_tokens_details=True)
    prompt = "longword " * 40
    async with aiohttp.ClientSession() as session:
        for expected_cached in (0, 32):
            async with session.post(
                emulator.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}
            ) as response:
                usage = (await response.json())["usage"]
            assert usage["prompt_tokens"] == 40
            assert usage["prompt_tokens_details"] == {"cached_tokens": expected_cached}


async def test_the_time_between_tokens_is_served_as_vllms_histogram(
    make_emulator: MakeEmulator,
) -> None:
    # vLLM's vllm:inter_token_latency_seconds: one observation per output token after the first,
    # its delay since the previous one; what the sidecar reads its decodes' step time from.
    emulator: RunningEmulator = await make_emulator(decode_s_per_token=0.002)
    async with aiohttp.ClientSession() as session:
        for stream in (False, True):
            body = {"prompt": "hello", "max_tokens": 5, "stream": stream}
            async with session.post(emulator.url + "/v1/completions", json=body) as response:
                await response.read()
        text = await metrics_text(session, emulator)
    assert metric_value(text, "vllm:inter_token_latency_seconds_count") == 8  # 4 each
    assert metric_value(text, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.016)
    assert 'vllm:inter_token_latency_seconds_bucket{le="0.01",model_name=' in text
