"""What the shared state's commands cost Redis when Redis is busy: CPU per call at saturation.

Python cannot offer Redis more than a few thousand calls a second from two cores, and below
saturation a call's CPU is mostly the server waking for it (``epoll``, a read, a write per
call); a Redis serving a fleet is never idle, and serves many calls per wake. This benchmark
drives one real ``redis-server`` with ``redis-benchmark`` (C, ``--clients`` connections, each
sending its next call when the last is answered: no pipelining, as sidecars send them) and
reads, over each command's run, Redis's CPU (``INFO cpu``, networking included) and its own
µs per call (``INFO commandstats``). The figures scale: calls a second per Redis core =
10⁶ ÷ (CPU µs per call).

Commands, each with production's arguments:

- ``sync``: today's reservation sync script (``sidecar.scheduling.state.protocol``): one
  sidecar's table of ``--held`` lines replaced by one whose counts changed (a sync is sent when
  its table changed), among ``--sidecars`` sidecars registered beforehand (the id and the
  counts drawn at random by ``redis-benchmark`` for each call) whose tables cover
  ``--endpoints`` endpoints, each endpoint's speed published. Every call says it is the same
  time (``NOW``): no lease lapses, and the once-a-lease rebuild of the totals does not run;
- ``sharded``: the sharded design's sync script (``sidecar.scheduling.state.sharded``) on one
  shard holding its part of the sidecars (``--sidecars`` ÷ 12), each call a table of
  ``--held`` lines whose counts changed (a sync is sent only when its table changed);
- ``get``: a ``GET`` of one small key, the floor of any call;
- ``mget``: an ``MGET`` of ``--keys`` small keys (one read of sharded totals, or of scrape
  publications);
- ``hincrby``: one endpoint's sum moved by a reservation (a counter design's write);
- ``hgetall``: a hash of ``--endpoints`` fields read whole (a counter design's read);
- ``counters read``: the counters' read (``sidecar.scheduling.state.counters``): one ``MGET`` of
  the current and the previous epoch's key of ``--endpoints`` endpoints, the keys the module
  names; ``counters reserve`` and ``counters release``: its writes, ``INCRBY`` of one
  endpoint's key (tokens and a request packed in one integer, added or taken back) and its
  ``PEXPIREAT`` in one ``MULTI``/``EXEC``; ``counters release + read``: a read carrying a
  deferred release (``CounterReservations.defer_release``), the release and the ``MGET`` in one
  transaction;
- ``decision: …``: whole decisions, their calls one after the other on a connection: a read, a
  reservation and a release (an earlier decision's) on its own; then the same with the release
  carried by the read in ``--ride`` of the decisions; then also with the previous epoch's keys
  read in ``--previous`` of the decisions only (a read leaves them out once they hold nothing
  late enough into an epoch), the current epoch's alone in the others. Their cost is per
  decision;
- the layouts it was chosen against: two strings per endpoint and epoch (``strings``: a read
  of twice the keys; a write ``INCRBY`` twice, ``PEXPIREAT`` twice) and a hash of two fields
  (``hash``: a read of one ``HMGET`` per endpoint and epoch, pipelined; a write ``HINCRBY``
  twice and ``PEXPIREAT``), their writes plain pipelines (no ``MULTI``/``EXEC``).

The "command" column sums ``INFO commandstats``' µs of the commands named, ``EXEC``'s left out
(it holds the queued commands' µs, and its own few): the CPU column is the figure to read.

redis-benchmark sends one command per call; the pipelines (``counters reserve``, ...) are sent
by a driver of this process (uvloop, ``--clients`` connections, each sending its next pipeline
when the last is answered, with pre-encoded commands), which cannot offer Redis as many calls
as ``redis-benchmark`` does: ``get (driver)`` is a ``GET`` sent by it, to read its rows against.

    python -m bench saturation                 # 200,000 calls each, 50 connections
    python -m bench saturation --quick         # the smoke run: 2,000 calls each
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from bench.suite import add_quick, apply_quick
from devkit.processes import Launcher, free_port, tcp_open
from sidecar.scheduling.model import Speed
from sidecar.scheduling.state import counters, sharded
from sidecar.scheduling.state.protocol import SCRIPT, SyncProtocol, keys

LEASE_S = 10.0
"""``SIDECAR_STATE_LEASE_S``' default."""
NOW = 1_800_000_000.0
"""The time every sync says it is (a fixed ``now``: no lease lapses during a run, and the
once-a-lease re-sum, timed by ``python -m bench fleet``, does not run)."""


