"""The Redis backend with reservations as counters (``SIDECAR_STATE_RESERVATIONS=counters``):
what a decision reads and a reservation writes costs Redis the same at 8 sidecars and at 1,000.

**Reservations** go through ``counters.CounterReservations``: a reservation is one increment of
its endpoint's counter, written off the request path as soon as it is made; its release is the
same decrement, sent with this sidecar's next read (or alone within ``RELEASE_DELAY_S``); a
decision's ``refresh`` reads every endpoint of the pool in one round, waiting at most the
decision's budget (``timeout_s``), joined by every decision that comes while it is in flight.
The keys spread over ``GROUPS`` hash tags, one per master of a 3-master Redis Cluster.

**The view** is the last read's counts less this sidecar's own as Redis counted them when the
read was sent, plus this sidecar's own as they are now: its own reservations count at once, and
once. A reservation is taken as counted by Redis from its write's answer, a release from the
moment it is deferred; an increment or a decrement in flight while a read is sent may be counted
twice until the next read, never missed. An endpoint whose master did not answer (a Cluster's)
keeps its others' counts as last read.

**Speeds and ejections** go through the sync script as with ``SIDECAR_STATE_RESERVATIONS=script``
(``redis.RedisState``), in its heartbeats (``HEARTBEATS_PER_LEASE`` a lease) and on an
ejection, with an empty table: the script's work is then bounded by the endpoints, not the
reservations, and it is not on the request path.

**Rolling upgrade.** A sidecar on the script (an older version, or one configured so) counts
only the script's totals. A counters sidecar therefore checks, after a sync at most every half
heartbeat (``check_fleet``), whether any such sidecar is live: it keeps its own membership in
``{prefix}:counting`` (a sorted set, with the same lease deadline as its entry in the script's
``sidecars``, written after the sync that renewed it) and counts the live members of
``sidecars`` less the live members of ``counting``: those with half a lease left at once (their
entry in ``sidecars`` cannot have been dropped yet, by a sidecar whose clock is ahead of the
checker's by less than half a lease), the others (a dead sidecar's, one late to renew) only if
still live in ``sidecars`` (looked up, a second round trip, when the first count finds some
script sidecars). Every live script sidecar is in the first and not the second. While some
are (``bridging``, also until the first check answers), it sends its table with the syncs as
well, joins a sync with each decision, and reads, per endpoint, the larger of the script's
totals and the counters: the script's totals count every sidecar while old ones are live (each
counters sidecar writes both), the counters every sidecar once none is left; neither counts
one twice.
Rolled back, a counters sidecar notices the script sidecars at its next check (within a
heartbeat), until which they do not see its reservations. A counters sidecar leaving removes
its ``counting`` membership before its ``sidecars`` entry: in between, the others may take it for
a script sidecar (and bridge until their next check), never the other way round. Starting, it is
in ``sidecars`` from its first sync and in ``counting`` from its first check, a round trip later:
a sidecar checking in between bridges until its next check (sidecars started together, for
their first heartbeat or so).

**Faults.** A read that fails backs the reads off (``BACKOFF_FIRST_S`` doubling to
``BACKOFF_MAX_S``; no read is waited for meanwhile): the decisions go on with the view as last
read and this sidecar's own reservations. A write that fails backs off its endpoint's writes
alone (on a Cluster, a master down stops the writes of its endpoints only; a read leaves them
out and keeps their others' counts as last read); its reservation is counted by this sidecar
alone and its release sends nothing (``lost_writes``). A write that failed without an answer
may have been applied: that reservation then counts for every sidecar (this one twice) until
its epoch ends. What the counters refuse before sending (an endpoint name that cannot be in a
key, a pool over ``MAX_ENDPOINTS``) backs nothing off (``last_error`` says ``refused``). What
Redis loses (a restart without persistence, a failover that lost the
last writes) is not written again: a reservation it lost stops counting, and its release, a
decrement of a key that no longer holds it, hides as much of the others' on that endpoint until
the key's epoch ends (20 s at most, ``counters.EPOCH_S``). A sidecar that dies leaves its
reservations counted until their epoch ends; one that closes takes them back first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from sidecar.scheduling.state import Load, OwnReservations, Reservation, SharedView
from sidecar.scheduling.state.counters import (
    MAX_ENDPOINTS,
    RELEASE_DELAY_S,
    CounterReservations,
    Counters,
    Held,
    Refused,
    check_name,
)
from sidecar.scheduling.state.protocol import BACKOFF_FIRST_S, BACKOFF_MAX_S, Sync
from sidecar.scheduling.state.redis import _ERRORS, RedisState
from sidecar.tasks import stop_task

logger = logging.getLogger("sidecar.scheduling.state")

GROUPS = 3
"""The hash tags the counters spread over: one per master of a 3-master Cluster (fewer slots
for a read to visit than one per endpoint; ``python -m bench fleet`` measures both)."""
CHECK_LIMIT = 256
"""``counting`` members late to renew that a check looks up one by one in ``sidecars``, at
most."""
CLOSE_WRITES_S = 1.0
"""How long ``close`` waits for writes in flight before taking back what they counted."""


def _add_counted(into: dict[tuple[str, int], Load], held: Held, sign: int) -> None:
    key = (held.endpoint, held.epoch)
    load = into.get(key, Load())
    updated = Load(load.tokens + sign * held.tokens, load.requests + sign)
    if updated.requests <= 0:
        into.pop(key, None)
    else:
        into[key] = updated


def _add(into: dict[str, Load], endpoint: str, tokens: int, requests: int) -> None:
    load = into.get(endpoint, Load())
    updated = Load(load.tokens + tokens, load.requests + requests)
    if updated.requests <= 0:
        into.pop(endpoint, None)
    else:
        into[endpoint] = updated


class CounterState(RedisState):
    """``RedisState`` with its reservations as counters (the module's docstring)."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        groups: int = GROUPS,
        release_delay_s: float = RELEASE_DELAY_S,
        counters_clock: Callable[[], float] = time.monotonic,
        relearn_s: float | None = None,
        **options: Any,
    ) -> None:
        """``options``: ``RedisState``'s. ``counters_clock`` and ``relearn_s``: the counters'
        (``CounterReservations``'), which a test moves through epochs."""
        check_name(prefix, "a prefix")
        super().__init__(url, prefix=prefix, **options)
        self._prefix = prefix
        self._groups = groups
        self._release_delay_s = release_delay_s
        self._counters_clock = counters_clock
        self._relearn_s = relearn_s
        self.counting_key = f"{self._tag}:counting"
        """The counters sidecars, each with the deadline of its entry in the script's
        ``sidecars``."""
        self._mine = OwnReservations()
        self._counted: dict[tuple[str, int], Load] = {}
        """This sidecar's reservations as Redis counts them, by endpoint and the epoch whose key
        holds them: written, less the releases deferred."""
        self._others: dict[str, Load] = {}
        self._writes: dict[int, tuple[Reservation, asyncio.Task[Held | None]]] = {}
        """Each reservation not released yet, by ``id``, with its write."""
        self._releasing: set[asyncio.Task[Held | None]] = set()
        """The writes of reservations released before their write answered."""
        self._reservations: CounterReservations | None = None
        self._reading: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._answered = asyncio.Event()
        self._stopping = asyncio.Event()
        self._synced_at: float | None = None
        """The clock at the last answered sync: its lease deadline is this plus the lease."""
        self._down_until = -math.inf
        """Reads wait for nothing until then (the last one failed)."""
        self._read_backoff_s = BACKOFF_FIRST_S
        self._write_down: dict[str, tuple[float, float]] = {}
        """Per endpoint whose last write failed: until when its writes are skipped, and the
        backoff that set it (a Cluster master down stops the writes of its endpoints alone)."""
        self.bridging = True
        """Whether script sidecars may be live (the module's docstring): until the first check."""
        self.script_sidecars: int | None = None
        """Live sidecars on the script at the last check (None: not checked yet)."""
        self._pool: tuple[str, ...] = ()
        """The endpoints of the last decision's read: read again with the heartbeat."""
        self._last_read = -math.inf
        self.lost_writes = 0
        self.last_read_unix: float | None = None

    async def start(self) -> None:
        await super().start()
        assert self._client is not None
        counters = Counters(self._client, self._prefix, groups=self._groups)
        self._reservations = CounterReservations(
            counters,
            clock=self._counters_clock,
            relearn_s=self._relearn_s,
            release_delay_s=self._release_delay_s,
        )
        self._watcher = asyncio.create_task(self._watch(), name="redis-counters-check")

    async def close(self) -> None:
        self._closing = True
        # The watcher ends at its next turn should it miss the cancel below.
        self._answered.set()
        self._stopping.set()
        for running in (self._watcher, self._reading):
            if running is not None:
                await stop_task(running)
        reservations, self._reservations = self._reservations, None
        if reservations is not None:
            # What this sidecar still counts is taken back, as the script's goodbye does.
            held = [write for _, write in self._writes.values()]
            self._writes.clear()
            if held or self._releasing:
                await asyncio.wait([*held, *self._releasing], timeout=CLOSE_WRITES_S)
            for write in held:
                if write.done():
                    self._take_back(reservations, write)
                else:
                    write.cancel()
            for write in list(self._releasing):
                if write.done():
                    self._take_back(reservations, write, released=True)
                else:
                    write.cancel()  # its callback finds it cancelled
            try:
                async with asyncio.timeout(CLOSE_WRITES_S):
                    await reservations.close()
            except _ERRORS:
                pass
        await super().close()

    async def _leave(self, client: aioredis.Redis | RedisCluster) -> None:
        # Out of ``counting`` first: taken for a script sidecar meanwhile, never the reverse.
        await client.zrem(self.counting_key, self.member_id)
        await super()._leave(client)

    # Reservations and the view.

    def view(self) -> SharedView:
        script = self._protocol.view()
        loads = dict(self._others)
        for endpoint, own in self._mine.loads.items():
            _add(loads, endpoint, own.tokens, own.requests)
        if self.bridging:
            for endpoint, total in script.loads.items():
                counted = loads.get(endpoint, Load())
                loads[endpoint] = Load(
                    max(total.tokens, counted.tokens), max(total.requests, counted.requests)
                )
        return SharedView(loads, script.speeds, script.ejected_until)

    def reserve(self, endpoint: str, tokens: int) -> Reservation:
        ahead = self.view().loads.get(endpoint, Load()).tokens
        reservation = Reservation(endpoint, tokens, ahead)
        self._mine.add(endpoint, tokens, 1)
        self._protocol.reserve(endpoint, tokens)  # the script's table, sent while bridging
        reservations = self._reservations
        down = self._write_down.get(endpoint)
        if reservations is None:
            return reservation  # not started, or closed: this sidecar's alone
        if down is not None and time.monotonic() < down[0]:
            self.lost_writes += 1  # its endpoint's writes backed off: not written
            return reservation
        write = asyncio.create_task(self._write(reservations, endpoint, tokens))
        self._writes[id(reservation)] = (reservation, write)
        return reservation

    def release(self, reservation: Reservation) -> None:
        self._mine.add(reservation.endpoint, -reservation.tokens, -1)
        self._protocol.release(reservation)
        entry = self._writes.pop(id(reservation), None)
        reservations = self._reservations
        if entry is None or reservations is None:
            return
        write = entry[1]
        if write.done():
            self._take_back(reservations, write)
        else:
            self._releasing.add(write)
            write.add_done_callback(lambda done: self._take_back(reservations, done, released=True))

    async def _write(
        self, reservations: CounterReservations, endpoint: str, tokens: int
    ) -> Held | None:
        try:
            held = await reservations.reserve(endpoint, tokens)
        except Exception as exc:
            self.lost_writes += 1
            if self._refused(exc):
                return None
            down = self._write_down.get(endpoint)
            if down is not None and time.monotonic() < down[0]:
                return None  # a write in flight with it failed too: backed off already
            backoff = BACKOFF_FIRST_S if down is None else min(2 * down[1], BACKOFF_MAX_S)
            if len(self._write_down) >= MAX_ENDPOINTS:
                self._write_down.clear()
            self._write_down[endpoint] = (time.monotonic() + backoff, backoff)
            return None
        self._write_down.pop(endpoint, None)
        _add_counted(self._counted, held, 1)
        return held

    def _take_back(
        self,
        reservations: CounterReservations,
        write: asyncio.Task[Held | None],
        *,
        released: bool = False,
    ) -> None:
        """A reservation's decrement deferred, once its write is known to have counted.
        ``released``: released before its write answered (in ``_releasing``, taken back once)."""
        if released:
            if write not in self._releasing:
                return  # taken back already (by ``close``)
            self._releasing.discard(write)
        if write.cancelled() or write.exception() is not None:
            return
        held = write.result()
        if held is not None:
            # Not counted any more whether deferred or too late to send (its key expired).
            _add_counted(self._counted, held, -1)
            reservations.defer_release(held)

    async def published(self) -> None:
        """Every change made so far published: the writes in flight answered, the releases
        deferred sent, and a sync of the speeds and ejections (the script's) answered. For
        tests and for tools; a decision never waits for this."""
        writes = [*(write for _, write in self._writes.values()), *self._releasing]
        if writes:
            await asyncio.wait(writes)
        await asyncio.sleep(0)  # the releases of writes just answered deferred (callbacks)
        if self._reservations is not None:
            await self._reservations.sent()
        await super().refresh()
        await super().refresh()

    # Reads.

    async def refresh(self, endpoints: Collection[str] = ()) -> None:
        if self._closing or self._reservations is None:
            return
        if self.bridging:
            await asyncio.gather(super().refresh(endpoints), self._refresh_counts(endpoints))
        else:
            await self._refresh_counts(endpoints)

    async def _refresh_counts(self, endpoints: Collection[str]) -> None:
        if not endpoints or time.monotonic() < self._down_until:
            return  # nothing to read, or Redis is down: waiting would only cost the budget
        reading = self._reading
        if reading is None:
            self._pool = tuple(endpoints)
            reading = self._reading = asyncio.create_task(self._read(self._pool))
        await self._within_budget(reading, "no counters within the decision budget")

    async def _read(self, endpoints: tuple[str, ...]) -> None:
        reservations = self._reservations
        assert reservations is not None
        sent = dict(self._counted)
        try:
            counts = await reservations.read(endpoints)
        except Exception as exc:
            if not self._refused(exc):
                self._down_until = time.monotonic() + self._read_backoff_s
                self._read_backoff_s = min(2 * self._read_backoff_s, BACKOFF_MAX_S)
            return
        finally:
            self._reading = None
        # This sidecar's own, in the epochs the read counted (the current one and the one
        # before): one held longer is in no key read any more.
        read_epochs = (counts.epoch, counts.epoch - 1)
        mine_sent: dict[str, Load] = {}
        for (endpoint, epoch), load in sent.items():
            if epoch in read_epochs:
                _add(mine_sent, endpoint, load.tokens, load.requests)
        others: dict[str, Load] = {}
        missing = set(counts.missing)
        for endpoint in endpoints:
            if endpoint in missing:
                kept = self._others.get(endpoint)
                if kept is not None:
                    others[endpoint] = kept
                continue
            read = counts.loads.get(endpoint)
            if read is None:
                continue
            mine = mine_sent.get(endpoint, Load())
            if read.requests - mine.requests > 0:
                others[endpoint] = Load(
                    max(read.tokens - mine.tokens, 0), read.requests - mine.requests
                )
        self._others = others
        if not self.connected:
            logger.info("redis state backend connected")
        self.connected = True
        if counts.skipped:
            self._on_skipped("load", counts.skipped)
        self._down_until = -math.inf
        self._read_backoff_s = BACKOFF_FIRST_S
        self.last_read_unix = time.time()
        self._last_read = time.monotonic()

    def _refused(self, exc: Exception) -> bool:
        """A read or a write failed: recorded. True when the counters refused it before sending
        (an endpoint that cannot be in a key, a pool over ``MAX_ENDPOINTS``): nothing to back
        off from."""
        if isinstance(exc, Refused):
            self._record_error("refused", str(exc))
            return True
        if not isinstance(exc, _ERRORS):
            logger.exception("shared-state counters failed unexpectedly")
        self._record_error("connection", f"{type(exc).__name__}: {exc}")
        return False

    # The rolling upgrade's check.

    def _synced(self, sync: Sync) -> None:
        self._synced_at = sync.now
        self._answered.set()

    async def _watch(self) -> None:
        """``check_fleet`` after a sync, at most every half heartbeat; and the pool read again
        when no decision read it for a heartbeat, so that the view (``/debug/scheduler``, the
        endpoints' gauges) does not stay as the last decision left it."""
        heartbeat = self._protocol.heartbeat_s
        # Until closing, not forever: a cancel that meets a Redis answer can be lost (Python
        # 3.11's ``asyncio.wait_for``, which redis-py uses), and ``close`` would wait for good.
        while not self._closing:
            await self._answered.wait()
            self._answered.clear()
            if self._closing:
                return
            try:
                await self.check_fleet()
            except Exception as exc:
                if not isinstance(exc, _ERRORS):
                    logger.exception("the counters' fleet check failed unexpectedly")
                # Left as it was: the next sync's check tries again.
            idle = time.monotonic() - self._last_read >= heartbeat
            if idle and self._pool and time.monotonic() >= self._down_until:
                if self._reading is None and not self._closing:
                    self._reading = asyncio.create_task(self._read(self._pool))
                if self._reading is not None:
                    await asyncio.wait([self._reading])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(heartbeat / 2):
                    await self._stopping.wait()

    async def check_fleet(self) -> None:
        """Renew this sidecar's ``counting`` membership to the deadline of its last sync, count
        the live script sidecars, and bridge while there are some."""
        client, synced_at = self._client, self._synced_at
        if client is None or synced_at is None or self._closing:
            return
        lease = self._protocol.lease_s
        now = self._clock()
        pipe = client.pipeline(transaction=False)
        pipe.zadd(self.counting_key, {self.member_id: synced_at + lease})
        pipe.zremrangebyscore(self.counting_key, "-inf", f"({now - lease!r}")
        pipe.zcount(self.keys[0], repr(now), "+inf")
        # A counters sidecar with half a lease left counts at once: its ``sidecars`` entry,
        # renewed with it, cannot have been dropped yet (by a sidecar whose clock is past its
        # deadline) unless that clock is half a lease ahead of this one.
        half = now + lease / 2
        pipe.zcount(self.counting_key, repr(half), "+inf")
        pipe.pexpire(self.counting_key, max(1, round(2 * lease * 1000)))
        answers = await pipe.execute()
        script = max(0, int(answers[2]) - int(answers[3]))
        if script:
            # Those with less left (dead ones, or late to renew) count only if still live in
            # ``sidecars``: a dead counters sidecar whose entry there was dropped hides no
            # script sidecar, and one still there is not taken for a script sidecar.
            script = max(0, script - await self._still_counting(client, now, half))
        self.script_sidecars = script
        bridging = script > 0
        if bridging != self.bridging:
            logger.info(
                "redis state backend: %d sidecar(s) on the script's reservations; %s",
                script,
                "sharing this sidecar's table with them" if bridging else "counters only",
            )
            self.bridging = bridging
            self._protocol.share_table(bridging)

    async def _still_counting(
        self, client: aioredis.Redis | RedisCluster, now: float, half: float
    ) -> int:
        """The ``counting`` members live until before ``half`` that are still live in
        ``sidecars``; when more than ``CHECK_LIMIT`` are (thousands dead at once), none: the
        check errs on the side of the script."""
        late = await client.zrangebyscore(
            self.counting_key, repr(now), f"({half!r}", start=0, num=CHECK_LIMIT + 1
        )
        if not late or len(late) > CHECK_LIMIT:
            return 0
        deadlines = await client.execute_command("ZMSCORE", self.keys[0], *late)
        return sum(1 for deadline in deadlines if deadline is not None and float(deadline) >= now)

    def status(self) -> dict[str, Any]:
        status = super().status()
        reservations = self._reservations
        status["reservations"] = {
            "kind": "counters",
            "bridging": self.bridging,
            "script_sidecars": self.script_sidecars,
            "last_read_unix": self.last_read_unix,
            "writes_in_flight": sum(not task.done() for _, task in self._writes.values()),
            "lost_writes": self.lost_writes,
            **(
                {}
                if reservations is None
                else {
                    "deferred_releases": reservations.deferred,
                    "lost_releases": reservations.lost_releases,
                    "late_releases": reservations.late,
                    "moved": reservations.moved,
                    "negative_counters": reservations.clamped,
                }
            ),
        }
        return status
