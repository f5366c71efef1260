"""Shared state at fleet scale: what N sidecars' reservations cost Redis, per decision and per pod.

Plays N sidecars — N instances of the production Redis backend (``RedisState``), all in this one
process, each with its own connections — against a real ``redis-server`` and a Redis Cluster of
3 masters (each with a replica) on loopback. Each cell (store × N × offered rate) runs two
windows on keys of its own:

- **idle**: N sidecars and no decision: what their heartbeats cost, which grows with N;
- **load**: decisions offered at a fixed fleet-wide rate, evenly spaced, each through a sidecar
  chosen at random, as the scheduler makes them: ``refresh`` (the request path's one round trip,
  under the production budget ``SIDECAR_STATE_TIMEOUT_MS``, 5 ms), a reservation on the least
  loaded of ``--endpoints`` prefill endpoints as the view shows them, and its release after a
  prefill's time (``--hold-ms``).

Redis's side is read from the servers, per master, over each window: ``INFO commandstats`` (the
sync script's calls and Redis's own µs per call) and ``INFO cpu`` (the server process's CPU,
networking included), and ``SLOWLOG`` for the commands over 1 ms. Then the re-sum of every
sidecar's table, which the script runs once per lease, is forced once and timed the same way.

Two cores cannot offer 20,000 decisions a second from Python; the figures that scale are the
servers' costs per call and per decision, measured at two or more offered rates, and the limit
is extrapolated from them: decisions a second per Redis core = 10⁶ ÷ (Redis CPU µs per decision),
less what the idle heartbeats of N sidecars take. The decision's wait is measured in this busy
process, so it is an upper bound of a sidecar's.

With ``--scrapes`` it plays the shared prefill scrapes instead (``SIDECAR_SHARED_SCRAPES``):
N production ``ScrapeShare``s on those backends, each running its scrape round once per
scrape interval (``--scrape-interval``, 1 s) at its own phase, the scrapes themselves stood in
for (nothing listens at the endpoints); it reports how many sidecars scraped each endpoint a
second (the engines' fan-out),
what the reads and publications cost Redis (``INFO commandstats``: ``MGET``, ``ZRANGEBYSCORE``,
``SET``) and what one sidecar's part costs this process.

With ``--reservations sharded`` it plays the sharded reservations instead
(``sidecar.scheduling.state.sharded``): N production ``ShardedReservations`` on one production
client per store (a sidecar has its own; the servers' cost per call is the same), each holding
``SHARDED_LINES`` reservations over ``--endpoints``; per cell (store × N × rate) an idle window,
then syncs alone at the offered rate (a sidecar chosen at random releases one reservation, makes
another and syncs), reads alone at that rate (every shard's totals; with ``--read-groups`` g,
each sidecar has read once before, and a read fetches one group), and a ``GET`` of one key at
that rate (the floor: what any round trip costs the servers here). Redis's side per master as
above (``EVALSHA`` and ``MGET`` in ``INFO commandstats``, ``INFO cpu`` less the idle window's,
``SLOWLOG``). At the first rate, every sidecar's table grown to every endpoint, a shard started
anew (its sums deleted by hand) and then every sidecar lapsed and dropped, a bounded number per
sync, each timed. The extrapolation: 1,000 pods each syncing and reading every 100 ms, Redis
cores = 10,000 × (CPU µs per sync + per read) ÷ 10⁶; per master, the busiest one's.

With ``--reservations counter-state`` the N sidecars run the production backend of
``SIDECAR_STATE_RESERVATIONS=counters`` (``CounterState``) in the same windows: the idle one
measures its heartbeats (the sync script with an empty table, the rolling upgrade's check), the
load one its decisions (``refresh`` reading the counters, the reservation's write, its release
carried by a later read); there is no re-sum to time.

With ``--reservations counters`` it plays the per-endpoint counters by epoch instead
(``sidecar.scheduling.state.counters``): N production ``CounterReservations`` on one production
client per store, each with its clock's offset learnt from Redis before the windows; per cell
(store × N × rate) an idle window, then decisions at the offered rate, each through a sidecar
chosen at random: its read of every endpoint's current and previous epoch (the decision's wait),
a reservation on the least loaded endpoint, and its release after ``--hold-ms`` (off the
decision's path); then a ``GET`` of one key at that rate (the floor). Redis's side per master
(``MGET``, ``INCRBY``, ``PEXPIREAT``, ``TIME`` in ``INFO commandstats``, ``INFO cpu`` less the
idle window's, ``SLOWLOG``). The extrapolation: Redis cores at 20,000 decisions a second =
20,000 × (CPU µs per decision) ÷ 10⁶; per master, the busiest one's. ``--counter-groups 3``
puts the keys under 3 hash tags (one per master) rather than one per endpoint.

    python -m bench fleet                       # N = 8 ... 4,096; 100 and 300 decisions/s
    python -m bench fleet --json fleet.json     # the figures as JSON too
    python -m bench fleet --scrapes             # the shared scrapes, N = 8 ... 1,024
    python -m bench fleet --reservations sharded --rates 300,1000   # syncs (and reads) a second
    python -m bench fleet --reservations counters --rates 500,1000  # decisions a second
    python -m bench fleet --reservations counter-state --sidecars 8,64,256,1024
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import random
import resource
import shutil
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis

from bench.cluster import run
from bench.readings import own_cpu_s
from bench.suite import add_quick, apply_quick
from devkit.processes import Launcher, free_port, tcp_open
from devkit.rediscluster import RedisCluster
from devkit.stats import percentile
from sidecar.engines.shared_scrapes import ScrapeShare
from sidecar.fleet.load import EngineLoad
from sidecar.fleet.snapshot import EngineSnapshot
from sidecar.scheduling.state import Load, Reservation, counters, sharded
from sidecar.scheduling.state.counter_state import CounterState
from sidecar.scheduling.state.protocol import keys
from sidecar.scheduling.state.redis import RedisState

LEASE_S = 10.0
"""``SIDECAR_STATE_LEASE_S``' default: a sidecar heartbeats three times per lease."""
TIMEOUT_S = 0.005
"""``SIDECAR_STATE_TIMEOUT_MS``' default: the longest a decision waits for Redis."""
SLOW_US = 1000
"""Commands over this many µs are kept in the slow log and reported."""
PROMPT_TOKENS = 8192
"""Tokens each reservation counts (an 8k-token prompt)."""
BLOCK_TOKENS = 64
"""The prefill prefix index's block (``SIDECAR_PREFIX_BLOCK_TOKENS``' default): a placement
shares one 8-byte digest per block of its prompt."""
OBSERVERS = 16
"""Sidecars whose learning is followed (following all 4,096 would cost this process more than
the fleet does)."""
SETTLED_S = 1.0
"""A placement counts as one the fleet should know once it is this old."""
RESUM_LINES = 4
"""Reservations each sidecar holds when the re-sum is timed (prefills in flight on 4 endpoints)."""
PROBE_FIGURES = (
    "decisions",
    "wait_p50_ms",
    "wait_p99_ms",
    "wait_max_ms",
    "cpu_us_per_decision",
    "cpu_share",
)
"""What ``bench.fleet_probe`` reports (``--probe``)."""
STARTS_AT_ONCE = 64
"""Sidecars started (or stopped) together: each registers with a sync of its own at once."""


@dataclass(frozen=True, slots=True)
class ServerCost:
    """One server's (a master's) side of a window."""

    port: int
    script_calls: int
    script_usec_per_call: float
    cpu_s: float
    slowest_ms: float | None
    """The longest command over ``SLOW_US``, or None: none was."""
    net_in: int = 0
    net_out: int = 0
    """Bytes the server read and wrote (``INFO stats``)."""


@dataclass(slots=True)
class Window:
    seconds: float
    """From its start until its last release (the costs' span)."""
    decisions: int
    servers: list[ServerCost]
    waits_ms: list[float] = field(default_factory=list, repr=False)
    learnt_share: float | None = None
    """Of the others' placements published at least ``SETTLED_S`` before the window ended, the
    share the observing sidecars had learnt by its end (None: the prefix share was off)."""
    learnt_age_ms: list[float] = field(default_factory=list, repr=False)
    """How old each placement was when an observer learnt it."""
    offered_s: float = 0.0
    """From its start until its last decision began (the rate's span)."""
    driver_cpu_s: float = 0.0
    """This process's CPU over the window: near ``seconds``, it could not play the fleet on
    time (heartbeats and syncs late, waits inflated)."""
    over_budget: int = 0
    """Decisions whose refresh had no answer within ``TIMEOUT_S`` (they decide on the local
    view)."""
    probe: dict[str, Any] | None = None
    """``bench.fleet_probe``'s figures (``--probe``): one sidecar's decisions in a process of
    its own, beside this window's load."""

    @property
    def script_calls(self) -> int:
        return sum(server.script_calls for server in self.servers)

    @property
    def cpu_s(self) -> float:
        return sum(server.cpu_s for server in self.servers)

    @property
    def net_bytes(self) -> int:
        return sum(server.net_in + server.net_out for server in self.servers)

    @property
    def usec_per_call(self) -> float:
        calls = self.script_calls
        spent = sum(s.script_calls * s.script_usec_per_call for s in self.servers)
        return spent / calls if calls else 0.0

    @property
    def busiest_cpu_s(self) -> float:
        return max(server.cpu_s for server in self.servers)

    @property
    def slowest_ms(self) -> float | None:
        slow = [s.slowest_ms for s in self.servers if s.slowest_ms is not None]
        return max(slow) if slow else None


