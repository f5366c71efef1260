"""The shared-state sync protocol without I/O (as h11 is HTTP's): what a sidecar sends Redis,
what it makes of the answer, and when it syncs.

Inputs: this sidecar's changes (``reserve``, ``release``, ``publish_speed``,
``publish_ejection``), the clock (``now``, passed to every call that reads it) and how each sync
ended (``received`` with the script's answer, ``failed``). Outputs: the command to send (``begin``
returns a ``Sync``; its ``args()`` are the script's ARGV), the ``view()``, and when to sync (the
``wake`` callback, ``decision_waits``, the worker's ``worker_woke`` / ``worker_owed``,
``heartbeat_s``, ``backoff_left``). Nothing here awaits, connects or sleeps. ``RedisState``
(``redis.py``) drives it with redis-py and asyncio; the simulator (``bench/sim/state.py``) drives
it in virtual time against a model of the script: the simulator cannot drift from production.

The rules, which every driver follows:

- The view is the other sidecars' reservations as the last answer gave them (the pool's totals
  less this sidecar's table as that sync sent it), plus this sidecar's own table as it is now;
  the speeds and ejections of the last answer, with this sidecar's published since.
- One sync at a time. A sync sends this sidecar's whole table (absolute values: Redis heals
  itself after a restart, a failover or a lost update) and what was published since the last
  sync; a failed sync's publications go with the next one, which is not tried before a backoff
  (``BACKOFF_FIRST_S`` doubling to ``BACKOFF_MAX_S``; an answer resets it).
- A decision's refresh joins the sync in flight or begins one, unless Redis is down (backing
  off): waiting would only cost the decision its timeout.
- A reservation, a release or an ejection calls ``wake``: the background worker publishes it off
  the request path (a speed waits for the next sync). The worker wakes on that or on its
  heartbeat (``HEARTBEATS_PER_LEASE`` per lease), waits out the backoff, and is then owed a sync
  that begins after the one in flight, if any (which may have been sent before the change): it
  begins one whenever none is in flight and waits, until that sync has ended.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.scheduling.model import Speed
from sidecar.scheduling.state import Load, OwnReservations, Reservation, SharedView

# The wire: one Lua script does a whole sync in one round trip. It replaces this sidecar's
# reservations with their current absolute values, renews its lease, drops sidecars whose lease
# ran out (a dead sidecar's reservations stop counting within the lease), stores published
# speeds and ejections, and returns the pool's totals. The totals are kept in Redis (KEYS[5])
# and updated by the difference between a sidecar's table as stored and as sent, and by a dead
# sidecar's table when it is dropped: a sync's work does not grow with the number of sidecars.
# The totals are rebuilt from every live sidecar's table when they cannot be trusted: missing
# (a restart, an expiry), counting another number of tables than the reservations hash holds
# (a table written or removed by anything but this script), or older than one lease (so that a
# change written behind the script's back, e.g. by an older sidecar during a rolling upgrade,
# counts within a lease, as a dead sidecar's share stops counting within one). It touches only
# the keys it is given as ``KEYS`` (nothing by a name built inside it), so it runs as it is on a
# Redis Cluster.
_SYNC = """
local sid, now, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local limit, key_bytes, value_bytes = @LIMIT@, @KEY_BYTES@, @VALUE_BYTES@
local skipped = 0
local lease_ms = math.ceil(lease * 1000)
local COUNT = '#tables'
-- A key of another type (written by hand, by another program) would fail every command on it,
-- and so every sync of every sidecar: it is deleted, said in the answer, and the totals rebuilt.
local TYPES = {'zset', 'hash', 'hash', 'hash', 'hash'}
local repaired = {}
for j = 1, #TYPES do
  local held = redis.call('TYPE', KEYS[j]).ok
  if held ~= TYPES[j] and held ~= 'none' then
    redis.call('DEL', KEYS[j])
    repaired[#repaired + 1] = KEYS[j]; repaired[#repaired + 1] = held
  end
end
local function add(text, delta, sign)
  if not text then return end
  for ep, tok, req in string.gmatch(text, '(%S+) (%d+) (%d+)') do
    local d = delta[ep]
    if d == nil then d = {0, 0}; delta[ep] = d end
    d[1] = d[1] + sign * tonumber(tok); d[2] = d[2] + sign * tonumber(req)
  end
end
local BUILT = '#built'
local counted = tonumber(redis.call('HGET', KEYS[5], COUNT) or '')
local built = tonumber(redis.call('HGET', KEYS[5], BUILT) or '')
local rebuild = counted == nil or counted ~= redis.call('HLEN', KEYS[4])
  or built == nil or now - built > lease or now < built or #repaired > 0
local delta = {}
if not rebuild then add(redis.call('HGET', KEYS[4], sid), delta, -1) end
if ARGV[4] == '' then
  redis.call('HDEL', KEYS[4], sid)
else
  redis.call('HSET', KEYS[4], sid, ARGV[4])
  if not rebuild then add(ARGV[4], delta, 1) end
end
redis.call('ZADD', KEYS[1], now + lease, sid)
local i = 5
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]); i = i + 2 end
if n > 0 then redis.call('PEXPIRE', KEYS[2], lease_ms * 100) end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local current = tonumber(redis.call('HGET', KEYS[3], ARGV[i]) or '0') or 0
  if tonumber(ARGV[i + 1]) > current then redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) end
  i = i + 2
