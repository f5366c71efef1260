"""What a hostile publisher can make a subscriber hold, and a replay that never ends: the bytes
at the sockets and in the queue bounded, a replay ended by its deadline or for want of progress,
an engine behind its publisher shown approximate. Real ZMQ sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import tracemalloc
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import TypeAlias

import msgpack
import pytest
import zmq
import zmq.asyncio

from sidecar.engines.upstream import HttpClient
from sidecar.kvevents.events import BlockRemoved, BlockStored, EventBatch
from sidecar.kvevents.fleet import FleetOptions, KVFleet, RequestKeys
from sidecar.kvevents.subscriber import QUEUE_BYTES, Backoff, ResetReason, Subscriber
from sidecar.kvevents.tokens import TokenSource
from sidecar.kvevents.wire import (
    DEFAULT_LIMITS,
    END_SEQ_FRAME,
    DropReason,
    decode_payload,
    decoded_bytes,
    encode_message,
    encode_seq,
)
from sidecar.observability.kv_metrics import (
    SOURCE_APPROXIMATE,
    SOURCE_EVENTS,
    KVEventsCollector,
)

from .helpers import WAIT_S, RawPublisher, Recorder
from .test_silent_publisher import until

MIB = 1024 * 1024
FAIL_S = 5.0
"""How long a bounded replay may take here at most (its timeouts are a fraction of a second):
without the bound it never ends, and the test fails at this, not at the test's timeout."""


def test_the_connections_refuse_a_frame_over_the_payload_limit_and_queue_few() -> None:
    subscriber = Subscriber(host="127.0.0.1", port=1, replay_port=2, consumer=Recorder())
    limit = DEFAULT_LIMITS.max_payload_bytes
    for bounds, frames in ((subscriber.subscription_limits, 3), (subscriber.replay_limits, 4)):
        assert bounds.max_frame_bytes == limit == 2 * MIB
        assert bounds.max_frames == frames
        assert limit < bounds.max_message_bytes <= limit + 8 * 1024
        # Four messages at the bound queued, one being read: about 12 MiB at most.
        assert bounds.max_queued == 4
        assert bounds.held_bytes() <= 13 * MIB


def removals(seq: int, count: int = 2048) -> EventBatch:
    """A batch of one ``BlockRemoved`` of ``count`` hashes: 20 KiB of msgpack, one turn of the
    apply task (2,048 events), 12 times as many read in a turn of the receive task."""
    first = 2**63 + seq * count
    return EventBatch(seq, 1.0, (BlockRemoved(tuple(range(first, first + count))),))


async def test_a_flood_does_not_grow_the_queue_past_its_bytes() -> None:
    """400 batches arrive at once, each 220 KiB decoded (88 MiB in all): the receive task reads
    them faster than the consumer is handed them, and the queue never holds more than its
    16 MiB and one batch; what did not fit is dropped and counted, the newest kept."""
    cost = decoded_bytes(removals(0))
    assert 200 * 1024 < cost < 240 * 1024
    raw = RawPublisher()
    recorder = Recorder()
    sent = 400
    try:
        async with Subscriber(host="127.0.0.1", port=raw.port, consumer=recorder) as subscriber:
            await raw.wait_subscribed()
            for seq in range(sent):
                raw.send(encode_message(removals(seq)))
            await recorder.wait_for(
                lambda: bool(recorder.batches) and recorder.batches[-1].seq == sent - 1
            )
            await subscriber.drained()
    finally:
        raw.close()
    stats = subscriber.stats
    assert QUEUE_BYTES // 2 < stats.queued_bytes_peak <= QUEUE_BYTES + cost
    assert stats.drops_total[DropReason.QUEUE_FULL] == sent - len(recorder.batches) > 0
    assert stats.resets_total[ResetReason.QUEUE_FULL] >= 1
    assert (stats.queued, stats.queued_bytes) == (0, 0)


async def _one_hostile_message(send: Callable[[RawPublisher], None]) -> Subscriber:
    """A batch, then what ``send`` sends, then another batch: the subscriber must lose the
    connection to the hostile message, reconnect, reset, and take the batch after it, having
    counted no message as a drop (none was read whole). The subscriber, closed."""
    raw = RawPublisher()
    recorder = Recorder()
    try:
        async with Subscriber(
            host="127.0.0.1",
            port=raw.port,
            consumer=recorder,
            backoff=Backoff(initial_s=0.01, cap_s=0.05),
        ) as subscriber:
            await raw.wait_subscribed()
            raw.send(encode_message(EventBatch(seq=0, ts=1.0, events=())))
            await recorder.wait_batches(1)
            send(raw)
            await raw.wait_subscribed()  # subscribed again: a new connection
            raw.send(encode_message(EventBatch(seq=0, ts=2.0, events=())))
            await recorder.wait_batches(2)
    finally:
        raw.close()
    assert subscriber.stats.disconnects_total == 1
    assert recorder.items[1] is ResetReason.RECONNECTED
    assert subscriber.stats.drops_total == {}
    return subscriber


