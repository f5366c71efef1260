"""Reservations shared through shards: a pool's totals spread over Redis hash slots, each
sidecar writing to one shard and reading every shard's sums (not wired into the scheduler yet;
``python -m bench fleet --reservations sharded`` measures it).

**Shards.** A pool has ``S`` shards (``SHARDS``, 12), each four keys under a hash tag of its
own (``KEY_NAMES``): ``leases`` (a sorted set, the time on Redis's clock each sidecar's lease
ends), ``tables`` (a hash, one field per sidecar: its reservations, one ``endpoint tokens
requests`` line each), ``sums`` (a hash: the shard's live tables summed by endpoint, and the
shard's own fields, each beginning with ``#``) and ``totals`` (a string: the sums as
``decode_totals`` reads them). The tags are chosen (``shard_tags``) so that a Redis Cluster of
``CLUSTER_MASTERS`` (3) masters with the slots split evenly, as ``redis-cli --cluster create``
splits them, holds ``S / 3`` shards on each master; another split or another number of masters
still works, less evenly.

**Writing.** A sidecar belongs to one shard (a hash of its id, ``shard_of``). When its table
changed, a heartbeat is due (``HEARTBEATS_PER_LEASE`` per lease) or its shard was started anew
(``due``), it runs ``SCRIPT`` on its shard: its table replaced, the shard's sums updated by the
difference (its old row subtracted, the new one added), its lease renewed, at most ``expire``
lapsed sidecars of the shard dropped (their rows subtracted) and the totals stored again as one
string. Leases, lapses and the keys' expiry are judged by Redis's clock (``TIME`` in the
script), never by a sidecar's. A row is checked before the script's first write (at most
``MAX_ENTRIES`` lines, each an endpoint of at most ``MAX_KEY_BYTES`` not beginning with ``#``
and two counts): a refused sync leaves the shard as it was. A call's work is bounded by the rows
it touches and the endpoints the shard holds, never by the number of sidecars.

**Consistency.** Only the script writes a shard's keys, every change of a call at once (a
script's writes replicate together), so the sums stay the sum of the rows without a re-sum.
A totals string lost alone (an eviction, a hand's ``DEL``) is written again by the shard's next
sync, a heartbeat at the latest. When the sums cannot be trusted — missing while tables remain,
counting another number of tables than the hash holds, a key of another type — the script
starts the shard anew: its keys deleted (work bounded by the shard's tables, about
``N / S``), a new generation in the totals. Each sidecar of the shard sees the generation change
in its next read of the shard, and sends its whole table (``due``): the shard's sums are whole
again within a sync period and a read. (A sync that ran before the new generation but is
answered after such a read clears that debt; the next read of the shard owes it again.) Every
key expires within a lease of the last sync that renewed it (a leaving sidecar renews nothing):
a shard whose sidecars all left leaves nothing behind.

**Reading.** ``read`` fetches every shard's totals in one ``MGET`` (a Cluster: one pipeline per
master, an ``MGET`` per slot, ``mget_nonatomic``) and sums them; with ``read_groups`` g, the
first read every shard, each later one every g-th shard in turn, the others as last read. Each
value is checked as the sync's answer is (``protocol``): at most ``MAX_TOTALS_BYTES`` and
``MAX_ENTRIES`` endpoints (as many as the script writes), every endpoint printable, without a
space, of at most ``MAX_KEY_BYTES``, its two counts integers in range, else skipped and counted;
whoever can write the keys cannot stall or steer a sidecar.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from sidecar.scheduling.state import Load
from sidecar.scheduling.state.protocol import HEARTBEATS_PER_LEASE, MAX_KEY_BYTES, MAX_LOAD
from sidecar.scheduling.state.replies import BoundedHiredisParser, bound_cluster

SHARDS = 12
"""Shards per pool: four per master of a 3-master Cluster."""
CLUSTER_MASTERS = 3
"""The Cluster the tags are chosen for (``shard_tags``)."""
EXPIRE_PER_SYNC = 8
"""Lapsed sidecars one sync drops at most: more go with the next syncs of the shard."""
MAX_ENTRIES = 1024
"""Endpoints one shard's totals hold at most, as read (a prefill pool holds far fewer)."""
MAX_TOTALS_BYTES = 128 + MAX_ENTRIES * (MAX_KEY_BYTES + 29)
"""One shard's totals as read (329 KiB): the shard's own fields, then ``MAX_ENTRIES`` endpoints
of ``MAX_KEY_BYTES`` and two counts of 13 digits, as the script writes them at most. Twelve of
them fit in one reply (``replies.MAX_REPLY_BYTES``, 4 MiB)."""
SLOT_MARGIN = 16
"""A tag's slot is kept this far inside its master's range, so that a split rounded another
way (one slot either side) leaves it there."""

