"""The subscriber on real ZMQ sockets (loopback): gaps replayed or reset, a restarted publisher,
hostile messages counted as drops, the bound of the queue to the consumer."""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import msgpack

from sidecar.emulator import RunningEmulator
from sidecar.kvevents.events import AllBlocksCleared, EventBatch
from sidecar.kvevents.subscriber import Backoff, ResetReason, Subscriber
from sidecar.kvevents.wire import DropReason, WireLimits, encode_message, encode_seq
from tests.conftest import StartEmulator

from .helpers import WAIT_S, RawPublisher, Recorder, events_config, publisher


async def complete(session: aiohttp.ClientSession, emulator: RunningEmulator, text: str) -> None:
    async with session.post(
        f"{emulator.url}/v1/completions", json={"prompt": text, "max_tokens": 1}
    ) as resp:
        assert resp.status == 200


async def store(session: aiohttp.ClientSession, emulator: RunningEmulator, count: int) -> None:
    """``count`` prompts with no block in common with any other: one batch each."""
    for _ in range(count):
        await complete(session, emulator, f"{uuid.uuid4().hex} " * 8)


def subscriber_of(emulator: RunningEmulator, consumer: Recorder, **options: object) -> Subscriber:
    assert emulator.kv_events_port is not None
    return Subscriber(
        host="127.0.0.1",
        port=emulator.kv_events_port,
        replay_port=emulator.kv_events_replay_port,
        consumer=consumer,
        **options,  # type: ignore[arg-type]
    )


async def test_what_was_published_before_the_subscription_is_replayed(
    start_engine: StartEmulator, session: aiohttp.ClientSession
) -> None:
    emulator = await start_engine(kv_events_config=events_config())
    await store(session, emulator, 3)  # seq 0..2: nobody listens
    recorder = Recorder()
    async with subscriber_of(emulator, recorder) as subscriber:
        await publisher(emulator).wait_subscriptions(1)
        await store(session, emulator, 1)  # seq 3: a gap of three behind it
        batches = await recorder.wait_batches(4)
    assert [b.seq for b in batches] == [0, 1, 2, 3]
    assert recorder.resets == []  # the replay filled the gap: the state is exact
    assert (subscriber.stats.gaps_total, subscriber.stats.replays_total) == (1, 1)
    assert subscriber.stats.replayed_batches_total == 3
    assert publisher(emulator).replays_total == 1


async def test_a_gap_the_buffer_no_longer_holds_resets_then_keeps_the_rest(
    start_engine: StartEmulator, session: aiohttp.ClientSession
) -> None:
    emulator = await start_engine(kv_events_config=events_config(buffer_steps=2))
    await store(session, emulator, 4)  # seq 0..3, nobody listens
    recorder = Recorder()
    async with subscriber_of(emulator, recorder) as subscriber:
        await publisher(emulator).wait_subscriptions(1)
        await store(session, emulator, 1)  # seq 4; the replay buffer keeps the last two: 3, 4
        await recorder.wait_batches(2)
    # An unknown gap means unknown state; what the replay still had is true after it.
    assert recorder.items[0] is ResetReason.GAP
    assert [b.seq for b in recorder.batches] == [3, 4]
    assert subscriber.stats.resets_total == {ResetReason.GAP: 1}


async def test_without_a_replay_endpoint_a_gap_is_a_reset(
    start_engine: StartEmulator, session: aiohttp.ClientSession
) -> None:
    emulator = await start_engine(kv_events_config=events_config(replay_endpoint=None))
    await store(session, emulator, 2)
    recorder = Recorder()
    async with subscriber_of(emulator, recorder) as subscriber:
        await publisher(emulator).wait_subscriptions(1)
        await store(session, emulator, 1)
        await recorder.wait_batches(1)
    assert recorder.items[0] is ResetReason.GAP
    assert [b.seq for b in recorder.batches] == [2]
    assert subscriber.stats.replays_total == 0


async def test_an_unanswered_replay_is_a_reset_within_its_timeout(
    session: aiohttp.ClientSession,
) -> None:
    raw = RawPublisher()
    silent = RawPublisher()  # a replay port that takes the request and never answers
    recorder = Recorder()
    try:
        async with Subscriber(
            host="127.0.0.1",
            port=raw.port,
            replay_port=silent.port,
            consumer=recorder,
            replay_timeout_s=0.2,
        ) as subscriber:
            await raw.wait_subscribed()
            raw.send(encode_message(EventBatch(seq=5, ts=1.0, events=())))
            await recorder.wait_batches(1)
    finally:
        raw.close()
        silent.close()
    assert recorder.items == [ResetReason.GAP, EventBatch(seq=5, ts=1.0, events=())]
    assert subscriber.stats.replays_total == 1