async def test_a_message_over_the_limit_ends_the_connection_before_it_is_held() -> None:
    """A payload a byte over the limit: the reader refuses the frame on its header, before its
    body is read, and the connection ends."""
    limit = DEFAULT_LIMITS.max_payload_bytes
    await _one_hostile_message(lambda raw: raw.send([b"", encode_seq(1), b"\xc0" * (limit + 1)]))


async def test_a_message_of_many_frames_is_a_lost_connection_not_hundreds_of_mib() -> None:
    """A hostile engine's PUB (pyzmq) sends one message of 200 frames of 2 MiB (400 MiB, which
    libzmq held whole before the subscriber saw any of it): the subscriber reads its first
    frame and ends the connection on the second's header (past the message's bytes)."""
    frame = b"x" * DEFAULT_LIMITS.max_payload_bytes

    def many_frames(raw: RawPublisher) -> None:
        plain: zmq.Socket[bytes] = zmq.Socket.shadow(raw._socket.underlying)
        plain.send_multipart([frame] * 200, zmq.NOBLOCK, copy=False)

    subscriber = await _one_hostile_message(many_frames)
    bounds = subscriber.subscription_limits
    assert bounds.max_frames == 3
    assert bounds.max_message_bytes < 2 * DEFAULT_LIMITS.max_payload_bytes


def test_the_decoded_size_bounds_what_a_batch_holds() -> None:
    """``decoded_bytes`` (what the queue counts) is at least what ``tracemalloc`` sees a decoded
    batch hold, for batches shaped as the costliest the wire accepts (a quarter of their size):
    large token ids, bytes hashes, extra keys."""
    rng = random.Random(0)
    blocks = 4096
    shapes = [
        {
            "type": "BlockStored",
            "block_hashes": [rng.getrandbits(64) for _ in range(blocks)],
            "parent_block_hash": None,
            "token_ids": [rng.randrange(2**31, 2**32) for _ in range(16 * blocks)],
            "block_size": 16,
            "medium": "GPU",
        },
        {
            "type": "BlockStored",
            "block_hashes": [rng.randbytes(64) for _ in range(1024)],
            "parent_block_hash": None,
            "token_ids": [rng.randrange(256, 2**16) for _ in range(1024)],
            "block_size": 1,
            "lora_name": "x" * 1000,
            "extra_keys": [[f"{i}ab" for i in range(63)] for _ in range(1024)],
        },
        {
            "type": "BlockStored",
            "block_hashes": list(range(2000)),
            "parent_block_hash": None,
            "token_ids": [5] * 2000,
            "block_size": 1,
            "extra_keys": [[[None, 1.5, "ab", b"cd"], b"xy", 2**40] for _ in range(2000)],
        },
    ]
    for shape in shapes:
        payload = msgpack.packb([1.0, [shape], None], use_bin_type=True)
        tracemalloc.start()
        try:
            batch = decode_payload(0, payload)
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert held <= decoded_bytes(batch) <= 2 * held + 8 * len(payload)
    removed = [{"type": "BlockRemoved", "block_hashes": [i], "medium": "CPU"} for i in range(2000)]
    payload = msgpack.packb([1.0, removed, None])
    tracemalloc.start()
    try:
        batch = decode_payload(0, payload)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held <= decoded_bytes(batch)


# -- replays that do not end -------------------------------------------------------------------


Answer: TypeAlias = Callable[[zmq.asyncio.Socket, bytes], Coroutine[object, object, None]]


@contextlib.asynccontextmanager
async def hostile_replay(answer: Answer) -> AsyncIterator[int]:
    """A ROUTER on loopback that takes a replay request and hands the socket and the
    requester's identity to ``answer``; yields its port."""
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        while True:
            identity, _, _start = await router.recv_multipart()
            await answer(router, identity)

    task = asyncio.create_task(serve())
    try:
        yield port
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        context.destroy(linger=0)


def empty(seq: int) -> EventBatch:
    return EventBatch(seq=seq, ts=1.0, events=())


