"""Reservations as per-endpoint counters keyed by epoch: each reservation one increment, each
release the same decrement, each decision's read every endpoint's counters in one round (the
scheduler's with ``SIDECAR_STATE_RESERVATIONS=counters``, through ``counter_state``; ``python -m
bench fleet --reservations counters`` and ``python -m bench saturation`` measure it).

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
``SKEW_MS`` ago and ``PEXPIREAT key ((epoch + EPOCHS_KEPT) · epoch_s)``, atomically, in one round
trip: a key never lives without its expiry. On one server a transaction (``MULTI``/``EXEC``); on a
Cluster ``ADD_SCRIPT`` (``EVAL``), redis-py running a Cluster transaction's commands each on a
thread of its own that blocks the event loop. Releasing is the negative increment on the key of the
epoch that counts the reservation, the one it was made in or moved to (``Held`` remembers it; see
below for moves), with the same ``PEXPIREAT``. The expiry is an absolute time on Redis's clock, the
same from every writer: a key lives until the start of the third epoch after its own, one epoch
after the last read of it. A release that comes after its key expired creates the key with a
negative count and, its expiry being past, deletes it at once; one whose key has surely expired (by
the sidecar's reckoning) is not sent at all (``late``).

**Deferred releases.** ``defer_release`` does not send a release at once: it goes with the
sidecar's next read, in the read's round and before its ``MGET`` (on one server in the read's
transaction; on a Cluster in the pipeline of the master it is on), or, if no read comes within
``RELEASE_DELAY_S`` (0.1 s) of the first release deferred, on its own with whatever else was
deferred meanwhile (without waiting once ``MAX_DEFERRED`` wait; what is deferred while a send is
in flight waits for it: at most the client's socket timeout). A write costs a busy Redis about a
round trip, so a release carried by the next decision's read saves most of its cost (``python
-m bench saturation``: the ``decision`` rows). The price: every sidecar counts a finished prefill
that much longer (a pod deciding 20 times a second, Poisson, reads within 0.1 s 86 % of the
time). A release whose outcome is not known (its server did not answer) or that Redis refused is
not sent again (a second decrement would hide a live reservation; a lost one stays counted until
its epoch ends): ``lost_releases`` counts them. A read given up on by its caller (a timeout)
does not lose the releases it carries: its fetch goes on until answered. ``close`` sends what
is deferred; a sidecar that ends without it leaves them counted, as a dead one does.

**Reading.** ``read(endpoints)`` fetches the current and the previous epoch's key of every endpoint:
one ``MGET`` on one server (a server that does not answer fails the read; with deferred releases,
one transaction of them and the ``MGET``), on a Cluster one plain pipeline per master, in parallel,
an ``MGET`` per slot (after the deferred releases it carries): a master that does not answer fails
only its endpoints, which the read names (``Counts.missing``) and leaves out of its loads, for the
caller to decide about them on what it knows itself. **The previous epoch is left out once empty**:
from ``CLEAR_AFTER_MS`` (2 s) into an epoch, a read that finds an endpoint's previous key holding
nothing leaves that key out for the rest of the epoch (``Counts.keys`` says how many were asked):
only releases can reach it by then. A write returned later than that into the next epoch (a stalled
loop) is moved into it (``moved``); a read that finds the key holding something again reads it
again. This narrows the clocks' tolerance: only a reader whose offset was learnt within ``SKEW_MS``
leaves a key out (an offset learnt less closely is learnt again after ``RELEARN_BACKOFF_S``), and a
step of Redis's clock of more than ``CLEAR_AFTER_MS - 2 · SKEW_MS`` between two sidecars'
relearnings can hide a reservation until the epoch ends, where ``epoch_s - SKEW_MS`` could before. A
reservation held across a boundary keeps its endpoint's two keys read until its release; a dead
sidecar's, until the epoch ends, as before. When prefills last less than those 2 s, a read is of two
keys an endpoint for the first 2 s of each 10 s epoch and one after: 1.2 keys an endpoint on
average, against 2. A reservation is counted from its increment until its release is applied, or
until the end of the epoch after its own — at least ``epoch_s - SKEW_MS`` (its epoch is that of
``SKEW_MS`` before it was made), at most ``2 · epoch_s``: a reservation held longer than that may
stop being counted before its release. The key's expiry keeps its margin: it outlives the last read
of it by an epoch, far more than ``SKEW_MS``. Each value is checked (``decode_count``): at most
``MAX_VALUE_BYTES``, an integer, its tokens within ±``MAX_LOAD`` and its requests within
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
import functools
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

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
CLEAR_AFTER_MS = 2_000.0
"""From this far into an epoch (a reader's reckoning, its offset learnt within ``SKEW_MS``) on, a
read that finds an endpoint's key of the previous epoch empty leaves that key out for the rest of
the epoch: nothing but releases reaches it any more. A writer within ``SKEW_MS`` of the reader
writes into the new epoch from ``2 · SKEW_MS`` after the boundary by the reader's reckoning, and
a reservation whose write returns later than ``CLEAR_AFTER_MS - 2 · SKEW_MS`` into the next
epoch (by its writer's) is moved into it (``CounterReservations.moved``)."""
RELEASE_DELAY_S = 0.1
"""How long a deferred release waits for the sidecar's next read to go with, before it is sent
on its own."""
MAX_DEFERRED = 64
"""Deferred releases that make the sender send without waiting for its delay (or for a read),
as soon as no send of its is in flight."""
TAG_CACHE = 4 * MAX_ENDPOINTS
"""Endpoints whose tags are remembered (the cache is emptied when full)."""
_INT64 = (1 << 63) - 1


class Refused(ValueError):
    """What the counters refuse before sending anything: a name that cannot be in a key, a
    count out of range, a read of too many endpoints (a ``ValueError`` raised once Redis
    answered is another matter: its answer was not what it should be)."""


def check_name(name: str, what: str) -> None:
    """``Refused`` unless ``name`` can go in a hash tag: printable, without space or brace,
    of at most ``MAX_KEY_BYTES``."""
    if not 0 < len(name.encode()) <= MAX_KEY_BYTES or not name.isprintable():
        raise Refused(f"not {what} for a counter key (its length): {name[:40]!r}")
    if any(c in name for c in " {}"):
        raise Refused(f"not {what} for a counter key (a space or brace): {name[:40]!r}")


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
    """The epoch whose key counts it (the one it was made in, or moved to): its release goes
    to that key."""


@dataclass(frozen=True, slots=True)
class Add:
    """One key moved: ``INCRBY key delta``, then ``PEXPIREAT key expire_at_ms``."""

    key: str
    delta: int
    expire_at_ms: int


@dataclass(frozen=True, slots=True)
class Fetched:
    values: list[object]
    """Each key's value (None: none, or not a string)."""
    missing: set[int]
    """The indices of the keys whose master did not answer."""
    lost: int = 0
    """The adds sent along whose outcome is not known (their master did not answer) or that
    Redis refused."""


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
    keys: int = 0
    """The keys asked: one or two an endpoint (a master's that did not answer included)."""


ADD_SCRIPT = """
local refused = 0
for i, key in ipairs(KEYS) do
  local delta = ARGV[2 * i - 1]
  if type(redis.pcall('INCRBY', key, delta)) == 'table' then
    refused = refused + 1
  elseif type(redis.pcall('PEXPIREAT', key, ARGV[2 * i])) == 'table' then
    refused = refused + 1
    if redis.call('DECRBY', key, delta) == 0 and redis.call('PTTL', key) == -1 then
      redis.call('DEL', key)
    end
  end
end
return refused
"""
"""On a Cluster, the writes of one slot's keys (KEYS, each with its increment and its expiry
in ARGV): each key's ``INCRBY`` then its ``PEXPIREAT``, atomically, or neither (an expiry refused
undoes its increment, and removes the key it made). Returns how many were refused. Sent with
``EVAL`` (Redis caches it by its hash; no ``NOSCRIPT`` after a failover)."""


def _script_args(adds: Sequence[Add]) -> list[str | int]:
    return [*(add.key for add in adds), *(v for a in adds for v in (a.delta, a.expire_at_ms))]


def _queue(pipe: Any, adds: Sequence[Add]) -> None:
    for add in adds:
        pipe.incrby(add.key, add.delta)
        pipe.pexpireat(add.key, add.expire_at_ms)


def _refused(answers: Sequence[object], adds: Sequence[Add]) -> int:
    """How many of ``adds`` Redis refused, by their answers (an ``INCRBY`` and a ``PEXPIREAT``
    each; a transaction that failed whole answers fewer, or a single error)."""
    if len(answers) != 2 * len(adds):
        return len(adds)
    return sum(
        isinstance(answers[2 * i], Exception) or isinstance(answers[2 * i + 1], Exception)
        for i in range(len(adds))
    )


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
        self._keys: dict[tuple[int, tuple[str, ...]], tuple[list[str], list[str]]] = {}

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

    def read_keys(
        self, endpoints: tuple[str, ...], epoch: int, cleared: tuple[bool, ...] | None = None
    ) -> list[str]:
        """The keys a read of ``endpoints`` fetches in ``epoch``: each endpoint's previous and
        current epoch's, in that order, or its current only where ``cleared`` says so (the
        last few lists remembered: the sidecars of a process read the same endpoints all epoch
        long)."""
        lists = self._keys.get((epoch, endpoints))
        if lists is None:
            current = [self.key(name, epoch) for name in endpoints]
            both = [
                k
                for name, now in zip(endpoints, current, strict=True)
                for k in (self.key(name, epoch - 1), now)
            ]
            lists = (both, current)
            if len(self._keys) >= 4:
                self._keys.clear()
            self._keys[(epoch, endpoints)] = lists
        both, current = lists
        if cleared is None or not any(cleared):
            return both
        if all(cleared):
            return current
        keys = []
        for index, only_current in enumerate(cleared):
            if not only_current:
                keys.append(both[2 * index])
            keys.append(current[index])
        return keys

    def expire_at_ms(self, epoch: int) -> int:
        """When epoch ``epoch``'s keys expire, in ms on Redis's clock."""
        return round((epoch + EPOCHS_KEPT) * self.epoch_ms)

    async def add(self, key: str, delta: int, expire_at_ms: int) -> None:
        """``INCRBY`` and ``PEXPIREAT`` of one key, in one round trip, atomically: the key never
        lives without its expiry. Raises when Redis refuses it."""
        if self.cluster:
            refused = await self.client.eval(ADD_SCRIPT, 1, key, delta, expire_at_ms)
            if refused:
                raise RedisError(f"Redis refused the write of {key}")
            return
        pipe = self.client.pipeline(transaction=True)
        pipe.incrby(key, delta)
        pipe.pexpireat(key, expire_at_ms)
        await pipe.execute()

    async def add_all(self, adds: Sequence[Add]) -> int:
        """``adds`` in one round, each key's ``INCRBY`` with its ``PEXPIREAT``, atomically: one
        transaction; on a Cluster one pipeline per master, in parallel, one ``ADD_SCRIPT`` per
        slot. Returns how many were lost: refused by Redis, or sent to a server that did not
        answer (their outcome not known: not sent again, a second decrement being worse than
        a count kept until its epoch ends)."""
        if not adds:
            return 0
        if self.cluster:
            assert isinstance(self.client, RedisCluster)
            return (await self._per_master(self.client, (), adds)).lost
        pipe = self.client.pipeline(transaction=True)
        _queue(pipe, adds)
        try:
            answers = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError):
            return len(adds)
        return _refused(answers, adds)

    async def fetch(self, keys: Sequence[str], adds: Sequence[Add] = ()) -> Fetched:
        """The values of ``keys``, with ``adds`` applied before they are read, in one round: one
        transaction of the adds and an ``MGET`` (a server that does not answer fails it); on a
        Cluster one pipeline per master, in parallel, an ``ADD_SCRIPT`` per slot of its adds
        then an ``MGET`` per slot of its keys."""
        if self.cluster:
            assert isinstance(self.client, RedisCluster)
            return await self._per_master(self.client, keys, adds)
        if adds:
            pipe = self.client.pipeline(transaction=True)
            _queue(pipe, adds)
            pipe.execute_command("MGET", *keys)
            answers = await pipe.execute(raise_on_error=False)
            values = answers[-1] if answers else None
            lost = _refused(answers[:-1], adds)
        else:
            values = await self.client.execute_command("MGET", *keys)
            lost = 0
        if not isinstance(values, list) or len(values) != len(keys):
            raise ValueError("MGET answered something else")
        return Fetched(values, set(), lost)

    async def _per_master(
        self, client: RedisCluster, keys: Sequence[str], adds: Sequence[Add]
    ) -> Fetched:
        """``fetch`` on a Cluster: per master one plain pipeline (redis-py runs a Cluster
        transaction's commands each on a thread of its own, blocking the loop: none here), its
        adds first, one ``ADD_SCRIPT`` per slot (atomic, in the order sent), then one ``MGET``
        per slot; a master that does not answer fails only its keys (``missing``) and its
        adds (``lost``)."""
        reads: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            reads.setdefault(client.keyslot(key), []).append(index)
        writes: dict[int, list[Add]] = {}
        for add in adds:
            writes.setdefault(client.keyslot(add.key), []).append(add)
        # Per master: its slots' adds, its slots' reads.
        masters: dict[str, tuple[list[list[Add]], list[list[int]]]] = {}

        def on(key: str) -> tuple[list[list[Add]], list[list[int]]]:
            node = client.get_node_from_key(key)
            return masters.setdefault(node.name if node else "", ([], []))

        for group in writes.values():
            on(group[0].key)[0].append(group)
        for indices in reads.values():
            on(keys[indices[0]])[1].append(indices)

        async def ask(
            scripts: list[list[Add]], groups: list[list[int]]
        ) -> tuple[list[object], list[object]]:
            pipe = client.pipeline()
            for group in scripts:
                pipe.eval(ADD_SCRIPT, len(group), *_script_args(group))
            for indices in groups:
                pipe.execute_command("MGET", *(keys[i] for i in indices))
            answers: list[object] = await pipe.execute(raise_on_error=False)
            return answers[: len(scripts)], answers[len(scripts) :]

        plans = list(masters.values())
        answered = await asyncio.gather(*(ask(*plan) for plan in plans), return_exceptions=True)
        values: list[object] = [None] * len(keys)
        missing: set[int] = set()
        lost = 0
        for (scripts, groups), outcome in zip(plans, answered, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome  # a cancellation
                missing.update(i for indices in groups for i in indices)
                lost += sum(len(group) for group in scripts)
                continue
            refused, got_all = outcome
            for group, count in zip(scripts, refused, strict=True):
                in_range = isinstance(count, int) and 0 <= count <= len(group)
                lost += count if isinstance(count, int) and in_range else len(group)
            for indices, got in zip(groups, got_all, strict=True):
                if isinstance(got, Exception):
                    missing.update(indices)
                    continue
                if not isinstance(got, list) or len(got) != len(indices):
                    raise ValueError("MGET answered something else")
                for i, value in zip(indices, got, strict=True):
                    values[i] = value
        return Fetched(values, missing, lost)

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
        release_delay_s: float = RELEASE_DELAY_S,
    ) -> None:
        """``clock``: this sidecar's monotonic clock, in seconds (any origin); ``relearn_s``: how
        often the offset is learnt again (an epoch; a test that moves ``clock`` to stand for
        Redis's clock moving gives it longer); ``release_delay_s``: how long a deferred release
        waits for a read to go with (on the event loop's clock)."""
        if release_delay_s < 0:
            raise ValueError("a release is not sent before it is made")
        self._counters = counters
        self._release_delay_s = release_delay_s
        self._deferred: list[Add] = []
        self._full = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._carrying: set[asyncio.Task[Fetched]] = set()
        """Reads' fetches that carry releases, until done (one given up on goes on)."""
        self._cleared: dict[str, int] = {}
        """Per endpoint, the epoch in which a read found its previous epoch's key empty late
        enough: the reads of that epoch leave that key out."""
        self._precise = False
        """The offset was learnt from a ``TIME`` answered within ``SKEW_MS``: only then does a
        read leave a key out."""
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
        self.moved = 0
        """Reservations whose write returned so late that a reader may have left their key out
        already: moved into the epoch of their return."""
        self.lost_releases = 0
        """Deferred releases Redis refused or whose outcome is not known (sent with a read or on
        their own to a server that did not answer): their reservations stay counted until
        their epoch ends."""

    async def learn_clock(self) -> None:
        """The offset of Redis's clock from this sidecar's, from one ``TIME``."""
        sent = self._clock()
        redis_ms = await self._counters.redis_ms()
        answered = self._clock()
        self._next_learn = answered + self._relearn_s
        precise = (answered - sent) * 1000 <= SKEW_MS
        if self._offset_ms is not None and not precise:
            self.slow_clocks += 1  # the answer's time not known closely enough: the old kept
            if not self._precise:
                self._next_learn = answered + RELEARN_BACKOFF_S
            return
        self._offset_ms = redis_ms - (sent + answered) * 500
        self._precise = precise
        if not precise:  # a first offset, taken whatever its round trip: learnt again soon
            self._next_learn = answered + RELEARN_BACKOFF_S

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
            raise Refused(f"tokens out of range: {tokens}")
        if self._offset_ms is None:
            await self._learn_first()
        held = Held(endpoint, tokens, self.write_epoch())
        counters = self._counters
        await counters.add(
            counters.key(endpoint, held.epoch), pack(tokens, 1), counters.expire_at_ms(held.epoch)
        )
        late_ms = (held.epoch + 1) * counters.epoch_ms + CLEAR_AFTER_MS - 2 * SKEW_MS
        if self.now_ms() < late_ms:
            return held  # it landed before any reader could leave its key out
        # Returned so late that a reader may have found the key empty and left it out: moved
        # into the epoch of now (the same hash tag: one transaction, or one script).
        moved = Held(endpoint, tokens, self.write_epoch())
        lost = await counters.add_all(
            [
                Add(
                    counters.key(endpoint, held.epoch),
                    -pack(tokens, 1),
                    counters.expire_at_ms(held.epoch),
                ),
                Add(
                    counters.key(endpoint, moved.epoch),
                    pack(tokens, 1),
                    counters.expire_at_ms(moved.epoch),
                ),
            ]
        )
        if lost:
            return held  # not known to have moved: where it was made
        self.moved += 1
        return moved

    def _undo(self, held: Held) -> Add | None:
        """What takes ``held`` back: the key of the epoch it was made in moved back; None (and
        counted) when that key has expired."""
        if self._offset_ms is not None and self.epoch() >= held.epoch + EPOCHS_KEPT:
            self.late += 1
            return None
        counters = self._counters
        key = counters.key(held.endpoint, held.epoch)
        return Add(key, -pack(held.tokens, 1), counters.expire_at_ms(held.epoch))

    async def release(self, held: Held) -> bool:
        """Take a reservation back now, in a round trip of its own; False (and nothing sent)
        when its key has expired."""
        undo = self._undo(held)
        if undo is None:
            return False
        await self._counters.add(undo.key, undo.delta, undo.expire_at_ms)
        return True

    def defer_release(self, held: Held) -> bool:
        """Take a reservation back with this sidecar's next read (applied before the read's
        ``MGET``, in its round: no call of its own), or else with whatever else was deferred
        when the sender goes: ``release_delay_s`` after it was started by the first release
        deferred, or as soon as ``MAX_DEFERRED`` wait and no send is in flight. Until then
        every sidecar, this one's reads included, still counts it. False (nothing deferred)
        when its key has expired."""
        undo = self._undo(held)
        if undo is None:
            return False
        self._deferred.append(undo)
        if len(self._deferred) >= MAX_DEFERRED:
            self._full.set()
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_deferred())
        return True

    @property
    def deferred(self) -> int:
        """Releases deferred and not sent yet (nor in flight)."""
        return len(self._deferred)

    def _take_deferred(self) -> list[Add]:
        taken, self._deferred = self._deferred, []
        self._full.clear()
        return taken

    async def _send_deferred(self) -> None:
        """The deferred releases sent once the delay is over or too many wait, unless a read
        took them; again while some are left."""
        try:
            while self._deferred:
                try:
                    async with asyncio.timeout(self._release_delay_s):
                        await self._full.wait()
                except TimeoutError:
                    pass
                await self.flush()
        finally:
            if self._sender is asyncio.current_task():
                self._sender = None

    async def sent(self) -> None:
        """Wait until no deferred release is left to send (a read or the sender took them)."""
        while self._sender is not None:
            await asyncio.shield(self._sender)

    async def flush(self) -> None:
        """Every deferred release sent now, in one round (``Counters.add_all``)."""
        taken = self._take_deferred()
        if taken:
            try:
                self.lost_releases += await self._counters.add_all(taken)
            except BaseException:
                self.lost_releases += len(taken)
                raise

    def _carried(self, adds: int, task: asyncio.Task[Fetched]) -> None:
        """A read's fetch done: the releases it carried that were lost, counted."""
        self._carrying.discard(task)
        if task.cancelled() or task.exception() is not None:
            self.lost_releases += adds
        else:
            self.lost_releases += task.result().lost

    async def close(self) -> None:
        """Every deferred release sent (the sender woken at once), and the reads that carry
        some answered."""
        self._full.set()
        await self.sent()
        await self.flush()
        await asyncio.gather(*list(self._carrying), return_exceptions=True)

    async def read(self, endpoints: Iterable[str]) -> Counts:
        """Every endpoint's counters, the current and the previous epoch's summed, the previous
        left out once seen empty late enough (``CLEAR_AFTER_MS``): one round (the clock's
        offset, when due, learnt in parallel; the first read learns it first)."""
        names = tuple(dict.fromkeys(endpoints))
        if len(names) > MAX_ENDPOINTS:
            raise Refused(f"{len(names)} endpoints, over {MAX_ENDPOINTS}")
        if self._offset_ms is None:
            await self._learn_first()
        counters = self._counters
        reckoned = self.now_ms()
        epoch = int(reckoned // counters.epoch_ms)
        clearing = self._precise and reckoned - epoch * counters.epoch_ms >= CLEAR_AFTER_MS
        cleared = tuple(self._cleared.get(name) == epoch for name in names)
        keys = counters.read_keys(names, epoch, cleared)
        adds = self._take_deferred()
        fetching: Awaitable[Fetched]
        if adds:
            # Carried releases are not lost with a read its caller gave up on: the fetch goes
            # on (bounded by the client's socket timeout) and counts what it lost when done.
            task = asyncio.create_task(counters.fetch(keys, adds))
            self._carrying.add(task)
            task.add_done_callback(functools.partial(self._carried, len(adds)))
            fetching = asyncio.shield(task)
        else:
            fetching = counters.fetch(keys)
        now = self._clock()
        if now >= self._next_learn:
            self._next_learn = now + self._relearn_s  # sent: no other read sends one meanwhile
            got, _ = await asyncio.gather(fetching, self._relearn(), return_exceptions=True)
            if isinstance(got, BaseException):
                raise got
            fetched = got
        else:
            fetched = await fetching
        values, unanswered = fetched.values, fetched.missing
        loads: dict[str, Load] = {}
        missing: list[str] = []
        skipped = clamped = 0
        first = 0
        for name, only_current in zip(names, cleared, strict=True):
            span = range(first, first + (1 if only_current else 2))
            first = span.stop
            if any(i in unanswered for i in span):
                missing.append(name)
                continue
            tokens = requests = 0
            previous_empty = not only_current
            for position, i in enumerate(span):
                raw = values[i]
                count = decode_count(raw)
                if count is None:
                    skipped += raw is not None
                    if raw is not None and position == 0:
                        previous_empty = False  # not a counter: read again, and counted again
                    continue
                if position == 0 and (count.load.requests or count.load.tokens):
                    previous_empty = False
                clamped += count.clamped
                tokens += count.load.tokens
                requests += count.load.requests
            if tokens or requests:
                loads[name] = Load(tokens, requests)
            if len(span) == 2 and not previous_empty:
                self._cleared.pop(name, None)  # a read that overlapped one that left it out
            elif clearing and previous_empty and len(span) == 2:
                if len(self._cleared) >= TAG_CACHE:
                    self._cleared.clear()
                self._cleared[name] = epoch
        self.skipped += skipped
        self.clamped += clamped
        return Counts(loads, epoch, skipped, clamped, tuple(missing), len(keys))
