"""The block index shared in Redis: what its event writes and per-decision queries cost the servers.

Plays the prototype ``sidecar/kvevents/shared_index.py`` against a real ``redis-server`` and a
Redis Cluster of 3 masters (each with a replica) on loopback, started as ``bench/fleet.py``
starts them:

- **events**: ``--engines`` prefill engines' KV events, applied by their owners (one
  ``SharedKVIndex`` in this process, its background flusher on) at a fixed offered rate of block
  events a second (``--event-rates``): each engine prefills prompts of ``--stored-tokens`` tokens
  (16-token blocks, stored in ``BlockStored`` events of 64 blocks, chained), each prompt's first
  block its own; an engine over ``--capacity`` blocks evicts its oldest prompt (one
  ``BlockRemoved``, tail first). A stored or a removed block is one event.
- **queries**: another ``SharedKVIndex`` (another "process": its own connections) looks up
  prompts of ``--prompt-tokens`` tokens, the leading part of prompts the engines hold, at a fixed
  offered rate (``--query-rates``), each on its own task (open loop), its round timed in the
  client (``on_round``: from sending to the last reply). The prompts are hashed before the
  window and their hashing timed apart (``hash µs``, added to ``own µs``): a sidecar hashes tens
  of prompts a second, and this one process could not hash 500 a second and time the rounds.

The servers' side is read per master over each window: ``INFO cpu`` (the process's CPU, less an
idle window's, per event or per query) and ``INFO commandstats`` (``SETBIT``, ``PEXPIRE``,
``MGET``: Redis's own µs); the bytes a block costs from ``INFO memory`` (``used_memory``'s growth
÷ the block keys the windows left); this process's CPU per event and per query (the owner's and
the sidecar's own cost; the event generator's share is in the events'); how long a store takes
to be seen by a query (the flush interval, ``FLUSH_S``). Then the extrapolation to a fleet.

    python -m bench kv_shared                          # both stores, 5k/20k events/s, 200/500 q/s
    python -m bench kv_shared --stores cluster --window-s 5
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import shutil
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.crc import key_slot

from bench.cluster import run
from bench.fleet import Store, cluster, server_cpu_s, server_info, standalone
from bench.readings import own_cpu_s
from bench.suite import add_quick, apply_quick
from devkit.processes import Launcher
from devkit.stats import percentile
from sidecar.kvevents.events import BlockRemoved, BlockStored, EventBatch
from sidecar.kvevents.shared_index import (
    FLUSH_S,
    MAX_BLOCKS,
    SHARDS,
    EngineOwner,
    ShardLayout,
    SharedKVIndex,
    sample_positions,
)
from sidecar.kvevents.tokens import checked_ids

BLOCK = 16
CHUNK = 64
"""Blocks per ``BlockStored`` (a prefill's chunk)."""
SECRET = b"kv_shared bench secret, 32 bytes"
COMMANDS = ("setbit", "pexpire", "mget")
REGISTRY_KEYS = 2
"""Keys of the pool that are no block: the endpoint registry and its counter."""


# --- the servers ---------------------------------------------------------------------------------


async def _reset(store: Store) -> dict[int, float]:
    """Every master's command stats zeroed; their CPU seconds now."""
    before = {}
    for port in store.masters:
        client = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        try:
            await client.config_resetstat()
        finally:
            await client.aclose()
        before[port] = await server_cpu_s(port)
    return before


@dataclass(frozen=True, slots=True)
class ServerReading:
    port: int
    cpu_s: float
    commands: dict[str, tuple[int, float]]
    """Per command: calls, and Redis's µs spent in them."""


async def _readings(store: Store, before: dict[int, float]) -> list[ServerReading]:
    readings = []
    for port in store.masters:
        stats = await server_info(port, "commandstats")
        commands = {}
        for name in COMMANDS:
            entry = stats.get(f"cmdstat_{name}", {})
            commands[name] = (int(entry.get("calls", 0)), float(entry.get("usec", 0.0)))
        readings.append(ServerReading(port, await server_cpu_s(port) - before[port], commands))
    return readings


async def _used_memory(store: Store) -> tuple[int, int]:
    """Bytes used and keys held, summed over the masters."""
    used = keys = 0
    for port in store.masters:
        used += int((await server_info(port, "memory"))["used_memory"])
        keys += int((await server_info(port, "keyspace")).get("db0", {}).get("keys", 0))
    return used, keys


# --- the workload --------------------------------------------------------------------------------


class Workload:
    """``engines`` engines' prefills and evictions, as KV events applied to their owners."""

    def __init__(
        self, owners: Sequence[EngineOwner], rng: random.Random, *, blocks: int, capacity: int
    ) -> None:
        self._owners = owners
        self._rng = rng
        self._blocks = blocks
        self._capacity = capacity
        self._body = [rng.randrange(1, 150_000) for _ in range(2 * blocks * BLOCK)]
        self._next_hash = 1
        self._turn = 0
        self._prompts = 0
        self._held: list[collections.deque[tuple[int, ...]]] = [collections.deque() for _ in owners]
        self._size = [0] * len(owners)
        self.recent: collections.deque[list[int]] = collections.deque(maxlen=64)
        """The prompts stored last (every engine's last few: still held)."""

    def prompt(self) -> list[int]:
        """A new prompt: a first block of its own, then a stretch of a shared body."""
        self._prompts += 1
        first = [self._prompts, *(self._rng.randrange(1, 150_000) for _ in range(BLOCK - 1))]
        start = self._rng.randrange(len(self._body) - self._blocks * BLOCK)
        return first + self._body[start : start + (self._blocks - 1) * BLOCK]

    def step(self) -> int:
        """The next engine prefills one prompt (and evicts what it must): its events."""
        engine = self._turn
        self._turn = (self._turn + 1) % len(self._owners)
        owner = self._owners[engine]
        tokens = self.prompt()
        hashes = tuple(range(self._next_hash, self._next_hash + self._blocks))
        self._next_hash += self._blocks
        events = 0
        for first in range(0, self._blocks, CHUNK):
            part = hashes[first : first + CHUNK]
            stored = BlockStored(
                block_hashes=part,
                parent_block_hash=None if first == 0 else hashes[first - 1],
                token_ids=tuple(tokens[first * BLOCK : (first + len(part)) * BLOCK]),
                block_size=BLOCK,
            )
            owner.apply(EventBatch(seq=0, ts=0.0, events=(stored,)))
            events += len(part)
        self._held[engine].append(hashes)
        self._size[engine] += len(hashes)
        while self._size[engine] > self._capacity:
            gone = self._held[engine].popleft()
            self._size[engine] -= len(gone)
            removed = BlockRemoved(block_hashes=gone[::-1])
            owner.apply(EventBatch(seq=0, ts=0.0, events=(removed,)))
            events += len(gone)
        self.recent.append(tokens)
        return events


# --- the windows ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Window:
    store: str
    kind: str
    """``events`` or ``queries``."""
    rate: float
    """Offered events or queries a second."""
    prompt_tokens: int
    seconds: float
    count: int
    """Events applied, or queries answered."""
    servers: list[ServerReading]
    own_cpu_s: float
    idle_cpu_per_s: float
    """The masters' CPU a second with nothing offered (subtracted)."""
    rounds_ms: list[float] = field(default_factory=list, repr=False)
    failed: int = 0
    hash_us: float = 0.0
    """This process's CPU to hash one prompt (median), not in ``own_cpu_s``."""

    @property
    def sound(self) -> bool:
        """Whether this process kept up: at most 1 % of the queries failed or were skipped (a
        window where this process could not keep up times its own backlog, not Redis)."""
        return self.failed <= 0.01 * self.count

    def figures(self) -> dict[str, Any]:
        count = max(1, self.count)
        cpu = sum(s.cpu_s for s in self.servers)
        busy = max(0.0, cpu - self.idle_cpu_per_s * self.seconds)
        usec = sum(u for s in self.servers for _, u in s.commands.values())
        calls = sum(c for s in self.servers for c, _ in s.commands.values())
        return {
            "store": self.store,
            "kind": self.kind,
            "offered_per_s": self.rate,
            "prompt_tokens": self.prompt_tokens,
            "achieved_per_s": self.count / self.seconds if self.seconds else 0.0,
            "redis_cpu_us": 1e6 * busy / count,
            "redis_cmd_us": usec / count,
            "commands": calls / count,
            "busiest_share": max(s.cpu_s for s in self.servers) / cpu if cpu else 0.0,
            "busiest_cpu_s": max(s.cpu_s for s in self.servers),
            "own_cpu_us": 1e6 * self.own_cpu_s / count + self.hash_us,
            "hash_us": self.hash_us,
            "round_p50_ms": percentile(self.rounds_ms, 50) if self.rounds_ms else None,
            "round_p99_ms": percentile(self.rounds_ms, 99) if self.rounds_ms else None,
            "failed": self.failed,
        }


async def idle_cpu_per_s(store: Store, seconds: float) -> float:
    before = await _reset(store)
    began = time.perf_counter()
    await asyncio.sleep(seconds)
    readings = await _readings(store, before)
    return sum(r.cpu_s for r in readings) / (time.perf_counter() - began)


async def events_window(
    store: Store,
    writer: SharedKVIndex,
    workload: Workload,
    rate: float,
    seconds: float,
    idle: float,
) -> Window:
    await writer.flush()
    before = await _reset(store)
    cpu = own_cpu_s()
    began = time.perf_counter()
    emitted = 0
    while (elapsed := time.perf_counter() - began) < seconds:
        while emitted < rate * elapsed:
            emitted += workload.step()
        await asyncio.sleep(0.005)
    await writer.flush()
    took = time.perf_counter() - began
    own = own_cpu_s() - cpu
    servers = await _readings(store, before)
    return Window(store.name, "events", rate, 0, took, emitted, servers, own, idle)


async def queries_window(
    store: Store,
    reader: SharedKVIndex,
    prompts: Sequence[list[int]],
    rate: float,
    tokens: int,
    seconds: float,
    idle: float,
) -> Window:
    rounds: list[float] = []
    reader.on_round = lambda s: rounds.append(1000 * s)
    failed_before = reader.counters.failed + reader.counters.backoff
    # Hashed before the window, and timed apart (``hash_us``): a sidecar hashes its own
    # prompts, tens a second, and this one process could not hash 500 a second and still
    # time the rounds. The ids as the sidecar has them, checked and packed (``TokenIds``).
    asked = []
    hashing = []
    for prompt in prompts:
        ids = checked_ids(prompt[:tokens])
        assert ids is not None
        began = time.perf_counter()
        asked.append(reader.digests(ids))
        hashing.append(1e6 * (time.perf_counter() - began))
    tasks: list[asyncio.Task[dict[str, int]]] = []
    before = await _reset(store)
    cpu = own_cpu_s()
    began = time.perf_counter()
    total = int(rate * seconds)
    for i in range(total):
        wait = began + i / rate - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(reader.lookup(asked[i % len(asked)])))
    answers = await asyncio.gather(*tasks)
    reader.on_round = lambda s: None
    took = time.perf_counter() - began
    own = own_cpu_s() - cpu
    servers = await _readings(store, before)
    if not any(answers):
        raise RuntimeError("no query found a block the engines hold")
    failed = reader.counters.failed + reader.counters.backoff - failed_before
    window = Window(store.name, "queries", rate, tokens, took, total, servers, own, idle)
    window.rounds_ms, window.failed = rounds, failed
    window.hash_us = statistics.median(hashing)
    return window