@dataclass(frozen=True, slots=True)
class Cell:
    store: str
    sidecars: int
    offered_per_s: float
    idle: Window
    load: Window
    resum_ms: float | None
    """The forced re-sum of every table: the longest command then (None: under ``SLOW_US``)."""

    def figures(self) -> dict[str, Any]:
        """What the report and the JSON show."""
        idle, load = self.idle, self.load
        idle_cpu_per_s = idle.cpu_s / idle.seconds
        decision_cpu_s = max(0.0, load.cpu_s - idle_cpu_per_s * load.seconds)
        per_decision_us = 1e6 * decision_cpu_s / load.decisions if load.decisions else None
        return {
            "store": self.store,
            "sidecars": self.sidecars,
            "offered_per_s": self.offered_per_s,
            "achieved_per_s": load.decisions / load.offered_s if load.offered_s else None,
            "script_calls_per_decision": (
                (load.script_calls - idle.script_calls / idle.seconds * load.seconds)
                / load.decisions
                if load.decisions
                else None
            ),
            "script_usec_per_call": load.usec_per_call,
            "redis_cpu_us_per_decision": per_decision_us,
            "decisions_per_redis_core": 1e6 / per_decision_us if per_decision_us else None,
            "idle_syncs_per_sidecar_s": idle.script_calls / idle.seconds / self.sidecars,
            "idle_redis_cpu_per_s": idle_cpu_per_s,
            "busiest_master_share": load.busiest_cpu_s / load.cpu_s if load.cpu_s else None,
            "busiest_master_cpu_per_s": load.busiest_cpu_s / load.seconds,
            "wait_p50_ms": _percentile(load.waits_ms, 50),
            "wait_p99_ms": _percentile(load.waits_ms, 99),
            "over_budget": load.over_budget / load.decisions if load.decisions else None,
            "net_bytes_per_decision": (
                (load.net_bytes - idle.net_bytes / idle.seconds * load.seconds) / load.decisions
                if load.decisions
                else None
            ),
            "learnt_share": load.learnt_share,
            "learnt_age_p50_ms": _percentile(load.learnt_age_ms, 50),
            "driver_busy": load.driver_cpu_s / load.seconds,
            "slowest_command_ms": load.slowest_ms,
            "resum_ms": self.resum_ms,
            **{f"probe_{name}": (load.probe or {}).get(name) for name in PROBE_FIGURES},
        }


def _percentile(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) if values else None


# --- the stores ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Store:
    name: str
    url: str
    """What the sidecars connect to."""
    masters: tuple[int, ...]
    """The ports whose costs are read (every master)."""
    cluster: bool


@asynccontextmanager
async def standalone(launcher: Launcher) -> AsyncIterator[Store]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    argv = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--maxclients", "10000",
    ]  # fmt: skip
    child = await launcher.start(
        "redis", argv, ready=lambda: tcp_open("127.0.0.1", port), timeout_s=10
    )
    try:
        yield Store("redis", f"redis://127.0.0.1:{port}/0", (port,), cluster=False)
    finally:
        await child.stop()


@asynccontextmanager
async def cluster() -> AsyncIterator[Store]:
    nodes = RedisCluster(3)
    try:
        await nodes.start()
        masters = tuple(
            n["port"] for n in await nodes.nodes(nodes.ports[0]) if "master" in n["flags"]
        )
        for port in nodes.ports:
            await nodes.command(port, "CONFIG", "SET", "maxclients", "10000")
        yield Store("cluster", nodes.url(masters[0]), masters, cluster=True)
    finally:
        await nodes.stop()


async def _stores(names: Sequence[str]) -> AsyncIterator[Store]:
    """Each store named (``redis``, ``cluster``) started in turn, and stopped after its turn."""
    async with Launcher(prefix="pd-sidecar-bench-fleet-") as launcher:
        for name in names:
            async with standalone(launcher) if name == "redis" else cluster() as store:
                yield store


async def server_info(port: int, section: str) -> dict[str, Any]:
    """``INFO section`` of the Redis at ``port`` on loopback."""
    client = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    try:
        info: dict[str, Any] = await client.info(section)
        return info
    finally:
        await client.aclose()


async def _command(port: int, *args: Any) -> Any:
    client = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    try:
        return await client.execute_command(*args)  # type: ignore[no-untyped-call]
    finally:
        await client.aclose()


async def server_cpu_s(port: int) -> float:
    """The CPU seconds the Redis at ``port`` has spent (user and system)."""
    cpu = await server_info(port, "cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


async def _net(port: int) -> tuple[int, int]:
    stats = await server_info(port, "stats")
    return int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])


Readings = dict[int, tuple[float, int, int]]
"""Per master: its CPU seconds, bytes read and bytes written so far."""


async def _reset(store: Store) -> Readings:
    """Zero every master's command stats and slow log; their CPU and network readings now."""
    readings = {}
    for port in store.masters:
        await _command(port, "CONFIG", "SET", "slowlog-log-slower-than", str(SLOW_US))
        await _command(port, "SLOWLOG", "RESET")
        readings[port] = (await server_cpu_s(port), 0, 0)
        await _command(port, "CONFIG", "RESETSTAT")  # the network totals too
    return readings


async def _costs(store: Store, before: Readings) -> list[ServerCost]:
    costs = []
    for port in store.masters:
        cpu_before, _, _ = before[port]
        net_in, net_out = await _net(port)
        stats = (await server_info(port, "commandstats")).get("cmdstat_evalsha", {})
        slow = await _command(port, "SLOWLOG", "GET", "128")
        slowest = max((int(entry[2]) for entry in slow), default=None)
        costs.append(
            ServerCost(
                port,
                int(stats.get("calls", 0)),
                float(stats.get("usec_per_call", 0.0)),
                await server_cpu_s(port) - cpu_before,
                None if slowest is None else slowest / 1000,
                net_in,
                net_out,
            )
        )
    return costs


# --- the fleet -----------------------------------------------------------------------------------


