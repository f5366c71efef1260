"""The emulator publishes vLLM's KV events on vLLM's wire: what a prompt stores, what the LRU
evicts, a reset; both encodings; --kv-events-config as vLLM takes it; off, nothing is imported."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import zmq
import zmq.asyncio

from sidecar.emulator import RunningEmulator
from sidecar.emulator.config import EmulatorConfig, config_from_args
from sidecar.emulator.kv import chain_hashes
from sidecar.emulator.text import text_prompt, token_id
from sidecar.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from sidecar.kvevents.subscriber import Subscriber
from sidecar.kvevents.wire import ENCODINGS, END_SEQ_FRAME, Encoding, decode_seq, encode_seq
from tests.conftest import StartEmulator
from tests.imports import imported

from .helpers import WAIT_S, Recorder, events_config, publisher

BLOCK = 4


async def complete(
    session: aiohttp.ClientSession, emulator: RunningEmulator, prompt: object
) -> None:
    body = {"prompt": prompt, "max_tokens": 1}
    async with session.post(f"{emulator.url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


def units(text: str) -> list[bytes]:
    """The emulator's tokens of a text prompt: 4 characters each."""
    return [text[i : i + 4].encode() for i in range(0, len(text), 4)]


@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_a_prompt_is_stored_then_evicted_then_cleared(
    start_engine: StartEmulator, session: aiohttp.ClientSession, encoding: Encoding
) -> None:
    emulator = await start_engine(
        block_size=BLOCK,
        num_gpu_blocks=4,
        kv_events_config=events_config(topic="kv@emulator"),
        kv_events_encoding=encoding,
    )
    recorder = Recorder()
    port = emulator.kv_events_port
    assert port is not None
    async with Subscriber(
        host="127.0.0.1",
        port=port,
        replay_port=emulator.kv_events_replay_port,
        topic="kv@emulator",
        consumer=recorder,
    ):
        await publisher(emulator).wait_subscriptions(1)
        first = "a" * 4 * 2 * BLOCK + "tail"  # two full blocks, then a partial one
        second = "b" * 4 * 4 * BLOCK  # four full blocks: the cache holds four, A is evicted
        await complete(session, emulator, first)
        await complete(session, emulator, second)
        async with session.post(f"{emulator.url}/reset_prefix_cache") as resp:
            assert resp.status == 200
        batches = await recorder.wait_batches(3)

    assert [b.seq for b in batches] == [0, 1, 2]
    assert recorder.resets == []
    first_hashes = chain_hashes(text_prompt(first).full_blocks(BLOCK))
    second_hashes = chain_hashes(text_prompt(second).full_blocks(BLOCK))
    assert batches[0].events == (
        BlockStored(
            block_hashes=tuple(first_hashes),
            parent_block_hash=None,
            token_ids=tuple(token_id(unit) for unit in units(first)[: 2 * BLOCK]),
            block_size=BLOCK,
            medium="GPU",
        ),
    )
    assert batches[1].events == (
        BlockStored(
            block_hashes=tuple(second_hashes),
            parent_block_hash=None,
            token_ids=(token_id(b"bbbb"),) * (4 * BLOCK),
            block_size=BLOCK,
            medium="GPU",
        ),
        # Least recently used first: a prompt's tail is evicted before its head.
        BlockRemoved(block_hashes=(first_hashes[1], first_hashes[0]), medium="GPU"),
    )
    assert batches[2].events == (AllBlocksCleared(),)
    assert all(b.data_parallel_rank == 0 for b in batches)


async def test_token_id_prompts_publish_their_ids_and_only_new_blocks(
    start_engine: StartEmulator, session: aiohttp.ClientSession
) -> None:
    emulator = await start_engine(block_size=BLOCK, kv_events_config=events_config())
    recorder = Recorder()
    assert emulator.kv_events_port is not None
    async with Subscriber(
        host="127.0.0.1",
        port=emulator.kv_events_port,
        replay_port=emulator.kv_events_replay_port,
        consumer=recorder,
    ):
        await publisher(emulator).wait_subscriptions(1)
        await complete(session, emulator, list(range(100, 109)))  # two full blocks
        await complete(session, emulator, list(range(100, 113)))  # a hit on both, one new
        batches = await recorder.wait_batches(2)
    head, more = batches[0].events[0], batches[1].events[0]
    assert isinstance(head, BlockStored)
    assert isinstance(more, BlockStored)
    assert head.token_ids == tuple(range(100, 108))
    assert head.parent_block_hash is None
    assert more.token_ids == tuple(range(108, 112))
    assert more.parent_block_hash == head.block_hashes[-1]  # chained after what was cached


