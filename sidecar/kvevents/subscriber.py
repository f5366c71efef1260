"""One engine's KV-event stream: subscribe, notice what was lost, replay it or say so, reconnect.

One :class:`Subscriber` per publishing engine (an address, its events port, its replay port, its
topic); it hands batches, in order, to an :class:`EventConsumer` (the exact index) from a task
of its own, never from the request path. Two tasks::

    receive:  connect (ZMTP, as a SUB) --handshake--> recv -> decode -> sequence check -> queue
                 ^  lost / refused / timeout: backoff (capped, exponential)  |  gap: replay
                 +----------------------------------------------------------+
    apply:    queue -> consumer.apply(batch) | consumer.reset(reason)

Sequence numbers (vLLM's ``ZmqEventPublisher``: consecutive from 0 per publisher) drive it:

- ``seq == expected``: in order, queued.
- ``seq > expected``: messages were lost (a PUB drops at its high-water mark, and a new
  subscription misses what was sent before it). The replay socket is asked from ``expected``
  (at most ``max_replay_batches`` back), and each replayed batch goes to the queue as it
  arrives, waiting for room: a replay longer than the queue fills the gap too. A replayed batch
  that does not follow the one before it (the publisher's buffer of ``buffer_steps`` batches
  moved on, or it dropped replies) is preceded by ``reset(GAP)`` (an unknown gap means unknown
  state), and so is ``seq`` when the replay stopped short of it (no replay endpoint, no reply
  within ``replay_timeout_s``): what follows a reset is true of the engine from then on.
- ``seq < expected``: a new publisher (the engine restarted): ``reset(RESTARTED)``, then the
  same as a first message.
- A lost connection (closed, silent through ZMTP heartbeats, or a message over a bound):
  ``reset(RECONNECTED)`` at the next connection, which then starts as a first subscription,
  with ``expected`` 0: a replay from 0 rebuilds the exact state while the engine's history fits
  its replay buffer.

Bounded memory (``docs/kv-events.md``, Bounds): both connections to an engine (the subscription, the
replay) are read by the sidecar's own ZMTP reader (``zmtp.py``), which checks each frame's header
before its body and ends the connection at a frame over ``WireLimits.max_payload_bytes``, a message
of more frames than the protocol uses (3, a replay's 4) or of more bytes than a payload and its
envelope (``subscription_limits``, ``replay_limits``); each queues ``rcvhwm`` messages read, sized
from ``SOCKET_BYTES``; the queue to the consumer (``backlog.Backlog``) ``queue_size`` batches and
``queue_bytes`` of them decoded (``wire.decoded_bytes``), plus one. A live batch that finds the
queue full drops the pending batches (counted) for ``reset(QUEUE_FULL)``: the index forgets rather
than lags; replayed batches, and the live ones that follow a replay (what the engine published
meanwhile, up to ``_PATIENT_AFTER_REPLAY``), wait for room instead. A replay keeps nothing of its
own, and ends ``replay_timeout_s`` after its last progress (a batch it already had, repeated, is
none, and is not even decoded) or at ``replay_deadline_s``.

An engine is *catching up* while a replay is read or more than ``max_behind`` batches it
published (as far as read) are not applied: its index lacks what the engine holds, and the fleet
uses the approximate index for it meanwhile (``stats.behind``, ``stats.replaying``).

The event loop keeps the turn: decoding is bounded per message (``wire.py``), and each task
gives the loop back after ``_WAKE_BYTES`` of payload or ``_DRAIN_PER_WAKE`` messages read (the
receive task, a replay included) and after ``_DRAIN_PER_WAKE`` batches or ``_APPLY_EVENTS``
events applied (the apply task). A malformed message is a counted drop
(:class:`~sidecar.kvevents.wire.DropReason`), never an exception out of the task; a consumer
that raises is logged, counted and reset.

Neither this module nor ``zmtp.py`` imports ``zmq``: the engines' side of the protocol is
libzmq's (the emulator's and the tests' publishers are pyzmq sockets).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, TypeAlias

from sidecar.kvevents import zmtp
from sidecar.kvevents.backlog import Backlog
from sidecar.kvevents.events import AllBlocksCleared, EventBatch
from sidecar.kvevents.wire import (
    DEFAULT_LIMITS,
    DropReason,
    WireError,
    WireLimits,
    decode_message,
    decode_seq,
    decoded_bytes,
    encode_seq,
)

log = logging.getLogger("sidecar.kvevents.subscriber")

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]

_DRAIN_PER_WAKE = 256
"""Messages read (batches applied) per turn before the loop gets the turn back."""
_WAKE_BYTES = 256 * 1024
"""Payload bytes decoded per turn: a few milliseconds of msgpack (it holds the GIL, so a thread
would not spare the loop); one larger message is a turn of its own."""
_APPLY_EVENTS = 2048
"""Events (blocks) applied per turn: the index costs 6–17 µs a block on a loaded machine
(``docs/benchmarks.md``), a turn 10–35 ms; one larger batch is a turn of its own."""
SOCKET_BYTES = 10 * 1024 * 1024
"""What one connection of a subscriber (the subscription's, the replay's) may hold queued, in
messages at the message bound (``message_limits``): the high-water mark is this over that bound
(4 with the defaults). A small mark costs an honest engine nothing: what the subscriber has not
read yet waits in TCP's buffers and in the engine's PUB queue (vLLM: 100,000 messages), on the
engine's side."""
_ENVELOPE_BYTES = 4096
"""A message's bytes besides its payload and topic: the sequence number's 8, a replay's empty
delimiter, room to spare."""
_SUBSCRIPTION_FRAMES = 3  # [topic, seq, payload]
_REPLAY_FRAMES = 4  # [b"", topic, seq, payload], as the DEALER reads the ROUTER's replies
_PATIENT_AFTER_REPLAY = 1000
"""Live batches after a replay that wait for room in the queue rather than make way for a reset:
what the engine published while the replay was read (a lag, shown as ``behind``, not memory:
the receive task waits, and the backlog stays in the sockets' bounded queues and on the
engine's side)."""
LIVE_HOLD_BYTES = 8 * 1024 * 1024
"""What the subscription brings while a replay is read, kept undecoded (frames' bytes) to be
taken in order after it; beyond it messages are dropped, counted, and replayed after."""
QUEUE_BYTES = 16 * 1024 * 1024
"""The decoded batches the queue to the consumer may hold (``wire.decoded_bytes``), besides
its count of batches."""
_RESET_BYTES = 64