KEY_NAMES = ("leases", "tables", "sums", "totals")
"""A shard's keys after its hash tag, in the script's ``KEYS`` order."""
GENERATION, TABLES, RENEW = "#generation", "#tables", "#renew"
"""The sums' own fields (no endpoint begins with ``#``)."""

# One sync of one sidecar on its shard (the module's docstring). KEYS: leases, tables, sums,
# totals. ARGV: sidecar id, lease (seconds), its table (lines), the most lapsed sidecars to
# drop, 1 if the sidecar leaves (its lease goes, no expiry is renewed) else
# 0. The sums (a hash: endpoint -> ``tokens requests``, and the shard's own fields: its
# generation, the tables it counts, when the keys' expiry is next renewed) are updated by the
# difference between the rows as stored and as sent; the totals string is the sums' fields and
# values joined by newlines, written again when they changed (and with each renewal), expiring
# with the sums. The answer: the shard's generation, the sidecars dropped, whether the shard was
# started anew (1) or not (0), the tables it holds.
_SYNC = """
local sid, lease, row = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local limit, leaving = tonumber(ARGV[4]), ARGV[5] == '1'
local keep_ms = math.max(1, math.ceil(lease * 1000))
-- The row checked before the first write: a refused sync leaves the shard as it was.
local lines = 0
for line in string.gmatch(row, '[^\\n]+') do
  local ep, tok, req = string.match(line, '^(%S+) (%d+) (%d+)$')
  lines = lines + 1
  if lines > @ENTRIES@ or not ep or #ep > @KEY_BYTES@ or string.sub(ep, 1, 1) == '#'
      or #tok > 13 or #req > 13 then
    return redis.error_reply('ERR row refused at line ' .. lines)
  end
end
-- Leases, lapses and renewals on Redis's clock (as its key expiry), whatever the callers'.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local GEN, COUNT, RENEW = '#generation', '#tables', '#renew'
local own = redis.pcall('HMGET', KEYS[3], GEN, COUNT, RENEW)
local tables = redis.pcall('HLEN', KEYS[2])
local leases = redis.pcall('ZCARD', KEYS[1])
local gen, fresh = nil, false
if own.err or type(tables) ~= 'number' or type(leases) ~= 'number' or not own[1]
    or tonumber(own[2]) ~= tables or leases < tables then
  -- Not the sum of the tables any more (or a key of another type): the shard starts anew, its
  -- sidecars send their tables again when they read the new generation.
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
  gen, fresh, own, tables = t[1] .. string.format('%06d', tonumber(t[2])), true, {}, 0
  redis.call('HSET', KEYS[3], GEN, gen)
else
  gen = own[1]
end
local delta = {}
local function add(text, sign)
  if not text then return end
  for line in string.gmatch(text, '[^\\n]+') do
    local ep, tok, req = string.match(line, '^(%S+) (%d+) (%d+)$')
    -- The sums' own fields begin with '#': a line naming one (a hand's row) is no endpoint.
    if ep and string.sub(ep, 1, 1) ~= '#' then
      local d = delta[ep]
      if d == nil then d = {0, 0}; delta[ep] = d end
      d[1] = d[1] + sign * tonumber(tok); d[2] = d[2] + sign * tonumber(req)
    end
  end
end
-- A command over a long list of fields, @CHUNK@ at a time (unpack is bounded by Lua's stack).
local function chunked(command, key, list)
  local replies = {}
  for first = 1, #list, @CHUNK@ do
    local part = redis.call(command, key, unpack(list, first, math.min(first + @CHUNK@ - 1, #list)))
    if type(part) == 'table' then
      for j = 1, #part do replies[first + j - 1] = part[j] end
    end
  end
  return replies
end
local count = tables
local old = redis.call('HGET', KEYS[2], sid)
if old ~= row then
  add(old, -1)
  if row == '' then
    count = count - redis.call('HDEL', KEYS[2], sid)
  else
    count = count + redis.call('HSET', KEYS[2], sid, row)
    add(row, 1)
  end
end
if leaving then
  redis.call('ZREM', KEYS[1], sid)
else
  redis.call('ZADD', KEYS[1], now + lease, sid)
end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'LIMIT', 0, limit)
for _, gone in ipairs(dead) do
  add(redis.call('HGET', KEYS[2], gone), -1)
  count = count - redis.call('HDEL', KEYS[2], gone)
  redis.call('ZREM', KEYS[1], gone)
end
-- The endpoints whose sums moved, read and written back in one command each (a chunk each).
local eps = {}
for ep, d in pairs(delta) do
  if d[1] ~= 0 or d[2] ~= 0 then eps[#eps + 1] = ep end
end
local changed = fresh or #eps > 0
if #eps > 0 then
  local held = chunked('HMGET', KEYS[3], eps)
  local set, gone = {}, {}
  for j, ep in ipairs(eps) do
    local tok, req = delta[ep][1], delta[ep][2]
    if held[j] then
      local t, r = string.match(held[j], '^(%d+) (%d+)$')
      tok, req = tok + (tonumber(t) or 0), req + (tonumber(r) or 0)
    end
    if req > 0 then
      set[#set + 1] = ep; set[#set + 1] = string.format('%.0f %.0f', math.max(tok, 0), req)
    else
      gone[#gone + 1] = ep
    end
  end
  if #set > 0 then chunked('HSET', KEYS[3], set) end
  if #gone > 0 then chunked('HDEL', KEYS[3], gone) end
end
if count ~= tables or fresh then redis.call('HSET', KEYS[3], COUNT, count); changed = true end
local renew = tonumber(own[3] or '') or 0
local ttl = redis.call('PTTL', KEYS[3])
if ttl < 0 or (not leaving and (now >= renew or now < renew - lease)) then
  -- Every key lives a lease after the last sync that renewed it: renewed a third of a lease
  -- at most apart, they outlive every live sidecar's lease. A leaving sidecar renews nothing
  -- (unless the sums have no expiry yet: a shard it started anew).
  redis.call('HSET', KEYS[3], RENEW, string.format('%.3f', now + lease / 3))
  redis.call('PEXPIRE', KEYS[3], keep_ms)
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], keep_ms) end
  if count > 0 then redis.call('PEXPIRE', KEYS[2], keep_ms) end
  ttl, changed = keep_ms, true
else
  -- A key this call created expires with the sums.
  ttl = math.max(ttl, 1)
  if leases == 0 and not leaving then redis.call('PEXPIRE', KEYS[1], ttl) end
  if tables == 0 and count > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
end
if not changed and redis.call('EXISTS', KEYS[4]) == 0 then
  -- The totals string alone was lost (an eviction, a hand's DEL): written again.
  changed = true
end
if changed then
  -- The shard's own fields and at most @ENTRIES@ endpoints, each value of 27 bytes at most (two
  -- counts of 13 digits, as read): the string stays within what a reader takes.
  local flat, out, held = redis.call('HGETALL', KEYS[3]), {}, 0
  for j = 1, #flat, 2 do
    local name, value = flat[j], flat[j + 1]
    local mine = string.sub(name, 1, 1) == '#'
    if mine or (held < @ENTRIES@ and #value <= 27) then
      out[#out + 1] = name; out[#out + 1] = value
      if not mine then held = held + 1 end
    end
  end
  redis.call('SET', KEYS[4], table.concat(out, '\\n'), 'PX', ttl)
end
return {gen, #dead, fresh and 1 or 0, count}
"""
CHUNK = 1000
"""Fields one command of the script names at most (an even number: ``HSET`` takes pairs)."""
SCRIPT = (
    _SYNC.replace("@ENTRIES@", str(MAX_ENTRIES))
    .replace("@KEY_BYTES@", str(MAX_KEY_BYTES))
    .replace("@CHUNK@", str(CHUNK))
)
"""The sync script, as sent to Redis."""


