"""Reservations as per-endpoint counters keyed by epoch: each reservation one increment, each
release the same decrement, each decision's read every endpoint's counters in one round (not
wired into the scheduler yet; ``python -m bench fleet --reservations counters`` and ``python -m
bench saturation`` measure it).

**Epochs.** Time is cut in epochs of ``epoch_s`` seconds (``EPOCH_S``, 10), at least the longest a
reservation is held (a prefill): epoch ``k`` runs from ``k · epoch_s`` to ``(k + 1) · epoch_s`` on
Redis's clock, never a sidecar's. A sidecar learns its clock's offset from Redis's with ``TIME``
(the midpoint of the call, when it starts and again once an epoch, the renewal sent alongside a
read: the same round, in parallel), and reads the epoch on its own monotonic clock plus that offset.
The answer's time is taken when the coroutine resumes, later than the answer by whatever else the
loop ran meanwhile, so the offset's error is not bounded by half the network's round trip: it is by
half the round trip as measured, and a ``TIME`` whose measured round trip is over ``SKEW_MS`` (50
ms) is not learnt from (the offset learnt before is kept; a sidecar's first is taken whatever its
round trip, there being none before). A ``TIME`` that fails (on a Cluster it goes to one node,
redis-py's default, which may be the one down) fails no read: the read's ``MGET`` answers, the
offset learnt before is kept, and the next ``TIME`` goes after a backoff (``RELEARN_BACKOFF_S``,
doubled at each failure up to an epoch); one is in flight at a time, whatever the reads meanwhile.
The first read or reservation cannot do without it: it waits for one ``TIME`` (one at a time) and
fails with it. ``TIME`` rather than a script computing the epoch inside Redis: the key of a write
must be named by its caller (a Cluster routes by it, and a script may only touch the keys it is
given), and one ``TIME`` per sidecar an epoch costs the fleet a call per ten seconds per sidecar,
against the decisions' thousands a second. A sidecar whose clock is off by any amount computes the
same epoch as the others (the offset absorbs it); two sidecars' reckonings differ by their offsets'
errors, within ``SKEW_MS``. A writer puts a reservation in the epoch of ``now - SKEW_MS`` (its
reckoning), a reader reads the epochs of ``now`` and the one before: for a reader behind the writer
by at most ``SKEW_MS`` the reservation's epoch is never later than the reader's current one, and for
one ahead (by at most ``epoch_s - SKEW_MS``) never earlier than its previous, so every reader counts
it, whichever side of a boundary each stands. (Writing in the epoch of ``now`` instead, a writer 5
ms ahead of a reader just before a boundary writes in an epoch the reader does not read yet.)

**Keys.** Per endpoint and epoch one string, ``{prefix/endpoint}:epoch`` (``counter_key``): a
hash tag per endpoint, so that the endpoints spread over a Cluster's slots (``groups`` g: g tags
instead, ``g / 3`` on each master of an even 3-master split as ``sharded.shard_tags`` chooses
them, each endpoint on one by a hash of its name: fewer slots for a read to visit). The string
holds two counters packed in one integer, ``tokens · PACK + requests`` (``PACK`` = 2²⁰: a key's
requests stay within ±``PACK / 2``, its tokens within ±2⁴³), so that one ``INCRBY`` moves both
and a read fetches one key per endpoint and epoch (``python -m bench saturation`` measures the
two-string and hash layouts against it: a read of 128 strings, or 64 ``HMGET``s, costs Redis more
than one of 64 keys).

**Writing.** Reserving ``t`` tokens is ``INCRBY key (t · PACK + 1)`` on the key of the epoch of
``SKEW_MS`` ago and ``PEXPIREAT key ((epoch + EPOCHS_KEPT) · epoch_s)``, in one transaction
(``MULTI``/``EXEC``, the same slot: one round trip, and a key never lives without its expiry);
releasing is the negative increment on the key of the epoch the reservation was made in (``Held``
remembers it), with the same ``PEXPIREAT``. The expiry is an absolute time on Redis's clock, the
same from every writer: a key lives until the start of the third epoch after its own, one epoch
after the last read of it. A release that comes after its key expired creates the key with a
negative count and, its expiry being past, deletes it at once; one whose key has surely expired (by
the sidecar's reckoning) is not sent at all (``late``).

**Reading.** ``read(endpoints)`` fetches the current and the previous epoch's key of every endpoint:
one ``MGET`` on one server (a server that does not answer fails the read), on a Cluster one pipeline
per master, in parallel, an ``MGET`` per slot: a master that does not answer fails only its
endpoints, which the read names (``Counts.missing``) and leaves out of its loads, for the caller to
decide about them on what it knows itself. A reservation is counted from its increment until its
release, or until the end of the epoch after its own — at least ``epoch_s - SKEW_MS`` (its epoch is
that of ``SKEW_MS`` before it was made), at most ``2 · epoch_s``: a reservation held longer than
that may stop being counted before its release. The key's expiry keeps its margin: it outlives the
last read of it by an epoch, far more than ``SKEW_MS``. Each value is checked (``decode_count``): at
most ``MAX_VALUE_BYTES``, an integer, its tokens within ±``MAX_LOAD`` and its requests within
±``MAX_REQUESTS`` (2¹⁸, half the field), else skipped and counted; a negative counter (a release
whose reservation the reader did not see, a hand's write) is read as 0 and counted. Whoever can
write the keys can make a sidecar see loads that are not there, as with any shared state, but cannot
make it read more than 20 bytes a key or take a value out of range.

**A sidecar that dies** leaves its reservations counted until the end of the epoch after the
one each was made in (at most ``2 · epoch_s``, 20 s by default), and in Redis's memory until
``EPOCHS_KEPT`` epochs after it: nothing else to clean. Nothing in Redis grows with the number
of sidecars: ``2 × endpoints`` live keys (three epochs at most), whatever N.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from sidecar.scheduling.state import Load
from sidecar.scheduling.state.protocol import MAX_KEY_BYTES, MAX_LOAD
from sidecar.scheduling.state.sharded import Client, shard_tags

EPOCH_S = 10.0
"""An epoch's length: at least the longest a reservation is held."""
RELEARN_BACKOFF_S = 1.0
"""After a ``TIME`` that failed, the wait before the next (doubled at each failure in a row, up
to the relearning's period)."""
SKEW_MS = 50.0
"""How far two sidecars' reckonings of Redis's clock may differ: a write goes to the epoch of
``SKEW_MS`` ago, and a ``TIME`` whose round trip is longer is not learnt from."""
EPOCHS_KEPT = 3
"""Epoch ``k``'s key expires at the start of epoch ``k + EPOCHS_KEPT``: read in epochs ``k`` and
``k + 1``, kept one more for releases and for clocks that disagree around a boundary."""
PACK = 1 << 20
"""A key's value is ``tokens · PACK + requests``."""
MAX_REQUESTS = PACK // 4
"""A key's requests as read at most: the field holds ±``PACK / 2``, and a count near its edge is
one step from carrying into the tokens."""
MAX_VALUE_BYTES = 20
"""A key's value as read: a signed 64-bit integer's longest decimal form."""
MAX_ENDPOINTS = 1024
"""Endpoints one read asks at most."""
TAG_CACHE = 4 * MAX_ENDPOINTS
"""Endpoints whose tags are remembered (the cache is emptied when full)."""
_INT64 = (1 << 63) - 1


