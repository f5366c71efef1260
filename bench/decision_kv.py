"""The decision's cost with KV events on: ``python -m bench decision_cost --kv-events``.

    python -m bench decision_cost --kv-events                  # timed, and /tokenize apart
    python -m bench decision_cost --kv-events --instructions   # callgrind, Ir per decision

Not a benchmark of its own: ``decision_cost`` runs it, and callgrind runs it as
``python -m bench.decision_kv --count KIND CASE N`` (the operations counted).

The memory placement of ``decision_cost.py`` (qoe, a 2,000-token prompt of 8,000 characters, 8
prefill endpoints, ``IN_FLIGHT`` placements reserved, both approximate prefix indexes on), with a
``KVFleet`` whose exact indexes are in sync for the 8 endpoints and the local decode rank: each
fed ``EventBatch``es built in this process (no ZMQ; a subscriber stand-in says "connected"), each
holding ``FILLER`` other prompts of 125 blocks of 16 tokens. The token ids are given (a token
source that answers at once with the ids the emulator's ``/tokenize`` gives for the prompt),
so the timed ``place_request()`` is the decision alone; the ``/tokenize`` round trip is measured
apart, on loopback against a real emulator process, through the sidecar's own ``TokenSource``: it
is part of the request's time to first token, not of the decision.

Cases, each prompt's text distinct per placement (the approximate indexes miss at their first
block, as in ``decision_cost.py``):

- ``distinct``: token ids no engine holds — every exact look-up misses at block 0.
- ``full``: token ids whose 2,000 tokens are all held by one endpoint (``FULL_PROMPTS`` prompts
  stored in turn on endpoints 0..7 and cycled through): that endpoint's look-up hits all 124
  blocks a hit may cover (vLLM computes the last token), the other 8 indexes miss at block 0.

Reported: ``place_request()``'s wall median / p99 and thread-CPU median; the parts on their own —
the request's keys (``PromptKeys``, computed as far as the look-ups read them), the 9 look-ups on
those keys (the hitting endpoint's apart), and the rest of the decision by difference.
``--instructions``: callgrind's ``Ir`` per decision (the placement's recording left out, as
``decision_cost.py``'s "the decision"), per keys and per look-ups, from two runs of ``SHORT``
and ``LONG`` placements whose set-up is the same (the difference over the extra placements).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.decision_cost import (
    ENDPOINTS,
    IN_FLIGHT,
    PROMPT_TOKENS,
    body,
    callgrind_total,
    finish,
    load,
    pool,
    scheduler_on,
    summary,
)
from sidecar.emulator.text import text_prompt
from sidecar.emulator.tokenize import prompt_units, unit_token_id
from sidecar.kvevents.events import BlockStored, EventBatch
from sidecar.kvevents.fleet import (
    FleetOptions,
    KVFleet,
    PromptLookup,
    _Engine,
    _Member,
    decode_engine,
)
from sidecar.kvevents.index import KVIndex
from sidecar.kvevents.tokens import TokenIds, TokenSourceStats, checked_ids
from sidecar.scheduling.placement import Placement
from sidecar.scheduling.state import MemoryState

BLOCK = 16
"""vLLM's default block size."""
FILLER = 16
"""Other prompts of 2,000 tokens each index holds (2,000 blocks): lived-in dictionaries."""
FULL_PROMPTS = 64
"""Distinct fully cached prompts, on endpoint ``k % 8`` for prompt ``k``."""
SHORT, LONG = 20, 220
"""Placements of the two callgrind runs."""
CASES = ("distinct", "full")


_UNITS: dict[str, int] = {}


def token_ids(text: str) -> list[int]:
    """What the emulator's ``/tokenize`` answers for ``text`` (its one rule, ``unit_token_id``,
    remembered per unit: the bench's prompts repeat their units)."""
    units = _UNITS
    ids = []
    for unit in prompt_units(text_prompt(text)):
        found = units.get(unit)
        if found is None:
            found = units[unit] = unit_token_id(unit)
        ids.append(found)
    return ids


def filler_ids(seed: int) -> list[int]:
    """Another prompt's 2,000 token ids, distinct per ``seed`` (what else an engine holds)."""
    return [(seed * 1_000_003 + i * 7919) % 128_000 for i in range(PROMPT_TOKENS)]