def even_split(masters: int) -> list[tuple[int, int]]:
    """The slot ranges ``redis-cli --cluster create`` gives ``masters`` masters (its
    ``clusterManagerCommandCreate``: 16,384 / masters each, the ends rounded), in order."""
    per = REDIS_CLUSTER_HASH_SLOTS / masters
    ranges, first, cursor = [], 0, 0.0
    for index in range(masters):
        last = round(cursor + per - 1)
        if last > REDIS_CLUSTER_HASH_SLOTS - 1 or index == masters - 1:
            last = REDIS_CLUSTER_HASH_SLOTS - 1
        ranges.append((first, last))
        first, cursor = last + 1, cursor + per
    return ranges


def shard_tags(prefix: str, shards: int = SHARDS, masters: int = CLUSTER_MASTERS) -> list[str]:
    """Each shard's hash tag: shard ``i`` on master ``i % masters`` of an even split, each on
    a slot of its own. The first candidate ``{prefix:i.j}`` (j = 0, 1, ...) whose slot falls
    inside that master's range, ``SLOT_MARGIN`` from its ends, on a slot no earlier shard took:
    a pure function of its arguments, so that every sidecar finds the same tags."""
    ranges = even_split(masters)
    taken: set[int] = set()
    tags = []
    for index in range(shards):
        low, high = ranges[index % masters]
        for attempt in range(100_000):
            tag = "{" + f"{prefix}:{index}.{attempt}" + "}"
            slot = key_slot(tag.encode())
            if low + SLOT_MARGIN <= slot <= high - SLOT_MARGIN and slot not in taken:
                taken.add(slot)
                tags.append(tag)
                break
        else:  # pragma: no cover - 100,000 candidates cover every range many times over
            raise RuntimeError(f"no tag found for shard {index}")
    return tags