@dataclass(frozen=True, slots=True)
class Cost:
    command: str
    calls: int
    calls_per_s: float
    """What this machine's ``redis-benchmark`` reached (its two cores shared with Redis)."""
    command_us: float
    """Redis's own µs per call (``INFO commandstats``): the command's work."""
    cpu_us: float
    """Redis's CPU per call (``INFO cpu``): the work, and the networking around it."""

    @property
    def per_core(self) -> float:
        """Calls a second one Redis core serves at this cost."""
        return 1e6 / self.cpu_us if self.cpu_us > 0 else float("inf")


def sync_args(
    sidecar: str, endpoints: int, held: int, *, first: int = 0, speeds: bool = False
) -> list[str]:
    """One sync's ARGV as production sends it: ``held`` reservations of 8k tokens, on the
    endpoints from ``first`` on (of ``endpoints``); with ``speeds``, every endpoint's speed
    published too (a steady sync sends none: speeds go when they change)."""
    protocol = SyncProtocol(sidecar, lease_s=LEASE_S, wake=lambda: None)
    for index in range(held):
        protocol.reserve(_endpoint((first + index) % endpoints), 8192)
    if speeds:
        for index in range(endpoints):
            protocol.publish_speed(_endpoint(index), Speed(s_per_token=1e-4, overhead_s=0.02))
    sync = protocol.begin(NOW)
    return [str(arg) for arg in sync.args()]


def _endpoint(index: int) -> str:
    """An endpoint's name in the tables (a loopback one: nothing connects to it)."""
    return f"127.0.{index // 250}.{index % 250 + 1}:8000"


async def _readings(client: aioredis.Redis) -> tuple[float, dict[str, Any]]:
    cpu = await client.info("cpu")
    stats = await client.info("commandstats")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), stats


async def measure(
    client: aioredis.Redis,
    port: int,
    name: str,
    stat: str,
    argv: Sequence[str],
    args: Any,
    *,
    ids: int = 1,
) -> Cost:
    """``argv`` (a command and its arguments) sent ``args.calls`` times by ``redis-benchmark``,
    each ``__rand_int__`` in it a number below ``ids`` drawn for each call; ``stat``: its name
    in ``INFO commandstats`` (``cmdstat_evalsha``, ...)."""
    cpu_before, stats_before = await _readings(client)
    began = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        "redis-benchmark",
        *("-h", "127.0.0.1", "-p", str(port), "-c", str(args.clients), "-n", str(args.calls)),
        *("-r", str(ids), "-q"),
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"redis-benchmark failed: {err.decode(errors='replace')[-500:]}")
    seconds = time.monotonic() - began
    cpu_after, stats_after = await _readings(client)
    before = stats_before.get(stat, {"calls": 0, "usec": 0})
    after = stats_after.get(stat)
    if after is None:
        raise RuntimeError(f"{name}: Redis counted no {stat}")
    calls = int(after["calls"]) - int(before["calls"])
    if calls < args.calls:
        raise RuntimeError(f"{name}: {calls} calls counted of {args.calls} sent")
    for refused in ("failed_calls", "rejected_calls"):
        if int(after.get(refused, 0)) > int(before.get(refused, 0)):
            raise RuntimeError(f"{name}: Redis refused calls ({refused}): its arguments are wrong")
    usec = int(after["usec"]) - int(before["usec"])
    return Cost(
        command=name,
        calls=calls,
        calls_per_s=calls / seconds,
        command_us=usec / calls,
        cpu_us=(cpu_after - cpu_before) * 1e6 / calls,
    )


