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

    python -m bench fleet                       # N = 8 ... 4,096; 100 and 300 decisions/s
    python -m bench fleet --json fleet.json     # the figures as JSON too
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import resource
import shutil
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
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
from sidecar.scheduling.state import Load, Reservation
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


async def _info(port: int, section: str) -> dict[str, Any]:
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


async def _cpu_s(port: int) -> float:
    cpu = await _info(port, "cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


async def _net(port: int) -> tuple[int, int]:
    stats = await _info(port, "stats")
    return int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])


Readings = dict[int, tuple[float, int, int]]
"""Per master: its CPU seconds, bytes read and bytes written so far."""


async def _reset(store: Store) -> Readings:
    """Zero every master's command stats and slow log; their CPU and network readings now."""
    readings = {}
    for port in store.masters:
        await _command(port, "CONFIG", "SET", "slowlog-log-slower-than", str(SLOW_US))
        await _command(port, "SLOWLOG", "RESET")
        readings[port] = (await _cpu_s(port), 0, 0)
        await _command(port, "CONFIG", "RESETSTAT")  # the network totals too
    return readings


async def _costs(store: Store, before: Readings) -> list[ServerCost]:
    costs = []
    for port in store.masters:
        cpu_before, _, _ = before[port]
        net_in, net_out = await _net(port)
        stats = (await _info(port, "commandstats")).get("cmdstat_evalsha", {})
        slow = await _command(port, "SLOWLOG", "GET", "128")
        slowest = max((int(entry[2]) for entry in slow), default=None)
        costs.append(
            ServerCost(
                port,
                int(stats.get("calls", 0)),
                float(stats.get("usec_per_call", 0.0)),
                await _cpu_s(port) - cpu_before,
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
        self, store: Store, sidecars: int, prefix: str, endpoints: int, *, share: bool
    ) -> None:
        """``share``: the prefix share on (as with ``SIDECAR_PREFIX_HASH_KEY`` set): every
        decision publishes its placement, every sidecar learns the others'."""
        self.store = store
        self.share = share
        self.prefix = prefix
        self.endpoints = [f"127.0.1.{i}:8000" for i in range(endpoints)]
        """Names only: nothing connects to them."""
        self.timeouts = 0
        """Refreshes that had no answer within the budget, all sidecars together."""
        self.members = [
            RedisState(
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
        await member.refresh()
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


async def load_window(
    fleet: Fleet, rate: float, seconds: float, hold_s: float, rng: random.Random
) -> Window:
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
    fleet = Fleet(store, sidecars, prefix, args.endpoints, share=args.prefix_share)
    await fleet.start()
    try:
        idle = await idle_window(fleet, args.idle_s)
        load = await load_window(fleet, rate, args.load_s, args.hold_ms / 1000, rng)
        # The re-sum does not depend on the rate: timed at the first one only.
        resum_ms = await resum(fleet) if rate == args.rates[0] else None
    finally:
        await fleet.close()
    return Cell(store.name, sidecars, rate, idle, load, resum_ms)


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
)


def _cell_text(value: Any, form: str) -> str:
    return "-" if value is None else form.format(value)


def report(cells: Sequence[Cell]) -> str:
    rows = [[title for _, title, _ in COLUMNS]]
    for cell in cells:
        figures = cell.figures()
        rows.append([_cell_text(figures[key], form) for key, _, form in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
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
    cells: list[Cell] = []
    async with Launcher(prefix="pd-sidecar-bench-fleet-") as launcher:
        for name in args.stores:
            opened = standalone(launcher) if name == "redis" else cluster()
            async with opened as store:
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
    parser.add_argument("--sidecars", type=_int_list, default=[8, 64, 256, 1024, 4096])
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
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    add_quick(parser, "N = 8 and 32 at 50 decisions/s, 1 s windows")
    return parser


def main_cli(argv: list[str] | None = None) -> int:
    parser = main_parser()
    args = apply_quick(
        parser, parser.parse_args(argv), sidecars=[8, 32], rates=[50.0], idle_s=1.0, load_s=1.0
    )
    if unknown := set(args.stores) - {"redis", "cluster"}:
        parser.error(f"--stores: unknown {sorted(unknown)}; known: redis, cluster")
    return run(lambda: main(args))


if __name__ == "__main__":
    sys.exit(main_cli())