def shard_keys(tag: str) -> tuple[str, ...]:
    """A shard's keys, in the script's ``KEYS`` order."""
    return tuple(f"{tag}:{name}" for name in KEY_NAMES)


def shard_of(sidecar: str, shards: int) -> int:
    """The shard a sidecar writes to: a hash of its id, the same in every process."""
    return zlib.crc32(sidecar.encode()) % shards


def encode_row(table: Mapping[str, Load]) -> str:
    """A table as the script's row: one ``endpoint tokens requests`` line per endpoint held.
    ``ValueError`` for a table the script would refuse: over ``MAX_ENTRIES`` lines, an endpoint
    empty, over ``MAX_KEY_BYTES``, holding white space or beginning with ``#`` (the sums' own
    fields), a count out of range."""
    lines = []
    for endpoint, load in table.items():
        if load.requests <= 0:
            continue
        if not 0 < len(endpoint.encode()) <= MAX_KEY_BYTES or endpoint.startswith("#"):
            raise ValueError(f"not an endpoint for a row (# or its length): {endpoint[:40]!r}")
        if len(endpoint.split()) != 1 or endpoint.strip() != endpoint:
            raise ValueError(f"an endpoint with white space: {endpoint[:40]!r}")
        if not (0 <= load.tokens <= MAX_LOAD and load.requests <= MAX_LOAD):
            raise ValueError(f"a load out of range for {endpoint[:40]!r}")
        lines.append(f"{endpoint} {load.tokens} {load.requests}")
    if len(lines) > MAX_ENTRIES:
        raise ValueError(f"a row of {len(lines)} lines, over {MAX_ENTRIES}")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ShardTotals:
    """One shard's totals as read, every entry checked."""

    generation: str
    tables: int
    loads: dict[str, Load]
    skipped: int
    """Lines left out: they did not parse, were out of range, or beyond ``MAX_ENTRIES``."""


def decode_totals(raw: object) -> ShardTotals | None:
    """A shard's totals string (its sums' fields and values, one a line), checked: None when it
    is not one at all (not a string, too long, no generation), else its entries, each pair
    that fails skipped and counted."""
    if not isinstance(raw, bytes) or len(raw) > MAX_TOTALS_BYTES or not raw.isascii():
        return None
    lines = raw.decode("ascii").split("\n")
    generation, tables = None, 0
    loads: dict[str, Load] = {}
    skipped = len(lines) % 2
    for name, value in zip(lines[::2], lines[1::2], strict=False):
        if name == GENERATION:
            generation = value if value.isdigit() and len(value) <= 20 else None
        elif name == TABLES and value.isdigit() and len(value) <= 9:
            tables = int(value)
        elif name != RENEW:
            load = _entry(name, value) if len(loads) < MAX_ENTRIES else None
            if load is None or name in loads:
                skipped += 1
            else:
                loads[name] = load
    if generation is None:
        return None
    return ShardTotals(generation, tables, loads, skipped)