async def run(args: argparse.Namespace) -> list[Cost]:
    binary = shutil.which("redis-server")
    if binary is None or shutil.which("redis-benchmark") is None:
        raise RuntimeError("redis-server and redis-benchmark are needed (apt-get install redis)")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--maxclients", "10000"]  # fmt: skip
    async with Launcher(prefix="pd-sidecar-bench-saturation-") as launcher:
        child = await launcher.start(
            "redis", argv, ready=lambda: tcp_open("127.0.0.1", port), timeout_s=10
        )
        client = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
        try:
            sha = await client.script_load(SCRIPT)
            pool_keys = keys("saturation")
            # Every sidecar registered once, their reservations over every endpoint, every
            # endpoint's speed published: the runs replace tables in a pool's steady state.
            for sidecar in range(args.sidecars):
                await client.evalsha(
                    sha,
                    len(pool_keys),
                    *pool_keys,
                    *sync_args(
                        f"sidecar-{sidecar:012d}",
                        args.endpoints,
                        args.held,
                        first=sidecar,
                        speeds=sidecar == 0,
                    ),
                )
            await client.mset({f"k{i}": "x" * 64 for i in range(args.keys)})
            await client.hset(
                "sums", mapping={_endpoint(i): "81920 10" for i in range(args.endpoints)}
            )
            # The measured sync: a registered sidecar's table whose counts changed (a sync is
            # sent when its table changed), the id and the counts drawn for each call.
            changed = sync_args("sidecar-__rand_int__", args.endpoints, args.held)
            changed[3] = changed[3].replace(" 8192 1", " __rand_int__ 1")
            sync = ["EVALSHA", sha, str(len(pool_keys)), *pool_keys, *changed]
            costs = [
                await measure(
                    client, port, "sync", "cmdstat_evalsha", sync, args, ids=args.sidecars
                )
            ]
            # Each run replaced registered tables and added none: every id drawn was one.
            # (Checked at once: the keys expire a lease after the last sync.)
            await _tables(client, pool_keys[3], args.sidecars)
            # Registered now: a shard's keys expire a lease after its last sync.
            sharded_sync, shard_tables, members = await _sharded_setup(client, args)
            costs.append(
                await measure(
                    client, port, "sharded", "cmdstat_evalsha", sharded_sync, args, ids=members
                )
            )
            await _tables(client, shard_tables, members)
            costs += [
                await measure(client, port, "get", "cmdstat_get", ["GET", "k0"], args),
                await measure(
                    client,
                    port,
                    "mget",
                    "cmdstat_mget",
                    ["MGET", *(f"k{i}" for i in range(args.keys))],
                    args,
                ),
                await measure(
                    client, port, "hincrby", "cmdstat_hincrby", ["HINCRBY", "c", "e", "1"], args
                ),
                await measure(
                    client, port, "hgetall", "cmdstat_hgetall", ["HGETALL", "sums"], args
                ),
            ]
            costs += await _counter_costs(client, port, args)
            return costs
        finally:
            await client.aclose()
            await child.stop()


# --- the counters --------------------------------------------------------------------------------

COUNTERS_EPOCH = 180_000_000
"""The epoch the measured counters are in (any: the keys are written before the runs, with an
expiry far ahead)."""
EXPIRE_AT_MS = 4_102_444_800_000
"""Their expiry (2100): no key expires during a run."""


def _resp(*args: str | int) -> bytes:
    """One command in RESP, as redis-py sends it."""
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


Stage = tuple[bytes, int]
"""A pipeline of commands in RESP and the lines of RESP its replies hold."""


class _Rounds(asyncio.Protocol):
    """One connection of the driver: a call's stages sent one after the other, each when the
    last one's replies are in (their lines counted), then the next call's, ``rounds`` calls."""

    def __init__(
        self, calls: Sequence[Sequence[Stage]], rounds: int, done: asyncio.Future[None]
    ) -> None:
        self._calls, self._left, self._done = calls, rounds, done
        self._seen = 0
        self._call = 0
        self._stage = 0
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._send()

    def _lines(self) -> int:
        return self._calls[self._call][self._stage][1]

    def _send(self) -> None:
        assert self._transport is not None
        self._transport.write(self._calls[self._call][self._stage][0])

    def data_received(self, data: bytes) -> None:
        # Lines counted by their ``\n``: a chunk may end between a line's ``\r`` and ``\n``
        # (no value sent here holds either).
        self._seen += data.count(b"\n")
        while self._left > 0 and self._seen >= self._lines():
            self._seen -= self._lines()
            self._stage += 1
            if self._stage == len(self._calls[self._call]):
                self._stage = 0
                self._call = (self._call + 1) % len(self._calls)
                self._left -= 1
            if self._left:
                self._send()
        if self._left == 0 and not self._done.done():
            self._done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_exception(exc or ConnectionError("Redis closed the connection"))


async def measure_pipelined(
    client: aioredis.Redis,
    port: int,
    name: str,
    stats: Sequence[str],
    payloads: Sequence[bytes],
    lines: int,
    args: Any,
) -> Cost:
    """``payloads`` (pipelines of commands, in turn) sent ``args.calls`` times by this
    process's driver, over ``args.clients`` connections; ``lines``: the lines of RESP one
    pipeline's replies hold; ``stats``: its commands' names in ``INFO commandstats``."""
    calls = [[(payload, lines)] for payload in payloads]
    return await measure_calls(client, port, name, stats, calls, args)