async def pings_ms(reader: SharedKVIndex, rate: float, seconds: float) -> list[float]:
    """``PING`` rounds to every master at once at ``rate`` a second, timed as the queries'
    rounds are: the floor of a round in this process on this machine."""
    tasks = []
    began = time.perf_counter()
    for i in range(int(rate * seconds)):
        wait = began + i / rate - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(reader.ping()))
    return [1000 * s for s in await asyncio.gather(*tasks)]


async def visible_ms(writer: SharedKVIndex, reader: SharedKVIndex, workload: Workload) -> float:
    """From an engine's store applied by its owner to a query that finds it (flushed by the
    background flusher), ms."""
    workload.step()
    tokens = workload.recent[-1]
    began = time.perf_counter()
    # Polled: the flusher's timing is the production one, not injected.
    while not await reader.query(tokens[: 2 * BLOCK + 1]):  # noqa: ASYNC110
        await asyncio.sleep(0.002)
    return 1000 * (time.perf_counter() - began)


@dataclass(slots=True)
class StoreRun:
    store: str
    windows: list[Window]
    bytes_per_block: float
    blocks: int
    visible_ms: list[float]
    pings: dict[float, list[float]] = field(default_factory=dict)
    """Per offered rate: the rounds of ``PING`` (``pings_ms``), ms."""
    saturated: list[tuple[int, float, float]] = field(default_factory=list)
    """Per master asked: ``MGET``s a second under ``redis-benchmark``, and Redis's CPU µs each."""