async def test_a_restarted_publisher_is_reconnected_with_backoff_and_reset(
    start_engine: StartEmulator, session: aiohttp.ClientSession
) -> None:
    first = await start_engine(kv_events_config=events_config())
    port, replay_port = first.kv_events_port, first.kv_events_replay_port
    delays: list[float] = []
    waiting, restarted = asyncio.Event(), asyncio.Event()

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        if len(delays) >= 3:  # two attempts find nobody listening, the third the new engine
            waiting.set()
            await restarted.wait()

    recorder = Recorder()
    async with subscriber_of(
        first, recorder, backoff=Backoff(initial_s=0.5, cap_s=1.5), sleep=sleep
    ) as subscriber:
        await publisher(first).wait_subscriptions(1)
        await store(session, first, 1)
        await recorder.wait_batches(1)
        await first.close()
        await asyncio.wait_for(waiting.wait(), WAIT_S)
        config = events_config(
            endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
        )
        second = await start_engine(kv_events_config=config)
        restarted.set()
        await publisher(second).wait_subscriptions(1)
        await complete(session, second, "after the restart " * 8)
        await recorder.wait_batches(2)
    assert delays == [0.5, 1.0, 1.5]  # doubled, capped
    assert recorder.items[1] is ResetReason.RECONNECTED
    assert [b.seq for b in recorder.batches] == [0, 0]  # the new engine counts from 0 again
    assert subscriber.stats.connects_total == 2
    assert subscriber.stats.disconnects_total == 1
    assert subscriber.stats.connect_failures_total == 2


async def test_hostile_messages_are_counted_drops_and_the_subscriber_lives_on() -> None:
    raw = RawPublisher()
    recorder = Recorder()
    limits = WireLimits(max_payload_bytes=1024, max_events=2)
    cleared = {"type": "AllBlocksCleared"}
    try:
        async with Subscriber(
            host="127.0.0.1", port=raw.port, topic="t", consumer=recorder, limits=limits
        ) as subscriber:
            await raw.wait_subscribed()
            raw.send([b"t", encode_seq(0)])  # two frames
            raw.send([b"t", encode_seq(0), b"", b""])  # four
            raw.send([b"t", b"\x00\x01", msgpack.packb([1.0, [], None])])  # a 2-byte seq
            raw.send([b"t", encode_seq(-7), msgpack.packb([1.0, [], None])])
            raw.send([b"t", encode_seq(0), b"\x90" * 2048])  # over the payload limit
            raw.send([b"t", encode_seq(0), b"\xc1\xc1"])  # not msgpack
            raw.send([b"t", encode_seq(0), msgpack.packb({"ts": "x", "events": 3})])
            raw.send([b"t", encode_seq(0), msgpack.packb([1.0, [cleared] * 3, None])])
            raw.send([b"tt", encode_seq(0), msgpack.packb([1.0, [], None])])  # another topic
            raw.send([b"t", encode_seq(0), msgpack.packb([1.0, [cleared], None])])  # valid
            batches = await recorder.wait_batches(1)
    finally:
        raw.close()
    assert batches == [EventBatch(seq=0, ts=1.0, events=(AllBlocksCleared(),))]
    assert recorder.resets == []
    assert subscriber.stats.drops_total == {
        DropReason.FRAMES: 2,
        DropReason.SEQ: 2,
        DropReason.TOO_LARGE: 1,
        DropReason.MSGPACK: 1,
        DropReason.SHAPE: 1,
        DropReason.LIMITS: 1,
        DropReason.TOPIC: 1,
    }
    assert subscriber.stats.messages_total == 1
    assert subscriber.stats.events_total == 1


async def test_a_full_queue_drops_counts_and_resets_and_stays_bounded(
    start_engine: StartEmulator, session: aiohttp.ClientSession
) -> None:
    """A replayed gap is queued in one go: 11 batches into a queue of 4."""
    emulator = await start_engine(kv_events_config=events_config())
    await store(session, emulator, 10)
    recorder = Recorder()
    async with subscriber_of(emulator, recorder, queue_size=4) as subscriber:
        await publisher(emulator).wait_subscriptions(1)
        await store(session, emulator, 1)  # seq 10: the gap 0..9 is replayed
        await recorder.wait_for(lambda: bool(recorder.batches) and recorder.batches[-1].seq == 10)
        await subscriber.drained()
    applied = [b.seq for b in recorder.batches]
    last_reset = max(i for i, item in enumerate(recorder.items) if item is ResetReason.QUEUE_FULL)
    after = [item.seq for item in recorder.items[last_reset + 1 :] if isinstance(item, EventBatch)]
    assert after == list(range(after[0], 11))  # in order after the reset, up to the newest
    dropped = subscriber.stats.drops_total[DropReason.QUEUE_FULL]
    assert dropped == 11 - len(applied) > 0
    assert subscriber.stats.resets_total[ResetReason.QUEUE_FULL] >= 1
    assert subscriber.stats.queued == 0