end
-- At most `limit` dead sidecars per sync, one by one: more (written by hand) go with the next
-- syncs, never all in one call (Lua's unpack fails past a few thousand).
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, limit)
for _, gone in ipairs(dead) do
  if not rebuild then add(redis.call('HGET', KEYS[4], gone), delta, -1) end
  redis.call('HDEL', KEYS[4], gone)
  redis.call('ZREM', KEYS[1], gone)
end
if rebuild then
  -- Every live sidecar's table summed anew; a table without a lease never counts: dropped.
  redis.call('DEL', KEYS[5])
  local held = redis.call('HGETALL', KEYS[4])
  for j = 1, #held, 2 do
    if redis.call('ZSCORE', KEYS[1], held[j]) then
      add(held[j + 1], delta, 1)
    else
      redis.call('HDEL', KEYS[4], held[j])
    end
  end
end
for ep, d in pairs(delta) do
  if d[1] ~= 0 or d[2] ~= 0 then
    local tok, req = 0, 0
    local total = redis.call('HGET', KEYS[5], ep)
    if total then
      local t, r = string.match(total, '^(%d+) (%d+)$')
      tok, req = tonumber(t) or 0, tonumber(r) or 0
    end
    tok, req = tok + d[1], req + d[2]
    if req > 0 then
      redis.call('HSET', KEYS[5], ep, string.format('%.0f %.0f', math.max(tok, 0), req))
    else
      redis.call('HDEL', KEYS[5], ep)
    end
  end