def _entry(endpoint: str, value: str) -> Load | None:
    """An endpoint's sums (``tokens requests``), or None: not an endpoint, not in range."""
    if not 0 < len(endpoint) <= MAX_KEY_BYTES or not endpoint.isprintable() or " " in endpoint:
        return None
    parts = value.split(" ")
    if len(parts) != 2 or not all(part.isdigit() and len(part) <= 13 for part in parts):
        return None
    load = Load(int(parts[0]), int(parts[1]))
    if load.tokens > MAX_LOAD or not 0 < load.requests <= MAX_LOAD:
        return None
    return load


@dataclass(frozen=True, slots=True)
class Synced:
    """What one sync's script answered."""

    generation: str
    expired: int
    """Lapsed sidecars it dropped."""
    fresh: bool
    """The shard was started anew (its totals could not be trusted)."""
    tables: int


@dataclass(frozen=True, slots=True)
class Totals:
    """Every shard's totals, summed."""

    loads: dict[str, Load]
    """Every live sidecar's reservations by endpoint, this sidecar's as last sent included."""
    generations: tuple[str | None, ...]
    """Each shard's generation (None: no totals, or not readable)."""
    skipped: int
    """Entries and shards left out because they did not check."""


Client = aioredis.Redis | RedisCluster


def connect(url: str, *, cluster: bool, timeout_s: float = 1.0) -> Client:
    """A client as the production backend builds one (``RedisState.start``): replies bounded
    before hiredis allocates them, one attempt per call."""
    if cluster:
        return bound_cluster(
            RedisCluster.from_url(
                url,
                socket_connect_timeout=timeout_s,
                socket_timeout=timeout_s,
                retry=Retry(NoBackoff(), retries=0),
            )
        )
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry_on_timeout=False,
        parser_class=BoundedHiredisParser,
    )


class Shards:
    """A pool's shards on one client: their keys, the script, the read of every shard's
    totals. Shared by the sidecars of one process (one client, many ``ShardedReservations``)."""

    def __init__(self, client: Client, prefix: str, *, shards: int = SHARDS) -> None:
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.tags = shard_tags(prefix, shards)
        self.keys = [shard_keys(tag) for tag in self.tags]
        self.totals_keys = [keys[3] for keys in self.keys]
        self.script: Any = client.register_script(SCRIPT)

    async def run(self, shard: int, args: Sequence[str | int | float]) -> Synced:
        raw = await self.script(keys=self.keys[shard], args=list(args))
        if not isinstance(raw, list) or len(raw) != 4:
            raise ValueError("the sync script answered something else")
        generation, expired, fresh, tables = raw
        if not isinstance(generation, bytes) or not generation.isdigit():
            raise ValueError("the sync script answered no generation")
        return Synced(generation.decode(), int(expired), bool(fresh), int(tables))

    async def fetch(self, shards: Sequence[int]) -> tuple[list[ShardTotals | None], int]:
        """The totals of ``shards`` (None: none, or not readable), and the entries and shards
        left out: one ``MGET`` (a Cluster: one pipeline per master, an ``MGET`` per slot)."""
        names = [self.totals_keys[shard] for shard in shards]
        if self.cluster:
            assert isinstance(self.client, RedisCluster)
            values = await self.client.mget_nonatomic(names)
        else:
            values = await self.client.execute_command("MGET", *names)
        if not isinstance(values, list) or len(values) != len(names):
            raise ValueError("MGET answered something else")
        decoded = [decode_totals(value) for value in values]
        skipped = sum(
            (value is not None) if shard is None else shard.skipped
            for value, shard in zip(values, decoded, strict=True)
        )
        return decoded, skipped

    async def read(self) -> Totals:
        """Every shard's totals, summed."""
        decoded, skipped = await self.fetch(range(len(self.tags)))
        return summed(decoded, skipped)


