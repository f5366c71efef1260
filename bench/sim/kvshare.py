"""With several sidecars, does each subscribe to every engine's KV events, or
does one subscribe and publish the index through the state backend? Measured on the simulator's
Mooncake replay with 8 prefill engines and 16 decode engines (16 sidecars):

    python -m bench.sim.kvshare --trace PATH [--rate 2] [--requests 1500]

One run of ``qoe exact`` counts what the prefill engines publish (batches, blocks stored and
removed, the msgpack bytes vLLM 0.32 would send: ``sidecar.kvevents.wire.encode_payload``) and
what applying it costs a ``KVIndex`` (CPU seconds per event, this machine). From those, per
second of the replay:

- ``subscribe``: every sidecar subscribes to every engine: each message goes to all 16, each
  sidecar applies every event; staleness is the events' own lag (an engine step, then the LAN);
- ``shared``: one sidecar subscribes and writes the index's changes to Redis (its keys: 8 bytes
  a block stored or removed, plus the engine hash a removal names, 8 more: the least a delta
  can carry), the 15 others read them with the prefix share's cadence
  (``sidecar.scheduling.state.prefix_share``: a sync every ``SYNC_S`` after a change, at least
  every ``4 × SYNC_S``; each reply at most ``REPLY_BYTES``); staleness adds that wait.

The figures and the choice are in docs/kv-events.md ("Several sidecars").
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.sim.run import Simulation
from bench.sim.scenario import QOE_EXACT
from bench.sim.scenarios import MOONCAKE_EVICT
from sidecar.kvevents.events import BlockRemoved, BlockStored, EventBatch
from sidecar.kvevents.index import KVIndex
from sidecar.kvevents.wire import encode_payload
from sidecar.scheduling.state.prefix_share import REPLY_BYTES, SYNC_S

PREFILL = 8
DECODE = 16
FRAME_BYTES = 8 + 2
"""A message's sequence frame and a short topic, besides its payload."""
KEY_BYTES = 8
"""A block's key in a shared index (and an engine hash)."""


@dataclass(frozen=True, slots=True)
class Published:
    seconds: float
    """Virtual seconds of the replay."""
    batches: int
    events: int
    """Blocks stored or removed, and clears."""
    stored: int
    removed: int
    payload_bytes: int
    apply_s: float
    """CPU seconds ``KVIndex.apply`` took for all of it (one subscriber's share)."""


def measure(trace: str, rate: float, measured: int, warmup: int, seed: int) -> Published:
    scenario = replace(
        MOONCAKE_EVICT, trace_path=trace, prefill_engines=PREFILL, decode_engines=DECODE
    )
    simulation = Simulation(scenario, QOE_EXACT, rate, measured=measured, warmup=warmup, seed=seed)
    source = simulation.exact
    assert source is not None
    counts = {"batches": 0, "stored": 0, "removed": 0, "bytes": 0}
    apply_s = 0.0
    shadow = {key: KVIndex(max_blocks=index.max_blocks) for key, index in source.indexes.items()}

    def observe(key: str, batch: EventBatch) -> None:
        nonlocal apply_s
        counts["batches"] += 1
        counts["bytes"] += len(encode_payload(batch)) + FRAME_BYTES
        for event in batch.events:
            if isinstance(event, BlockStored):
                counts["stored"] += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                counts["removed"] += len(event.block_hashes)
        started = time.process_time()
        shadow[key].apply(batch)  # what one more subscriber's index costs
        apply_s += time.process_time() - started

    source.observer = observe
    stats = simulation.run()
    events = counts["stored"] + counts["removed"]
    return Published(
        stats.sim_s,
        counts["batches"],
        events,
        counts["stored"],
        counts["removed"],
        counts["bytes"],
        apply_s,
    )


def report(published: Published, lag_s: float) -> str:
    s = published.seconds
    batches, events, payload = (
        published.batches / s,
        published.events / s,
        published.payload_bytes / s,
    )
    per_event = published.apply_s / published.events if published.events else 0.0
    core = events * per_event
    delta = (published.stored * KEY_BYTES + published.removed * 2 * KEY_BYTES) / s
    readers = DECODE - 1
    reads = readers / SYNC_S  # every reader syncs every SYNC_S while the stream moves
    reply_limit = REPLY_BYTES / SYNC_S
    lines = [
        f"{PREFILL} prefill engines, {DECODE} sidecars; {s:,.0f} virtual seconds of the replay",
        f"published by all engines: {batches:,.1f} messages/s, {events:,.0f} events/s "
        f"({published.stored / s:,.0f} stored, {published.removed / s:,.0f} removed blocks/s), "
        f"{payload / 1e6:,.2f} MB/s; applying them: {per_event * 1e6:.2f} us/event, "
        f"{core * 100:.1f} % of a core",
        "",
        f"{'':<10}{'messages/s':>14}{'MB/s':>10}{'CPU/sidecar':>13}{'staleness':>22}",
        f"{'subscribe':<10}{DECODE * batches:>14,.0f}{DECODE * payload / 1e6:>10,.2f}"
        f"{core * 100:>12.1f}%{f'{lag_s * 1000:g} ms':>22}",
        f"{'shared':<10}{batches + 1 / SYNC_S + reads:>14,.0f}"
        f"{(payload + (1 + readers) * delta) / 1e6:>10,.2f}"
        f"{'':>13}{f'{lag_s * 1000:g} ms + {SYNC_S * 1000:g}-{5 * SYNC_S * 1000:g} ms':>22}",
        f"(shared: the subscriber applies everything ({core * 100:.1f} % of a core), every "
        f"other sidecar applies the deltas; a reader's sync returns at most {REPLY_BYTES:,} "
        f"bytes, {reply_limit / 1e6:.2f} MB/s against the {delta / 1e6:.3f} MB/s of deltas)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sim.kvshare", description=__doc__)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s of the replay")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    published = measure(args.trace, args.rate, args.requests, args.requests // 5, args.seed)
    print(report(published, MOONCAKE_EVICT.kv_event_lag_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
