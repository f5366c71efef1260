"""The scrape's parser: the gauges and the KV cache's size, from a real emulator's /metrics and from
malformed text."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from sidecar.emulator import EmulatorConfig, start_emulator
from sidecar.engines.scrape import cache_tokens_of, parse_engine_load
from sidecar.fleet.load import EngineLoad, describe_load, merge_loads

INFO = "vllm:cache_config_info"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.mark.parametrize(("block_size", "num_gpu_blocks"), [(16, 4096), (32, 1000)])
async def test_the_cache_size_of_a_real_emulator(
    http: aiohttp.ClientSession, block_size: int, num_gpu_blocks: int
) -> None:
    config = EmulatorConfig(port=0, block_size=block_size, num_gpu_blocks=num_gpu_blocks)
    async with (
        await start_emulator(config) as emulator,
        http.get(emulator.url + "/metrics") as response,
    ):
        text = await response.text()
    load = parse_engine_load(text, at=5.0)
    assert load.cache_tokens == block_size * num_gpu_blocks
    assert (load.waiting, load.running, load.at) == (0.0, 0.0, 5.0)
    assert describe_load(load, now=6.0) == {
        "waiting": 0.0,
        "running": 0.0,
        "kv_usage": 0.0,
        "cache_tokens": block_size * num_gpu_blocks,
        "age_s": 1.0,
    }


def info(labels: str) -> str:
    return f"{INFO}{{{labels}}} 1.0"


VLLM_LIKE = (
    'block_size="16",user_specified_block_size="False",gpu_memory_utilization="0.92",'
    'cache_dtype="auto",num_gpu_blocks_override="None",enable_prefix_caching="True",'
    "kv_cache_dtype_skip_layers=\"['0', '2']\",mamba_block_size=\"None\","
    'num_gpu_blocks="27000",num_cpu_blocks="None",engine="0"'
)


@pytest.mark.parametrize(
    ("labels", "tokens"),
    [
        (VLLM_LIKE, 16 * 27000),
        # Names are matched whole: mamba_block_size is not block_size, nor the override the count.
        (
            'mamba_block_size="1024",block_size="16",num_gpu_blocks_override="7",'
            'num_gpu_blocks="10"',
            160,
        ),
        # A value may hold commas, escaped quotes and what looks like another label.
        ('note="a,num_gpu_blocks=\\"5\\"",block_size="16",num_gpu_blocks="100"', 1600),
        ('block_size="16",num_gpu_blocks="100",kv_cache_size_tokens="1500"', 1500),  # preferred
        ('block_size="16",num_gpu_blocks="100",kv_cache_size_tokens="None"', 1600),
        ('block_size="16",num_gpu_blocks="100",', 1600),  # a trailing comma is allowed
        ('block_size="65536",num_gpu_blocks="100000"', 65536 * 100000),
        # Before the engine profiled its memory, and other values not to be trusted:
        ('block_size="16",num_gpu_blocks="None"', None),
        ('block_size="16"', None),
        ('num_gpu_blocks="100"', None),
        ('block_size="16",num_gpu_blocks="0"', None),
        ('block_size="16",num_gpu_blocks="-100"', None),
        ('block_size="16",num_gpu_blocks="1e3"', None),
        ('block_size="16",num_gpu_blocks=" 100"', None),
        ('block_size="16",num_gpu_blocks="١٠٠"', None),  # digits, but not ASCII ones
        ('block_size="16",num_gpu_blocks="99999999999999999999999"', None),
        ('block_size="65537",num_gpu_blocks="100"', None),
        ('block_size="16",num_gpu_blocks="100000001"', None),
        ('block_size="65536",num_gpu_blocks="1000000"', None),  # 6.5·10¹⁰ tokens: too many
        ('block_size="16",num_gpu_blocks="100"" engine="0"', None),
        ('block_size="16" num_gpu_blocks="100"', None),
        ("block_size=16,num_gpu_blocks=100", None),
        ('block_size="16",num_gpu_blocks="100', None),
    ],
)
def test_the_cache_size_from_the_labels(labels: str, tokens: int | None) -> None:
    assert cache_tokens_of(info(labels)) == tokens
    assert parse_engine_load(info(labels) + "\n", at=0.0).cache_tokens == tokens


def test_a_cache_size_is_unknown_unless_every_line_of_it_is_good() -> None:
    assert cache_tokens_of(f'{INFO}{{block_size="16",num_gpu_blocks="10"') is None  # no brace
    assert cache_tokens_of(f"{INFO} 1.0") is None  # no labels
    padding = "x" * 20_000  # longer than any vLLM's line: not parsed at all
    assert cache_tokens_of(info(f'block_size="16",num_gpu_blocks="10",pad="{padding}"')) is None
    one = info('block_size="16",num_gpu_blocks="10",engine="0"')
    two = info('block_size="16",num_gpu_blocks="30",engine="1"')
    bad = info('block_size="16",num_gpu_blocks="None",engine="1"')
    gauges = "# HELP x\nvllm:num_requests_waiting 3.0\nvllm:num_requests_running 1.0\n"
    assert parse_engine_load(gauges + one + "\n" + two, at=0.0).cache_tokens == 640  # engines
    load = parse_engine_load(gauges + one + "\n" + bad, at=0.0)
    assert (load.cache_tokens, load.waiting, load.running) == (None, 3.0, 1.0)
    assert parse_engine_load(gauges, at=0.0).cache_tokens is None
    many = "\n".join(info(f'block_size="16",num_gpu_blocks="10",engine="{i}"') for i in range(65))
    assert parse_engine_load(many, at=0.0).cache_tokens is None


def test_data_parallel_ranks_sum_their_caches() -> None:
    assert EngineLoad(1.0, 2.0, None, 0.0).cache_tokens is None  # positional, as before
    first = EngineLoad(1.0, 2.0, 0.5, at=3.0, cache_tokens=100)
    second = EngineLoad(0.0, 1.0, 0.1, at=2.0, cache_tokens=50)
    merged = merge_loads([first, second])
    assert merged is not None
    assert (merged.cache_tokens, merged.waiting, merged.at) == (150, 1.0, 2.0)
    unknown = merge_loads([first, EngineLoad(0.0, 1.0, 0.1, at=2.0)])
    assert unknown is not None
    assert unknown.cache_tokens is None


def test_the_gauges_are_found_on_any_line_and_by_their_whole_name() -> None:
    text = (
        'vllm:num_requests_waiting{model_name="a"} 2.0\r\n'  # the first line, CRLF
        "# HELP vllm:num_requests_running Requests running.\r\n"
        'vllm:num_requests_running_by_kind{kind="x"} 50.0\r\n'  # a longer name: not it
        'vllm:num_requests_waiting{model_name="b"} 1.0\r\n'
        "vllm:num_requests_running 4.0\r\n"
        "vllm:kv_cache_usage_perc NaN\r\n"  # unknown
        "vllm:kv_cache_usage_perc\r\n"  # no value
        "vllm:num_requests_waiting"  # the last line, no value
    )
    load = parse_engine_load(text, at=0.0)
    assert (load.waiting, load.running, load.kv_usage) == (3.0, 4.0, None)
    assert parse_engine_load("", at=0.0) == EngineLoad(None, None, None, at=0.0)


def test_the_inter_token_histogram_is_read_under_either_of_vllms_names() -> None:
    itl = "vllm:inter_token_latency_seconds"
    text = (
        f'{itl}_bucket{{le="0.05",model_name="m",engine="0"}} 90.0\n'
        f'{itl}_sum{{model_name="m",engine="0"}} 3.5\n'
        f'{itl}_count{{model_name="m",engine="0"}} 100.0\n'
        f'{itl}_sum{{model_name="m",engine="1"}} 1.5\n'
        f'{itl}_count{{model_name="m",engine="1"}} 50.0\n'
        "vllm:time_per_output_token_seconds_sum 99.0\n"  # the old name: the new one wins
        "vllm:time_per_output_token_seconds_count 99.0\n"
    )
    load = parse_engine_load(text, at=0.0)
    assert (load.itl_sum_s, load.itl_count) == (5.0, 150.0)
    old = parse_engine_load(text.replace(itl, "vllm:other"), at=0.0)
    assert (old.itl_sum_s, old.itl_count) == (99.0, 99.0)
    half = parse_engine_load(f"{itl}_sum 3.5\n", at=0.0)  # a sum without its count: unknown
    assert (half.itl_sum_s, half.itl_count) == (None, None)
    # A counter is finite and never negative: a histogram with any other value is unknown.
    for bad in ("+Inf", "inf", "-1.0"):
        for part in ("_sum", "_count"):
            wrong = parse_engine_load(text + f'{itl}{part}{{engine="9"}} {bad}\n', at=0.0)
            assert (wrong.itl_sum_s, wrong.itl_count) == (None, None), (bad, part)
    # Data-parallel ranks: summed, unknown while any rank's is.
    first = EngineLoad(0.0, 1.0, None, at=1.0, itl_sum_s=2.0, itl_count=40.0)
    second = EngineLoad(0.0, 1.0, None, at=1.0, itl_sum_s=1.0, itl_count=10.0)
    merged = merge_loads([first, second])
    assert merged is not None
    assert (merged.itl_sum_s, merged.itl_count) == (3.0, 50.0)
    unknown = merge_loads([first, EngineLoad(0.0, 1.0, None, at=1.0)])
    assert unknown is not None
    assert (unknown.itl_sum_s, unknown.itl_count) == (None, None)


async def test_a_real_emulators_inter_token_histogram(http: aiohttp.ClientSession) -> None:
    config = EmulatorConfig(port=0, decode_s_per_token=0.001)
    async with await start_emulator(config) as emulator:
        body = {"prompt": "hello", "max_tokens": 3}
        async with http.post(emulator.url + "/v1/completions", json=body) as response:
            assert response.status == 200
        async with http.get(emulator.url + "/metrics") as response:
            load = parse_engine_load(await response.text(), at=0.0)
    assert load.itl_count == 2
    assert load.itl_sum_s == pytest.approx(0.002)
