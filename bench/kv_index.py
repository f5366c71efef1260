"""The exact prefix index's cost: applying KV events, a look-up, memory per block.

    python -m bench kv_index                # ~1 minute
    python -m bench kv_index --repeats 9
    python -m bench kv_index --instructions # callgrind: instructions per operation (~2 minutes)
    python -m bench kv_index --quick        # one repeat, sets 10 times smaller (seconds)

``sidecar.kvevents.index.KVIndex`` alone, in this process, no I/O. Events are what vLLM publishes
for prompts of 2,000 tokens in blocks of 16 (125 blocks): one ``BlockStored`` per prompt, or one
per block (a decode filling blocks one at a time), and one ``BlockRemoved`` per evicted block (as
vLLM's block pool emits them), with 64-bit int hashes (vLLM's default) into an index held at
100,000 blocks. Times are wall-clock microseconds per block or per look-up, the best and the
median of ``--repeats`` runs (the best is the cost; the median shows the machine's load). Memory:
``tracemalloc``'s count of what the index keeps per block, for int and for 32-byte hashes.

``--instructions`` counts instead, with ``valgrind --tool=callgrind`` (``PYTHONHASHSEED=0``), the
instructions of each operation: a child process sets up one case and runs it ``--ops`` times,
another sets it up and runs it never, and the difference is divided by ``--ops``. A figure that
does not move with the machine's load.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from bench.suite import add_quick, apply_quick
from sidecar.kvevents.events import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from sidecar.kvevents.index import KVIndex, PromptKeys

BLOCK = 16
PROMPT_TOKENS = 2000
BLOCKS = PROMPT_TOKENS // BLOCK


def prompt(seed: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 128_000 for i in range(tokens)]


def engine_hashes(ids: list[int], as_bytes: bool = False) -> list[int | bytes]:
    """The engine's chained hashes (sha256, as vLLM's default): not the index's own."""
    parent = b"seed"
    out: list[int | bytes] = []
    for i in range(len(ids) // BLOCK):
        parent = hashlib.sha256(parent + repr(ids[i * BLOCK : (i + 1) * BLOCK]).encode()).digest()
        out.append(parent if as_bytes else int.from_bytes(parent[:8], "big"))
    return out


def stored(
    ids: list[int],
    hashes: list[int | bytes],
    first: int = 0,
    count: int | None = None,
    **fields: object,
) -> BlockStored:
    end = len(hashes) if count is None else first + count
    return BlockStored(
        block_hashes=tuple(hashes[first:end]),
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=tuple(ids[first * BLOCK : end * BLOCK]),
        block_size=BLOCK,
        **fields,  # type: ignore[arg-type]
    )


def timed(run: Callable[[], int], repeats: int) -> tuple[float, float]:
    """Best and median seconds per unit of ``run`` (which returns its unit count)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        units = run()
        samples.append((time.perf_counter() - start) / units)
    return min(samples), statistics.median(samples)


def apply_costs(repeats: int, scale: int = 1) -> list[tuple[str, float, float]]:
    """``scale``: the sets are that many times smaller (the quick run's)."""
    prompts = [prompt(seed) for seed in range(1000 // scale)]
    hashes = [engine_hashes(p) for p in prompts]
    rows = []
    seq = iter(range(10**9))

    def batch(*events: BlockStored | BlockRemoved) -> EventBatch:
        return EventBatch(seq=next(seq), ts=0.0, events=events)

    whole = [batch(stored(p, h)) for p, h in zip(prompts, hashes, strict=True)]
    some = 400 // scale
    removed = [batch(BlockRemoved(block_hashes=(block,))) for h in hashes[:some] for block in h]

    def store_whole() -> int:
        index = KVIndex(max_blocks=100_000)
        for b in whole:
            index.apply(b)
        return len(whole) * BLOCKS

    rows.append(("apply: BlockStored of 125 blocks, per block", *timed(store_whole, repeats)))

    singles = [
        batch(stored(p, h, first=i, count=1))
        for p, h in zip(prompts[:some], hashes[:some], strict=True)
        for i in range(BLOCKS)
    ]

    def store_singles() -> int:
        index = KVIndex(max_blocks=100_000)
        for b in singles:
            index.apply(b)
        return len(singles)

    rows.append(("apply: BlockStored of 1 block, per block", *timed(store_singles, repeats)))

    def remove_only() -> tuple[float, float]:
        samples = []
        for _ in range(repeats):
            index = KVIndex(max_blocks=100_000)
            for b in whole[:some]:
                index.apply(b)
            start = time.perf_counter()
            for b in removed:
                index.apply(b)
            samples.append((time.perf_counter() - start) / len(removed))
        return min(samples), statistics.median(samples)

    rows.append(("apply: BlockRemoved of 1 block, per block", *remove_only()))
    return rows


def lookup_costs(repeats: int, scale: int = 1) -> list[tuple[str, float, float]]:
    rows = []
    index = KVIndex(max_blocks=100_000)
    for seed in range(500 // scale):
        ids = prompt(seed)
        index.apply(EventBatch(seq=seed, ts=0.0, events=(stored(ids, engine_hashes(ids)),)))
    full = [*prompt(7), 1]
    half = [*prompt(7)[: PROMPT_TOKENS // 2], *prompt(99_999)[: PROMPT_TOKENS // 2]]
    miss = prompt(99_999)
    n = 2000 // scale

    for name, probe, expect in (
        ("look-up, 2,000 tokens, all 125 blocks cached", full, 125 * BLOCK),
        ("look-up, 2,000 tokens, first 62 blocks cached", half, 62 * BLOCK),
        ("look-up, 2,000 tokens, nothing cached", miss, 0),
    ):
        assert index.lookup(probe).gpu == expect, (name, index.lookup(probe))

        def run(probe: list[int] = probe) -> int:
            for _ in range(n):
                index.lookup(probe)
            return n

        rows.append((name, *timed(run, repeats)))

    # One request looked up in nine indexes (eight prefill engines and the local one), its keys
    # computed once (``PromptKeys``): each index holds the prompt's first half.
    nine = []
    for _ in range(9):
        other = KVIndex(max_blocks=100_000)
        ids = prompt(7)[: PROMPT_TOKENS // 2]
        other.apply(EventBatch(seq=0, ts=0.0, events=(stored(ids, engine_hashes(ids)),)))
        nine.append(other)

    def run_nine() -> int:
        for _ in range(n // 10):
            keys = PromptKeys(full)
            for other in nine:
                other.lookup(keys)
        return n // 10

    rows.append(("look-up in 9 indexes, one PromptKeys, 62 blocks each", *timed(run_nine, repeats)))

    # Two groups (full attention + sliding window of 512 tokens), and a CPU offload tier.
    hybrid = KVIndex(max_blocks=100_000)
    ids = prompt(7)
    h = engine_hashes(ids)
    hybrid.apply(
        EventBatch(
            seq=0,
            ts=0.0,
            events=(
                stored(ids, h, group_idx=0, kv_cache_spec_kind="full_attention"),
                stored(
                    ids,
                    h,
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=512,
                ),
                stored(ids, h, medium=MEDIUM_CPU),
            ),
        )
    )
    assert hybrid.lookup(full).gpu == 125 * BLOCK

    def run_hybrid() -> int:
        for _ in range(n):
            hybrid.lookup(full)
        return n

    rows.append(("look-up, 2 groups (SWA) + CPU tier, all cached", *timed(run_hybrid, repeats)))
    return rows


def memory_per_block(as_bytes: bool, scale: int = 1) -> float:
    prompts = [prompt(seed, 20 * BLOCK) for seed in range(5000 // scale)]
    hashes = [engine_hashes(p, as_bytes=True) for p in prompts]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = KVIndex(max_blocks=200_000)
        for p, h in zip(prompts, hashes, strict=True):
            # The hashes are made inside the measurement, as the decoder makes them.
            raw = [x for x in h if isinstance(x, bytes)]
            own: list[int | bytes] = [
                bytes(bytearray(x)) if as_bytes else int.from_bytes(x[:8], "big") for x in raw
            ]
            index.apply(EventBatch(seq=0, ts=0.0, events=(stored(p, own),)))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return used / len(index)


def case(name: str) -> Callable[[], object]:
    """One operation, set up (for ``--instructions``)."""
    ids = prompt(7)
    hashes = engine_hashes(ids)
    index = KVIndex(max_blocks=100_000)
    if name == "store-125":
        events = stored(ids, hashes)
        return lambda: index.apply(EventBatch(seq=0, ts=0.0, events=(events,)))
    index.apply(EventBatch(seq=0, ts=0.0, events=(stored(ids, hashes),)))
    if name == "remove-1":
        removal = EventBatch(seq=0, ts=0.0, events=(BlockRemoved(block_hashes=(hashes[5],)),))
        return lambda: index.apply(removal)
    probe = {"lookup-full": [*ids, 1], "lookup-miss": prompt(99_999)}[name]
    index.lookup(probe)  # once in the set-up: what a process does once is no look-up's cost
    return lambda: index.lookup(probe)


CASES = {
    "store-125": ("apply: BlockStored of 125 blocks, per block", 125),
    "remove-1": ("apply: BlockRemoved of 1 block (absent after the first)", 1),
    "lookup-full": ("look-up, 2,000 tokens, all 125 blocks cached", 1),
    "lookup-miss": ("look-up, 2,000 tokens, nothing cached", 1),
}


def child(name: str, ops: int) -> None:
    run = case(name)
    for _ in range(ops):
        run()


def instructions(name: str, ops: int) -> float:
    def count(n: int) -> int:
        with tempfile.TemporaryDirectory() as out:
            dump = Path(out) / "callgrind.out"
            subprocess.run(
                [
                    "valgrind",
                    "--tool=callgrind",
                    f"--callgrind-out-file={dump}",
                    sys.executable,
                    "-m",
                    "bench.kv_index",
                    "--child",
                    name,
                    "--ops",
                    str(n),
                ],
                check=True,
                capture_output=True,
                env={**os.environ, "PYTHONHASHSEED": "0"},
            )
            match = re.search(r"^(?:summary|totals): (\d+)", dump.read_text(), re.M)
            assert match, dump
            return int(match.group(1))

    return (count(ops) - count(0)) / ops


def main_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench kv_index", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--instructions", action="store_true")
    parser.add_argument("--ops", type=int, default=50)
    parser.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    add_quick(parser, "one repeat, sets 10 times smaller")
    args = apply_quick(parser, parser.parse_args(argv), repeats=1)
    if args.child:
        child(args.child, args.ops)
        return 0
    if args.instructions:
        print(f"{'':56} {'instructions':>12}")
        for name, (label, per) in CASES.items():
            print(f"{label:56} {instructions(name, args.ops) / per:12.0f}")
        return 0
    version = sys.version.split()[0]
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, Python {version}")
    print(f"{'':56} {'best µs':>9} {'median µs':>10}")
    scale = 10 if args.quick else 1
    rows = [*apply_costs(args.repeats, scale), *lookup_costs(args.repeats, scale)]
    for name, best, median in rows:
        print(f"{name:56} {best * 1e6:9.2f} {median * 1e6:10.2f}")
    print(f"memory per block, 64-bit int hashes: {memory_per_block(False, scale):.0f} bytes")
    print(f"memory per block, 32-byte hashes:    {memory_per_block(True, scale):.0f} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main_cli())
