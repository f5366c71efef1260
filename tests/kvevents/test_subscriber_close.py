"""``close()`` ends a subscriber whatever it awaits: the handshake's waits on the socket
monitor, a replay's replies. Both used ``asyncio.wait_for``, which in Python 3.11 swallows a
cancellation that arrives as the awaited message does (CPython gh-86296): the task went on, and
``close()`` (the app's shutdown, a pool member leaving discovery) waited for it forever."""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

from sidecar.kvevents.events import EventBatch
from sidecar.kvevents.subscriber import Subscriber
from sidecar.kvevents.wire import encode_message

from .helpers import RawPublisher, Recorder

FAIL_S = 10.0
"""The bound on waits for what takes well under a second (a failure then reads as which)."""

CLOSE_S = 5.0
"""The bound on ``close()``: milliseconds are expected, seconds on a loaded machine."""


async def closes(subscriber: Subscriber) -> bool:
    """Whether ``close()`` returns within ``CLOSE_S``; if not, its tasks are cancelled until
    they end, so that a failing test leaves nothing running."""
    closing = asyncio.create_task(subscriber.close())
    done, _ = await asyncio.wait([closing], timeout=CLOSE_S)
    while not closing.done():
        for task in asyncio.all_tasks():
            if task.get_name().startswith(f"kvevents {subscriber.endpoint} "):
                task.cancel()
        await asyncio.wait([closing], timeout=0.1)
    return bool(done)


async def test_close_ends_a_subscriber_that_is_connecting() -> None:
    """``close()`` at 40 points of a subscription's first moments (the handshake's waits on
    the socket monitor, then the first receive): it returns. With ``wait_for`` a quarter of
    these closes hung."""
    raw = RawPublisher()
    try:
        for turns in [*range(8)] * 5:
            subscriber = Subscriber(host="127.0.0.1", port=raw.port, consumer=Recorder())
            await subscriber.start()
            for _ in range(turns):
                await asyncio.sleep(0)
            assert await closes(subscriber), f"close() hung {turns} turns after start()"
    finally:
        raw.close()


async def test_close_ends_a_subscriber_that_is_replaying() -> None:
    """``close()`` while a long replay streams in, at 8 points of it: it returns. With
    ``wait_for`` every one hung: while replies stream in, the next is already there when
    awaited."""
    backlog = 100_000
    for turns in range(8):
        raw = RawPublisher()
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # waits for the reader, as the emulator's
        replay_port = router.bind_to_random_port("tcp://127.0.0.1")

        async def serve(router: zmq.asyncio.Socket = router) -> None:
            identity, _, _start = await router.recv_multipart()
            with contextlib.suppress(zmq.ZMQError):  # EHOSTUNREACH: the reader closed
                for seq in range(backlog):
                    frames = encode_message(EventBatch(seq=seq, ts=1.0, events=()))
                    await router.send_multipart([identity, b"", *frames])
                    if seq % 64 == 0:
                        await asyncio.sleep(0)  # a send that fits returns without a turn

        server = asyncio.create_task(serve())
        recorder = Recorder()
        subscriber = Subscriber(
            host="127.0.0.1",
            port=raw.port,
            replay_port=replay_port,
            consumer=recorder,
            max_replay_batches=backlog,
        )
        try:
            await subscriber.start()
            await raw.wait_subscribed()
            raw.send(encode_message(EventBatch(seq=backlog, ts=1.0, events=())))
            applied = 10 + 50 * turns
            await recorder.wait_for(lambda: len(recorder.items) >= applied, FAIL_S)  # noqa: B023
            assert subscriber.stats.replays_total == 1
            assert await closes(subscriber), f"close() hung in a replay ({turns})"
        finally:
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
            raw.close()
            context.destroy(linger=0)
