"""The Redis backend: every sidecar's reservations, speed estimates and ejections, shared.

One Lua script does everything in one round trip: it replaces this sidecar's reservations with
their current absolute values (so Redis heals itself after a restart, a failover or a lost
update), renews the sidecar's lease, drops sidecars whose lease ran out (a dead sidecar's
reservations stop counting within ``lease_s``), stores published speeds and ejections, and returns
the pool's totals.

On the request path only ``refresh`` talks to Redis, before the scheduler decides where a
prompt prefills: it joins the sync in flight or starts one, waits for its answer at most
``timeout_s`` and never raises, so the decision reads every sidecar's reservations one round trip
old rather than as of this sidecar's last sync (with few prefills per sidecar, seconds old: the
reservations of a wide pool of sidecars were then seen too late and the prefill queues
unbalanced, docs/scheduling.md). A slow or absent Redis leaves the decision to the view it has.
Reservations, releases, speeds and ejections change the local table at once and wake a background
worker, which syncs them (and heartbeats, and reconnects) off the request path.

Four keys, all sharing one hash tag (``{prefix}``): ``sidecars`` (a sorted set, lease deadline per
sidecar id), ``reservations`` (a hash, one field per sidecar: its reservations, one ``endpoint
tokens requests`` line each), ``speeds`` and ``ejections`` (hashes, one field per endpoint). The
script touches only the keys it is given as ``KEYS`` — nothing by a name built inside it — so it
runs as it is on a standalone Redis and on a Redis Cluster (``cluster=True``: redis-py's cluster
client), where the four keys live in one slot, are redirected together and fail over together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from sidecar.scheduling.model import Speed
from sidecar.scheduling.state import Load, OwnReservations, Reservation, SharedView
from sidecar.tasks import stop_task

logger = logging.getLogger("sidecar.scheduling.state")

_SYNC = """
local sid, now, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local limit, key_bytes, value_bytes = @LIMIT@, @KEY_BYTES@, @VALUE_BYTES@
local skipped = 0
local lease_ms = math.ceil(lease * 1000)
if ARGV[4] == '' then
  redis.call('HDEL', KEYS[4], sid)