class ResetReason(StrEnum):
    """Why the consumer must forget what it knows of this engine."""

    GAP = "gap"  # messages lost and not replayable
    RESTARTED = "restarted"  # the sequence went back: a new publisher
    RECONNECTED = "reconnected"  # the connection was lost; what happened meanwhile is unknown
    QUEUE_FULL = "queue_full"  # the consumer fell behind; pending batches were dropped
    CONSUMER_ERROR = "consumer_error"  # the consumer raised while applying a batch


class EventConsumer(Protocol):
    """What receives one engine's batches, in sequence order, from the subscriber's apply task."""

    def apply(self, batch: EventBatch) -> None: ...

    def reset(self, reason: ResetReason) -> None:
        """Forget this engine's blocks: what follows starts from an unknown state."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential delays between connection attempts: initial, ×factor, ..., cap."""

    initial_s: float = 0.1
    cap_s: float = 30.0
    factor: float = 2.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_s
        while True:
            yield delay
            delay = min(self.cap_s, delay * self.factor)


@dataclass(slots=True)
class SubscriberStats:
    """Counters of one subscriber (the metrics read them); ``events_total`` counts one stored or
    removed block, or one clear, as one event."""

    messages_total: int = 0
    batches_applied_total: int = 0
    events_total: int = 0
    drops_total: Counter[DropReason] = field(default_factory=Counter)
    gaps_total: int = 0
    replays_total: int = 0
    replayed_batches_total: int = 0
    resets_total: Counter[ResetReason] = field(default_factory=Counter)
    connects_total: int = 0
    connect_failures_total: int = 0
    disconnects_total: int = 0
    connected: bool = False
    lag_s: float | None = None
    """The engine's timestamp of the last applied batch against the clock, seconds."""
    queued: int = 0
    queued_bytes: int = 0
    """The decoded size of what is queued (``wire.decoded_bytes``)."""
    queued_bytes_peak: int = 0
    """The most ``queued_bytes`` ever was."""
    held_bytes_peak: int = 0
    """The most bytes the subscription brought while a replay was read (``LIVE_HOLD_BYTES``)."""
    behind: int = 0
    """Batches the engine published (as far as the subscriber has read) that are not applied
    yet: a gap being replayed, the queue's backlog."""
    replaying: bool = False
    """A replay is being read: the index lacks the batches of the gap until it ends."""
    replays_cut_total: int = 0
    """Replays ended by their deadline or for want of progress (then a ``gap`` reset)."""