async def test_kv_events_state_shows_in_the_kv_view(
    start_engine: StartEmulator, session: aiohttp.ClientSession
) -> None:
    on = await start_engine(kv_events_config=events_config(buffer_steps=3))
    off = await start_engine()
    await complete(session, on, "x" * 64)
    async with session.get(f"{on.url}/emulator/kv") as resp:
        view = (await resp.json())["kv_events"]
    assert view["enabled"] is True
    assert view["next_seq"] == 1
    assert view["encoding"] == "map"
    assert view["port"] == on.kv_events_port
    assert view["replay_port"] == on.kv_events_replay_port
    async with session.get(f"{off.url}/emulator/kv") as resp:
        assert (await resp.json())["kv_events"] == {"enabled": False}
    assert off.kv_events_port is None


def test_the_flag_takes_vllms_json() -> None:
    text = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 50, "hwm": 10}'
    )
    config = config_from_args(["--kv-events-config", text, "--kv-events-encoding", "array"])
    options = config.kv_events()
    assert options is not None
    assert options.enabled
    assert (options.endpoint, options.replay_endpoint, options.topic) == (
        "tcp://*:5557",
        "tcp://*:5558",
        "kv",
    )
    assert (options.buffer_steps, options.hwm, config.kv_events_encoding) == (50, 10, "array")
    # vLLM: enabling events without a publisher means "zmq".
    implied = EmulatorConfig(kv_events_config='{"enable_kv_cache_events": true}').kv_events()
    assert implied is not None
    assert implied.publisher == "zmq"


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1]",
        '{"enable_kv_cache_events": true, "colour": "red"}',
        '{"enable_kv_cache_events": "yes"}',
        '{"enable_kv_cache_events": true, "publisher": "kafka"}',
        '{"enable_kv_cache_events": true, "buffer_steps": 0}',
        '{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}',
    ],
)
def test_a_bad_kv_events_config_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="kv_events_config"):
        EmulatorConfig(kv_events_config=text)
    with pytest.raises(SystemExit):
        config_from_args(["--kv-events-config", text])


def test_the_sidecar_and_the_emulator_import_neither_zmq_nor_msgpack() -> None:
    modules = imported("-c", "import sidecar.app, sidecar.emulator.app, sidecar.emulator.__main__")
    assert not {name for name in modules if name.split(".")[0] in ("zmq", "msgpack")}


async def test_a_replay_longer_than_the_queues_reaches_a_slow_reader_whole(
    start_engine: StartEmulator,
) -> None:
    """1,500 batches of ~20 KiB (30 MB: beyond the ROUTER's 1,000 messages, a small receive
    queue and the TCP buffers) to a reader that takes one message per turn of the loop: every
    batch arrives, in order, then the end marker (a ROUTER that drops lost the tail and it)."""
    emulator = await start_engine(kv_events_config=events_config(buffer_steps=2_000))
    events = publisher(emulator)
    stored = BlockStored(
        block_hashes=tuple(range(1, 1025)),
        parent_block_hash=None,
        token_ids=tuple(range(100_000, 100_000 + 1024 * BLOCK)),
        block_size=BLOCK,
        medium="GPU",
    )
    for _ in range(1_500):
        events.stored([stored], [])
    assert emulator.kv_events_replay_port is not None
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 10)
    seqs: list[int] = []
    try:
        dealer.connect(f"tcp://127.0.0.1:{emulator.kv_events_replay_port}")
        await dealer.send_multipart([b"", encode_seq(0)])

        async def read_slowly() -> bytes:
            while True:
                _, _, seq, payload = await dealer.recv_multipart()
                if seq == END_SEQ_FRAME:
                    return payload
                seqs.append(decode_seq(seq))
                assert len(payload) > 16 * 1024
                await asyncio.sleep(0)  # the publisher's turn: it sends ahead, up to the HWMs

        assert await asyncio.wait_for(read_slowly(), 4 * WAIT_S) == b""
    finally:
        context.destroy(linger=0)
    assert seqs == list(range(1_500))
    assert events.replays_abandoned_total == 0