def check_name(name: str, what: str) -> None:
    """``ValueError`` unless ``name`` can go in a hash tag: printable, without space or brace,
    of at most ``MAX_KEY_BYTES``."""
    if not 0 < len(name.encode()) <= MAX_KEY_BYTES or not name.isprintable():
        raise ValueError(f"not {what} for a counter key (its length): {name[:40]!r}")
    if any(c in name for c in " {}"):
        raise ValueError(f"not {what} for a counter key (a space or brace): {name[:40]!r}")


def pack(tokens: int, requests: int) -> int:
    """The increment that moves a key's tokens by ``tokens`` and its requests by ``requests``."""
    return tokens * PACK + requests


def unpack(value: int) -> tuple[int, int]:
    """A key's value as its two counters, either of them negative (``|requests| < PACK / 2``)."""
    requests = (value + PACK // 2) % PACK - PACK // 2
    return (value - requests) // PACK, requests


@dataclass(frozen=True, slots=True)
class Count:
    """One key's counters as read, every part checked."""

    load: Load
    clamped: bool
    """A counter was negative, and is read as 0."""


def decode_count(raw: object) -> Count | None:
    """One key's value as ``MGET`` answers it (None: no key, or not a string) checked: None when
    it is not a counter at all (too long, not an integer, beyond 64 bits, a counter over
    ``MAX_LOAD``, requests over ``MAX_REQUESTS``), else its counters, a negative one read as 0."""
    if not isinstance(raw, bytes) or not 0 < len(raw) <= MAX_VALUE_BYTES:
        return None
    digits = raw[1:] if raw[:1] == b"-" else raw
    if not digits.isdigit() or not digits.isascii():
        return None
    value = int(raw)
    if abs(value) > _INT64:
        return None
    tokens, requests = unpack(value)
    if abs(tokens) > MAX_LOAD or abs(requests) > MAX_REQUESTS:
        return None
    clamped = tokens < 0 or requests < 0
    return Count(Load(max(tokens, 0), max(requests, 0)), clamped)


@dataclass(frozen=True, slots=True)
class Held:
    """A reservation as counted: what its release takes back, and where."""

    endpoint: str
    tokens: int
    epoch: int
    """The epoch it was made in: its release goes to that epoch's key."""


@dataclass(frozen=True, slots=True)
class Counts:
    """Every endpoint asked, as read."""

    loads: dict[str, Load]
    """The endpoints some reservation is counted on (tokens, requests), the current and the
    previous epoch's summed."""
    epoch: int
    skipped: int
    """Keys whose value was no counter (left out)."""
    clamped: int
    """Keys with a negative counter (read as 0)."""
    missing: tuple[str, ...] = ()
    """The endpoints whose keys' master did not answer (a Cluster's): not in ``loads``, for
    the caller to decide about on what it knows itself."""


class Counters:
    """A pool's counters on one client: their keys, the writes and the reads. Shared by the
    sidecars of one process (one client, many ``CounterReservations``)."""

    def __init__(
        self, client: Client, prefix: str, *, epoch_s: float = EPOCH_S, groups: int | None = None
    ) -> None:
        check_name(prefix, "a prefix")
        if epoch_s <= 0:
            raise ValueError("an epoch lasts some time")
        if groups is not None and groups < 1:
            raise ValueError(f"keys under at least one hash tag, not {groups}")
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.prefix = prefix
        self.epoch_ms = epoch_s * 1000
        self._groups = None if groups is None else shard_tags(prefix, groups)
        self._tags: dict[str, str] = {}
        self._keys: dict[tuple[int, tuple[str, ...]], list[str]] = {}

    def tag(self, endpoint: str) -> str:
        """The start of ``endpoint``'s keys, its hash tag in it."""
        tag = self._tags.get(endpoint)
        if tag is None:
            check_name(endpoint, "an endpoint")
            if self._groups is None:
                tag = "{" + f"{self.prefix}/{endpoint}" + "}"
            else:
                group = self._groups[zlib.crc32(endpoint.encode()) % len(self._groups)]
                tag = f"{group}{endpoint}"
            if len(self._tags) >= TAG_CACHE:
                self._tags.clear()
            self._tags[endpoint] = tag
        return tag

    def key(self, endpoint: str, epoch: int) -> str:
        return f"{self.tag(endpoint)}:{epoch}"

    def read_keys(self, endpoints: tuple[str, ...], epoch: int) -> list[str]:
        """The keys a read of ``endpoints`` fetches in ``epoch``: each endpoint's previous and
        current epoch's, in that order (the last few lists remembered: the sidecars of a
        process read the same endpoints all epoch long)."""
        keys = self._keys.get((epoch, endpoints))
        if keys is None:
            keys = [self.key(name, e) for name in endpoints for e in (epoch - 1, epoch)]
            if len(self._keys) >= 4:
                self._keys.clear()
            self._keys[(epoch, endpoints)] = keys
        return keys

    def expire_at_ms(self, epoch: int) -> int:
        """When epoch ``epoch``'s keys expire, in ms on Redis's clock."""
        return round((epoch + EPOCHS_KEPT) * self.epoch_ms)

    async def add(self, key: str, delta: int, expire_at_ms: int) -> None:
        """``INCRBY`` and ``PEXPIREAT`` of one key, in one round trip and one transaction: the
        key never lives without its expiry."""
        pipe = self.client.pipeline(transaction=True)
        pipe.incrby(key, delta)
        pipe.pexpireat(key, expire_at_ms)
        await pipe.execute()

    async def fetch(self, keys: Sequence[str]) -> tuple[list[object], set[int]]:
        """The values of ``keys`` (None: none, or not a string), and the indices of those whose
        master did not answer: one ``MGET`` (a server that does not answer fails it), on a
        Cluster one pipeline per master, in parallel, an ``MGET`` per slot."""
        if self.cluster:
            assert isinstance(self.client, RedisCluster)
            return await self._fetch_per_master(self.client, keys)
        values = await self.client.execute_command("MGET", *keys)
        if not isinstance(values, list) or len(values) != len(keys):
            raise ValueError("MGET answered something else")
        return values, set()

    async def _fetch_per_master(
        self, client: RedisCluster, keys: Sequence[str]
    ) -> tuple[list[object], set[int]]:
        slots: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            slots.setdefault(client.keyslot(key), []).append(index)
        masters: dict[str, list[list[int]]] = {}
        for indices in slots.values():
            master = client.get_node_from_key(keys[indices[0]])
            masters.setdefault(master.name if master else "", []).append(indices)

        async def ask(groups: list[list[int]]) -> list[object]:
            pipe = client.pipeline()
            for indices in groups:
                pipe.execute_command("MGET", *(keys[i] for i in indices))
            answers: list[object] = await pipe.execute()
            return answers

        groups_per_master = list(masters.values())
        answered = await asyncio.gather(
            *(ask(groups) for groups in groups_per_master), return_exceptions=True
        )
        values: list[object] = [None] * len(keys)
        missing: set[int] = set()
        for groups, answers in zip(groups_per_master, answered, strict=True):
            if isinstance(answers, BaseException):
                if not isinstance(answers, Exception):
                    raise answers  # a cancellation
                missing.update(i for indices in groups for i in indices)
                continue
            for indices, got in zip(groups, answers, strict=True):
                if not isinstance(got, list) or len(got) != len(indices):
                    raise ValueError("MGET answered something else")
                for i, value in zip(indices, got, strict=True):
                    values[i] = value
        return values, missing

    async def redis_ms(self) -> float:
        """Redis's clock, in ms (``TIME``)."""
        raw = await self.client.execute_command("TIME")
        if isinstance(raw, dict):  # a Cluster answers per node
            raw = next(iter(raw.values()))
        if not isinstance(raw, list | tuple) or len(raw) != 2:
            raise ValueError("TIME answered something else")
        seconds, micros = (int(part) for part in raw)
        return seconds * 1000 + micros / 1000


class CounterReservations:
    """One sidecar's side: its clock's offset from Redis's, the epoch, its reserves, releases and
    reads."""

    def __init__(
        self,
        counters: Counters,
        *,
        clock: Callable[[], float] = time.monotonic,
        relearn_s: float | None = None,
    ) -> None:
        """``clock``: this sidecar's monotonic clock, in seconds (any origin); ``relearn_s``: how
        often the offset is learnt again (an epoch; a test that moves ``clock`` to stand for
        Redis's clock moving gives it longer)."""
        self._counters = counters
        self._clock = clock
        self._relearn_s = counters.epoch_ms / 1000 if relearn_s is None else relearn_s
        self._offset_ms: float | None = None
        """Redis's clock less this sidecar's, in ms, as last learnt."""
        self._next_learn = 0.0
        """When a read next sends ``TIME`` (on ``clock``): set when one is sent, so that one at
        a time is in flight."""
        self._backoff_s = RELEARN_BACKOFF_S
        self._first = asyncio.Lock()
        self.skipped = 0
        """Keys the reads left out, in all."""
        self.clamped = 0
        """Negative counters the reads took as 0, in all."""
        self.late = 0
        """Releases not sent: their key had expired."""
        self.slow_clocks = 0
        """``TIME`` answers not learnt from: their round trip was over ``SKEW_MS``."""
        self.clock_failures = 0
        """``TIME``s sent with a read that failed (the offset learnt before kept)."""

    async def learn_clock(self) -> None:
        """The offset of Redis's clock from this sidecar's, from one ``TIME``."""
        sent = self._clock()
        redis_ms = await self._counters.redis_ms()
        answered = self._clock()
        self._next_learn = answered + self._relearn_s
        if self._offset_ms is not None and (answered - sent) * 1000 > SKEW_MS:
            self.slow_clocks += 1  # the answer's time not known closely enough: the old kept
            return
        self._offset_ms = redis_ms - (sent + answered) * 500

    async def _learn_first(self) -> None:
        """The offset learnt before the first read or reservation (one ``TIME`` at a time: the
        others wait for it); its failure is the caller's."""
        async with self._first:
            if self._offset_ms is None:
                await self.learn_clock()

    async def _relearn(self) -> None:
        """The offset learnt again; on a failure the one learnt before kept, and the next try
        after a backoff."""
        try:
            await self.learn_clock()
        except (RedisError, OSError, ValueError):
            self.clock_failures += 1
            self._next_learn = self._clock() + self._backoff_s
            self._backoff_s = min(2 * self._backoff_s, self._relearn_s)
        else:
            self._backoff_s = RELEARN_BACKOFF_S

    def now_ms(self) -> float:
        """Redis's clock as this sidecar reckons it, in ms (the offset must have been learnt)."""
        if self._offset_ms is None:
            raise RuntimeError("the clock's offset is not learnt yet")
        return self._clock() * 1000 + self._offset_ms

    def epoch(self) -> int:
        """The current epoch on Redis's clock: the one a read reads, with the previous."""
        return int(self.now_ms() // self._counters.epoch_ms)

    def write_epoch(self) -> int:
        """The epoch a reservation goes to: that of ``SKEW_MS`` ago, never later than the
        current epoch of a reader whose reckoning is at most ``SKEW_MS`` behind."""
        return int((self.now_ms() - SKEW_MS) // self._counters.epoch_ms)

    async def reserve(self, endpoint: str, tokens: int) -> Held:
        """Count a reservation of ``tokens`` on ``endpoint`` in the current epoch."""
        if not 0 <= tokens <= MAX_LOAD:
            raise ValueError(f"tokens out of range: {tokens}")
        if self._offset_ms is None:
            await self._learn_first()
        held = Held(endpoint, tokens, self.write_epoch())
        counters = self._counters
        await counters.add(
            counters.key(endpoint, held.epoch), pack(tokens, 1), counters.expire_at_ms(held.epoch)
        )
        return held

    async def release(self, held: Held) -> bool:
        """Take a reservation back from the key of the epoch it was made in; False (and nothing
        sent) when that key has expired."""
        if self._offset_ms is not None and self.epoch() >= held.epoch + EPOCHS_KEPT:
            self.late += 1
            return False
        counters = self._counters
        await counters.add(
            counters.key(held.endpoint, held.epoch),
            -pack(held.tokens, 1),
            counters.expire_at_ms(held.epoch),
        )
        return True

    async def read(self, endpoints: Iterable[str]) -> Counts:
        """Every endpoint's counters, the current and the previous epoch's summed: one round
        (the clock's offset, when due, learnt in parallel; the first read learns it first)."""
        names = tuple(dict.fromkeys(endpoints))
        if len(names) > MAX_ENDPOINTS:
            raise ValueError(f"{len(names)} endpoints, over {MAX_ENDPOINTS}")
        if self._offset_ms is None:
            await self._learn_first()
        epoch = self.epoch()
        counters = self._counters
        keys = counters.read_keys(names, epoch)
        now = self._clock()
        if now >= self._next_learn:
            self._next_learn = now + self._relearn_s  # sent: no other read sends one meanwhile
            fetched, _ = await asyncio.gather(
                counters.fetch(keys), self._relearn(), return_exceptions=True
            )
            if isinstance(fetched, BaseException):
                raise fetched
            values, unanswered = fetched
        else:
            values, unanswered = await counters.fetch(keys)
        loads: dict[str, Load] = {}
        missing: list[str] = []
        skipped = clamped = 0
        for index, name in enumerate(names):
            if 2 * index in unanswered or 2 * index + 1 in unanswered:
                missing.append(name)
                continue
            tokens = requests = 0
            for raw in values[2 * index : 2 * index + 2]:
                count = decode_count(raw)
                if count is None:
                    skipped += raw is not None
                    continue
                clamped += count.clamped
                tokens += count.load.tokens
                requests += count.load.requests
            if tokens or requests:
                loads[name] = Load(tokens, requests)
        self.skipped += skipped
        self.clamped += clamped
        return Counts(loads, epoch, skipped, clamped, tuple(missing))