class Fleet:
    """N production Redis backends in one pool (``prefix``), as N sidecars would run them."""

    def __init__(
        self,
        store: Store,
        sidecars: int,
        prefix: str,
        endpoints: int,
        *,
        share: bool,
        counters: bool = False,
    ) -> None:
        """``share``: the prefix share on (as with ``SIDECAR_PREFIX_HASH_KEY`` set): every
        decision publishes its placement, every sidecar learns the others'. ``counters``: the
        backend of ``SIDECAR_STATE_RESERVATIONS=counters`` (``CounterState``)."""
        kind = CounterState if counters else RedisState
        self.counters = counters
        self.store = store
        self.share = share
        self.prefix = prefix
        self.endpoints = [f"127.0.1.{i}:8000" for i in range(endpoints)]
        """Names only: nothing connects to them."""
        self.timeouts = 0
        """Refreshes that had no answer within the budget, all sidecars together."""
        self.members = [
            kind(
                store.url,
                prefix=prefix,
                cluster=store.cluster,
                lease_s=LEASE_S,
                timeout_s=TIMEOUT_S,
                on_error=self._count,
            )
            for _ in range(sidecars)
        ]
        self.published: dict[bytes, tuple[int, float]] = {}
        """Each placement (by its first digest): who published it, and when."""
        self.learnt: list[dict[bytes, float]] = [{} for _ in range(min(OBSERVERS, sidecars))]
        """What each observer (the first sidecars) learnt of the others', and when."""
        if share:
            for index, member in enumerate(self.members):
                member.share_prefixes(self._learner(index))

    def _learner(self, index: int) -> Callable[[str, Sequence[bytes]], None]:
        if index >= len(self.learnt):
            return lambda endpoint, hashes: None
        learnt = self.learnt[index]

        def learn(endpoint: str, hashes: Sequence[bytes]) -> None:
            if hashes:
                learnt.setdefault(hashes[0], time.monotonic())

        return learn

    async def synced(
        self, members: Sequence[RedisState] | None = None, *, within_s: float = 60.0
    ) -> None:
        """Return once each of ``members`` (all) has had a sync answered since the call."""
        since = time.time()
        waiting = list(self.members if members is None else members)
        async with asyncio.timeout(within_s):
            # The syncs run in each backend's worker task: there is no event to await.
            while waiting := [m for m in waiting if (m.last_sync_unix or 0.0) <= since]:  # noqa: ASYNC110
                await asyncio.sleep(0.02)

    def learnt_share(self, since: float, until: float) -> tuple[float, list[float]]:
        """Of the placements published between ``since`` and ``until`` by others, the share the
        observers had learnt; and how old each was when learnt."""
        shares, ages = [], []
        for observer, learnt in enumerate(self.learnt):
            theirs = [
                (key, at)
                for key, (owner, at) in self.published.items()
                if owner != observer and since <= at <= until
            ]
            known = [(learnt[key] - at) * 1000 for key, at in theirs if key in learnt]
            shares.append(len(known) / len(theirs) if theirs else 1.0)
            ages.extend(known)
        return statistics.fmean(shares), ages

    def _count(self, kind: str) -> None:
        if kind == "timeout":
            self.timeouts += 1

    async def start(self) -> None:
        """Start the sidecars a batch at a time, each batch once the last has registered (its
        first syncs answered): a thousand cluster clients reading the slots at once are
        refused."""
        for batch in _batches(self.members):
            await asyncio.gather(*(member.start() for member in batch))
            await self.synced(batch)

    async def close(self) -> None:
        for batch in _batches(self.members):
            await asyncio.gather(*(member.close() for member in batch))

    async def decide(self, rng: random.Random, hold_s: float, window: Window) -> None:
        """One decision through a sidecar chosen at random, as the scheduler makes it."""
        index = rng.randrange(len(self.members))
        member = self.members[index]
        began = time.perf_counter()
        await member.refresh(self.endpoints)
        window.waits_ms.append((time.perf_counter() - began) * 1000)
        loads = member.view().loads
        least = min(loads.get(e, Load()).tokens for e in self.endpoints)
        chosen = rng.choice([e for e in self.endpoints if loads.get(e, Load()).tokens == least])
        held: Reservation = member.reserve(chosen, PROMPT_TOKENS)
        if self.share:
            hashes = [rng.randbytes(8) for _ in range(PROMPT_TOKENS // BLOCK_TOKENS)]
            self.published[hashes[0]] = (index, time.monotonic())
            member.publish_prefix(chosen, hashes)
        await asyncio.sleep(hold_s)
        member.release(held)


def _batches(items: list[RedisState]) -> list[list[RedisState]]:
    return [items[i : i + STARTS_AT_ONCE] for i in range(0, len(items), STARTS_AT_ONCE)]


async def idle_window(fleet: Fleet, seconds: float) -> Window:
    before = await _reset(fleet.store)
    began = time.monotonic()
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - began
    return Window(elapsed, 0, await _costs(fleet.store, before))


async def start_probe(fleet: Fleet, rate: float, seconds: float) -> asyncio.subprocess.Process:
    """``bench.fleet_probe`` in a process of its own: one more sidecar of the fleet's kind, on
    its pool, deciding at ``rate`` for ``seconds`` once started (its start not measured)."""
    command = [
        sys.executable, "-m", "bench.fleet_probe", "--url", fleet.store.url,
        "--prefix", fleet.prefix, "--endpoints", str(len(fleet.endpoints)),
        "--rate", repr(rate), "--seconds", repr(seconds),
    ]  # fmt: skip
    if fleet.store.cluster:
        command.append("--cluster")
    if fleet.counters:
        command.append("--counters")
    return await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)


async def probe_result(process: asyncio.subprocess.Process) -> dict[str, Any] | None:
    output, _ = await process.communicate()
    if process.returncode != 0 or not output.strip():
        print(f"warning: the probe failed (exit status {process.returncode})", file=sys.stderr)
        return None
    result: dict[str, Any] = orjson.loads(output.splitlines()[-1])
    return result


async def load_window(
    fleet: Fleet,
    rate: float,
    seconds: float,
    hold_s: float,
    rng: random.Random,
    probe_rate: float | None = None,
) -> Window:
    prober = None if probe_rate is None else await start_probe(fleet, probe_rate, seconds)
    before = await _reset(fleet.store)
    timeouts = fleet.timeouts
    cpu = own_cpu_s()
    window = Window(0.0, 0, [])
    loop = asyncio.get_running_loop()
    began = loop.time()
    began_at = time.monotonic()  # the clock the placements are stamped with
    decisions: set[asyncio.Task[None]] = set()
    for i in range(int(rate * seconds)):
        due = began + i / rate
        if (wait := due - loop.time()) > 0:
            await asyncio.sleep(wait)
        task = asyncio.create_task(fleet.decide(rng, hold_s, window))
        decisions.add(task)
        task.add_done_callback(decisions.discard)
    window.offered_s = loop.time() - began + 1 / rate
    await asyncio.gather(*decisions)
    if fleet.share:
        # What the observers learn of placements at least SETTLED_S old, as the window ends.
        window.learnt_share, window.learnt_age_ms = fleet.learnt_share(
            began_at, time.monotonic() - SETTLED_S
        )
    window.seconds = loop.time() - began
    window.decisions = len(window.waits_ms)
    window.over_budget = fleet.timeouts - timeouts
    window.driver_cpu_s = own_cpu_s() - cpu
    window.servers = await _costs(fleet.store, before)
    if prober is not None:
        window.probe = await probe_result(prober)
    return window


async def resum(fleet: Fleet) -> float | None:
    """Force a sync to re-sum every table (the script does once per lease), with every sidecar
    holding ``RESUM_LINES`` reservations as a busy fleet does, and time it."""
    held = [
        member.reserve(endpoint, PROMPT_TOKENS)
        for member in fleet.members
        for endpoint in fleet.endpoints[:RESUM_LINES]
    ]
    await fleet.synced(within_s=300)  # thousands of syncs from this one process
    await _reset(fleet.store)
    totals = keys(fleet.prefix)[4]
    client: Any = (
        aioredis.RedisCluster.from_url(fleet.store.url)
        if fleet.store.cluster
        else aioredis.Redis.from_url(fleet.store.url)
    )
    try:
        await client.hdel(totals, "#built")
    finally:
        await client.aclose()
    member = fleet.members[0]
    member.publish_ejection(fleet.endpoints[-1], 0.0)  # wakes its worker: a sync, which re-sums
    await fleet.synced([member])
    costs = await _costs(fleet.store, {port: (0.0, 0, 0) for port in fleet.store.masters})
    for reservation, owner in zip(held, _owners(fleet, len(held)), strict=True):
        owner.release(reservation)
    slow = [c.slowest_ms for c in costs if c.slowest_ms is not None]
    return max(slow) if slow else None


def _owners(fleet: Fleet, count: int) -> list[RedisState]:
    return [member for member in fleet.members for _ in range(RESUM_LINES)][:count]


async def measure_cell(
    store: Store, sidecars: int, rate: float, args: argparse.Namespace, rng: random.Random
) -> Cell:
    prefix = f"fleet-{store.name}-{sidecars}-{rate:g}"
    counters = args.reservations == "counter-state"
    fleet = Fleet(
        store, sidecars, prefix, args.endpoints, share=args.prefix_share, counters=counters
    )
    await fleet.start()
    try:
        idle = await idle_window(fleet, args.idle_s)
        load = await load_window(
            fleet, rate, args.load_s, args.hold_ms / 1000, rng, probe_rate=args.probe
        )
        # The re-sum does not depend on the rate: timed at the first one only (the counters'
        # tables are empty: there is nothing to re-sum).
        first = rate == args.rates[0]
        resum_ms = await resum(fleet) if first and not counters else None
    finally:
        await fleet.close()
    return Cell(store.name, sidecars, rate, idle, load, resum_ms)


# --- the shared scrapes -------------------------------------------------------------------------

SCRAPE_S = 1.0
"""``SIDECAR_SCRAPE_INTERVAL_S``' default (``--scrape-interval``)."""
SCRAPE_COMMANDS = ("mget", "zrangebyscore", "set")
"""What the shared scrapes send: the round's read, the member list with it, the publications."""
SETTLE_MAX_S = 180.0
"""The longest the unmeasured rounds go on waiting for this process to keep time."""
FOUND = EngineSnapshot(
    load=EngineLoad(waiting=2.0, running=6.0, kv_usage=0.4, at=0.0, cache_tokens=1_048_576),
    at=0.0,
)
"""What every stood-in scrape finds."""


@dataclass(frozen=True, slots=True)
class ScrapeCell:
    store: str
    sidecars: int
    turns: int
    """Rounds each sidecar ran."""
    interval_s: float
    """The scrape interval: each sidecar's round came once per interval."""
    seconds: float
    scrapes: dict[str, int]
    """Scrapes of each endpoint over the window, every sidecar's."""
    commands: dict[str, tuple[int, float]]
    """The scrape commands' calls and Redis µs over the window, every master's."""
    redis_cpu_s: float
    """Every master's CPU over the window, the backends' heartbeats included."""
    driver_cpu_s: float
    """This process's CPU over the window (every backend's and share's)."""
    first_round_ms: float
    """CPU of one sidecar's first round: the member list read and every endpoint ranked."""

    def figures(self) -> dict[str, Any]:
        # Each sidecar ran ``turns`` rounds, one per interval: the fleet's steady state over
        # ``turns`` intervals (the window itself ends with the last sidecar's round).
        steady_s = self.turns * self.interval_s
        per_endpoint = [count / steady_s for count in self.scrapes.values()]
        calls = sum(calls for calls, _ in self.commands.values())
        usec = sum(spent for _, spent in self.commands.values())
        rounds = self.sidecars * self.turns
        return {
            "store": self.store,
            "sidecars": self.sidecars,
            "scrapes_per_endpoint_s": statistics.fmean(per_endpoint) if per_endpoint else 0.0,
            "busiest_endpoint_s": max(per_endpoint, default=0.0),
            "commands_per_round": calls / rounds,
            "redis_usec_per_round": usec / rounds,
            "redis_usec_per_s": usec / steady_s,
            "redis_cpu_per_s": self.redis_cpu_s / self.seconds,
            "sidecar_cpu_share": self.driver_cpu_s / steady_s / self.sidecars,
            "first_round_ms": self.first_round_ms,
        }


SCRAPE_COLUMNS = (
    ("store", "store", "{}"),
    ("sidecars", "N", "{}"),
    ("scrapes_per_endpoint_s", "scrapes/endpoint/s", "{:.2f}"),
    ("busiest_endpoint_s", "busiest", "{:.2f}"),
    ("commands_per_round", "cmds/round", "{:.2f}"),
    ("redis_usec_per_round", "µs/round", "{:.1f}"),
    ("redis_usec_per_s", "scrape µs/s", "{:.0f}"),
    ("redis_cpu_per_s", "redis cpu", "{:.3f}"),
    ("sidecar_cpu_share", "per sidecar", "{:.2%}"),
    ("first_round_ms", "1st round ms", "{:.1f}"),
)


async def _scrape_round(
    share: ScrapeShare, endpoints: Sequence[str], scraped: collections.Counter[str]
) -> None:
    """One sidecar's scrape round, as the engine monitor runs it, the scrapes stood in for."""
    now, wall = time.monotonic(), time.time()
    await share.read(endpoints, now=now, wall=wall)
    for endpoint in endpoints:
        if share.scrapes(endpoint, wall=wall):
            share.found(endpoint, FOUND, wall=wall)
            scraped[endpoint] += 1
        else:
            share.take(endpoint, now=now, wall=wall)
    await share.publish(now=now)


async def _phased_rounds(
    shares: Sequence[ScrapeShare],
    endpoints: Sequence[str],
    turns: int,
    scraped: collections.Counter[str],
    interval_s: float,
) -> float:
    """``turns`` scrape rounds of every share, each at its own phase of the interval; the
    seconds they took."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    rounds: set[asyncio.Task[None]] = set()
    for turn in range(turns):
        for index, share in enumerate(shares):
            due = began + (turn + index / len(shares)) * interval_s
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            task = asyncio.create_task(_scrape_round(share, endpoints, scraped))
            rounds.add(task)
            task.add_done_callback(rounds.discard)
    await asyncio.gather(*rounds)
    return loop.time() - began


async def _command_stats(store: Store) -> dict[str, tuple[int, float]]:
    totals: dict[str, tuple[int, float]] = {}
    for port in store.masters:
        stats = await server_info(port, "commandstats")
        for name in SCRAPE_COMMANDS:
            entry = stats.get(f"cmdstat_{name}", {})
            calls, usec = totals.get(name, (0, 0.0))
            totals[name] = (calls + int(entry.get("calls", 0)), usec + float(entry.get("usec", 0)))
    return totals


async def scrape_cell(store: Store, sidecars: int, args: argparse.Namespace) -> ScrapeCell:
    fleet = Fleet(store, sidecars, f"scrapes-{store.name}-{sidecars}", args.endpoints, share=False)
    await fleet.start()
    try:
        shares = [
            ScrapeShare(
                member,
                per_endpoint=args.per_endpoint,
                interval_s=args.scrape_interval,
                members_every_s=LEASE_S,
                timeout_s=1.0,
            )
            for member in fleet.members
        ]
        # The first rounds, one after another: each reads the members and ranks every
        # endpoint; whoever finds an endpoint unpublished scrapes it.
        cpu = own_cpu_s()
        for share in shares:
            await _scrape_round(share, fleet.endpoints, collections.Counter())
        first_round_ms = (own_cpu_s() - cpu) * 1000 / sidecars
        # Rounds of each at its own phase, unmeasured, until the first lease is over and this
        # process keeps time: a share reads the member list every round in its first lease
        # (the fleet registering, each new list ranked again), once a lease after; and the
        # first rounds' publications, seconds old, are scraped again.
        loop = asyncio.get_running_loop()
        settled, give_up = loop.time() + LEASE_S, loop.time() + SETTLE_MAX_S
        while True:
            took = await _phased_rounds(
                shares, fleet.endpoints, 1, collections.Counter(), args.scrape_interval
            )
            if loop.time() >= settled and took <= 1.5 * args.scrape_interval:
                break
            if loop.time() >= give_up:
                print(f"N {sidecars}: this process did not keep time; measured anyway")
                break
        before = await _reset(store)
        cpu = own_cpu_s()
        scraped: collections.Counter[str] = collections.Counter()
        seconds = await _phased_rounds(
            shares, fleet.endpoints, args.rounds, scraped, args.scrape_interval
        )
        driver_cpu_s = own_cpu_s() - cpu
        commands = await _command_stats(store)
        redis_cpu_s = sum([await server_cpu_s(port) - before[port][0] for port in store.masters])
    finally:
        await fleet.close()
    return ScrapeCell(
        store.name,
        sidecars,
        args.rounds,
        args.scrape_interval,
        seconds,
        {endpoint: scraped[endpoint] for endpoint in fleet.endpoints},
        commands,
        redis_cpu_s,
        driver_cpu_s,
        first_round_ms,
    )


async def scrapes_main(args: argparse.Namespace) -> int:
    cells: list[ScrapeCell] = []
    async for store in _stores(args.stores):
        for sidecars in args.sidecars:
            cell = await scrape_cell(store, sidecars, args)
            cells.append(cell)
            print(_table([cell.figures()], SCRAPE_COLUMNS).splitlines()[-1], flush=True)
    print()
    print(_table([cell.figures() for cell in cells], SCRAPE_COLUMNS))
    if args.json is not None:
        args.json.write_bytes(
            orjson.dumps([cell.figures() for cell in cells], option=orjson.OPT_INDENT_2)
        )
    bound = args.per_endpoint + 1
    over = [c for c in cells if c.figures()["busiest_endpoint_s"] > bound / c.interval_s]
    for cell in over:
        print(
            f"error: {cell.store} N {cell.sidecars}: an endpoint was scraped more than "
            f"{bound} times a second",
            file=sys.stderr,
        )
    return 1 if over else 0


# --- the sharded reservations --------------------------------------------------------------------

SHARDED_LINES = 6
"""Reservations each sidecar holds in the measured windows (20 requests a second, each held
about 0.3 s); every sync replaces one of them."""
SHARDED_LEASE_S = 600.0
"""The sidecars' lease in the measured windows: each syncs about every N / rate seconds there,
and none may lapse (the expiry is measured on its own)."""
SHARDED_COMMANDS = ("evalsha", "mget", "get")
SHARDED_BATCH = 64
"""Sidecars registering (or refilling their tables) at once (within redis-py's 100 connections)."""
TARGET_PODS = 1000
TARGET_PERIOD_S = 0.1
"""The extrapolation: 1,000 pods, each syncing and reading once per 100 ms."""


@dataclass(frozen=True, slots=True)
class MasterReading:
    """One master over one window: its CPU, the commands' calls and µs, the slowest command."""

    port: int
    cpu_s: float
    commands: dict[str, tuple[int, float]]
    slowest_ms: float | None
    slowest: str = ""
    """The slowest command's name (``SLOWLOG``), if one was over ``SLOW_US``."""
    preempted: int = 0
    """Times the kernel took the CPU from the server during the window
    (``nonvoluntary_ctxt_switches``): a command's wall time, which ``SLOWLOG`` reports,
    includes them."""


@dataclass(frozen=True, slots=True)
class ShardedWindow:
    seconds: float
    count: int
    """Syncs or reads done (each a call of the production class)."""
    masters: list[MasterReading]
    failed: int = 0

    def calls(self, command: str) -> int:
        return sum(m.commands.get(command, (0, 0.0))[0] for m in self.masters)

    def usec_per_call(self, command: str) -> float | None:
        calls = self.calls(command)
        usec = sum(m.commands.get(command, (0, 0.0))[1] for m in self.masters)
        return usec / calls if calls else None

    @property
    def slowest_ms(self) -> float | None:
        slow = [m.slowest_ms for m in self.masters if m.slowest_ms is not None]
        return max(slow) if slow else None

    def cpu_us(self, idle: ShardedWindow) -> dict[int, float]:
        """Each master's CPU µs per operation of this window, less what it spends idle (as
        ``idle``, a window without operations, measured)."""
        rest = {m.port: m.cpu_s / idle.seconds for m in idle.masters}
        return {
            m.port: 1e6 * max(0.0, m.cpu_s - rest[m.port] * self.seconds) / self.count
            for m in self.masters
        }


@dataclass(frozen=True, slots=True)
class ShardedCell:
    store: str
    sidecars: int
    offered_per_s: float
    idle: ShardedWindow
    writes: ShardedWindow
    """Syncs alone at the offered rate."""
    reads: ShardedWindow
    """Reads alone at the offered rate."""
    floor: ShardedWindow
    """A ``GET`` of one key at the offered rate: what a round trip costs the servers on this
    machine now, whatever the command (the syncs' and reads' share of it is no design's)."""
    expiry: ShardedWindow | None = None
    """Every sidecar lapsed, its row 32 lines long, and dropped by syncs (``EXPIRE_PER_SYNC`` a
    call): measured at the first rate only."""
    reset_ms: float | None = None
    """A shard started anew (its tables deleted), the call's µs in ms."""

    def figures(self) -> dict[str, Any]:
        writes, reads = self.writes.cpu_us(self.idle), self.reads.cpu_us(self.idle)
        pair = {port: writes[port] + reads[port] for port in writes}
        slow = [w.slowest_ms for w in (self.writes, self.reads) if w.slowest_ms is not None]
        per_pod_s = TARGET_PODS / TARGET_PERIOD_S
        expiry = self.expiry
        return {
            "store": self.store,
            "sidecars": self.sidecars,
            "offered_per_s": self.offered_per_s,
            "syncs_per_s": self.writes.count / self.writes.seconds,
            "reads_per_s": self.reads.count / self.reads.seconds,
            "failed": self.writes.failed + self.reads.failed,
            "script_usec_per_call": self.writes.usec_per_call("evalsha"),
            "mget_calls_per_read": self.reads.calls("mget") / self.reads.count,
            "mget_usec_per_call": self.reads.usec_per_call("mget"),
            "cpu_us_per_sync": sum(writes.values()),
            "cpu_us_per_read": sum(reads.values()),
            "floor_cpu_us_per_call": sum(self.floor.cpu_us(self.idle).values()),
            "busiest_cpu_us_per_pair": max(pair.values()),
            "busiest_master_share": max(pair.values()) / sum(pair.values())
            if sum(pair.values())
            else None,
            "target_cores": per_pod_s * sum(pair.values()) / 1e6,
            "target_busiest_cores": per_pod_s * max(pair.values()) / 1e6,
            "slowest_command_ms": max(slow) if slow else None,
            "preempted": sum(m.preempted for w in (self.writes, self.reads) for m in w.masters),
            "expire_calls": expiry.count if expiry else None,
            "expire_usec_per_call": expiry.usec_per_call("evalsha") if expiry else None,
            "expire_slowest_ms": expiry.slowest_ms if expiry else None,
            "reset_ms": self.reset_ms,
        }


SHARDED_COLUMNS = (
    ("store", "store", "{}"),
    ("sidecars", "N", "{}"),
    ("syncs_per_s", "syncs/s", "{:.0f}"),
    ("reads_per_s", "reads/s", "{:.0f}"),
    ("script_usec_per_call", "script µs", "{:.1f}"),
    ("mget_calls_per_read", "mget/read", "{:.0f}"),
    ("mget_usec_per_call", "mget µs", "{:.1f}"),
    ("cpu_us_per_sync", "cpu µs/sync", "{:.0f}"),
    ("cpu_us_per_read", "cpu µs/read", "{:.0f}"),
    ("floor_cpu_us_per_call", "floor µs", "{:.0f}"),
    ("busiest_master_share", "busiest", "{:.2f}"),
    ("target_cores", "1k×10/s cores", "{:.2f}"),
    ("target_busiest_cores", "busiest", "{:.2f}"),
    ("slowest_command_ms", "slowest ms", "{:.1f}"),
    ("preempted", "preempted", "{}"),
    ("expire_usec_per_call", "expire µs", "{:.0f}"),
    ("expire_slowest_ms", "expire max ms", "{:.1f}"),
    ("reset_ms", "reset ms", "{:.2f}"),
    ("failed", "failed", "{}"),
)


async def _sharded_reset(store: Store) -> dict[int, tuple[float, int]]:
    """Zero every master's command stats and slow log; their CPU seconds and preemptions now."""
    preempted = {port: await _preempted(port) for port in store.masters}
    return {port: (cpu, preempted[port]) for port, (cpu, _, _) in (await _reset(store)).items()}


async def _preempted(port: int) -> int:
    """The server's involuntary context switches so far (0 when its /proc is not readable)."""
    return _context_switches(int((await server_info(port, "server"))["process_id"]))


def _context_switches(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("nonvoluntary_ctxt_switches:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


async def _sharded_readings(
    store: Store, before: dict[int, tuple[float, int]], commands: Sequence[str] = SHARDED_COMMANDS
) -> list[MasterReading]:
    readings = []
    for port in store.masters:
        stats = await server_info(port, "commandstats")
        slow = await _command(port, "SLOWLOG", "GET", "128")
        top = max(slow, key=lambda entry: int(entry[2]), default=None)
        slowest = None if top is None else int(top[2])
        readings.append(
            MasterReading(
                port,
                await server_cpu_s(port) - before[port][0],
                {
                    name: (int(entry.get("calls", 0)), float(entry.get("usec", 0.0)))
                    for name in commands
                    if (entry := stats.get(f"cmdstat_{name}"))
                },
                None if slowest is None else slowest / 1000,
                "" if top is None else bytes(top[3][0]).decode(errors="replace").lower(),
                await _preempted(port) - before[port][1],
            )
        )
    return readings


class ShardedFleet:
    """N sidecars' ``ShardedReservations`` on one production client (a real sidecar has its
    own: the servers' cost per call is the same), each with a table of its own."""

    def __init__(
        self, store: Store, sidecars: int, prefix: str, endpoints: int, read_groups: int = 1
    ) -> None:
        self.client = sharded.connect(store.url, cluster=store.cluster)
        self.shards = sharded.Shards(self.client, prefix)
        self.endpoints = [f"127.0.1.{i}:8000" for i in range(endpoints)]
        self.members = [
            sharded.ShardedReservations(
                self.shards, f"{i:032x}", lease_s=SHARDED_LEASE_S, read_groups=read_groups
            )
            for i in range(sidecars)
        ]
        self.tables: list[dict[str, Load]] = [{} for _ in range(sidecars)]

    async def fill(self, rng: random.Random, lines: int) -> None:
        """Every sidecar syncs a table of ``lines`` reservations, a batch at a time."""
        for table in self.tables:
            table.clear()
            for endpoint in rng.sample(self.endpoints, lines):
                table[endpoint] = Load(PROMPT_TOKENS, 1)
        for first in range(0, len(self.members), SHARDED_BATCH):
            await asyncio.gather(
                *(
                    member.sync(self.tables[first + i], time.time())
                    for i, member in enumerate(self.members[first : first + SHARDED_BATCH])
                )
            )

    async def first_reads(self) -> None:
        """Every sidecar's first read (of every shard), a batch at a time: the reads measured
        are then those of a sidecar that has read before, one group each with ``read_groups``."""
        for first in range(0, len(self.members), SHARDED_BATCH):
            await asyncio.gather(
                *(member.read() for member in self.members[first : first + SHARDED_BATCH])
            )

    async def sync_one(self, rng: random.Random) -> None:
        """A sidecar chosen at random: one reservation released, another made, then synced."""
        index = rng.randrange(len(self.members))
        table = self.tables[index]
        if table:
            del table[rng.choice(list(table))]
        table[rng.choice([e for e in self.endpoints if e not in table])] = Load(PROMPT_TOKENS, 1)
        await self.members[index].sync(table, time.time())

    async def read_one(self, rng: random.Random) -> None:
        await self.members[rng.randrange(len(self.members))].read()

    async def floor(self) -> None:
        await self.client.get(self.shards.totals_keys[0])

    async def close(self) -> None:
        await self.client.aclose()


async def _paced(
    rate: float, seconds: float, action: Callable[[], Coroutine[Any, Any, None]]
) -> tuple[int, int, float]:
    """``action`` started ``rate`` times a second, evenly spaced, for ``seconds``: the calls
    done and failed, and the seconds until the last ended."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    tasks: list[asyncio.Task[None]] = []
    # A late driver queues its calls rather than open more connections than the pool holds.
    gate = asyncio.Semaphore(SHARDED_BATCH)

    async def gated() -> None:
        async with gate:
            await action()

    for i in range(int(rate * seconds)):
        if (wait := began + i / rate - loop.time()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(gated()))
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    failed = sum(isinstance(outcome, BaseException) for outcome in outcomes)
    return len(outcomes) - failed, failed, loop.time() - began


async def _sharded_window(
    store: Store, rate: float, seconds: float, action: Callable[[], Coroutine[Any, Any, None]]
) -> ShardedWindow:
    before = await _sharded_reset(store)
    done, failed, elapsed = await _paced(rate, seconds, action)
    return ShardedWindow(elapsed, done, await _sharded_readings(store, before), failed)


def _member_of(shards: sharded.Shards, shard: int, name: str) -> sharded.ShardedReservations:
    """A sidecar of ``shard`` (its id found by trying ``name-0``, ``name-1``, ...)."""
    for attempt in range(10_000):
        sidecar = f"{name}-{attempt}"
        if sharded.shard_of(sidecar, len(shards.tags)) == shard:
            return sharded.ShardedReservations(shards, sidecar, lease_s=LEASE_S)
    raise RuntimeError(f"no id found for shard {shard}")


async def _time_reset(fleet: ShardedFleet, store: Store) -> float | None:
    """Shard 0's sums deleted by hand, then one sync of its: the shard starts anew (its every
    table deleted). The call's µs, in ms."""
    shards = fleet.shards
    await fleet.client.delete(shards.keys[0][2])  # its sums
    member = _member_of(shards, 0, "reset")
    before = await _sharded_reset(store)
    synced = await member.sync({}, time.time())
    readings = await _sharded_readings(store, before)
    await member.leave()
    if not synced.fresh:
        raise RuntimeError("the shard was not started anew")
    # Its sidecars send their tables again (as their next read tells them to).
    again = [(m, t) for m, t in zip(fleet.members, fleet.tables, strict=True) if m.shard == 0]
    for first in range(0, len(again), SHARDED_BATCH):
        batch = again[first : first + SHARDED_BATCH]
        await asyncio.gather(*(m.sync(t, time.time()) for m, t in batch))
    usec = ShardedWindow(0.0, 1, readings).usec_per_call("evalsha")
    return None if usec is None else usec / 1000


async def _time_expiry(fleet: ShardedFleet, store: Store) -> ShardedWindow:
    """Every sidecar lapsed (its lease's end set to 0: the script judges leases by Redis's
    clock), and dropped by a sync of its shard, ``EXPIRE_PER_SYNC`` a call, shard after shard."""
    for leases, *_ in fleet.shards.keys:
        # Every score times 0, in place (a shard of no sidecar has no such key).
        if await fleet.client.exists(leases):
            await fleet.client.zunionstore(leases, {leases: 0})
    members = [_member_of(fleet.shards, s, "late") for s in range(len(fleet.shards.tags))]
    before = await _sharded_reset(store)
    began, calls, dropped = time.monotonic(), 0, 0
    for member in members:
        while True:
            synced = await member.sync({}, time.time())
            calls += 1
            dropped += synced.expired
            if synced.expired == 0:
                break
        await member.leave()
    seconds = time.monotonic() - began
    if dropped != len(fleet.members):
        raise RuntimeError(f"{dropped} of {len(fleet.members)} lapsed sidecars were dropped")
    return ShardedWindow(seconds, calls, await _sharded_readings(store, before))


async def sharded_cell(
    store: Store, sidecars: int, rate: float, args: argparse.Namespace, rng: random.Random
) -> ShardedCell:
    prefix = f"sharded-{store.name}-{sidecars}-{rate:g}"
    fleet = ShardedFleet(store, sidecars, prefix, args.endpoints, args.read_groups)
    try:
        await fleet.fill(rng, min(SHARDED_LINES, args.endpoints))
        if args.read_groups > 1:
            await fleet.first_reads()
        before = await _sharded_reset(store)
        await asyncio.sleep(args.idle_s)
        idle = ShardedWindow(args.idle_s, 1, await _sharded_readings(store, before))
        writes = await _sharded_window(store, rate, args.load_s, lambda: fleet.sync_one(rng))
        reads = await _sharded_window(store, rate, args.load_s, lambda: fleet.read_one(rng))
        floor = await _sharded_window(store, rate, args.load_s, fleet.floor)
        expiry, reset_ms = None, None
        if rate == args.rates[0]:
            # The worst rows: every sidecar holding a reservation on every endpoint.
            await fleet.fill(rng, args.endpoints)
            reset_ms = await _time_reset(fleet, store)
            expiry = await _time_expiry(fleet, store)
    finally:
        await fleet.close()
        for port in store.masters:
            await _command(port, "FLUSHALL")
    return ShardedCell(store.name, sidecars, rate, idle, writes, reads, floor, expiry, reset_ms)


async def sharded_main(args: argparse.Namespace, rng: random.Random) -> int:
    groups = args.read_groups
    print(f"each read fetches {'every shard' if groups == 1 else f'every {groups}th shard'}")
    cells: list[ShardedCell] = []
    async for store in _stores(args.stores):
        for sidecars in args.sidecars:
            for rate in args.rates:
                cell = await sharded_cell(store, sidecars, rate, args, rng)
                cells.append(cell)
                print(_table([cell.figures()], SHARDED_COLUMNS).splitlines()[-1], flush=True)
    print()
    print(_table([cell.figures() for cell in cells], SHARDED_COLUMNS))
    single = {(c.sidecars, c.offered_per_s): c for c in cells if c.store == "redis"}
    for cell in cells:
        alone = single.get((cell.sidecars, cell.offered_per_s))
        if cell.store == "cluster" and alone is not None:
            mine, theirs = cell.figures(), alone.figures()
            share = mine["busiest_cpu_us_per_pair"] / theirs["busiest_cpu_us_per_pair"]
            print(
                f"cluster, N {cell.sidecars}, {cell.offered_per_s:g}/s: the busiest master "
                f"spends {share:.2f}x the CPU of the single server (a sync and a read)"
            )
    if args.json is not None:
        payload = [
            {
                **cell.figures(),
                "windows": {
                    name: asdict(window)
                    for name in ("idle", "writes", "reads", "floor", "expiry")
                    if (window := getattr(cell, name)) is not None
                },
            }
            for cell in cells
        ]
        args.json.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    failed = [c for c in cells if c.figures()["failed"]]
    for cell in failed:
        print(f"error: {cell.store} N {cell.sidecars}: calls failed", file=sys.stderr)
    return 1 if failed else 0


# --- the counter reservations --------------------------------------------------------------------

COUNTER_COMMANDS = ("mget", "incrby", "pexpireat", "time", "get")
TARGET_DECISIONS_S = 20_000
"""The extrapolation: 1,000 pods × 20 decisions a second."""
WAIT_TARGET_MS = 1.0
"""A decision's read, p99, at 500 decisions a second."""
SLOW_TARGET_MS = 5.0
"""No command longer."""


@dataclass(frozen=True, slots=True)
class CounterCell:
    store: str
    sidecars: int
    offered_per_s: float
    idle: ShardedWindow
    load: ShardedWindow
    """Decisions at the offered rate: a read, a reservation, its release after ``--hold-ms``."""
    floor: ShardedWindow
    """A ``GET`` of one key at the offered rate: what a round trip costs the servers now."""
    waits_ms: list[float] = field(default_factory=list, repr=False)
    """Each decision's read, as this process waited for it."""
    driver_cpu_s: float = 0.0
    skipped: int = 0
    """Keys the reads left out or clamped (none unless a hand wrote them)."""
    left: int = 0
    """Endpoints a read after the last release still counted, or could not read: none when
    every reservation was taken back."""

    def figures(self) -> dict[str, Any]:
        load = self.load
        per_master = load.cpu_us(self.idle) if load.count else {}
        total = sum(per_master.values())
        busiest = max(per_master.values(), default=0.0)
        usec = sum(load.usec_per_call(c) or 0.0 for c in ("mget", "incrby", "pexpireat"))
        slow = [m for m in load.masters if m.slowest_ms is not None]
        top = max(slow, key=lambda m: m.slowest_ms or 0.0, default=None)
        return {
            "store": self.store,
            "sidecars": self.sidecars,
            "offered_per_s": self.offered_per_s,
            "decisions_per_s": load.count / load.seconds if load.seconds else None,
            "failed": load.failed,
            "mget_calls_per_decision": load.calls("mget") / load.count if load.count else None,
            "mget_usec_per_call": load.usec_per_call("mget"),
            "incrby_calls_per_decision": load.calls("incrby") / load.count if load.count else None,
            "command_usec_per_decision": (
                sum(
                    m.commands.get(c, (0, 0.0))[1]
                    for m in load.masters
                    for c in ("mget", "incrby", "pexpireat", "time")
                )
                / load.count
                if load.count
                else None
            ),
            "command_usec_per_call": usec,
            "cpu_us_per_decision": total,
            "busiest_cpu_us_per_decision": busiest,
            "busiest_master_share": busiest / total if total else None,
            "floor_cpu_us_per_call": sum(self.floor.cpu_us(self.idle).values())
            if self.floor.count
            else None,
            "target_cores": TARGET_DECISIONS_S * total / 1e6,
            "target_busiest_cores": TARGET_DECISIONS_S * busiest / 1e6,
            "wait_p50_ms": _percentile(self.waits_ms, 50),
            "wait_p99_ms": _percentile(self.waits_ms, 99),
            "slowest_command_ms": None if top is None else top.slowest_ms,
            "slowest_command": "" if top is None else top.slowest,
            "preempted": sum(m.preempted for m in load.masters),
            "driver_busy": self.driver_cpu_s / load.seconds if load.seconds else None,
            "skipped": self.skipped,
        }


COUNTER_COLUMNS = (
    ("store", "store", "{}"),
    ("sidecars", "N", "{}"),
    ("offered_per_s", "offered/s", "{:g}"),
    ("decisions_per_s", "done/s", "{:.0f}"),
    ("mget_calls_per_decision", "mget/dec", "{:.1f}"),
    ("mget_usec_per_call", "mget µs", "{:.1f}"),
    ("incrby_calls_per_decision", "incr/dec", "{:.2f}"),
    ("command_usec_per_decision", "cmd µs/dec", "{:.1f}"),
    ("cpu_us_per_decision", "cpu µs/dec", "{:.0f}"),
    ("busiest_cpu_us_per_decision", "busiest µs", "{:.0f}"),
    ("busiest_master_share", "busiest", "{:.2f}"),
    ("floor_cpu_us_per_call", "floor µs", "{:.0f}"),
    ("target_cores", "20k/s cores", "{:.2f}"),
    ("target_busiest_cores", "busiest", "{:.2f}"),
    ("wait_p50_ms", "read p50", "{:.2f}"),
    ("wait_p99_ms", "read p99", "{:.2f}"),
    ("slowest_command_ms", "slowest ms", "{:.1f}"),
    ("preempted", "preempted", "{}"),
    ("driver_busy", "driver", "{:.0%}"),
    ("failed", "failed", "{}"),
)


class CounterFleet:
    """N sidecars' ``CounterReservations`` on one production client (a real sidecar has its
    own: the servers' cost per call is the same), each with its own clock offset."""

    def __init__(
        self, store: Store, sidecars: int, prefix: str, endpoints: int, groups: int | None
    ) -> None:
        self.client = sharded.connect(store.url, cluster=store.cluster)
        self.pool = counters.Counters(self.client, prefix, groups=groups)
        self.endpoints = [f"127.0.1.{i}:8000" for i in range(endpoints)]
        self.members = [counters.CounterReservations(self.pool) for _ in range(sidecars)]
        self.waits_ms: list[float] = []
        self.releases: set[asyncio.Task[None]] = set()
        self.failed_releases = 0

    async def learn_clocks(self) -> None:
        """Every sidecar's clock offset learnt (as each does once when it starts), a batch at a
        time: the windows measure decisions, not starts."""
        for first in range(0, len(self.members), SHARDED_BATCH):
            batch = self.members[first : first + SHARDED_BATCH]
            await asyncio.gather(*(member.learn_clock() for member in batch))

    async def decide(self, rng: random.Random, hold_s: float) -> None:
        """One decision through a sidecar chosen at random: its read (the wait), a reservation
        on the least loaded endpoint, released after ``hold_s`` (off the decision's path)."""
        member = self.members[rng.randrange(len(self.members))]
        began = time.perf_counter()
        counts = await member.read(self.endpoints)
        self.waits_ms.append((time.perf_counter() - began) * 1000)
        least = min(counts.loads.get(e, Load()).tokens for e in self.endpoints)
        chosen = rng.choice(
            [e for e in self.endpoints if counts.loads.get(e, Load()).tokens == least]
        )
        held = await member.reserve(chosen, PROMPT_TOKENS)
        task = asyncio.create_task(self._release(member, held, hold_s))
        self.releases.add(task)
        task.add_done_callback(self.releases.discard)

    async def _release(
        self, member: counters.CounterReservations, held: counters.Held, hold_s: float
    ) -> None:
        """The release deferred, as a sidecar sends it: with the member's next read, or on its
        own after ``counters.RELEASE_DELAY_S``."""
        await asyncio.sleep(hold_s)
        member.defer_release(held)

    async def drain(self) -> None:
        """Every release made and sent (lost ones counted in ``failed_releases``)."""
        while self.releases:
            await asyncio.gather(*list(self.releases))
        for member in self.members:
            try:
                await member.sent()
            except Exception:  # counted: the window reports its failures
                self.failed_releases += 1

    @property
    def lost_releases(self) -> int:
        return sum(member.lost_releases for member in self.members)

    async def floor(self) -> None:
        await self.client.get(self.pool.key(self.endpoints[0], 0))

    async def close(self) -> None:
        await self.drain()
        for member in self.members:
            await member.close()
        await self.client.aclose()


async def counter_cell(
    store: Store, sidecars: int, rate: float, args: argparse.Namespace, rng: random.Random
) -> CounterCell:
    prefix = f"counters-{store.name}-{sidecars}-{rate:g}"
    fleet = CounterFleet(store, sidecars, prefix, args.endpoints, args.counter_groups)
    try:
        await fleet.learn_clocks()
        before = await _sharded_reset(store)
        await asyncio.sleep(args.idle_s)
        idle = ShardedWindow(
            args.idle_s, 1, await _sharded_readings(store, before, COUNTER_COMMANDS)
        )
        before = await _sharded_reset(store)
        cpu = own_cpu_s()
        loop = asyncio.get_running_loop()
        began = loop.time()
        hold_s = args.hold_ms / 1000
        done, failed, _ = await _paced(rate, args.load_s, lambda: fleet.decide(rng, hold_s))
        await fleet.drain()  # the window ends with its last release
        seconds = loop.time() - began
        driver_cpu_s = own_cpu_s() - cpu
        load = ShardedWindow(
            seconds,
            done,
            await _sharded_readings(store, before, COUNTER_COMMANDS),
            failed + fleet.failed_releases + fleet.lost_releases,
        )
        floor = await _sharded_window(store, rate, args.load_s, fleet.floor)
        final = await fleet.members[0].read(fleet.endpoints)  # every release taken back
        left = len(final.loads) + len(final.missing)
        skipped = sum(m.skipped + m.clamped for m in fleet.members)
    finally:
        await fleet.close()
        for port in store.masters:
            await _command(port, "FLUSHALL")
    return CounterCell(
        store.name, sidecars, rate, idle, load, floor, fleet.waits_ms, driver_cpu_s, skipped, left
    )


def counter_errors(cells: Sequence[CounterCell]) -> list[str]:
    """What makes the run fail: calls that failed; a final read that still counts some
    reservation, or left out or clamped a key."""
    errors = []
    for cell in cells:
        where = f"{cell.store} N {cell.sidecars} at {cell.offered_per_s:g}/s"
        if cell.figures()["failed"]:
            errors.append(f"{where}: calls failed")
        if cell.left:
            errors.append(f"{where}: {cell.left} endpoints still counted after the last release")
        if cell.skipped:
            errors.append(f"{where}: {cell.skipped} keys skipped or clamped")
    return errors


async def counters_main(args: argparse.Namespace, rng: random.Random) -> int:
    groups = args.counter_groups
    print(f"keys under {'a hash tag per endpoint' if not groups else f'{groups} hash tags'}")
    cells: list[CounterCell] = []
    async for store in _stores(args.stores):
        for sidecars in args.sidecars:
            for rate in args.rates:
                cell = await counter_cell(store, sidecars, rate, args, rng)
                cells.append(cell)
                print(_table([cell.figures()], COUNTER_COLUMNS).splitlines()[-1], flush=True)
    print()
    print(_table([cell.figures() for cell in cells], COUNTER_COLUMNS))
    print()
    single = {(c.sidecars, c.offered_per_s): c for c in cells if c.store == "redis"}
    for cell in cells:
        mine = cell.figures()
        alone = single.get((cell.sidecars, cell.offered_per_s))
        if cell.store == "cluster" and alone is not None and alone.figures()["cpu_us_per_decision"]:
            share = mine["busiest_cpu_us_per_decision"] / alone.figures()["cpu_us_per_decision"]
            print(
                f"cluster, N {cell.sidecars}, {cell.offered_per_s:g}/s: the busiest master "
                f"spends {share:.2f}x the CPU of the single server per decision"
            )
    slow = [c for c in cells if (c.figures()["slowest_command_ms"] or 0.0) > SLOW_TARGET_MS]
    for cell in slow:
        figures = cell.figures()
        print(
            f"{cell.store}, N {cell.sidecars}, {cell.offered_per_s:g}/s: a command over "
            f"{SLOW_TARGET_MS:g} ms ({figures['slowest_command']}, "
            f"{figures['slowest_command_ms']:.1f} ms)"
        )
    if args.json is not None:
        payload = [
            {
                **cell.figures(),
                "windows": {
                    name: asdict(getattr(cell, name)) for name in ("idle", "load", "floor")
                },
            }
            for cell in cells
        ]
        args.json.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    errors = counter_errors(cells)
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


# --- the report ----------------------------------------------------------------------------------

COLUMNS = (
    ("store", "store", "{}"),
    ("sidecars", "N", "{}"),
    ("offered_per_s", "offered/s", "{:g}"),
    ("achieved_per_s", "done/s", "{:.0f}"),
    ("script_calls_per_decision", "calls/dec", "{:.2f}"),
    ("script_usec_per_call", "µs/call", "{:.0f}"),
    ("redis_cpu_us_per_decision", "cpu µs/dec", "{:.0f}"),
    ("decisions_per_redis_core", "dec/s/core", "{:.0f}"),
    ("idle_syncs_per_sidecar_s", "idle sync/s", "{:.2f}"),
    ("idle_redis_cpu_per_s", "idle cpu", "{:.3f}"),
    ("busiest_master_share", "busiest", "{:.2f}"),
    ("wait_p50_ms", "wait p50", "{:.2f}"),
    ("wait_p99_ms", "wait p99", "{:.2f}"),
    ("over_budget", ">5 ms", "{:.1%}"),
    ("net_bytes_per_decision", "bytes/dec", "{:.0f}"),
    ("learnt_share", "learnt", "{:.1%}"),
    ("learnt_age_p50_ms", "age p50", "{:.0f}"),
    ("driver_busy", "driver", "{:.0%}"),
    ("slowest_command_ms", "slowest ms", "{:.1f}"),
    ("resum_ms", "re-sum ms", "{:.1f}"),
    ("probe_wait_p50_ms", "probe p50", "{:.2f}"),
    ("probe_wait_p99_ms", "probe p99", "{:.2f}"),
    ("probe_wait_max_ms", "probe max", "{:.2f}"),
    ("probe_cpu_us_per_decision", "probe cpu µs/dec", "{:.0f}"),
    ("probe_cpu_share", "probe cpu", "{:.1%}"),
)


def _cell_text(value: Any, form: str) -> str:
    return "-" if value is None else form.format(value)


def report(cells: Sequence[Cell]) -> str:
    return _table([cell.figures() for cell in cells], COLUMNS)


def _table(rows_figures: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    rows = [[title for _, title, _ in columns]]
    for figures in rows_figures:
        rows.append([_cell_text(figures[key], form) for key, _, form in columns])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join(
        "  ".join(text.rjust(w) for text, w in zip(row, widths, strict=True)) for row in rows
    )


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _float_list(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


async def main(args: argparse.Namespace) -> int:
    # 1,024 sidecars hold two connections each here, and a cluster client one per master.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    logging.getLogger("sidecar.scheduling").setLevel(logging.ERROR)  # "deciding on the local view"
    rng = random.Random(args.seed)
    print(
        f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, "
        f"{args.endpoints} prefill endpoints, lease {LEASE_S:g} s, hold {args.hold_ms:g} ms, "
        f"idle {args.idle_s:g} s and load {args.load_s:g} s per cell",
        flush=True,
    )
    if args.scrapes:
        return await scrapes_main(args)
    if args.reservations == "sharded":
        return await sharded_main(args, rng)
    if args.reservations == "counters":
        return await counters_main(args, rng)
    cells: list[Cell] = []
    async for store in _stores(args.stores):
        for sidecars in args.sidecars:
            for rate in args.rates:
                cell = await measure_cell(store, sidecars, rate, args, rng)
                cells.append(cell)
                print(report([cell]).splitlines()[-1], flush=True)
    print()
    print(report(cells))
    single = {(c.sidecars, c.offered_per_s): c for c in cells if c.store == "redis"}
    for cell in cells:
        alone = single.get((cell.sidecars, cell.offered_per_s))
        if cell.store == "cluster" and alone is not None and alone.load.cpu_s:
            share = cell.load.busiest_cpu_s / alone.load.cpu_s
            print(
                f"cluster, N {cell.sidecars}, {cell.offered_per_s:g}/s: the busiest master "
                f"spends {share:.2f}x the CPU of the single server"
            )
    if args.json is not None:
        payload = [
            {**cell.figures(), "servers": [asdict(s) for s in cell.load.servers]} for cell in cells
        ]
        args.json.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    failed = [c for c in cells if c.load.decisions < int(c.offered_per_s * args.load_s)]
    for cell in failed:
        print(f"error: {cell.store} N {cell.sidecars}: decisions were lost", file=sys.stderr)
    return 1 if failed else 0


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench fleet", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--stores", type=lambda t: t.split(","), default=["redis", "cluster"])
    parser.add_argument(
        "--sidecars",
        type=_int_list,
        default=None,
        help="N, comma-separated (default 8,64,256,1024,4096; with --scrapes 8,64,256,1024)",
    )
    parser.add_argument("--rates", type=_float_list, default=[100.0, 300.0])
    parser.add_argument("--endpoints", type=int, default=32)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--load-s", type=float, default=10.0)
    parser.add_argument("--hold-ms", type=float, default=300.0)
    parser.add_argument(
        "--prefix-share",
        action="store_true",
        help="every decision also shares its placement (8k-token prompt), every sidecar learns",
    )
    parser.add_argument(
        "--scrapes",
        action="store_true",
        help="the shared prefill scrapes instead of the reservations (default N 8,64,256,1024)",
    )
    parser.add_argument(
        "--reservations",
        choices=["script", "sharded", "counters", "counter-state"],
        default="script",
        help="script: the backend of SIDECAR_STATE_RESERVATIONS=script (one script per decision "
        "on the pool's slot); counter-state: the backend of SIDECAR_STATE_RESERVATIONS=counters "
        "(its heartbeats, and decisions through refresh, reserve and release); sharded: "
        "the sharded design (sidecar.scheduling.state.sharded), syncs and reads at --rates each; "
        "counters: per-endpoint counters by epoch (sidecar.scheduling.state.counters), decisions "
        "at --rates",
    )
    parser.add_argument(
        "--counter-groups",
        type=int,
        default=None,
        help="counters: the keys under this many hash tags (3: one per master) rather than one "
        "per endpoint",
    )
    parser.add_argument(
        "--read-groups",
        type=int,
        default=1,
        help="sharded: a read fetches every g-th shard in turn (3: one master's), the rest as "
        "last read",
    )
    parser.add_argument(
        "--probe",
        type=float,
        default=None,
        help="script, counter-state: one more sidecar in a process of its own deciding this "
        "many times a second through each load window (bench.fleet_probe): its waits and CPU",
    )
    parser.add_argument("--per-endpoint", type=int, default=2, help="owners per endpoint")
    parser.add_argument("--rounds", type=int, default=5, help="scrape rounds measured")
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=SCRAPE_S,
        help="seconds between a sidecar's scrape rounds (longer: fewer rounds a second to play)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    add_quick(parser, "N = 8 and 32 at 50 decisions/s, 1 s windows (--scrapes: 2 rounds)")
    return parser


def main_cli(argv: list[str] | None = None) -> int:
    parser = main_parser()
    args = apply_quick(
        parser,
        parser.parse_args(argv),
        sidecars=[8, 32],
        rates=[50.0],
        idle_s=1.0,
        load_s=1.0,
        rounds=2,
    )
    if args.sidecars is None:
        args.sidecars = [8, 64, 256, 1024] if args.scrapes else [8, 64, 256, 1024, 4096]
    if unknown := set(args.stores) - {"redis", "cluster"}:
        parser.error(f"--stores: unknown {sorted(unknown)}; known: redis, cluster")
    return run(lambda: main(args))


if __name__ == "__main__":
    sys.exit(main_cli())
