"""A publisher that goes silent without closing its connection: a frozen engine (SIGSTOP), a
partition that drops packets. Nothing tells the subscriber, so ZMTP heartbeats (``heartbeat_s``)
must: the connection is lost, the engine falls back to the approximate index, and after the
thaw the subscriber reconnects, resets and replays. Also the silences the heartbeats do not
cover: before the handshake (``connect_timeout_s``) and on the replay socket
(``replay_timeout_s``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from sidecar.engines.upstream import HttpClient
from sidecar.kvevents.events import BlockStored, EventBatch
from sidecar.kvevents.fleet import FleetOptions, KVFleet, RequestKeys
from sidecar.kvevents.subscriber import Backoff, ResetReason, Subscriber
from sidecar.kvevents.tokens import TokenSource
from sidecar.kvevents.wire import END_SEQ_FRAME, encode_message
from sidecar.observability.kv_metrics import EngineReport

from .helpers import WAIT_S, RawPublisher, Recorder

HEARTBEAT_S = 0.1
"""The heartbeat under test: a silent publisher is lost within 4 intervals (a PING within one,
then 3 without an answer), 0.4 s."""
NOTICED_S = 5.0
"""The test's bound on that: loose for a loaded machine, yet a third of what the default 5 s
heartbeat takes (15-20 s), and without heartbeats nothing is ever noticed."""
FAIL_S = 10.0
"""The bound on waits for what takes well under a second (a failure then reads as which)."""
BLOCK = 16  # the emulator's block size


class EngineProcess:
    """An emulator in a process of its own, publishing KV events (and replays) on loopback, so
    that it can be frozen whole: SIGSTOP stops its ZMQ I/O thread too, and its sockets stay
    open (the kernel still accepts connections and acknowledges data for it)."""

    def __init__(self, process: asyncio.subprocess.Process, url: str) -> None:
        self.process = process
        self.url = url
        self.events_port = self.replay_port = 0
        self._drain: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls) -> EngineProcess:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:0",
            "replay_endpoint": "tcp://127.0.0.1:0",
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sidecar.emulator",
            "--host=127.0.0.1",
            "--port=0",
            "--prompt-tokens-details",
            f"--kv-events-config={json.dumps(config)}",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stderr is not None
        engine = cls(process, "")
        try:
            async with asyncio.timeout(WAIT_S):
                while " emulator serving " not in (
                    line := (await process.stderr.readline()).decode()
                ):
                    assert line, "the emulator exited before it served"
            engine.url = line.split(" at ", 1)[1].split()[0]
            # The rest of its log is read and dropped: a full pipe would stall the emulator.
            engine._drain = asyncio.create_task(_discard(process.stderr))
            kv = await engine.kv()
            engine.events_port, engine.replay_port = kv["port"], kv["replay_port"]
        except BaseException:
            await engine.close()
            raise
        return engine

    async def kv(self) -> dict[str, Any]:
        """The emulator's ``/emulator/kv``: its prefix cache and its publisher."""
        async with aiohttp.ClientSession() as http, http.get(self.url + "/emulator/kv") as resp:
            answer: dict[str, Any] = await resp.json()
        return {**answer["kv_events"], "prefix_cache_blocks": answer["prefix_cache_blocks"]}

    async def complete(self, token_ids: list[int]) -> int:
        """A completion of a token-id prompt (its blocks stored and published); returns the
        ``cached_tokens`` the engine reported for it."""
        body = {"model": "emulated-model", "prompt": token_ids, "max_tokens": 1}
        async with (
            aiohttp.ClientSession() as http,
            http.post(self.url + "/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def subscribed(self, count: int) -> None:
        """Until ``count`` subscriptions reached the publisher (what it publishes from then
        on reaches the subscriber)."""
        started = time.monotonic()
        while (await self.kv())["subscriptions_total"] < count:
            assert time.monotonic() - started < WAIT_S, f"not {count} subscriptions"
            await asyncio.sleep(0.02)

    def freeze(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    async def close(self) -> None:
        if self.process.returncode is None:
            self.thaw()  # a stopped process would keep SIGTERM pending
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), WAIT_S)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


@pytest.fixture
async def engine() -> AsyncIterator[EngineProcess]:
    started = await EngineProcess.start()
    try:
        yield started
    finally:
        await started.close()


@pytest.fixture
async def fleet(engine: EngineProcess) -> AsyncIterator[KVFleet]:
    """The fleet subscribed to ``engine`` as the local decode rank 0, with a heartbeat of
    ``HEARTBEAT_S`` and short waits between connection attempts."""
    client = HttpClient(connect_timeout_s=1.0)  # the token ids are not asked for here
    made = KVFleet(
        FleetOptions(
            port=0,
            replay_port=None,
            topic="",
            decode_hosts=("127.0.0.1",),
            decode_port=engine.events_port,
            decode_replay_port=engine.replay_port,
            cpu_weight=0.8,
            storage_weight=0.5,
            max_blocks=10_000,
        ),
        tokens=TokenSource(client, engine.url, timeout_s=1.0),
        subscriber_options={
            "heartbeat_s": HEARTBEAT_S,
            "connect_timeout_s": 0.5,
            "backoff": Backoff(initial_s=0.05, cap_s=0.2),
        },
    )
    await made.start()
    try:
        yield made
    finally:
        await made.close()


def rank0(fleet: KVFleet) -> EngineReport:
    [report] = fleet.report().engines
    return report


async def until(condition: Callable[[], bool], what: str, within_s: float = FAIL_S) -> None:
    """Poll ``condition`` (the subscriber's state) until it holds."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within_s:
            raise AssertionError(f"not within {within_s}s: {what}")
        await asyncio.sleep(0.01)


def prompt(number: int) -> list[int]:
    """Four whole blocks and one token more, of ids no other prompt shares."""
    return [number * 1_000 + i for i in range(4 * BLOCK + 1)]


async def test_a_frozen_publisher_is_lost_by_its_heartbeats_then_replayed_in_full(
    engine: EngineProcess, fleet: KVFleet
) -> None:
    """The engine's process stopped whole, its sockets open: the heartbeats lose it within
    ``NOTICED_S``, the fleet then answers for it from the approximate index, and after the
    thaw the subscriber reconnects, resets, replays from 0 and holds what the engine holds."""
    before = [prompt(1), prompt(2)]
    await engine.subscribed(1)
    for token_ids in before:
        await engine.complete(token_ids)
    published = (await engine.kv())["next_seq"]
    await until(lambda: rank0(fleet).batches_applied == published, "the batches applied")
    keys = [RequestKeys(token_ids, None, None) for token_ids in before]
    assert all(fleet.lookup_rank(0, key) is not None for key in keys)  # in sync: exact

    engine.freeze()
    try:
        await until(lambda: not rank0(fleet).connected, "the silence noticed", NOTICED_S)
        # Not in sync: the fleet answers None, and the decision takes the approximate index.
        assert rank0(fleet).source == "approximate"
        assert all(fleet.lookup_rank(0, key) is None for key in keys)
        # While frozen, its kernel still accepts connections: each attempt ends at the
        # handshake's timeout, and the engine stays approximate.
        await until(lambda: rank0(fleet).connect_failures >= 2, "attempts that time out")
        assert not rank0(fleet).connected
        assert rank0(fleet).connects == 1
    finally:
        engine.thaw()

    await until(lambda: rank0(fleet).connects == 2, "reconnected")
    await until(lambda: rank0(fleet).resets["reconnected"] == 1, "reset")
    assert rank0(fleet).source == "approximate"  # emptied, nothing applied since
    await engine.subscribed(2)
    applied = rank0(fleet).batches_applied
    after = prompt(3)
    await engine.complete(after)  # the first live batch since: a gap back to 0, replayed
    published = (await engine.kv())["next_seq"]
    await until(lambda: rank0(fleet).batches_applied == applied + published, "replayed")
    assert rank0(fleet).source == "events"
    shown = rank0(fleet)
    assert shown.replays == 1
    assert shown.resets == {**dict.fromkeys(shown.resets, 0), "reconnected": 1}
    # The index again holds what the engine holds: its blocks, and the hit it then reports.
    assert shown.blocks == (await engine.kv())["prefix_cache_blocks"] == 12
    for token_ids in [*before, after]:
        hit = fleet.lookup_rank(0, RequestKeys(token_ids, None, None))
        assert hit is not None
        assert fleet.cached_tokens(hit) == await engine.complete(token_ids) == 4 * BLOCK


async def test_a_publisher_that_never_completes_the_handshake_is_retried() -> None:
    """A listening socket that accepts (the kernel's backlog) and never speaks, as a frozen
    engine does: heartbeats start only after the handshake, so its own timeout ends each
    attempt, and the subscriber backs off and tries again."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        delays: list[float] = []
        retried = asyncio.Event()

        async def sleep(seconds: float) -> None:
            delays.append(seconds)
            if len(delays) >= 2:
                retried.set()
            await asyncio.sleep(0)

        recorder = Recorder()
        async with Subscriber(
            host="127.0.0.1",
            port=mute.getsockname()[1],
            consumer=recorder,
            connect_timeout_s=0.2,
            heartbeat_s=HEARTBEAT_S,
            backoff=Backoff(initial_s=0.1, cap_s=0.2),
            sleep=sleep,
        ) as subscriber:
            await asyncio.wait_for(retried.wait(), FAIL_S)
            stats = subscriber.stats
            assert (stats.connected, stats.connects_total) == (False, 0)
            assert stats.connect_failures_total >= 2
    assert delays[:2] == [0.1, 0.2]
    assert recorder.items == []


async def test_a_replay_that_stops_answering_midway_is_a_gap_and_the_subscription_goes_on() -> None:
    """The replay socket sends batches 0-2 of the five asked and then nothing, its connection
    open: those three are applied, the replay ends ``replay_timeout_s`` after the last reply,
    then a reset for what it did not send, the live batch that revealed the gap, and the
    live batches after it, in order."""
    raw = RawPublisher()
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    asked: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def serve_then_stall() -> None:
        identity, _, start = await router.recv_multipart()
        asked.set_result(int.from_bytes(start, "big", signed=True))
        for seq in range(3):
            await router.send_multipart([identity, b"", *encode_message(_block(seq))])
        await asyncio.Event().wait()  # silent, and the socket stays open
        await router.send_multipart([identity, b"", b"", END_SEQ_FRAME, b""])  # never

    server = asyncio.create_task(serve_then_stall())
    recorder = Recorder()
    try:
        async with Subscriber(
            host="127.0.0.1",
            port=raw.port,
            replay_port=replay_port,
            consumer=recorder,
            replay_timeout_s=0.3,
            heartbeat_s=HEARTBEAT_S,
        ) as subscriber:
            await raw.wait_subscribed()
            raw.send(encode_message(_block(5)))  # the first message heard: 0-4 are missing
            raw.send(encode_message(_block(6)))
            await recorder.wait_for(lambda: len(recorder.batches) >= 5, FAIL_S)
            raw.send(encode_message(_block(7)))
            await recorder.wait_for(lambda: len(recorder.batches) >= 6, FAIL_S)
            assert subscriber.stats.connected
    finally:
        server.cancel()
        raw.close()
        context.destroy(linger=0)
    assert asked.result() == 0
    assert recorder.items == [
        *map(_block, [0, 1, 2]),
        ResetReason.GAP,
        *map(_block, [5, 6, 7]),
    ]
    assert subscriber.stats.resets_total == {ResetReason.GAP: 1}
    assert subscriber.stats.replayed_batches_total == 3


def _block(seq: int) -> EventBatch:
    stored = BlockStored((seq + 1,), None if seq == 0 else seq, tuple(range(BLOCK)), BLOCK)
    return EventBatch(seq=seq, ts=1.0, events=(stored,))