async def measure_calls(
    client: aioredis.Redis,
    port: int,
    name: str,
    stats: Sequence[str],
    calls: Sequence[Sequence[Stage]],
    args: Any,
) -> Cost:
    """``calls`` (each a sequence of pipelines, sent one after the other as its answers come,
    the calls in turn) made ``args.calls`` times by this process's driver, over
    ``args.clients`` connections; ``stats``: the commands' names in ``INFO commandstats``,
    each sent at least once a call. The cost is per call."""
    loop = asyncio.get_running_loop()
    cpu_before, stats_before = await _readings(client)
    began = time.monotonic()
    share, extra = divmod(args.calls, args.clients)
    done: list[asyncio.Future[None]] = []
    transports = []
    for index in range(args.clients):
        rounds = share + (index < extra)
        if rounds == 0:
            continue
        finished: asyncio.Future[None] = loop.create_future()
        turned = list(calls[index % len(calls) :]) + list(calls[: index % len(calls)])
        transport, _ = await loop.create_connection(
            functools.partial(_Rounds, turned, rounds, finished), "127.0.0.1", port
        )
        transports.append(transport)
        done.append(finished)
    try:
        # Replies of another shape than a stage's lines say would leave a connection waiting.
        async with asyncio.timeout(60 + args.calls / 1000):
            await asyncio.gather(*done)
    finally:
        for transport in transports:
            transport.close()
    seconds = time.monotonic() - began
    cpu_after, stats_after = await _readings(client)
    usec = 0
    for stat in stats:
        before = stats_before.get(stat, {"calls": 0, "usec": 0})
        after = stats_after.get(stat)
        if after is None:
            raise RuntimeError(f"{name}: Redis counted no {stat}")
        if int(after["calls"]) - int(before["calls"]) < args.calls:
            raise RuntimeError(f"{name}: fewer {stat} counted than sent")
        for refused in ("failed_calls", "rejected_calls"):
            if int(after.get(refused, 0)) > int(before.get(refused, 0)):
                raise RuntimeError(f"{name}: Redis refused calls ({refused})")
        usec += int(after["usec"]) - int(before["usec"])
    return Cost(
        command=name,
        calls=args.calls,
        calls_per_s=args.calls / seconds,
        command_us=usec / args.calls,
        cpu_us=(cpu_after - cpu_before) * 1e6 / args.calls,
    )