def summed(shards: Sequence[ShardTotals | None], skipped: int) -> Totals:
    """The shards' totals added up by endpoint."""
    loads: dict[str, Load] = {}
    for shard in shards:
        if shard is None:
            continue
        for endpoint, load in shard.loads.items():
            held = loads.get(endpoint)
            if held is not None:
                load = Load(held.tokens + load.tokens, held.requests + load.requests)
            loads[endpoint] = load
    generations = tuple(None if shard is None else shard.generation for shard in shards)
    return Totals(loads, generations, skipped)


def _requested(table: Mapping[str, Load]) -> dict[str, Load]:
    """A table's entries some request holds: what a sync sends."""
    return {endpoint: load for endpoint, load in table.items() if load.requests > 0}


class ShardedReservations:
    """One sidecar's side: what it last sent, when it owes a sync, the sync and the read."""

    def __init__(
        self,
        shards: Shards,
        sidecar: str,
        *,
        lease_s: float,
        expire: int = EXPIRE_PER_SYNC,
        read_groups: int = 1,
    ) -> None:
        """``read_groups``: 1, every read fetches every shard; g > 1, the first read fetches every
        shard, each later one every g-th shard in turn (g = 3: one master's shards on the
        Cluster the tags are chosen for), summed with the others as last read, each then up to
        g reads old. The first group read is a hash of the sidecar's id: the fleet's reads
        spread over the groups (over the masters) rather than all starting on the first."""
        self._shards = shards
        self.sidecar = sidecar
        self.shard = shard_of(sidecar, len(shards.tags))
        self.lease_s = lease_s
        self.heartbeat_s = lease_s / HEARTBEATS_PER_LEASE
        self._expire = expire
        self.sent: dict[str, Load] = {}
        """This sidecar's table as its last answered sync sent it (the reader's to replace by
        its table now)."""
        self._sent_at: float | None = None
        self._generation: str | None = None
        """Its shard's generation as its last sync left it."""
        self._resend = False
        self._groups = read_groups
        self._turn = zlib.crc32(f"{sidecar}/reads".encode()) % read_groups
        self._whole = True
        """The next read fetches every shard (the first: nothing is held yet)."""
        self._held: list[ShardTotals | None] = [None] * len(shards.tags)
        """Each shard's totals as last read."""
        self.skipped = 0
        """Entries and shards the reads left out, in all."""

    def due(self, table: Mapping[str, Load], now: float) -> bool:
        """Whether a sync is owed: the table changed since the last one (its entries held by
        some request, as sent), a heartbeat is due, or the shard was started anew since (seen
        by a read)."""
        return (
            self._resend
            or self._sent_at is None
            or now - self._sent_at >= self.heartbeat_s
            or _requested(table) != self.sent
        )

    async def sync(self, table: Mapping[str, Load], now: float) -> Synced:
        """Replace this sidecar's table in its shard, renew its lease. ``now`` is this
        sidecar's clock (any: ``time.monotonic()``), for its heartbeats (``due``) only: the
        script judges leases by Redis's."""
        sent = _requested(table)
        args: list[str | int | float] = [
            self.sidecar,
            repr(self.lease_s),
            encode_row(sent),
            self._expire,
            0,
        ]
        synced = await self._shards.run(self.shard, args)
        self.sent, self._sent_at = sent, now
        self._generation, self._resend = synced.generation, False
        return synced

    async def leave(self) -> Synced:
        """Take this sidecar's table off its shard's totals, and its lease."""
        args: list[str | int | float] = [self.sidecar, repr(self.lease_s), "", 0, 1]
        synced = await self._shards.run(self.shard, args)
        self.sent, self._sent_at, self._generation = {}, None, None
        return synced

    async def read(self) -> Totals:
        """Every shard's totals, summed (``read_groups``: some as last read); a new generation
        of this sidecar's shard makes its next sync due."""
        if self._whole:
            part, self._whole = range(len(self._held)), False
        else:
            part = range(self._turn, len(self._held), self._groups)
            self._turn = (self._turn + 1) % self._groups
        fetched, skipped = await self._shards.fetch(part)
        for shard, read in zip(part, fetched, strict=True):
            self._held[shard] = read
        self.skipped += skipped
        totals = summed(self._held, skipped)
        own = totals.generations[self.shard]
        if self._sent_at is not None and self.shard in part and own != self._generation:
            self._resend = True
        return totals