async def repeat_one(router: zmq.asyncio.Socket, identity: bytes) -> None:
    """Batch 1, then batch 1 again every 20 ms, for ever: replies, no progress."""
    while True:
        await router.send_multipart([identity, b"", *encode_message(empty(1))])
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def repeating_without_pause() -> Iterator[int]:
    """A ROUTER on loopback, in a thread of its own, that answers a replay request with batch 1
    (16,384 removals) again and again as fast as the socket takes it: the subscriber always
    finds a reply waiting. Yields its port."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(10):
                identity, _, _start = router.recv_multipart()
                frames = [identity, b"", *encode_message(removals(1, 16_384))]  # 150 KiB
                while not stop.is_set():
                    with contextlib.suppress(zmq.Again):
                        router.send_multipart(frames, zmq.NOBLOCK)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join(WAIT_S)
        context.destroy(linger=0)


async def trickle(router: zmq.asyncio.Socket, identity: bytes) -> None:
    """Batches 1, 2, 3, ... one every 20 ms: progress, but a gap of 1,000 would take 20 s."""
    for seq in range(1, 1000):
        await router.send_multipart([identity, b"", *encode_message(empty(seq))])
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("paced", [True, False])
async def test_a_replay_that_repeats_a_batch_ends_for_want_of_progress(paced: bool) -> None:
    """Repeats every 20 ms, and back to back (a reply always waiting: a timeout on the wait for
    one would never fire, so progress is checked after each)."""
    raw = RawPublisher()
    recorder = Recorder()
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(raw.close)
        replay_port = (
            await stack.enter_async_context(hostile_replay(repeat_one))
            if paced
            else stack.enter_context(repeating_without_pause())
        )
        subscriber = await stack.enter_async_context(
            Subscriber(
                host="127.0.0.1",
                port=raw.port,
                replay_port=replay_port,
                consumer=recorder,
                replay_timeout_s=0.2,
            )
        )
        await raw.wait_subscribed()
        raw.send(encode_message(empty(0)))
        await recorder.wait_batches(1)
        raw.send(encode_message(empty(5)))  # a gap: 1..4, replayed as 1, 1, 1, ...
        await recorder.wait_for(lambda: len(recorder.batches) >= 3, FAIL_S)
        raw.send(encode_message(empty(6)))
        await recorder.wait_for(lambda: len(recorder.batches) >= 4, FAIL_S)
    first = empty(1) if paced else removals(1, 16_384)
    assert recorder.items == [empty(0), first, ResetReason.GAP, empty(5), empty(6)]
    assert subscriber.stats.replays_cut_total == 1
    assert subscriber.stats.replayed_batches_total == 1  # the repeats were not progress


async def test_a_replay_that_trickles_ends_at_its_deadline() -> None:
    raw = RawPublisher()
    recorder = Recorder()
    try:
        async with (
            hostile_replay(trickle) as replay_port,
            Subscriber(
                host="127.0.0.1",
                port=raw.port,
                replay_port=replay_port,
                consumer=recorder,
                replay_timeout_s=0.2,
                replay_deadline_s=0.3,
            ) as subscriber,
        ):
            await raw.wait_subscribed()
            raw.send(encode_message(empty(1000)))  # a gap of 0..999
            await recorder.wait_for(lambda: empty(1000) in recorder.items, FAIL_S)
    finally:
        raw.close()
    replayed = subscriber.stats.replayed_batches_total
    assert 1 <= replayed < 100  # a few tens of batches in 0.3 s, then the deadline
    assert recorder.items[-2:] == [ResetReason.GAP, empty(1000)]
    assert subscriber.stats.replays_cut_total == 1


def behind_metric(fleet: KVFleet) -> float:
    """``pd_sidecar_kv_events_behind_batches`` of decode rank 0, as the collector gives it."""
    for family in KVEventsCollector(fleet.report).collect():
        if family.name == "pd_sidecar_kv_events_behind_batches":
            [sample] = family.samples
            assert sample.labels == {"engine": "decode:0"}
            return float(sample.value)
    raise AssertionError("no pd_sidecar_kv_events_behind_batches")


async def test_an_engine_behind_its_publisher_is_approximate_and_shows_its_lag() -> None:
    """A decode rank in sync, then a gap of 299 batches whose replay trickles: while it lasts
    the rank's index is not used (approximate), and how far behind it is shows; once the
    replay stops making progress it ends, and a reset and the live batch put it back in
    sync."""
    raw = RawPublisher()
    stored = BlockStored((7,), None, tuple(range(16)), 16)
    keys = RequestKeys(tuple(range(40)), None, None)
    released = asyncio.Event()

    async def trickle_until_released(router: zmq.asyncio.Socket, identity: bytes) -> None:
        seq = 1
        while not released.is_set():
            await router.send_multipart([identity, b"", *encode_message(empty(seq))])
            seq += 1
            await asyncio.sleep(0.02)
        while True:  # then the last one again and again: no progress
            await router.send_multipart([identity, b"", *encode_message(empty(seq - 1))])
            await asyncio.sleep(0.02)

    client = HttpClient(connect_timeout_s=1.0)
    try:
        async with hostile_replay(trickle_until_released) as replay_port:
            fleet = KVFleet(
                FleetOptions(
                    port=0,
                    replay_port=None,
                    topic="",
                    decode_hosts=("127.0.0.1",),
                    decode_port=raw.port,
                    decode_replay_port=replay_port,
                    cpu_weight=0.8,
                    storage_weight=0.5,
                    max_blocks=1000,
                ),
                tokens=TokenSource(client, "http://127.0.0.9:1", timeout_s=1.0),
                subscriber_options={"replay_timeout_s": 0.2},
            )
            await fleet.start()
            try:
                await raw.wait_subscribed()
                raw.send(encode_message(EventBatch(seq=0, ts=1.0, events=(stored,))))
                await until(lambda: fleet.lookup_rank(0, keys) is not None, "in sync")
                [report] = fleet.report().engines
                assert (report.source, report.behind, report.replaying) == (SOURCE_EVENTS, 0, False)

                raw.send(encode_message(empty(300)))  # a gap of 1..299, replayed slowly
                await until(lambda: fleet.report().engines[0].batches_applied >= 3, "replaying")
                [report] = fleet.report().engines
                assert report.replaying
                assert report.source == SOURCE_APPROXIMATE
                assert 200 < report.behind < 299  # published up to 300, applied up to a few
                assert fleet.lookup_rank(0, keys) is None  # the stale index is not used
                shown = fleet.status()["decode_ranks"][0]
                assert (shown["source"], shown["replaying"]) == (SOURCE_APPROXIMATE, True)
                assert 200 < shown["behind"] < 299
                assert 200 < behind_metric(fleet) < 299

                released.set()  # the replay makes no progress: it ends, a reset, then 300
                await until(
                    lambda: fleet.report().engines[0].source == SOURCE_EVENTS, "in sync again"
                )
                [report] = fleet.report().engines
                assert (report.behind, report.replaying) == (0, False)
                assert report.resets["gap"] == 1
            finally:
                await fleet.close()
    finally:
        raw.close()
        await client.close()


async def test_the_subscription_is_read_during_a_replay_and_applied_after_it() -> None:
    """A replay of 59 batches that takes 0.6 s while the engine publishes 50 more, with
    heartbeats every 0.1 s: the subscription is read meanwhile (held, undecoded), so ZMQ keeps
    reading the connection and its heartbeats hold it (ZMQ's queue of 4 would have filled,
    ZMQ stopped reading, and the connection ended 0.3 s later); after the replay the 50 are
    applied in order, nothing reset."""
    raw = RawPublisher()
    recorder = Recorder()

    async def slow_replay(router: zmq.asyncio.Socket, identity: bytes) -> None:
        for seq in range(1, 60):
            await router.send_multipart([identity, b"", *encode_message(empty(seq))])
            await asyncio.sleep(0.01)
        await router.send_multipart([identity, b"", b"", END_SEQ_FRAME, b""])

    async def live() -> None:
        for seq in range(61, 111):
            raw.send(encode_message(empty(seq)))
            await asyncio.sleep(0.01)

    try:
        async with (
            hostile_replay(slow_replay) as replay_port,
            Subscriber(
                host="127.0.0.1",
                port=raw.port,
                replay_port=replay_port,
                consumer=recorder,
                heartbeat_s=0.1,
            ) as subscriber,
        ):
            await raw.wait_subscribed()
            raw.send(encode_message(empty(0)))
            await recorder.wait_batches(1)
            raw.send(encode_message(empty(60)))  # a gap of 1..59, replayed slowly
            await live()
            await recorder.wait_for(lambda: empty(110) in recorder.items, FAIL_S)
    finally:
        raw.close()
    assert recorder.items == [empty(seq) for seq in range(111)]
    assert subscriber.stats.disconnects_total == 0
    assert subscriber.stats.held_bytes_peak > 0