async def saturated(
    store: Store, layout: ShardLayout, keys: int, clients: int, requests: int
) -> list[tuple[int, float, float]]:
    """Each master's throughput and CPU per ``MGET`` of ``keys`` block keys (one shard of its
    own), driven by ``redis-benchmark`` with ``clients`` connections: what a request costs once
    many sidecars keep Redis busy (a wake-up serves many), against the per-request cost of the
    windows at hundreds a second. The masters one after the other."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return []
    out = []
    for port in store.masters:
        client = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        try:
            served = [p for p in layout.prefixes if await _serves(client, port, p, store.cluster)]
            prefix = served[0].decode()
            names = [f"{prefix}bench{i:03d}" for i in range(keys)]
            for i, name in enumerate(names):
                await client.setbit(name, i % 8, 1)
        finally:
            await client.aclose()
        before = await server_cpu_s(port)
        began = time.perf_counter()
        child = await asyncio.create_subprocess_exec(
            binary, "-h", "127.0.0.1", "-p", str(port), "-c", str(clients), "-n",
            str(requests), "-q", "MGET", *names,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await child.wait()
        took = time.perf_counter() - began
        cpu = await server_cpu_s(port) - before
        out.append((port, requests / took, 1e6 * cpu / requests))
    return out


async def _serves(client: aioredis.Redis, port: int, prefix: bytes, cluster_mode: bool) -> bool:
    """Whether the master at ``port`` (``client``) holds ``prefix``'s slot."""
    if not cluster_mode:
        return True
    slot = key_slot(prefix)
    ranges = await client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
    return any(int(r[0]) <= slot <= int(r[1]) and int(r[2][1]) == port for r in ranges)