@dataclass(frozen=True, slots=True)
class _Reset:
    reason: ResetReason


_Item: TypeAlias = EventBatch | _Reset


class _Lost(Exception):
    """The connection ended (or never started); the receive loop backs off and reconnects."""


def zmq_endpoint(host: str, port: int) -> str:
    """``tcp://host:port``, an IPv6 literal bracketed (the engine's endpoint, as logged)."""
    bare = host.removeprefix("[").removesuffix("]")
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(bare).version == 6:
            return f"tcp://[{bare}]:{port}"
    return f"tcp://{bare}:{port}"


def batch_events(batch: EventBatch) -> int:
    """Events as the cost target counts them: each stored or removed block, each clear."""
    return sum(
        1 if isinstance(event, AllBlocksCleared) else len(event.block_hashes)
        for event in batch.events
    )


class Subscriber:
    """Subscribes to one engine's KV events and feeds ``consumer``; ``start()``, ``close()``.

    ``replay_port`` None: gaps cannot be replayed (each is a reset). ``sleep`` (the backoff's
    waits) and ``clock`` (wall seconds, for the lag) are injectable. ``rcvhwm`` (the messages a
    connection queues) None: from ``SOCKET_BYTES`` and the message bound. A replay ends
    ``replay_timeout_s`` after its last progress (a repeated or earlier batch is none) and
    ``replay_deadline_s`` after it began, whatever it sends.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        consumer: EventConsumer,
        replay_port: int | None = None,
        topic: str = "",
        limits: WireLimits = DEFAULT_LIMITS,
        queue_size: int = 1024,
        queue_bytes: int = QUEUE_BYTES,
        max_replay_batches: int = 10_000,
        replay_timeout_s: float = 2.0,
        replay_deadline_s: float = 30.0,
        max_behind: int = _DRAIN_PER_WAKE,
        connect_timeout_s: float = 5.0,
        heartbeat_s: float = 5.0,
        rcvhwm: int | None = None,
        backoff: Backoff = Backoff(),
        sleep: Sleep = asyncio.sleep,
        clock: Clock = time.time,
    ) -> None:
        if queue_size < 2 or max_replay_batches < 0:
            raise ValueError("queue_size must be >= 2 and max_replay_batches >= 0")
        self.endpoint = zmq_endpoint(host, port)
        self.replay_endpoint = None if replay_port is None else zmq_endpoint(host, replay_port)
        self._host = host
        self._port = port
        self._replay_port = replay_port
        self._consumer = consumer
        self._topic = topic.encode()
        self._limits = limits
        self._max_replay = max_replay_batches
        self._replay_timeout_s = replay_timeout_s
        self._replay_deadline_s = replay_deadline_s
        self._max_behind = max_behind
        self._connect_timeout_s = connect_timeout_s
        self._heartbeat_s = heartbeat_s
        message_bytes = limits.max_payload_bytes + len(self._topic) + _ENVELOPE_BYTES
        queued = max(1, SOCKET_BYTES // message_bytes) if rcvhwm is None else rcvhwm
        self.subscription_limits = zmtp.Limits(
            max_frame_bytes=limits.max_payload_bytes,
            max_frames=_SUBSCRIPTION_FRAMES,
            max_message_bytes=message_bytes,
            max_queued=queued,
        )
        """What the subscription's connection reads at most (``zmtp.Limits``)."""
        self.replay_limits = zmtp.Limits(
            max_frame_bytes=limits.max_payload_bytes,
            max_frames=_REPLAY_FRAMES,
            max_message_bytes=message_bytes,
            max_queued=queued,
        )
        """What the replay's connection reads at most."""
        self._backoff = backoff
        self._sleep = sleep
        self._clock = clock
        self._queue: Backlog[_Item] = Backlog(queue_size, queue_bytes)
        self._expected = 0
        self._seen = -1
        """The highest sequence number read from the subscription (this publisher's)."""
        self._applied = -1
        """The sequence number of the last batch applied (-1: none since a reset)."""
        self._patient = 0
        """Live batches still to wait for room: those queued while a replay was read."""
        self._held: deque[list[bytes]] = deque()
        self._held_bytes = 0
        self._turn_bytes = self._turn_messages = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._delays = backoff.delays()
        self.stats = SubscriberStats()

    async def start(self) -> None:
        name = f"kvevents {self.endpoint}"
        self._tasks = [
            asyncio.create_task(self._receive_forever(), name=f"{name} receive"),
            asyncio.create_task(self._apply_forever(), name=f"{name} apply"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.stats.connected = False

    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- receive ---------------------------------------------------------------------------

    async def _receive_forever(self) -> None:
        first = True
        while True:
            try:
                await self._session(first)
            except _Lost as exc:
                log.info("KV events from %s: %s", self.endpoint, exc)
            except Exception:  # a bug must not end the subscription: log, back off, retry
                log.exception("KV events from %s: receive failed", self.endpoint)
            self.stats.connected = False
            first = False
            await self._sleep(next(self._delays))

    async def _connect(
        self, port: int, socket_type: bytes, limits: zmtp.Limits, ready: asyncio.Event
    ) -> zmtp.Connection:
        return await zmtp.connect(
            self._host,
            port,
            socket_type=socket_type,
            limits=limits,
            heartbeat_s=self._heartbeat_s,
            ready=ready,
            subscribe=self._topic if socket_type == b"SUB" else None,
        )

    async def _session(self, first: bool) -> None:
        """One connection: connect, then receive until it is lost (raises :class:`_Lost`)."""
        ready = asyncio.Event()
        try:
            # Until the ZMTP handshake is done, at most connect_timeout_s: heartbeats start only
            # after it, and a frozen process's kernel still accepts the connection.
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation
            # that arrives as the awaited result does (CPython gh-86296).
            async with asyncio.timeout(self._connect_timeout_s):
                sub = await self._connect(self._port, b"SUB", self.subscription_limits, ready)
        except TimeoutError:
            self.stats.connect_failures_total += 1
            raise _Lost(f"no connection within {self._connect_timeout_s}s") from None
        except (OSError, zmtp.ZmtpError) as exc:
            self.stats.connect_failures_total += 1
            raise _Lost(f"connection failed ({exc})") from None
        try:
            self.stats.connects_total += 1
            self.stats.connected = True
            if not first:
                await self._put(_Reset(ResetReason.RECONNECTED))
            self._expected = 0  # a new subscription: what came before it is replayed or reset
            self._seen = -1
            self._delays = self._backoff.delays()  # the next failure waits the initial delay
            await self._receive(sub)
        finally:
            await sub.close()

    async def _receive(self, sub: zmtp.Connection) -> None:
        self._held.clear()
        self._held_bytes = 0
        while True:
            await sub.wait()
            while (frames := self._take(sub)) is not None:
                await self._on_message(frames, sub)
                while self._held:  # what came while a replay was read, in order
                    held = self._held.popleft()
                    self._held_bytes -= _size(held)
                    await self._on_message(held, sub)
                    await self._pace(held)
                if await self._pace(frames):
                    break  # the loop had its turn: look again

    def _take(self, sub: zmtp.Connection) -> list[bytes] | None:
        """The subscription's next message, None if none yet; a lost connection (closed,
        silent through its heartbeats, or over a bound) raises :class:`_Lost`."""
        try:
            return sub.take()
        except zmtp.ZmtpError as exc:
            self.stats.disconnects_total += 1
            raise _Lost(f"disconnected: {exc}") from None

    def _hold(self, sub: zmtp.Connection) -> None:
        """During a replay: read what the subscription has (so that the connection is kept
        read, heartbeats included), keep it undecoded up to ``LIVE_HOLD_BYTES``, and note the
        newest sequence number; past the bound a message is dropped and counted
        (``queue_full``): the gap it leaves is replayed after."""
        for _ in range(_DRAIN_PER_WAKE):
            frames = self._take(sub)
            if frames is None:
                return
            seq = _seq_of(frames[1]) if len(frames) == 3 else None
            if seq is not None and seq > self._seen:
                self._seen = seq
            size = _size(frames)
            if self._held_bytes + size <= LIVE_HOLD_BYTES:
                self._held.append(frames)
                self._held_bytes += size
                self.stats.held_bytes_peak = max(self.stats.held_bytes_peak, self._held_bytes)
            else:
                self.stats.drops_total[DropReason.QUEUE_FULL] += 1

    async def _pace(self, frames: list[bytes]) -> bool:
        """Count a message read; past the turn's budget, give the loop its turn (True)."""
        self._turn_messages += 1
        self._turn_bytes += sum(map(len, frames))
        if self._turn_messages < _DRAIN_PER_WAKE and self._turn_bytes < _WAKE_BYTES:
            return False
        self._turn_bytes = self._turn_messages = 0
        await asyncio.sleep(0)
        return True

    def _decode(self, frames: list[bytes]) -> EventBatch | None:
        """The message's batch, or None (a counted drop)."""
        try:
            return decode_message(frames, topic=self._topic, limits=self._limits)
        except WireError as exc:
            self.stats.drops_total[exc.reason] += 1
            log.debug("KV events from %s: dropped a message: %s", self.endpoint, exc)
            return None

    async def _on_message(self, frames: list[bytes], sub: zmtp.Connection) -> None:
        batch = self._decode(frames)
        if batch is None:
            return
        self.stats.messages_total += 1
        if batch.seq < self._expected:
            self._push(_Reset(ResetReason.RESTARTED))
            self._expected = 0
            self._seen = -1
        self._seen = max(self._seen, batch.seq)
        self._count_behind()
        if batch.seq > self._expected:
            self.stats.gaps_total += 1
            await self._fill_gap(batch.seq, sub)
            # seq, then what the engine published during the replay: held, queued in the
            # connection and TCP on both sides, which a drop would waste the replay on.
            self._patient = _PATIENT_AFTER_REPLAY + 1 + len(self._held)
        if self._patient:
            self._patient -= 1
            await self._put(batch)
        else:
            self._push(batch)
        self._expected = batch.seq + 1

    async def _fill_gap(self, seq: int, sub: zmtp.Connection) -> None:
        """Replay ``[expected, seq)`` into the queue as it arrives; a reset before a batch that
        does not follow the one before it, and before ``seq`` when the replay stops short."""
        start = max(self._expected, seq - self._max_replay)
        if self._max_replay and self.replay_endpoint is not None:
            self.stats.replaying = True
            try:
                async with contextlib.aclosing(self._replay(start, seq, sub)) as replayed:
                    async for batch in replayed:
                        if batch.seq != self._expected:
                            await self._put(_Reset(ResetReason.GAP))
                        await self._put(batch)
                        self._expected = batch.seq + 1
            finally:
                self.stats.replaying = False
        if self._expected != seq:
            await self._put(_Reset(ResetReason.GAP))

    async def _replay(
        self, start: int, stop: int, sub: zmtp.Connection
    ) -> AsyncGenerator[EventBatch, None]:
        """The batches ``[start, stop)`` the replay socket still has, in order (maybe none),
        as they arrive; each new one within ``replay_timeout_s`` of the one before (a batch
        already had, repeated, is no progress), all within ``replay_deadline_s``. Meanwhile the
        subscription is read into the hold (``_hold``); its loss ends it all."""
        assert self._replay_port is not None
        self.stats.replays_total += 1
        last = start - 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._replay_deadline_s
        stalled = loop.time() + self._replay_timeout_s
        dealer: zmtp.Connection | None = None
        ready = sub.ready
        try:
            async with asyncio.timeout(self._replay_timeout_s):
                dealer = await self._connect(
                    self._replay_port, b"DEALER", self.replay_limits, ready
                )
            dealer.send([b"", encode_seq(start)])
            # Replies past the gap come through the subscription too: read up to stop - 1.
            while last < stop - 1:
                left = min(deadline, stalled) - loop.time()
                if left <= 0:
                    raise TimeoutError
                if not (dealer.pending or sub.pending):
                    ready.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(left):
                            await ready.wait()
                if sub.pending:
                    self._hold(sub)  # a lost subscription ends it all (_Lost)
                frames = dealer.take()
                if frames is None:
                    continue
                if len(frames) == 4 and frames[0] == b"" and _is_end(frames[2]):
                    break
                if len(frames) != 4 or frames[0] != b"":
                    self.stats.drops_total[DropReason.FRAMES] += 1
                    break
                seq = _seq_of(frames[2])
                if seq is None or seq >= stop:
                    if seq is None:
                        self.stats.drops_total[DropReason.SEQ] += 1
                    break
                await self._pace(frames)
                if seq <= last:  # a repeat or an earlier one: no progress, not even decoded
                    continue
                batch = self._decode(frames[1:])
                if batch is None:
                    break
                last = batch.seq
                self.stats.replayed_batches_total += 1
                yield batch
                stalled = loop.time() + self._replay_timeout_s  # after the queue had room
        except TimeoutError:
            self.stats.replays_cut_total += 1
            log.info(
                "KV events from %s: replay from %d ended at %d of %d (%s)",
                self.endpoint,
                start,
                last + 1,
                stop,
                "deadline" if loop.time() >= deadline else "no progress",
            )
        except (OSError, zmtp.ZmtpError) as exc:  # the replay's connection only
            log.info(
                "KV events from %s: replay from %d ended at %d of %d: %s",
                self.endpoint,
                start,
                last + 1,
                stop,
                exc,
            )
        finally:
            if dealer is not None:
                await dealer.close()

    async def _put(self, item: _Item) -> None:
        """Queue for the consumer, waiting for room (a replay: memory stays the queue's)."""
        await self._queue.put(item, _cost(item))
        self._count_queued()

    def _push(self, item: _Item) -> None:
        """Queue for the consumer; when full, the pending batches make way for a reset."""
        cost = _cost(item)
        if not self._queue.put_nowait(item, cost):
            dropped = 0
            while not self._queue.empty():
                if isinstance(self._queue.get_nowait(), EventBatch):
                    dropped += 1
                self._queue.task_done()
            self.stats.drops_total[DropReason.QUEUE_FULL] += dropped
            self._queue.put_nowait(_Reset(ResetReason.QUEUE_FULL), _RESET_BYTES)
            if isinstance(item, EventBatch):  # true of the engine after the reset: kept
                self._queue.put_nowait(item, cost, force=True)
        self._count_queued()

    def _count_queued(self) -> None:
        self.stats.queued = self._queue.qsize()
        self.stats.queued_bytes = self._queue.bytes
        self.stats.queued_bytes_peak = self._queue.peak_bytes

    def _count_behind(self) -> None:
        self.stats.behind = max(0, self._seen - self._applied)

    @property
    def catching_up(self) -> bool:
        """Whether the index lacks what the engine published: a replay is being read, or more
        than ``max_behind`` batches read are not applied yet."""
        return self.stats.replaying or self.stats.behind > self._max_behind

    # -- apply -----------------------------------------------------------------------------

    async def _apply_forever(self) -> None:
        while True:
            events = self._apply(await self._queue.get())
            # What else is queued, up to a turn's budget, then the loop gets the turn back:
            # neither side starves the other, nor the request path.
            for _ in range(_DRAIN_PER_WAKE - 1):
                if events >= _APPLY_EVENTS:
                    break
                try:
                    item = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    break
                events += self._apply(item)
            self._count_queued()
            self._count_behind()
            await asyncio.sleep(0)

    def _apply(self, item: _Item) -> int:
        """Hand one item to the consumer; returns its events (a reset: one)."""
        events = 1
        try:
            if isinstance(item, _Reset):
                self._applied = -1
                self.stats.resets_total[item.reason] += 1
                self._consumer.reset(item.reason)
            else:
                self._applied = item.seq
                events = batch_events(item)
                self._consumer.apply(item)
                self.stats.batches_applied_total += 1
                self.stats.events_total += events
                self.stats.lag_s = self._clock() - item.ts
        except Exception:
            log.exception("KV events from %s: the consumer failed", self.endpoint)
            self.stats.resets_total[ResetReason.CONSUMER_ERROR] += 1
            with contextlib.suppress(Exception):
                self._consumer.reset(ResetReason.CONSUMER_ERROR)
        finally:
            self._queue.task_done()
        return events

    async def drained(self) -> None:
        """Wait until everything queued so far was applied (tests, benchmarks)."""
        await self._queue.join()


def _size(frames: list[bytes]) -> int:
    return sum(map(len, frames))


def _cost(item: _Item) -> int:
    return _RESET_BYTES if isinstance(item, _Reset) else decoded_bytes(item)


def _seq_of(frame: bytes) -> int | None:
    try:
        seq = decode_seq(frame)
    except WireError:
        return None
    return seq if seq >= 0 else None


def _is_end(frame: bytes) -> bool:
    try:
        return decode_seq(frame) == -1
    except WireError:
        return False
