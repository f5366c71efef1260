"""What receiving vLLM's KV events costs: the subscriber's CPU per 10,000 events per second.

The target: at most 20 % of one core per 10,000 events per second.

An event is one stored or removed block (or one clear). A publisher process (this script with
``--publish``) sends vLLM-shaped batches on loopback at a fixed rate of events per second, in
vLLM 0.32's encoding; this process runs one :class:`~sidecar.kvevents.subscriber.Subscriber`
(on uvloop when installed, as the sidecar does) with a consumer that does nothing, and measures
its own CPU seconds (user + system, ZMQ's I/O thread included) over the measured window. Two
shapes: ``steps`` (a scheduler step's batch: 4 stores of 8 blocks and an eviction of 8, 40
events) and ``single`` (one block per message, the costliest per event).

    python -m bench kv_events                       # 10,000 events/s, 10 s per shape
    python -m bench kv_events --rate 20000 --seconds 5
    python -m bench kv_events --quick               # 1 s per shape; fails when none arrive

Exit status 1 when a shape's events did not arrive; the figures are never judged.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import sys
import time

from bench.suite import add_quick, apply_quick
from sidecar.kvevents.events import BlockRemoved, BlockStored, EventBatch, KVEvent
from sidecar.kvevents.subscriber import ResetReason, Subscriber
from sidecar.kvevents.wire import encode_payload, encode_seq

BLOCK_SIZE = 16
SHAPES = ("steps", "single")
WARMUP_S = 1.0


def _batch(shape: str, rng: random.Random) -> EventBatch:
    def stored(blocks: int) -> BlockStored:
        return BlockStored(
            block_hashes=tuple(rng.getrandbits(64) for _ in range(blocks)),
            parent_block_hash=rng.getrandbits(64),
            token_ids=tuple(rng.randrange(151_000) for _ in range(blocks * BLOCK_SIZE)),
            block_size=BLOCK_SIZE,
            medium="GPU",
        )

    if shape == "single":
        return EventBatch(seq=0, ts=time.time(), events=(stored(1),), data_parallel_rank=0)
    removed = BlockRemoved(block_hashes=tuple(rng.getrandbits(64) for _ in range(8)), medium="GPU")
    events: tuple[KVEvent, ...] = (*(stored(8) for _ in range(4)), removed)
    return EventBatch(seq=0, ts=time.time(), events=events, data_parallel_rank=0)


def publish(port: int, shape: str, rate: float, seconds: float) -> None:
    """The publisher process: a PUB on 127.0.0.1:port, ``rate`` events per second."""
    import zmq

    rng = random.Random(0)
    payloads = [encode_payload(_batch(shape, rng)) for _ in range(64)]
    per_batch = 1 if shape == "single" else 40
    interval = per_batch / rate
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # the subscriber connects (what it misses is a gap, then a reset)
    start = time.monotonic()
    seq = 0
    while (now := time.monotonic()) - start < seconds:
        due = start + seq * interval
        if due > now:
            time.sleep(due - now)
        sock.send_multipart([b"", encode_seq(seq), payloads[seq % len(payloads)]])
        seq += 1
    sock.close()


class _Nothing:
    def apply(self, batch: EventBatch) -> None:
        pass

    def reset(self, reason: ResetReason) -> None:
        pass


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def measure(shape: str, rate: float, seconds: float) -> tuple[float, float]:
    """(events per second received, CPU share of one core) over the measured window."""
    port = _free_port()
    publish_s = str(seconds + WARMUP_S + 1.0)
    publisher = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.kv_events", "--publish", str(port),
        "--shape", shape, "--rate", str(rate), "--seconds", publish_s,
    )  # fmt: skip
    subscriber = Subscriber(host="127.0.0.1", port=port, consumer=_Nothing(), queue_size=4096)
    try:
        await subscriber.start()
        await asyncio.sleep(0.5 + WARMUP_S)
        events, cpu, wall = subscriber.stats.events_total, _cpu_s(), time.monotonic()
        await asyncio.sleep(seconds)
        events = subscriber.stats.events_total - events
        cpu, wall = _cpu_s() - cpu, time.monotonic() - wall
    finally:
        await subscriber.close()
        await asyncio.wait_for(publisher.wait(), 30)
    drops = sum(subscriber.stats.drops_total.values())
    if drops:
        print(f"  ({drops} messages dropped: {dict(subscriber.stats.drops_total)})")
    return events / wall, cpu / wall


async def run(rate: float, seconds: float) -> int:
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} before the run")
    status = 0
    for shape in SHAPES:
        received, share = await measure(shape, rate, seconds)
        status = status or int(received == 0)
        per_10k = share * 10_000 / received if received else float("nan")
        print(
            f"{shape:>6}: {received:8.0f} events/s received, {share * 100:5.1f} % of one core"
            f" -> {per_10k * 100:5.1f} % of one core per 10,000 events/s (target <= 20 %)"
        )
    print(f"load average {os.getloadavg()[0]:.2f} after the run")
    return status


def main_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench kv_events", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rate", type=float, default=10_000, help="events per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per shape")
    parser.add_argument("--publish", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=SHAPES, default="steps", help=argparse.SUPPRESS)
    add_quick(parser, "1 s per shape")
    args = apply_quick(parser, parser.parse_args(argv), seconds=1.0)
    if args.publish is not None:
        publish(args.publish, args.shape, args.rate, args.seconds)
        return 0
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(args.rate, args.seconds))
    return uvloop.run(run(args.rate, args.seconds))


if __name__ == "__main__":
    sys.exit(main_cli())