end
redis.call('HSET', KEYS[5], COUNT, redis.call('HLEN', KEYS[4]))
if rebuild then redis.call('HSET', KEYS[5], BUILT, string.format('%.3f', now)) end
-- Gone with the lease when every sidecar is: nobody is left to read them.
redis.call('PEXPIRE', KEYS[1], lease_ms)
redis.call('PEXPIRE', KEYS[5], lease_ms)
if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('PEXPIRE', KEYS[4], lease_ms) end
-- What is read back is bounded (at most `limit` entries of each kind, of bounded size), since
-- anyone who can write these keys could otherwise make every sidecar parse them on its loop.
-- The answer is one string: a line of counts (entries left out; fields of the totals, the
-- speeds, the ejections and the keys repaired), a line of every field's size, then the fields
-- joined by newlines. The sizes say where each field ends, so that no field, whatever bytes it
-- holds, can move another; the newlines let the reader split the usual answer, where no field
-- holds one. One string: the reader walks one header, not one per field.
local fields, sizes = {}, {}
local function bounded(flat, own)
  local kept = 0
  for j = 1, #flat, 2 do
    local name, value = flat[j], flat[j + 1]
    if own == nil or not own[name] then  -- the totals' own fields are no endpoint's
      if kept < 2 * limit and #name <= key_bytes and #value <= value_bytes then
        fields[#fields + 1] = name; fields[#fields + 1] = value
        sizes[#sizes + 1] = #name; sizes[#sizes + 1] = #value
        kept = kept + 2
      else
        skipped = skipped + 1
      end
    end
  end
  return kept
end
local n_totals = bounded(redis.call('HGETALL', KEYS[5]), {[COUNT] = true, [BUILT] = true})
local n_speeds = bounded(redis.call('HGETALL', KEYS[2]))
local ejections = redis.call('HGETALL', KEYS[3])
local live = {}
for j = 1, #ejections, 2 do
  local until_unix = tonumber(ejections[j + 1])
  if until_unix == nil or until_unix > now then  -- not a time: the reader skips it, counted
    live[#live + 1] = ejections[j]; live[#live + 1] = ejections[j + 1]
  else
    redis.call('HDEL', KEYS[3], ejections[j])
  end
end
local n_ejections = bounded(live)
for j = 1, #repaired do
  fields[#fields + 1] = repaired[j]; sizes[#sizes + 1] = #repaired[j]
end
return string.format('%d %d %d %d %d', skipped, n_totals, n_speeds, n_ejections, #repaired)
  .. '\\n' .. table.concat(sizes, ' ') .. '\\n' .. table.concat(fields, '\\n')
"""
"""KEYS: sidecars, speeds, ejections, reservations, totals. ARGV: sidecar id, now, lease, this
sidecar's reservations (lines), then speeds and ejections, each a count and that many pairs. The
reply is one string: a line of counts — the entries the script left out (over ``MAX_ENTRIES``
of a kind, or longer than ``MAX_KEY_BYTES`` / ``MAX_VALUE_BYTES``), then the fields of the
totals (endpoint, ``tokens requests``), of the speeds and of the live ejections (endpoint,
value), and of the keys it found of another type and deleted (key, type) — then a line of every
field's size, then the fields joined by newlines. Not an array of every field, which every
reader would walk element by element (most of a sync's cost on the request path, and each
header is checked before hiredis parses it: ``replies``); not lines alone, in which a field
holding a newline moved every field after it."""

MAX_ENTRIES = 1024
"""Endpoints of each kind (loads, speeds, ejections) one sync reads back: far more than a prefill
pool holds, and few enough that a sync's reply stays small (tens of KiB) whatever the keys
hold."""
MAX_KEY_BYTES = 300
"""An endpoint is ``host:port``: a DNS name is at most 253 bytes."""
MAX_VALUE_BYTES = 64
"""A speed (two floats' ``repr``) or an ejection's time; anything longer is not ours."""
MAX_S_PER_TOKEN = 1.0
"""Prefill speeds beyond a second per token, or an overhead beyond ``MAX_OVERHEAD_S``, are no
engine's: read back, they are skipped."""
MAX_OVERHEAD_S = 600.0
MAX_LOAD = 10**12
"""Reserved tokens (and requests) of one endpoint beyond which a total is not believed."""
EJECTION_SKEW_S = 60.0
"""Slack for the clocks of two pods when an ejection's end is checked against the longest
ejection (an ejection is published as the Unix time it ends)."""

SCRIPT = (
    _SYNC.replace("@LIMIT@", str(MAX_ENTRIES))
    .replace("@KEY_BYTES@", str(MAX_KEY_BYTES))
    .replace("@VALUE_BYTES@", str(MAX_VALUE_BYTES))
)
"""The sync script, as sent to Redis."""

HEARTBEATS_PER_LEASE = 3
"""Syncs per lease at least, so that a live sidecar's lease never runs out between two."""
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 5.0
"""After a failed sync the next is not tried for the backoff: 0.5 s, doubling to 5 s."""


KEY_NAMES = ("sidecars", "speeds", "ejections", "reservations", "totals")
"""The pool's keys after its hash tag, in the script's ``KEYS`` order."""


def keys(prefix: str) -> tuple[str, ...]:
    """Every key of a pool (``SIDECAR_REDIS_KEY_PREFIX``), in the script's ``KEYS`` order: one
    hash tag, so that on a Redis Cluster they live in one slot."""
    tag = "{" + prefix + "}"
    return tuple(f"{tag}:{name}" for name in KEY_NAMES)


@dataclass(frozen=True, slots=True)
class Sync:
    """One call of the sync script: what it carries, and what its end needs back."""

    number: int
    """Syncs are numbered from 1 in the order they begin."""
    sidecar: str
    now: float
    """The sender's clock (Unix time): the script renews the lease and judges the others' by it."""
    lease_s: float
    table: dict[str, Load]
    """This sidecar's reservations as sent; the answer's totals include them."""
    speeds: dict[str, Speed]
    ejections: dict[str, float]
    """Published since the last sync (Unix time each ejection ends)."""

    def args(self) -> list[str | int]:
        """The script's ARGV."""
        held = "\n".join(f"{e} {load.tokens} {load.requests}" for e, load in self.table.items())
        args: list[str | int] = [self.sidecar, repr(self.now), repr(self.lease_s), held]
        args.append(len(self.speeds))
        for endpoint, speed in self.speeds.items():
            args += [endpoint, f"{speed.s_per_token!r} {speed.overhead_s!r}"]
        args.append(len(self.ejections))
        for endpoint, until in self.ejections.items():
            args += [endpoint, repr(until)]
        return args


@dataclass(frozen=True, slots=True)
class Reply:
    """What one sync read back, every entry checked."""

    totals: dict[str, Load]
    """Every live sidecar's reservations summed by endpoint, this sidecar's (as sent) included;
    only endpoints someone holds."""
    speeds: dict[str, Speed]
    ejections: dict[str, float]
    """The ejections that had not ended (Unix time each ends)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Entries left out, by kind: ``over_limit`` (by the script, beyond the bounds), ``load``,
    ``speed``, ``ejection`` (they did not parse or were out of range), ``wrong_type`` (keys of
    another type, deleted); only kinds with some."""
    repaired: tuple[tuple[str, str], ...] = ()
    """The keys the script found of another type and deleted: (key, the type it was)."""


class SyncProtocol:
    """One sidecar's side of the protocol (see the module's docstring for its rules)."""

    def __init__(self, sidecar: str, *, lease_s: float, wake: Callable[[], None]) -> None:
        """``sidecar``: this sidecar's id in Redis. ``wake``: called when a change is to be
        published off the request path (it wakes the driver's worker); it may begin a sync."""
        self.sidecar = sidecar
        self.lease_s = lease_s
        self.heartbeat_s = lease_s / HEARTBEATS_PER_LEASE
        self._wake = wake
        self._own = OwnReservations()
        self._others: dict[str, Load] = {}
        self._speeds: dict[str, Speed] = {}
        self._ejected: dict[str, float] = {}
        self._pending_speeds: dict[str, Speed] = {}
        self._pending_ejections: dict[str, float] = {}
        self._in_flight: Sync | None = None
        self._begun = 0
        self._ended = 0
        """The number of the last sync that ended (syncs end in the order they begin)."""
        self._owed = 0
        """The worker waits until a sync numbered this or higher has ended."""
        self._down_until = -math.inf
        self._backoff_s = BACKOFF_FIRST_S
        self.shares_table = True
        """Whether a sync sends this sidecar's table (else an empty one: its reservations are
        shared another way, ``counter_state``), and a reservation or release wakes the worker."""

    # This sidecar's changes, and the view.

    def view(self) -> SharedView:
        loads = dict(self._others)
        for endpoint, own in self._own.loads.items():
            other = loads.get(endpoint, Load())
            loads[endpoint] = Load(other.tokens + own.tokens, other.requests + own.requests)
        return SharedView(loads, dict(self._speeds), dict(self._ejected))

    def reserve(self, endpoint: str, tokens: int) -> Reservation:
        none = Load()
        ahead = self._others.get(endpoint, none).tokens + self._own.loads.get(endpoint, none).tokens
        self._own.add(endpoint, tokens, 1)
        if self.shares_table:
            self._wake()
        return Reservation(endpoint, tokens, ahead)

    def release(self, reservation: Reservation) -> None:
        self._own.add(reservation.endpoint, -reservation.tokens, -1)
        if self.shares_table:
            self._wake()

    def share_table(self, shares: bool) -> None:
        """Send this sidecar's table with the syncs from now on, or stop (the next sync takes it
        off the totals); either way the worker is woken to say so."""
        if shares != self.shares_table:
            self.shares_table = shares
            self._wake()

    def publish_speed(self, endpoint: str, speed: Speed) -> None:
        self._pending_speeds[endpoint] = speed
        self._speeds[endpoint] = speed

    def publish_ejection(self, endpoint: str, until_unix: float) -> None:
        self._pending_ejections[endpoint] = until_unix
        self._ejected[endpoint] = until_unix
        self._wake()

    # Syncs.

    @property
    def in_flight(self) -> Sync | None:
        """The sync begun and not yet ended."""
        return self._in_flight

    def decision_waits(self, now: float) -> bool:
        """Whether a decision's refresh waits for a sync: not while Redis is down (backing off),
        when waiting would only cost the decision its timeout."""
        return now >= self._down_until

    def backoff_left(self, now: float) -> float:
        """Seconds until a failed sync may be followed by another (zero or less: now)."""
        return self._down_until - now

    def begin(self, now: float) -> Sync:
        """The next sync to send: this sidecar's table now, and what was published since the
        last one. One at a time: the one in flight must have ended."""
        if self._in_flight is not None:
            raise RuntimeError(f"sync {self._in_flight.number} is still in flight")
        self._begun += 1
        speeds, self._pending_speeds = self._pending_speeds, {}
        ejections, self._pending_ejections = self._pending_ejections, {}
        table = dict(self._own.loads) if self.shares_table else {}
        sync = Sync(self._begun, self.sidecar, now, self.lease_s, table, speeds, ejections)
        self._in_flight = sync
        return sync

    def received(self, sync: Sync, reply: Reply) -> None:
        """``sync`` was answered: the others' reservations are the totals less this sidecar's
        as sent (its own count from the table as it is now)."""
        others: dict[str, Load] = {}
        for endpoint, total in reply.totals.items():
            mine = sync.table.get(endpoint, Load())
            if total.requests - mine.requests > 0:
                others[endpoint] = Load(total.tokens - mine.tokens, total.requests - mine.requests)
        self._others = others
        self._speeds = dict(reply.speeds)
        self._ejected = dict(reply.ejections)
        self._backoff_s = BACKOFF_FIRST_S
        self._end(sync)

    def failed(self, sync: Sync, now: float) -> None:
        """``sync`` got no usable answer (a connection, a cluster's routing, a reply of the
        wrong shape): its publications go with the next one, after the backoff."""
        self._keep_publications(sync)
        self._down_until = now + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
        self._end(sync)

    def cancelled(self, sync: Sync) -> None:
        """``sync`` was given up without an answer (the backend closing)."""
        self._keep_publications(sync)
        self._end(sync)

    def _keep_publications(self, sync: Sync) -> None:
        # Newer publications of the same endpoints win.
        self._pending_speeds = {**sync.speeds, **self._pending_speeds}
        self._pending_ejections = {**sync.ejections, **self._pending_ejections}

    def _end(self, sync: Sync) -> None:
        self._ended = sync.number
        if self._in_flight is sync:
            self._in_flight = None

    # The background worker.

    def worker_woke(self, *, syncing: bool) -> None:
        """The worker woke (a change, or its heartbeat) and waited out the backoff. ``syncing``:
        whether a sync is in flight (or about to begin: the driver's own bookkeeping), which may
        have been sent before the change; the worker is owed the one after it."""
        self._owed = self._ended + (2 if syncing else 1)

    @property
    def worker_owed(self) -> bool:
        """Whether the worker still waits for the sync it is owed: while it does, it begins one
        whenever none is in flight, and waits for it."""
        return self._ended < self._owed


def decode_reply(raw: Any, *, now: float, max_ejection_s: float) -> Reply:
    """The script's answer, checked. Each entry is checked (a name that is an endpoint's, a
    value that parses, finite numbers in range) and one that fails is skipped and counted, never
    the whole answer: whoever can write the keys (another version of the sidecar, a person)
    cannot stall or steer every sidecar. An answer of the wrong shape (which only something
    other than the script can give) raises (``ValueError``, ``TypeError``, ``IndexError``, ...).
    ``max_ejection_s`` is the longest ejection a sidecar publishes: one that ends later is not
    believed."""
    if not isinstance(raw, bytes):
        raise TypeError("not one string")
    head, sizes, data = raw.split(b"\n", 2)
    counts = head.split(b" ")
    if len(counts) != 5 or not all(count.isdigit() and len(count) < 8 for count in counts):
        raise ValueError("not a line of counts")
    over, n_totals, n_speeds, n_ejections, n_repaired = map(int, counts)
    if max(n_totals, n_speeds, n_ejections) > 2 * MAX_ENTRIES or n_repaired > 2 * len(KEY_NAMES):
        raise ValueError("more fields than the script sends")
    fields = _fields(sizes, data, n_totals + n_speeds + n_ejections + n_repaired)
    totals = _pairs(fields[:n_totals])
    speeds = _pairs(fields[n_totals : n_totals + n_speeds])
    ejections = _pairs(fields[n_totals + n_speeds : n_totals + n_speeds + n_ejections])
    skipped: dict[str, int] = {}
    if over:
        skipped["over_limit"] = over
    loads: dict[str, Load] = {}
    bad = 0
    for name, value in totals:
        load = _load(value) if _endpoint(name) else None
        if load is None:
            bad += 1
        else:
            loads[str(name)] = load
    _count(skipped, "load", bad)
    parsed_speeds = {}
    bad = 0
    for name, value in speeds:
        speed = _speed(value) if _endpoint(name) else None
        if speed is None:
            bad += 1
        else:
            parsed_speeds[str(name)] = speed
    _count(skipped, "speed", bad)
    latest = now + max_ejection_s + EJECTION_SKEW_S
    ejected = {}
    bad = 0
    for name, value in ejections:
        until = _number(value, 0.0, latest) if _endpoint(name) else None
        if until is None:
            bad += 1
        else:
            ejected[str(name)] = until
    _count(skipped, "ejection", bad)
    repaired = _pairs(fields[len(fields) - n_repaired :] if n_repaired else [])
    found = tuple((key or "?", held or "?") for key, held in repaired)
    _count(skipped, "wrong_type", len(found))
    return Reply(loads, parsed_speeds, ejected, skipped, found)


def _count(skipped: dict[str, int], kind: str, count: int) -> None:
    if count:
        skipped[kind] = count


def _fields(sizes: bytes, data: bytes, count: int) -> Sequence[str | None]:
    """``count`` fields from their sizes and the fields joined by newlines, each as text when it
    is printable ASCII, else None."""
    if not count:
        if sizes or data:
            raise ValueError("fields where none were counted")
        return []
    if sizes.count(b" ") != count - 1 or not sizes.replace(b" ", b"").isdigit():
        raise ValueError("not a size for each field")
    if (
        data.isascii()
        and data.count(b"\n") == count - 1
        and (text := data.decode("ascii")).replace("\n", "").isprintable()
    ):
        # The newlines are the joins alone: no field holds one (what the sidecars write).
        return text.split("\n")
    # Something else wrote the keys: each field where its size puts it, checked alone.
    ends = list(itertools.accumulate(map(int, sizes.split(b" "))))
    if ends[-1] + count - 1 != len(data):
        raise ValueError("sizes that do not add up to the fields")
    starts = [0, *ends]
    return [_field(data[starts[j] + j : ends[j] + j]) for j in range(count)]


def _pairs(fields: Sequence[str | None]) -> list[tuple[str | None, str | None]]:
    if len(fields) % 2:
        raise ValueError("half a pair")
    return list(zip(fields[::2], fields[1::2], strict=True))


def _field(raw: bytes) -> str | None:
    if raw.isascii() and (text := raw.decode("ascii")).isprintable():
        return text
    return None


def _endpoint(name: str | None) -> bool:
    """Whether ``name`` (printable ASCII, from ``_pairs``) is an endpoint's (``host:port``)."""
    return name is not None and 0 < len(name) <= MAX_KEY_BYTES and " " not in name


def _number(value: str | None, low: float, high: float) -> float | None:
    """``value`` as a finite float in [low, high], else None (NaN and infinities fail both)."""
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if low <= number <= high else None


def _speed(value: str | None) -> Speed | None:
    if value is None:
        return None
    parts = value.split(" ")
    if len(parts) != 2:
        return None
    s_per_token = _number(parts[0], 0.0, MAX_S_PER_TOKEN)
    overhead_s = _number(parts[1], 0.0, MAX_OVERHEAD_S)
    if s_per_token is None or overhead_s is None or s_per_token == 0.0:
        return None
    return Speed(s_per_token, overhead_s)


def _load(value: str | None) -> Load | None:
    if value is None:
        return None
    parts = value.split(" ")
    if len(parts) != 2:
        return None
    tokens_text, requests_text = parts
    if not (tokens_text.isdigit() and requests_text.isdigit()) or len(value) > 27:
        return None
    tokens, requests = int(tokens_text), int(requests_text)
    if tokens > MAX_LOAD or requests > MAX_LOAD:
        return None
    return Load(tokens, requests)