async def _counter_costs(client: aioredis.Redis, port: int, args: Any) -> list[Cost]:
    """The counters' read, reserve and release, and the layouts weighed against them, each on
    ``args.endpoints`` endpoints' keys of two epochs (written beforehand, counts in them)."""
    pool = counters.Counters(client, "saturation")
    names = [_endpoint(i) for i in range(args.endpoints)]
    epochs = (COUNTERS_EPOCH - 1, COUNTERS_EPOCH)
    packed = [pool.key(name, epoch) for name in names for epoch in epochs]
    strings = [f"{key}:{part}" for key in packed for part in ("t", "r")]
    value = counters.pack(8192 * 10, 10)
    await client.mset({key: value for key in packed} | {"driver-get": "x" * 64})
    await client.mset({key: 81920 if key.endswith("t") else 10 for key in strings})
    for key in packed:
        await client.hset(f"{key}:h", mapping={"t": 81920, "r": 10})
        await client.pexpireat(f"{key}:h", EXPIRE_AT_MS)
    for key in [*packed, *strings]:
        await client.pexpireat(key, EXPIRE_AT_MS)
    now = [pool.key(name, COUNTERS_EPOCH) for name in names]
    one = counters.pack(8192, 1)

    def add(key: str, delta: int) -> bytes:
        return _resp("INCRBY", key, delta) + _resp("PEXPIREAT", key, EXPIRE_AT_MS)

    # Production's writes on one server: an INCRBY and its PEXPIREAT in one MULTI/EXEC. Replies:
    # +OK, +QUEUED twice, then EXEC's array of two (3 lines): 6 lines.
    reserve = [_resp("MULTI") + add(key, one) + _resp("EXEC") for key in now]
    release = [_resp("MULTI") + add(key, -one) + _resp("EXEC") for key in now]
    # A read carrying a deferred release, as production sends it: the release and the MGET in
    # one transaction. Replies: +OK, +QUEUED three times, EXEC's array of three (its header,
    # the two integers, then the MGET's array: a header and two lines a key).
    mget = _resp("MGET", *packed)
    read_lines = 1 + 2 * len(packed)
    read_release = [_resp("MULTI") + add(key, -one) + mget + _resp("EXEC") for key in now]
    read_release_lines = 4 + 3 + read_lines
    # Whole decisions, each its stages one after the other: the read, the reservation, and a
    # release (an earlier decision's) on its own; or that release carried by the read, as
    # CounterReservations.defer_release sends it when a read comes within its delay: in
    # args.ride of the decisions, spread evenly over the variants (each connection plays a
    # run of them in turn).
    today = [[(mget, read_lines), (reserve[k], 6), (release[k], 6)] for k in range(len(now))]
    variants = 100
    rides = round(variants * args.ride)
    both = round(variants * args.previous)

    def spread(k: int, share: int) -> bool:
        """Whether variant ``k`` is among ``share`` of the ``variants``, spread evenly."""
        return (k + 1) * share // variants > k * share // variants

    riding = [
        [(read_release[k % len(now)], read_release_lines), (reserve[k % len(now)], 6)]
        if spread(k, rides)
        else today[k % len(now)]
        for k in range(variants)
    ]
    # And reads of the current epoch only (the previous left out once empty) but in
    # args.previous of the decisions, spread independently of the releases (a stride of 37).
    current = _resp("MGET", *now)
    current_lines = 1 + 2 * len(now)
    current_release = [_resp("MULTI") + add(key, -one) + current + _resp("EXEC") for key in now]

    def decision(k: int) -> list[Stage]:
        key = k % len(now)
        if spread((37 * k) % variants, both):
            read, lines, carrying, carrying_lines = (
                mget,
                read_lines,
                read_release,
                read_release_lines,
            )
        else:
            read, lines = current, current_lines
            carrying, carrying_lines = current_release, 7 + current_lines
        if spread(k, rides):
            return [(carrying[key], carrying_lines), (reserve[key], 6)]
        return [(read, lines), (reserve[key], 6), (release[key], 6)]

    adaptive = [decision(k) for k in range(variants)]
    reserve_strings = [
        _resp("INCRBY", f"{key}:t", 8192)
        + _resp("INCRBY", f"{key}:r", 1)
        + _resp("PEXPIREAT", f"{key}:t", EXPIRE_AT_MS)
        + _resp("PEXPIREAT", f"{key}:r", EXPIRE_AT_MS)
        for key in now
    ]
    reserve_hash = [
        _resp("HINCRBY", f"{key}:h", "t", 8192)
        + _resp("HINCRBY", f"{key}:h", "r", 1)
        + _resp("PEXPIREAT", f"{key}:h", EXPIRE_AT_MS)
        for key in now
    ]
    read_hash = [b"".join(_resp("HMGET", f"{key}:h", "t", "r") for key in packed)]
    incr, expire, multi = "cmdstat_incrby", "cmdstat_pexpireat", "cmdstat_multi"
    writes = [incr, expire, multi]
    costs = [
        await measure(client, port, "counters read", "cmdstat_mget", ["MGET", *packed], args),
        await measure_pipelined(client, port, "counters reserve", writes, reserve, 6, args),
        await measure_pipelined(client, port, "counters release", writes, release, 6, args),
        await measure_pipelined(
            client,
            port,
            "counters release + read",
            [*writes, "cmdstat_mget"],
            read_release,
            read_release_lines,
            args,
        ),
    ]
    # The reservations "release + read" took back, made again (not reported): the keys hold
    # what was written before the runs.
    await measure_pipelined(client, port, "counters reserve", writes, reserve, 6, args)
    costs += [
        await measure(client, port, "strings read", "cmdstat_mget", ["MGET", *strings], args),
        await measure_pipelined(
            client, port, "strings reserve", [incr, expire], reserve_strings, 4, args
        ),
        await measure_pipelined(
            client, port, "hash read", ["cmdstat_hmget"], read_hash, 5 * len(packed), args
        ),
        await measure_pipelined(
            client, port, "hash reserve", ["cmdstat_hincrby", expire], reserve_hash, 3, args
        ),
        await measure_pipelined(
            client, port, "get (driver)", ["cmdstat_get"], [_resp("GET", "driver-get")], 2, args
        ),
        await measure_calls(
            client, port, "decision: read, reserve, release", [*writes, "cmdstat_mget"], today, args
        ),
        await measure_calls(
            client,
            port,
            f"decision: the release with a read ({rides / variants:.0%})",
            [*writes, "cmdstat_mget"],
            riding,
            args,
        ),
        await measure_calls(
            client,
            port,
            f"decision: and the previous epoch read in {both / variants:.0%}",
            [*writes, "cmdstat_mget"],
            adaptive,
            args,
        ),
    ]
    # The rows that write pair up, each pair on the same schedule (each connection's run of
    # payloads depends only on their number and the arguments): what reserve adds to a key,
    # release takes back; what release + read takes back, the unreported reserve adds again;
    # each decision takes back what it reserved. Change one row of a pair, change both.
    held = await client.mget(now)
    if any(int(raw or b"0") != value for raw in held):
        raise RuntimeError("the counters' reserves and releases did not cancel out")
    return costs


