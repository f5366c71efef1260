"""Helpers of the KV-event tests: a consumer that records, a raw publisher on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from sidecar.emulator import EmulatorConfig, RunningEmulator, start_emulator
from sidecar.emulator.events import ZmqKvEvents
from sidecar.emulator.keys import ENGINE
from sidecar.kvevents.events import EventBatch
from sidecar.kvevents.subscriber import ResetReason

WAIT_S = 30.0  # an upper bound on waits for conditions, generous for a loaded CI machine
"""Upper bound of every wait on a condition (they end as soon as it holds)."""


class Recorder:
    """An :class:`~sidecar.kvevents.subscriber.EventConsumer` that keeps what it was given:
    ``EventBatch`` and ``ResetReason`` items, in order."""

    def __init__(self) -> None:
        self.items: list[EventBatch | ResetReason] = []
        self._changed = asyncio.Event()

    def apply(self, batch: EventBatch) -> None:
        self._record(batch)

    def reset(self, reason: ResetReason) -> None:
        self._record(reason)

    def _record(self, item: EventBatch | ResetReason) -> None:
        self.items.append(item)
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def batches(self) -> list[EventBatch]:
        return [item for item in self.items if isinstance(item, EventBatch)]

    @property
    def resets(self) -> list[ResetReason]:
        return [item for item in self.items if isinstance(item, ResetReason)]

    async def wait_for(self, condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
        async def until() -> None:
            while not condition():
                await self._changed.wait()

        await asyncio.wait_for(until(), timeout_s)

    async def wait_batches(self, count: int) -> list[EventBatch]:
        await self.wait_for(lambda: len(self.batches) >= count)
        return self.batches


def publisher(emulator: RunningEmulator) -> ZmqKvEvents:
    events = emulator.app[ENGINE].events
    assert isinstance(events, ZmqKvEvents)
    return events


def events_config(**fields: Any) -> str:
    """An emulator's ``kv_events_config`` on loopback, free ports (and a replay socket)."""
    import json

    values: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
    }
    values.update(fields)
    return json.dumps(values)


class RawPublisher:
    """An XPUB on ``host`` (a loopback address), at ``port`` (0: a free one), that sends
    whatever frames a test gives it, and tells when a subscription arrived (so nothing sent
    after it is lost to a slow joiner)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._socket.bind_to_random_port(f"tcp://{host}")

    async def wait_subscribed(self) -> None:
        async def until() -> None:
            while (await self._socket.recv())[:1] != b"\x01":
                pass

        await asyncio.wait_for(until(), WAIT_S)

    def send(self, frames: list[bytes]) -> None:
        plain: zmq.Socket[bytes] = zmq.Socket.shadow(self._socket.underlying)
        plain.send_multipart(frames, zmq.NOBLOCK)

    def close(self) -> None:
        self._context.destroy(linger=0)


class LoopWatch:
    """A task that wakes every ``interval_s`` and keeps the longest time the event loop made it
    wait beyond that (a stall: some callback held the loop, or a thread held the GIL; wall
    time, so a loaded machine lengthens it: bound it loosely), or with ``interval_s`` 0, the
    most ``count()`` grew between two of its turns (the work one turn of another task did)."""

    def __init__(self, interval_s: float = 0.001, count: Callable[[], int] = lambda: 0) -> None:
        self.longest_stall_s = 0.0
        self.most_per_turn = 0
        self._interval_s = interval_s
        self._count = count
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        last, seen = loop.time(), self._count()
        while True:
            await asyncio.sleep(self._interval_s)
            now, counted = loop.time(), self._count()
            self.longest_stall_s = max(self.longest_stall_s, now - last - self._interval_s)
            self.most_per_turn = max(self.most_per_turn, counted - seen)
            last, seen = now, counted

    async def __aenter__(self) -> LoopWatch:
        self._task = asyncio.create_task(self._watch())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
"""The prefill emulators' addresses: one events port for all, as on distinct pods."""


def events_on(host: str, port: int = 0, replay: int = 0, **fields: Any) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{host}:{port}",
            "replay_endpoint": f"tcp://{host}:{replay}",
            **fields,
        }
    )


class Pool:
    """Prefill emulators on distinct loopback addresses sharing an events and a replay port."""

    def __init__(self) -> None:
        self.started: list[RunningEmulator] = []
        self.engines: list[RunningEmulator] = []
        self.port = 0
        self.replay = 0

    async def add(self, *, events: bool = True, port: int = 0, **config: Any) -> RunningEmulator:
        host = HOSTS[len(self.engines)]
        if events:
            config["kv_events_config"] = events_on(host, self.port, self.replay)
        engine = await start_emulator(EmulatorConfig(host=host, port=port, **config))
        self.started.append(engine)
        if events and not self.port:
            assert engine.kv_events_port is not None
            assert engine.kv_events_replay_port is not None
            self.port, self.replay = engine.kv_events_port, engine.kv_events_replay_port
        self.engines.append(engine)
        return engine

    def settings(self) -> dict[str, Any]:
        """The sidecar's settings for this pool, events on (the decode ranks not subscribed)."""
        return {
            "prefill_endpoints": ",".join(engine.endpoint for engine in self.engines),
            "kv_events": True,
            "kv_events_port": self.port,
            "kv_events_replay_port": self.replay,
            "kv_events_decode_port": None,
            "kv_events_decode_replay_port": None,
        }