async def measure(store: Store, args: argparse.Namespace, rng: random.Random) -> StoreRun:
    pool = f"bench-{store.name}"
    cluster_mode = store.cluster
    options: dict[str, Any] = {"pool": pool, "secret": SECRET, "cluster": cluster_mode}
    writer = SharedKVIndex(store.url, shards=args.shards, **options)
    reader = SharedKVIndex(
        store.url, shards=args.shards, timeout_s=args.timeout_ms / 1000, **options
    )
    await writer.start()
    await reader.start(flusher=False)
    try:
        owners = [await writer.owner(f"127.0.0.1:{9000 + e}") for e in range(args.engines)]
        await reader.refresh_endpoints()
        workload = Workload(owners, rng, blocks=args.stored_tokens // BLOCK, capacity=args.capacity)
        idle = await idle_cpu_per_s(store, args.idle_s)
        used_before, keys_before = await _used_memory(store)
        windows = []
        for rate in args.event_rates:
            windows.append(await events_window(store, writer, workload, rate, args.window_s, idle))
            _line(windows[-1])
        used_after, keys_after = await _used_memory(store)
        blocks = keys_after - keys_before
        per_block = (used_after - used_before) / blocks if blocks > 0 else 0.0
        prompts = list(workload.recent)
        for tokens in args.prompt_tokens:
            for rate in args.query_rates:
                window = await queries_window(
                    store, reader, prompts, rate, tokens, args.window_s, idle
                )
                windows.append(window)
                _line(windows[-1])
        seen = [await visible_ms(writer, reader, workload) for _ in range(5)]
        asked = len(sample_positions((max(args.prompt_tokens) - 1) // BLOCK))
        keys = round(asked / len(store.masters))
        busy = (
            await saturated(store, writer.layout, keys, args.saturate_clients, args.saturate_n)
            if args.saturate_n
            else []
        )
        pings = {rate: await pings_ms(reader, rate, args.window_s) for rate in args.query_rates}
        return StoreRun(store.name, windows, per_block, blocks, seen, pings, busy)
    finally:
        await reader.close()
        await writer.close()


# --- the report ----------------------------------------------------------------------------------


def _text(value: Any, form: str) -> str:
    return "-" if value is None else format(value, form)


COLUMNS = (
    ("store", "store", "s"),
    ("kind", "kind", "s"),
    ("offered/s", "offered_per_s", ".0f"),
    ("tokens", "prompt_tokens", "d"),
    ("done/s", "achieved_per_s", ".0f"),
    ("redis cpu µs", "redis_cpu_us", ".2f"),
    ("redis cmd µs", "redis_cmd_us", ".2f"),
    ("cmds", "commands", ".2f"),
    ("busiest", "busiest_share", ".2f"),
    ("own µs", "own_cpu_us", ".1f"),
    ("hash µs", "hash_us", ".0f"),
    ("p50 ms", "round_p50_ms", ".3f"),
    ("p99 ms", "round_p99_ms", ".3f"),
    ("failed", "failed", "d"),
)


def _line(window: Window) -> None:
    figures = window.figures()
    print("  ".join(f"{h}={_text(figures[k], f)}" for h, k, f in COLUMNS), flush=True)


def table(windows: Sequence[Window]) -> str:
    rows = [[_text(w.figures()[k], f) for _, k, f in COLUMNS] for w in windows]
    heads = [h for h, _, _ in COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def extrapolate(runs: Sequence[StoreRun], args: argparse.Namespace) -> list[str]:
    """The fleet's Redis cores and a sidecar's own share, from the measured costs per item
    (the medians over the offered rates)."""
    lines = []
    fleet_events = 2 * args.fleet_engines * args.prefill_tokens_s / BLOCK
    for run_ in runs:
        events = [w.figures() for w in run_.windows if w.kind == "events" and w.sound]
        if not events:
            continue
        per_event = statistics.median(f["redis_cpu_us"] for f in events)
        own_event = statistics.median(f["own_cpu_us"] for f in events)
        write_cores = fleet_events * args.owners * per_event / 1e6
        lines.append(
            f"{run_.store}: {fleet_events:,.0f} block events/s fleet-wide ({args.fleet_engines} "
            f"engines × {args.prefill_tokens_s:,.0f} prefill tokens/s ÷ {BLOCK}, stored and "
            f"removed) × {args.owners} owners × {per_event:.2f} µs = {write_cores:.2f} Redis "
            f"cores; an owner of one engine spends "
            f"{2 * args.prefill_tokens_s / BLOCK * own_event / 1e4:.1f} % of a core"
        )
        for tokens in args.prompt_tokens:
            queries = [
                w.figures()
                for w in run_.windows
                if w.kind == "queries" and w.prompt_tokens == tokens and w.sound
            ]
            if not queries:
                continue
            per_query = statistics.median(f["redis_cpu_us"] for f in queries)
            own_query = statistics.median(f["own_cpu_us"] for f in queries)
            busiest = statistics.median(f["busiest_share"] for f in queries)
            cores = args.fleet_queries * per_query / 1e6
            lines.append(
                f"{run_.store}, {tokens}-token prompts: {args.fleet_queries:,.0f} queries/s × "
                f"{per_query:.1f} µs = {cores:.2f} Redis cores (busiest master "
                f"{busiest:.2f} of it); a sidecar at {args.sidecar_queries:g} queries/s spends "
                f"{args.sidecar_queries * own_query / 1e4:.2f} % of a core"
            )
        lines.append(
            f"{run_.store}: {run_.bytes_per_block:.0f} bytes of Redis per block "
            f"({run_.blocks:,} block keys held); a store seen by a query after "
            f"{statistics.median(run_.visible_ms):.0f} ms (median of 5, max "
            f"{max(run_.visible_ms):.0f}; flush every {1000 * FLUSH_S:.0f} ms)"
        )
    for run_ in runs:
        for rate, rounds in run_.pings.items():
            lines.append(
                f"{run_.store}: a PING round to every master at {rate:g}/s (the floor): p50 "
                f"{percentile(rounds, 50):.3f} ms, p99 {percentile(rounds, 99):.3f} ms"
            )
        for port, per_s, cpu_us in run_.saturated:
            lines.append(
                f"{run_.store} :{port}: MGETs of a query's keys on one master under "
                f"redis-benchmark ({args.saturate_clients} connections): {per_s:,.0f}/s, "
                f"{cpu_us:.1f} µs of Redis CPU each"
            )
    single = {
        (w.kind, w.rate, w.prompt_tokens): w for r in runs if r.store == "redis" for w in r.windows
    }
    for run_ in runs:
        if run_.store != "cluster":
            continue
        for window in run_.windows:
            alone = single.get((window.kind, window.rate, window.prompt_tokens))
            if alone is None or not (alone.sound and window.sound):
                continue
            cpu_alone = sum(s.cpu_s for s in alone.servers) / max(1, alone.count)
            busiest = max(s.cpu_s for s in window.servers) / max(1, window.count)
            if cpu_alone:
                lines.append(
                    f"cluster {window.kind} {window.rate:g}/s"
                    + (f" {window.prompt_tokens} tokens" if window.prompt_tokens else "")
                    + f": the busiest master spends {busiest / cpu_alone:.2f}x the CPU of the "
                    "single server per item"
                )
    return lines


def owner_bytes_per_block(blocks: int, *, hash_bytes: int | None, seed: int = 1) -> float:
    """The bytes one owner keeps per block its engine holds (``tracemalloc``): ``blocks``
    stored in events of ``CHUNK`` (their token ids dropped once applied, as the engine's are),
    the engine's hashes 64-bit ints (``hash_bytes`` None) or bytes of that length. Its writes
    go nowhere: the owner's index has no room to queue them."""
    rng = random.Random(seed)
    index = SharedKVIndex("redis://127.0.0.9:1/0", pool="bench", secret=SECRET, max_pending=0)
    owner = EngineOwner(index, "127.0.0.1:9000", 0, max_blocks=blocks)
    tokens = tuple(rng.randrange(1, 150_000) for _ in range(CHUNK * BLOCK))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(0, blocks, CHUNK):
            hashes = tuple(
                rng.getrandbits(64) if hash_bytes is None else rng.randbytes(hash_bytes)
                for _ in range(CHUNK)
            )
            stored = BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BLOCK
            )
            owner.apply(EventBatch(seq=0, ts=0.0, events=(stored,)))
        return (tracemalloc.get_traced_memory()[0] - before) / len(owner)
    finally:
        tracemalloc.stop()


async def main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    runs: list[StoreRun] = []
    async with Launcher(prefix="pd-sidecar-bench-kv-shared-") as launcher:
        for name in args.stores:
            async with standalone(launcher) if name == "redis" else cluster() as store:
                runs.append(await measure(store, args, rng))
    print()
    print(table([w for r in runs for w in r.windows]))
    unsound = [w for r in runs for w in r.windows if not w.sound]
    if unsound:
        print(
            f"{len(unsound)} window(s) where over 1 % of the queries failed (this process fell "
            "behind, or Redis did): left out of the extrapolation"
        )
    print()
    for line in extrapolate(runs, args):
        print(line)
    for hash_bytes in (None, 32):
        per_block = owner_bytes_per_block(args.owner_blocks, hash_bytes=hash_bytes)
        print(
            f"an owner keeps {per_block:.0f} bytes per held block ({args.owner_blocks:,} blocks, "
            f"{'64-bit int' if hash_bytes is None else f'{hash_bytes}-byte'} engine hashes): "
            f"{per_block * MAX_BLOCKS / 2**20:.1f} MiB at MAX_BLOCKS ({MAX_BLOCKS:,})"
        )
    stalled = [w for r in runs for w in r.windows if w.kind == "events" and not w.count]
    return 1 if stalled else 0


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def _float_list(text: str) -> list[float]:
    return [float(part) for part in text.split(",")]


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench kv_shared", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--stores", type=lambda t: t.split(","), default=["redis", "cluster"])
    parser.add_argument("--event-rates", type=_float_list, default=[5000.0, 20000.0])
    parser.add_argument("--query-rates", type=_float_list, default=[200.0, 500.0])
    parser.add_argument("--prompt-tokens", type=_int_list, default=[8192, 16384])
    parser.add_argument("--stored-tokens", type=int, default=16384, help="per prefill")
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument(
        "--shards", type=int, default=SHARDS, help="shards of the keyspace (an MGET each)"
    )
    parser.add_argument("--capacity", type=int, default=8192, help="blocks per engine")
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--idle-s", type=float, default=1.0)
    parser.add_argument(
        "--timeout-ms", type=float, default=50.0, help="a query's budget (measured: its round)"
    )
    parser.add_argument(
        "--saturate-n", type=int, default=100_000, help="redis-benchmark MGETs per master (0: none)"
    )
    parser.add_argument("--saturate-clients", type=int, default=50)
    parser.add_argument("--fleet-engines", type=int, default=32)
    parser.add_argument(
        "--prefill-tokens-s", type=float, default=16000.0, help="per engine, for the extrapolation"
    )
    parser.add_argument("--owners", type=int, default=3, help="owners writing each engine")
    parser.add_argument("--fleet-queries", type=float, default=20000.0)
    parser.add_argument("--sidecar-queries", type=float, default=20.0)
    parser.add_argument(
        "--owner-blocks", type=int, default=MAX_BLOCKS, help="held blocks, for an owner's bytes"
    )
    parser.add_argument("--seed", type=int, default=1)
    add_quick(parser, "the standalone Redis, 2k events/s and 50 queries/s, 0.5 s windows")
    return parser


def main_cli(argv: list[str] | None = None) -> int:
    parser = main_parser()
    args = apply_quick(
        parser,
        parser.parse_args(argv),
        stores=["redis"],
        event_rates=[2000.0],
        query_rates=[50.0],
        window_s=0.5,
        idle_s=0.3,
        saturate_n=2000,
        owner_blocks=6400,
    )
    if unknown := set(args.stores) - {"redis", "cluster"}:
        parser.error(f"--stores: unknown {sorted(unknown)}; known: redis, cluster")
    return run(lambda: main(args))


if __name__ == "__main__":
    sys.exit(main_cli())