else
  redis.call('HSET', KEYS[4], sid, ARGV[4])
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
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
if #dead > 0 then
  redis.call('HDEL', KEYS[4], unpack(dead))
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
end
-- Gone with the lease when every sidecar is: nobody is left to read them.
redis.call('PEXPIRE', KEYS[1], lease_ms)
if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('PEXPIRE', KEYS[4], lease_ms) end
-- What is read back is bounded (at most `limit` entries of each kind, of bounded size), since
-- anyone who can write these keys could otherwise make every sidecar parse them on its loop.
local totals, order = {}, {}
local held = redis.call('HGETALL', KEYS[4])
for j = 1, #held, 2 do
  if redis.call('ZSCORE', KEYS[1], held[j]) then
    for ep, tok, req in string.gmatch(held[j + 1], '(%S+) (%d+) (%d+)') do
      if totals[ep] == nil then
        if #order < limit and #ep <= key_bytes then
          totals[ep] = {0, 0}; order[#order + 1] = ep
        else
          skipped = skipped + 1
        end
      end
      if totals[ep] ~= nil then
        totals[ep][1] = totals[ep][1] + tonumber(tok)
        totals[ep][2] = totals[ep][2] + tonumber(req)
      end
    end
  end
end
local lines = {}
for _, ep in ipairs(order) do
  lines[#lines + 1] = string.format('%s %.0f %.0f', ep, totals[ep][1], totals[ep][2])
end
local function bounded(flat)
  local kept = {}
  for j = 1, #flat, 2 do
    if #kept < 2 * limit and #flat[j] <= key_bytes and #flat[j + 1] <= value_bytes then
      kept[#kept + 1] = flat[j]; kept[#kept + 1] = flat[j + 1]
    else
      skipped = skipped + 1
    end
  end
  return kept
end
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
return {
  table.concat(lines, '\\n'),
  table.concat(bounded(redis.call('HGETALL', KEYS[2])), '\\n'),
  table.concat(bounded(live), '\\n'),
  skipped,
}
"""
"""KEYS: sidecars, speeds, ejections, reservations. ARGV: sidecar id, now, lease, this sidecar's
reservations (lines), then speeds and ejections, each a count and that many pairs. The reply is
three strings of lines: the totals (``endpoint tokens requests`` each), then the speeds and the
live ejections (an endpoint's line, then its value's): three bulk strings rather than arrays of
every field, which redis-py's parser would read element by element (most of a sync's cost on
the request path); then how many entries the script left out (over ``MAX_ENTRIES`` of a kind,
or longer than ``MAX_KEY_BYTES`` / ``MAX_VALUE_BYTES``)."""

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

_SCRIPT = (
    _SYNC.replace("@LIMIT@", str(MAX_ENTRIES))
    .replace("@KEY_BYTES@", str(MAX_KEY_BYTES))
    .replace("@VALUE_BYTES@", str(MAX_VALUE_BYTES))
)

_ERRORS = (RedisError, RedisClusterException, OSError, TimeoutError)
"""What a Redis call may raise (the cluster client's "cannot be connected" and "slots not
covered" are not RedisErrors)."""


class RedisState:
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        cluster: bool = False,
        lease_s: float,
        timeout_s: float,
        max_ejection_s: float = 3600.0,
        on_error: Callable[[str], None] = lambda kind: None,
        on_skipped: Callable[[str, int], None] = lambda kind, count: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``max_ejection_s``: the longest ejection a sidecar publishes (SIDECAR_EJECT_MAX_S);
        one read back that ends later is not believed. ``on_skipped(kind, count)``: entries
        read back and left out (kind ``load``, ``speed``, ``ejection``; ``over_limit`` for what
        the script left out), since they do not parse, are out of range or beyond the bounds."""
        self._url = url
        self._cluster = cluster
        tag = "{" + prefix + "}"
        self.keys = (
            f"{tag}:sidecars",
            f"{tag}:speeds",
            f"{tag}:ejections",
            f"{tag}:reservations",
        )
        """Every key the backend touches, in the script's ``KEYS`` order."""
        self._id = uuid.uuid4().hex
        self._lease_s = lease_s
        self._timeout_s = timeout_s
        self._max_ejection_s = max_ejection_s
        self._on_error = on_error
        self._on_skipped = on_skipped
        self._clock = clock
        self._own = OwnReservations()
        self._others: dict[str, Load] = {}
        self._speeds: dict[str, Speed] = {}
        self._ejected: dict[str, float] = {}
        self._pending_speeds: dict[str, Speed] = {}
        self._pending_ejections: dict[str, float] = {}
        self._client: aioredis.Redis | RedisCluster | None = None
        self._script: Any = None
        self._sync: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._down_until = 0.0
        self._backoff_s = 0.5
        self.connected = False
        self.last_error: str | None = None
        self.last_sync_unix: float | None = None

    async def start(self) -> None:
        # Socket timeouts bound the background worker; the request path has its own, shorter wait.
        if self._cluster:
            # One attempt per sync, like the standalone client: a failed one backs off (below),
            # and the next re-reads the slots from the nodes left (a promoted replica included).
            self._client = RedisCluster.from_url(
                self._url,
                socket_connect_timeout=1.0,
                socket_timeout=1.0,
                retry=Retry(NoBackoff(), retries=0),
            )
        else:
            self._client = aioredis.Redis.from_url(
                self._url, socket_connect_timeout=1.0, socket_timeout=1.0, retry_on_timeout=False
            )
        self._script = self._client.register_script(_SCRIPT)
        self._worker = asyncio.create_task(self._work(), name="redis-state-sync")

    async def close(self) -> None:
        for task in (self._worker, self._sync):
            if task is not None:
                await stop_task(task)
        if self._client is not None:
            # Best effort: let the others stop counting us now rather than after the lease.
            with contextlib.suppress(*_ERRORS):
                async with asyncio.timeout(0.5):
                    await self._client.hdel(self.keys[3], self._id)
                    await self._client.zrem(self.keys[0], self._id)
            await self._client.aclose()
            self._client = None

    def view(self) -> SharedView:
        loads = dict(self._others)
        for endpoint, own in self._own.loads.items():
            other = loads.get(endpoint, Load())
            loads[endpoint] = Load(other.tokens + own.tokens, other.requests + own.requests)
        return SharedView(loads, dict(self._speeds), dict(self._ejected))

    async def refresh(self) -> None:
        if self._clock() < self._down_until:
            return  # Redis is down: decide on the view there is rather than wait for nothing
        if self._sync is None:
            self._sync = asyncio.create_task(self._run_sync())
        try:
            async with asyncio.timeout(self._timeout_s):
                await asyncio.shield(self._sync)
        except TimeoutError:
            self._record_error("timeout", "no answer within the decision budget")

    def reserve(self, endpoint: str, tokens: int) -> Reservation:
        ahead = self.view().loads.get(endpoint, Load()).tokens
        self._own.add(endpoint, tokens, 1)
        self._wake.set()
        return Reservation(endpoint, tokens, ahead)

    def release(self, reservation: Reservation) -> None:
        self._own.add(reservation.endpoint, -reservation.tokens, -1)
        self._wake.set()

    def publish_speed(self, endpoint: str, speed: Speed) -> None:
        self._pending_speeds[endpoint] = speed
        self._speeds[endpoint] = speed

    def publish_ejection(self, endpoint: str, until_unix: float) -> None:
        self._pending_ejections[endpoint] = until_unix
        self._ejected[endpoint] = until_unix
        self._wake.set()

    def status(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "connected": self.connected,
            "sidecar_id": self._id,
            "last_sync_unix": self.last_sync_unix,
            "last_error": self.last_error,
            "lease_s": self._lease_s,
            "cluster": self._cluster,
        }

    async def _work(self) -> None:
        """Sync after every change, and at least three times per lease (the heartbeat)."""
        heartbeat = self._lease_s / 3
        # Register at once (this also loads the script, so requests never pay for that).
        self._wake.set()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(heartbeat):
                    await self._wake.wait()
            self._wake.clear()
            wait = self._down_until - self._clock()
            if wait > 0:
                await asyncio.sleep(min(wait, heartbeat))
            # A sync in flight is a decision's refresh, which may have left before the change
            # that woke us: wait for it, then sync unless another one started since.
            await self._join_sync()
            if self._sync is None:
                self._sync = asyncio.create_task(self._run_sync())
            await self._join_sync()

    async def _join_sync(self) -> None:
        """Wait for the sync in flight, if any. Its cancellation (by ``close``) is not the
        worker's: only the worker's own ends the worker."""
        sync = self._sync
        if sync is None:
            return
        try:
            await asyncio.shield(sync)
        except asyncio.CancelledError:
            worker = asyncio.current_task()
            if worker is not None and worker.cancelling():
                raise

    async def _run_sync(self) -> None:
        try:
            await self._sync_once()
        finally:
            self._sync = None

    async def _sync_once(self) -> None:
        own = dict(self._own.loads)
        speeds, self._pending_speeds = self._pending_speeds, {}
        ejections, self._pending_ejections = self._pending_ejections, {}
        now = self._clock()
        held = "\n".join(f"{e} {load.tokens} {load.requests}" for e, load in own.items())
        args: list[Any] = [self._id, repr(now), repr(self._lease_s), held, len(speeds)]
        for endpoint, speed in speeds.items():
            args += [endpoint, f"{speed.s_per_token!r} {speed.overhead_s!r}"]
        args.append(len(ejections))
        for endpoint, until in ejections.items():
            args += [endpoint, repr(until)]
        try:
            reply = await self._script(keys=self.keys, args=args)
            self._apply(reply, own)
        except Exception as exc:
            # Whatever failed — the connection, the cluster's routing, an answer of the wrong
            # shape — the sync is lost, never the worker or a request: keep what was not
            # published (the next sync carries it) and back off.
            if not isinstance(exc, _ERRORS):
                logger.exception("shared-state sync failed unexpectedly")
            self._pending_speeds = {**speeds, **self._pending_speeds}
            self._pending_ejections = {**ejections, **self._pending_ejections}
            self._down_until = self._clock() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, 5.0)
            self._record_error("connection", f"{type(exc).__name__}: {exc}")

    def _apply(self, reply: Any, own_sent: dict[str, Load]) -> None:
        """Take what a sync read back. Each entry is checked (types, finite numbers in range)
        and one that fails is skipped and counted, never the whole sync: whoever can write the
        keys (another version of the sidecar, a person) cannot stall or steer every sidecar."""
        totals, speeds, ejections = (_lines(part) for part in reply[:3])
        if reply[3]:
            self._on_skipped("over_limit", int(reply[3]))
        others: dict[str, Load] = {}
        bad = 0
        for line in totals:
            load = _load(line)
            if load is None:
                bad += 1
                continue
            endpoint, total = load
            mine = own_sent.get(endpoint, Load())
            if total.requests - mine.requests > 0:
                others[endpoint] = Load(total.tokens - mine.tokens, total.requests - mine.requests)
        self._skipped("load", bad)
        self._others = others
        parsed_speeds = {}
        bad = 0
        for endpoint, text in zip(speeds[::2], speeds[1::2], strict=False):
            speed = _speed(text)
            if speed is None:
                bad += 1
            else:
                parsed_speeds[endpoint] = speed
        self._skipped("speed", bad)
        self._speeds = parsed_speeds
        latest = self._clock() + self._max_ejection_s + EJECTION_SKEW_S
        ejected = {}
        bad = 0
        for endpoint, text in zip(ejections[::2], ejections[1::2], strict=False):
            until = _number(text, 0.0, latest)
            if until is None:
                bad += 1
            else:
                ejected[endpoint] = until
        self._skipped("ejection", bad)
        self._ejected = ejected
        if not self.connected:
            logger.info("redis state backend connected")
        self.connected = True
        self._backoff_s = 0.5
        self.last_sync_unix = self._clock()

    def _skipped(self, kind: str, count: int) -> None:
        if count:
            self._on_skipped(kind, count)

    def _record_error(self, kind: str, detail: str) -> None:
        if self.connected or self.last_error is None:
            logger.warning("redis state backend: %s (%s); deciding on the local view", kind, detail)
        if kind == "connection":
            self.connected = False
        self.last_error = f"{kind}: {detail}"
        self._on_error(kind)


def _lines(value: Any) -> list[str]:
    text = value.decode() if isinstance(value, bytes) else str(value)
    return text.split("\n") if text else []


def _number(text: str, low: float, high: float) -> float | None:
    """``text`` as a finite float in [low, high], else None (NaN and infinities fail both)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if low <= value <= high else None


def _speed(text: str) -> Speed | None:
    parts = text.split(" ")
    if len(parts) != 2:
        return None
    s_per_token = _number(parts[0], 0.0, MAX_S_PER_TOKEN)
    overhead_s = _number(parts[1], 0.0, MAX_OVERHEAD_S)
    if s_per_token is None or overhead_s is None or s_per_token == 0.0:
        return None
    return Speed(s_per_token, overhead_s)


def _load(line: str) -> tuple[str, Load] | None:
    parts = line.split(" ")
    if len(parts) != 3 or not (parts[1].isascii() and parts[1].isdigit()):
        return None
    if not (parts[2].isascii() and parts[2].isdigit()) or max(len(parts[1]), len(parts[2])) > 13:
        return None
    tokens, requests = int(parts[1]), int(parts[2])
    if tokens > MAX_LOAD or requests > MAX_LOAD:
        return None
    return parts[0], Load(tokens, requests)