async def _tables(client: aioredis.Redis, key: str, registered: int) -> None:
    held = await client.hlen(key)
    if held != registered:
        raise RuntimeError(f"{key} holds {held} tables, not the {registered} registered")


async def _sharded_setup(
    client: aioredis.Redis, args: argparse.Namespace
) -> tuple[list[str], str, int]:
    """One shard's sidecars registered, each with a table of ``args.held`` lines over the
    endpoints. Returns the measured call's arguments (an id among them and token counts that
    ``redis-benchmark`` draws at random: a table that changed), the shard's key of tables, and
    how many sidecars it holds."""
    sha = await client.script_load(sharded.SCRIPT)
    shard_keys = sharded.shard_keys(sharded.shard_tags("saturation")[0])
    members = max(1, args.sidecars // sharded.SHARDS)

    def row(first: int, tokens: str) -> str:
        lines = [f"{_endpoint((first + i) % args.endpoints)} {tokens} 1" for i in range(args.held)]
        return "\n".join(lines)

    for member in range(members):
        await client.evalsha(
            sha,
            len(shard_keys),
            *shard_keys,
            *(f"sidecar-{member:012d}", repr(LEASE_S), row(member, "8192"), 8, 0),
        )
    argv = [
        "EVALSHA", sha, str(len(shard_keys)), *shard_keys,
        "sidecar-__rand_int__", repr(LEASE_S), row(0, "__rand_int__"), "8", "0",
    ]  # fmt: skip
    return argv, shard_keys[1], members


def report(costs: Sequence[Cost], args: argparse.Namespace) -> str:
    lines = [
        f"redis-benchmark, {args.clients} connections, {args.calls:,} calls each; sync: "
        f"{args.sidecars:,} sidecars, {args.held} held lines, {args.endpoints} endpoints; "
        f"mget: {args.keys} keys",
        "",
        "| command | calls/s reached | Redis µs per call (command) | Redis CPU µs per call "
        "| calls/s per Redis core |",
        "|---|---|---|---|---|",
    ]
    for cost in costs:
        lines.append(
            f"| {cost.command} | {cost.calls_per_s:,.0f} | {cost.command_us:.1f} | "
            f"{cost.cpu_us:.1f} | {cost.per_core:,.0f} |"
        )
    return "\n".join(lines)


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench saturation", description=__doc__)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--sidecars", type=int, default=1000)
    parser.add_argument("--endpoints", type=int, default=32)
    parser.add_argument("--held", type=int, default=4, help="reservations in each table")
    parser.add_argument("--keys", type=int, default=12, help="keys an MGET reads")
    parser.add_argument(
        "--previous",
        type=float,
        default=0.3,
        help="the share of reads that read the previous epoch's keys too (default: a read "
        "leaves them out from 2 s into a 10 s epoch once they hold nothing; 0.2 when prefills "
        "last under 2 s, 0.3 allowing for longer ones)",
    )
    parser.add_argument(
        "--ride",
        type=float,
        default=0.86,
        help="the share of decisions whose read carries a release (default: a pod deciding 20 "
        "times a second, Poisson, sends its next read within the 0.1 s release delay 86 %% of "
        "the time, 1 - exp(-2))",
    )
    add_quick(parser, "2,000 calls of each command, 50 sidecars")
    return parser


def main_cli(argv: list[str] | None = None) -> int:
    parser = main_parser()
    args = apply_quick(parser, parser.parse_args(argv), calls=2_000, sidecars=50)
    costs = asyncio.run(run(args))
    print(report(costs, args))
    return 0


if __name__ == "__main__":
    sys.exit(main_cli())
