"""The subscriber on real ZMQ sockets (loopback): gaps replayed or reset, a restarted publisher,
hostile messages counted as drops, the bound of the queue to the consumer."""

from __future__ import annotations

import asyncio
import random
import socket
import uuid
from collections.abc import Callable, Coroutine

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from sidecar.emulator import RunningEmulator
from sidecar.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from sidecar.kvevents.subscriber import Backoff, ResetReason, Subscriber
from sidecar.kvevents.wire import (
    END_SEQ_FRAME,
    DropReason,
    WireLimits,
    encode_message,
    encode_seq,
)
from tests.conftest import StartEmulator

from .helpers import WAIT_S, LoopWatch, RawPublisher, Recorder, events_config, publisher


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


async def test_a_replay_port_nobody_serves_is_a_reset_within_its_timeout() -> None:
    """Nobody listens on the replay port (an engine started without one, or restarting): the
    gap is a reset once the replay's timeout passes, and the subscription goes on."""
    with socket.socket() as closed:  # a loopback port bound and closed: nobody listens there
        closed.bind(("127.0.0.1", 0))
        nobody = closed.getsockname()[1]
    raw = RawPublisher()
    recorder = Recorder()
    try:
        async with Subscriber(
            host="127.0.0.1",
            port=raw.port,
            replay_port=nobody,
            consumer=recorder,
            replay_timeout_s=0.2,
        ) as subscriber:
            await raw.wait_subscribed()
            raw.send(encode_message(EventBatch(seq=5, ts=1.0, events=())))
            await recorder.wait_batches(1)
    finally:
        raw.close()
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
            raw.send([b"t", b"\x00\x01", msgpack.packb([1.0, [], None])])  # a 2-byte seq
            raw.send([b"t", encode_seq(-7), msgpack.packb([1.0, [], None])])
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
        DropReason.FRAMES: 1,  # four frames end the connection (test_zmtp.py)
        DropReason.SEQ: 2,
        DropReason.MSGPACK: 1,
        DropReason.SHAPE: 1,
        DropReason.LIMITS: 1,
        DropReason.TOPIC: 1,
    }
    assert subscriber.stats.messages_total == 1
    assert subscriber.stats.events_total == 1


async def test_a_full_queue_drops_counts_and_resets_and_stays_bounded() -> None:
    """Live batches read faster than they are applied, into a queue of 2: the pending batches
    make way for a reset and the newest; nothing is lost uncounted."""
    raw = RawPublisher()
    recorder = Recorder()
    sent = 0

    def caught_up() -> bool:
        return bool(recorder.batches) and recorder.batches[-1].seq == sent - 1

    try:
        async with Subscriber(
            host="127.0.0.1", port=raw.port, consumer=recorder, queue_size=2
        ) as subscriber:
            await raw.wait_subscribed()
            while not subscriber.stats.drops_total[DropReason.QUEUE_FULL]:
                for _ in range(64):  # a burst, read in one turn of the receive task
                    raw.send(encode_message(EventBatch(seq=sent, ts=1.0, events=())))
                    sent += 1
                await recorder.wait_for(caught_up)
            await subscriber.drained()
    finally:
        raw.close()
    applied = [b.seq for b in recorder.batches]
    assert applied == sorted(set(applied))  # in order, none twice
    assert applied[-1] == sent - 1  # the newest is kept
    assert subscriber.stats.drops_total[DropReason.QUEUE_FULL] == sent - len(applied)
    assert subscriber.stats.resets_total[ResetReason.QUEUE_FULL] >= 1
    for before, after in zip(recorder.items, recorder.items[1:], strict=False):
        if isinstance(before, EventBatch) and isinstance(after, EventBatch):
            assert after.seq == before.seq + 1  # a batch follows its predecessor or a reset
    assert subscriber.stats.queued == 0


def _replay_server(
    count: int, before: Callable[[], None]
) -> tuple[int, Callable[[], Coroutine[object, object, None]], zmq.asyncio.Context]:
    """A replay socket on loopback holding batches ``0 .. count - 1``: on a request it calls
    ``before()``, then sends every batch from the start asked, waiting when the reader's queue
    is full (as the emulator does), then the end marker."""
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        identity, _, start = await router.recv_multipart()
        before()
        for seq in range(int.from_bytes(start, "big", signed=True), count):
            await router.send_multipart([identity, b"", *encode_message(_one_block(seq))])
        await router.send_multipart([identity, b"", b"", END_SEQ_FRAME, b""])

    return port, serve, context


def _one_block(seq: int) -> EventBatch:
    """Batch ``seq`` of a chain: block ``seq + 1`` stored after block ``seq``."""
    stored = BlockStored((seq + 1,), None if seq == 0 else seq, tuple(range(16)), 16)
    return EventBatch(seq=seq, ts=1.0, events=(stored,))