def engine_hashes(ids: Sequence[int], salt: int) -> list[int]:
    """Stand-ins for the engine's block hashes: unique per (prompt, block), 64-bit ints."""
    return [hash((salt, i)) & ((1 << 63) - 1) for i in range(len(ids) // BLOCK)]


def stored(ids: Sequence[int], salt: int) -> EventBatch:
    """One ``BlockStored`` of ``ids``' full blocks, as vLLM publishes a computed prompt."""
    hashes = engine_hashes(ids, salt)
    return EventBatch(
        seq=0,
        ts=0.0,
        events=(
            BlockStored(
                block_hashes=tuple(hashes),
                parent_block_hash=None,
                token_ids=tuple(ids[: len(hashes) * BLOCK]),
                block_size=BLOCK,
            ),
        ),
    )


class _Connected:
    """A subscriber stand-in: the fleet reads ``stats.connected``, ``catching_up`` (and
    ``close``)."""

    catching_up = False

    class stats:
        connected = True

    async def close(self) -> None:
        return None


class GivenIds:
    """A token source that answers at once: the ids registered for a prompt's text."""

    timeout_s = 0.0

    def __init__(self) -> None:
        self.ids: dict[str, TokenIds] = {}
        self.stats = TokenSourceStats()

    async def token_ids(self, request: Mapping[str, Any]) -> TokenIds | None:
        self.stats.answered += 1
        return self.ids.get(request["prompt"])


def checked(ids: list[int]) -> TokenIds:
    """``ids`` as the sidecar's ``TokenSource`` answers them: checked, packed."""
    found = checked_ids(ids)
    assert found is not None
    return found


def full_ids(k: int) -> list[int]:
    """The ``k``-th fully cached prompt's ids (held by endpoint ``k % ENDPOINTS``)."""
    return token_ids(body(-1 - k)["prompt"])


def fleet_in_sync(tokens: GivenIds) -> KVFleet:
    """A fleet whose 8 endpoints and local rank 0 are in sync, fed in-process."""
    options = FleetOptions(
        port=5557,
        replay_port=None,
        topic="",
        decode_hosts=("127.0.0.1",),
        decode_port=5557,
        decode_replay_port=None,
        cpu_weight=1.0,
        storage_weight=1.0,
        max_blocks=200_000,
    )
    fleet = KVFleet(options, tokens=tokens)  # type: ignore[arg-type]
    names = [str(endpoint) for endpoint in pool()] + [decode_engine(0)]
    engines = []
    for n, name in enumerate(names):
        engine = _Engine(name, KVIndex(max_blocks=options.max_blocks))
        engine.subscriber = _Connected()  # type: ignore[assignment]
        for f in range(FILLER):
            engine.apply(stored(filler_ids(n * 1000 + f), 10**6 * n + f))
        engines.append(engine)
    for k in range(FULL_PROMPTS):
        engines[k % ENDPOINTS].apply(stored(full_ids(k), -1 - k))
    fleet._prefill = {
        name: _Member(name, (engine,)) for name, engine in zip(names, engines, strict=False)
    }
    fleet._ranks = [engines[-1]]
    fleet._running = True
    return fleet


def case_ids(case: str, index: int) -> list[int]:
    """The token ids of placement ``index`` in ``case``."""
    if case == "full":
        return full_ids(index % FULL_PROMPTS)
    return token_ids(body(index)["prompt"])


async def placements(
    case: str, iterations: int, *, timed: bool = True, prepare: int = 0
) -> dict[str, Any]:
    """``iterations`` decisions (plus a tenth to warm up) on a scheduler with the fleet (case
    ``off``: without it); each placement's recording is applied right after, untimed
    (``Scheduler._record``). ``prepare``: requests made beforehand at least."""
    tokens = GivenIds()
    fleet = fleet_in_sync(tokens)
    scheduler = scheduler_on(MemoryState(), "qoe")
    if case != "off":
        scheduler._kv_events = fleet
    await scheduler.start()
    total = iterations + iterations // 10
    requests = [body(i) for i in range(max(total, prepare))]
    for i, request in enumerate(requests):  # made before the clock runs
        # Checked and packed as the sidecar's ``TokenSource`` answers them (that work is the
        # token ids' cost, timed apart with ``/tokenize``).
        tokens.ids[request["prompt"]] = checked(case_ids(case, i))
    del requests[total:]
    record: Callable[[], None] = getattr(scheduler, "_record", lambda: None)
    if not timed:  # counted: the decision alone, its recording left out (as decision_cost.py)
        scheduler._defer = lambda *_: None  # type: ignore[method-assign]
    held: deque[Placement] = deque()
    samples: list[int] = []
    cpu_samples: list[int] = []
    reasons: dict[str, int] = {}
    sources: dict[str, int] = {}
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    try:
        for i, request in enumerate(requests):
            start, cpu_start = clock(), cpu()
            placement, _ = await scheduler.place_request(request, None)
            elapsed, cpu_elapsed = clock() - start, cpu() - cpu_start
            record()
            if i >= iterations // 10:
                samples.append(elapsed)
                cpu_samples.append(cpu_elapsed)
                reasons[placement.decision.reason] = reasons.get(placement.decision.reason, 0) + 1
                source = str(placement.cached_source)
                sources[source] = sources.get(source, 0) + 1
            held.append(placement)
            if len(held) > IN_FLIGHT:
                finish(scheduler, held.popleft())
    finally:
        await scheduler.close()
    if not timed:
        return {}
    return {
        **summary(samples),
        "cpu_median_us": summary(cpu_samples)["median_us"],
        "cpu_p99_us": summary(cpu_samples)["p99_us"],
        "reasons": reasons,
        "cached_source": sources,
        "engines_looked_up": len((fleet.last_decision or {"sources": ()})["sources"]),
    }


def lookups(case: str, iterations: int, *, parts: str = "both", prepare: int = 0) -> dict[str, Any]:
    """The exact part of a decision on its own: a request's ``PromptKeys`` and its 9 look-ups
    (the 8 endpoints', the local rank's), as ``PromptLookup`` makes them. Timed (thread CPU):
    the look-ups with a fresh ``PromptKeys`` (keyed as far as they read it), then again on the
    keys now computed (the probes alone, the hitting endpoint's apart); the keys' share is the
    difference. ``parts`` for callgrind: ``keys`` (the first pass only) or ``lookups`` (both
    passes); ``prepare``: token ids made beforehand at least (the same in every run)."""
    tokens = GivenIds()
    fleet = fleet_in_sync(tokens)
    total = iterations + iterations // 10
    ids = [checked(case_ids(case, i)) for i in range(max(total, prepare))]
    keys_cpu: list[int] = []
    hit_cpu: list[int] = []
    miss_cpu: list[int] = []
    all_cpu: list[int] = []
    cpu = time.thread_time_ns
    names = [str(endpoint) for endpoint in pool()]
    request = {"model": "emulated-model"}
    hits = 0
    for i in range(total):
        prompt = ids[i]
        keys = fleet.prompt_keys(prompt, request)
        lookup = PromptLookup(fleet, keys, len(prompt), None)
        t0 = cpu()
        for name in names:
            lookup(name)
        lookup.rank(0, 0)
        t1 = cpu()
        if parts == "keys":
            continue
        lookup = PromptLookup(fleet, keys, len(prompt), None)
        t2 = cpu()
        found = [lookup(name) for name in names]
        found.append(lookup.rank(0, 0))
        t3 = cpu()
        if parts == "lookups" or i < iterations // 10:
            continue
        hit = next((n for n, cached in enumerate(found) if cached), None)
        hits += hit is not None
        probes = t3 - t2
        keys_cpu.append(max(0, t1 - t0 - probes))
        all_cpu.append(probes)
        if hit is not None:
            one = PromptLookup(fleet, keys, len(prompt), None)
            t4 = cpu()
            one(names[hit])
            t5 = cpu()
            hit_cpu.append(t5 - t4)
            miss_cpu.append(max(0, probes - (t5 - t4)))
    if parts != "both":
        return {}
    figures: dict[str, Any] = {
        "keys (PromptKeys, as far as read)": summary(keys_cpu),
        "9 look-ups on computed keys": summary(all_cpu),
        "placements with a hit": hits,
    }
    if hit_cpu:
        figures["  the hitting endpoint's look-up"] = summary(hit_cpu)
        figures["  the 8 others (misses)"] = summary(miss_cpu)
    return figures


async def tokenize_costs(calls: int) -> dict[str, Any]:
    """``/tokenize`` of the 2,000-token prompt through the sidecar's ``TokenSource`` against an
    emulator process on loopback: wall and this thread's CPU per call."""
    from bench.cluster import BenchLauncher
    from sidecar.engines.upstream import HttpClient
    from sidecar.kvevents.tokens import TokenSource

    async with BenchLauncher(prefix="pd-sidecar-bench-tokenize-") as launcher:
        launcher.keep_logs = False
        emulator = launcher.spawn_emulator("decode")
        await emulator.wait_ready("/health")
        client = HttpClient(connect_timeout_s=1.0)
        await client.open()
        source = TokenSource(client, emulator.url, timeout_s=5.0)
        wall: list[int] = []
        thread: list[int] = []
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        try:
            for i in range(calls + calls // 10):
                request = body(i)
                start, cpu_start = clock(), cpu()
                ids = await source.token_ids(request)
                elapsed, cpu_elapsed = clock() - start, cpu() - cpu_start
                assert ids == token_ids(request["prompt"]), "the emulator's ids differ"
                if i >= calls // 10:
                    wall.append(elapsed)
                    thread.append(cpu_elapsed)
        finally:
            await client.close()
    return {**summary(wall), "cpu": summary(thread), "tokens": PROMPT_TOKENS}


def count_child(kind: str, case: str, iterations: int) -> None:
    """Untimed, for callgrind: ``place`` (decisions), ``keys`` or ``lookups``."""
    prepare = LONG + LONG // 10
    if kind == "place":
        asyncio.run(placements(case, iterations, timed=False, prepare=prepare))
    else:
        lookups(case, iterations, parts=kind, prepare=prepare)


def instructions(kind: str, case: str) -> float:
    """Ir per operation of ``kind`` in ``case``: two callgrind runs whose set-up is the same,
    ``SHORT`` and ``LONG`` operations (a tenth more each, the warm-up)."""
    counts = []
    with tempfile.TemporaryDirectory() as out:
        for n in (SHORT, LONG):
            argv = [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.{n}",
                sys.executable, "-m", "bench.decision_kv", "--count", kind, case, str(n),
            ]  # fmt: skip
            env = {**os.environ, "PYTHONHASHSEED": "0"}
            subprocess.run(argv, env=env, check=True, capture_output=True)
            counts.append(callgrind_total(f"{out}/cg.{n}"))
    return (counts[1] - counts[0]) / ((LONG - SHORT) * 1.1)


def run(iterations: int, *, count: bool, tokenize_calls: int = 300) -> int:
    """``decision_cost.py --kv-events``: the report, printed."""
    print(load())
    print(
        f"the decision with KV events on: a {PROMPT_TOKENS}-token prompt among {ENDPOINTS}"
        f" endpoints (memory, qoe), {IN_FLIGHT} in flight; exact indexes in sync for the"
        f" {ENDPOINTS} endpoints and the local rank ({FILLER} other prompts each), token ids given"
    )
    if count:
        off = instructions("place", "off")
        print(f"  {'off':<9} instructions per decision {off:>11,.0f} (KV events off)")
        for case in CASES:
            place = instructions("place", case)
            first = instructions("keys", case)  # the keys and the probes
            probes = instructions("lookups", case) - first  # the probes again
            keys = first - probes
            print(
                f"  {case:<9} instructions per decision {place:>11,.0f}; keys {keys:>9,.0f},"
                f" 9 look-ups {probes:>9,.0f}, the rest {place - keys - probes:>9,.0f}"
                f" ({place - keys - probes - off:+,.0f} on events off)"
                f"  ({load()})"
            )
        return 0
    print(f"  {'what':<52} {'median µs':>10} {'p99 µs':>10} {'CPU med µs':>10}")
    unfleeted = asyncio.run(placements("off", iterations))
    print(  # the same placements without the fleet (decision_cost.py's memory qoe)
        f"  {'place_request(), KV events off (the same placements)':<52}"
        f" {unfleeted['median_us']:>10.1f} {unfleeted['p99_us']:>10.1f}"
        f" {unfleeted['cpu_median_us']:>10.1f}"
    )
    for case in CASES:
        figures = asyncio.run(placements(case, iterations))
        print(
            f"  {'place_request(), ' + case:<52} {figures['median_us']:>10.1f}"
            f" {figures['p99_us']:>10.1f} {figures['cpu_median_us']:>10.1f}"
            f"  sources {figures['cached_source']}, {figures['reasons']}"
        )
        parts = lookups(case, iterations)
        for name, part in parts.items():
            if isinstance(part, dict):
                print(f"    {name:<50} {part['median_us']:>10.1f} {part['p99_us']:>10.1f}  (CPU)")
        exact = parts["keys (PromptKeys, as far as read)"]["median_us"]
        exact += parts["9 look-ups on computed keys"]["median_us"]
        print(f"    {'the rest of the decision (by difference)':<50}"
              f" {figures['cpu_median_us'] - exact:>10.1f}")  # fmt: skip
        print(f"    ({load()})")
    tokenize = asyncio.run(tokenize_costs(tokenize_calls))
    print(
        f"  {'/tokenize on loopback (emulator), apart':<52} {tokenize['median_us']:>10.1f}"
        f" {tokenize['p99_us']:>10.1f} {tokenize['cpu']['median_us']:>10.1f}"
        f"  ({tokenize['tokens']} tokens; part of the time to first token)"
    )
    print(load())
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--count"]:
        count_child(argv[1], argv[2], int(argv[3]))
        return 0
    print(json.dumps({"usage": "python -m bench decision_cost --kv-events [--instructions]"}))
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