async def test_a_replay_longer_than_the_queue_fills_the_gap() -> None:
    """A gap of 1,500 batches, replayed in full into a queue of 8, then 20 live batches ZMQ
    queued during the replay: all 1,521 applied in order, no reset, nothing dropped."""
    gap, backlog = 1_500, 20
    raw = RawPublisher()

    def live_during_the_replay() -> None:
        for seq in range(gap + 1, gap + 1 + backlog):
            raw.send(encode_message(_one_block(seq)))

    replay_port, serve, context = _replay_server(gap, live_during_the_replay)
    server = asyncio.create_task(serve())
    recorder = Recorder()
    try:
        async with Subscriber(
            host="127.0.0.1",
            port=raw.port,
            replay_port=replay_port,
            consumer=recorder,
            queue_size=8,
        ) as subscriber:
            await raw.wait_subscribed()
            raw.send(encode_message(_one_block(gap)))  # the first message heard: seq 1,500
            await recorder.wait_for(lambda: len(recorder.items) >= gap + 1 + backlog, 4 * WAIT_S)
            await subscriber.drained()
            await server
    finally:
        server.cancel()
        raw.close()
        context.destroy(linger=0)
    assert recorder.resets == []
    assert [b.seq for b in recorder.batches] == list(range(gap + 1 + backlog))
    assert subscriber.stats.replayed_batches_total == gap
    assert subscriber.stats.drops_total == {}


async def test_a_hostile_payload_is_a_drop_and_the_loop_stays_responsive() -> None:
    """The review's payload: 1.75 MiB of nested empty arrays (within the size limit: the
    decode stops at its item budget). A counted drop, and the event loop is never held for
    long: it was held 3 s for 3.75 MiB of them before the budget (larger than the limit, ZMQ
    now refuses those: ``test_kv_bounds``).
    Alone this test measures a 0.02-0.05 s stall; the bound, 1 s, leaves room for a loaded
    2-core CI machine (0.63 s seen there under benchmarks) and still fails the 3 s."""
    empties = b"\xdd" + (262_144).to_bytes(4, "big") + b"\x90" * 262_144
    within = b"\x93\xcb" + bytes(8) + b"\xdc\x00\x07" + empties[:-1] * 7 + b"\xc0"
    within = within.replace((262_144).to_bytes(4, "big"), (262_143).to_bytes(4, "big"))
    raw = RawPublisher()
    recorder = Recorder()
    try:
        async with Subscriber(host="127.0.0.1", port=raw.port, consumer=recorder) as subscriber:
            await raw.wait_subscribed()
            async with LoopWatch() as watch:
                raw.send([b"", encode_seq(0), within])
                raw.send(encode_message(EventBatch(seq=0, ts=1.0, events=())))
                await recorder.wait_batches(1)
    finally:
        raw.close()
    assert subscriber.stats.drops_total == {DropReason.LIMITS: 1}
    assert watch.longest_stall_s < 1.0


async def test_the_receive_task_gives_the_loop_its_turn_between_large_messages() -> None:
    """40 batches of 100 KiB arrive at once: the receive task decodes at most 256 KiB of them
    per turn of the event loop (it decoded all it found, up to 256 messages, in one)."""
    rng = random.Random(0)
    blocks = 1_280  # 20,480 token ids of 5 bytes: 100 KiB
    messages = [
        encode_message(
            EventBatch(
                seq=seq,
                ts=1.0,
                events=(
                    BlockStored(
                        tuple(rng.getrandbits(64) for _ in range(blocks)),
                        None,
                        tuple(rng.randrange(70_000, 150_000) for _ in range(16 * blocks)),
                        16,
                    ),
                ),
            )
        )
        for seq in range(40)
    ]
    assert 90 * 1024 < len(messages[0][2]) < 120 * 1024
    raw = RawPublisher()
    recorder = Recorder()
    try:
        async with Subscriber(host="127.0.0.1", port=raw.port, consumer=recorder) as subscriber:
            await raw.wait_subscribed()
            async with LoopWatch(0, lambda: subscriber.stats.messages_total) as watch:
                for frames in messages:
                    raw.send(frames)
                await recorder.wait_batches(40)
    finally:
        raw.close()
    assert subscriber.stats.drops_total == {}
    assert 1 <= watch.most_per_turn <= 3  # 256 KiB: the message that passes it ends the turn


async def test_the_apply_task_gives_the_loop_its_turn_every_2048_events() -> None:
    """60 batches removing 1,000 blocks each (9 KiB: read 28 to a turn): the consumer is handed
    at most three per turn of the event loop (it was handed every queued one, up to 256)."""
    messages = [
        encode_message(
            EventBatch(
                seq=seq,
                ts=1.0,
                events=(BlockRemoved(block_hashes=tuple(range(2**63, 2**63 + 1_000))),),
            )
        )
        for seq in range(60)
    ]
    raw = RawPublisher()
    recorder = Recorder()
    try:
        async with Subscriber(host="127.0.0.1", port=raw.port, consumer=recorder) as subscriber:
            await raw.wait_subscribed()
            async with LoopWatch(0, lambda: subscriber.stats.batches_applied_total) as watch:
                for frames in messages:
                    raw.send(frames)
                await recorder.wait_batches(60)
    finally:
        raw.close()
    assert subscriber.stats.events_total == 60_000
    assert 1 <= watch.most_per_turn <= 3
