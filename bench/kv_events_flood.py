"""What a hostile KV-event publisher can make a sidecar hold, and /health's latency meanwhile.

The sidecar's RSS growth and ``/health``'s latency while one publisher attacks its subscriber,
against the per-subscriber budget of ``docs/kv-events.md`` (Bounds) plus the index's cap.

    python -m bench kv_events_flood                     # the three attacks, 40 s each
    python -m bench kv_events_flood --attack replay --seconds 20
    python -m bench kv_events_flood --checkout /tmp/older    # another checkout's sidecar
    python -m bench kv_events_flood --quick             # the three attacks, 3 s each

A decode emulator and a sidecar with ``SIDECAR_KV_EVENTS=true`` whose prefill pool is one
member on 127.0.0.2; a process of this script plays that member's publisher (its events port
and its replay port, both on 127.0.0.2), so its own memory is not the sidecar's. Three attacks:

- ``flood``: a batch, then a gap, so that the subscriber asks for a replay; the replay makes
  progress one small batch every 1.5 s (never the 2 s without progress that ends one) while
  the events port sends the largest batches the wire accepts (16,384 blocks and 262,144 token
  ids, 1.4 MiB of msgpack, about 12 MiB decoded) as fast as the sockets take them. Once the
  replay reaches its deadline the subscriber reads the flood, and each new gap starts another.
- ``replay``: a new gap every 3 s, each replay answered by the largest batch repeated as fast
  as the socket takes it, for ever: no progress.
- ``frames``: messages of 200 frames of 2 MiB each (400 MiB a message, every frame within the
  payload limit), on the events port as fast as the socket takes them and in answer to each
  replay request. libzmq assembles such a message whole before delivering it; the sidecar's
  ZMTP reader ends the connection at the second frame's header (past the message's bytes).

The sidecar's RSS is sampled every 50 ms (``/proc``) and ``/health`` asked every 20 ms; the
figures are the growth over the RSS before the attack (its peak, and at the end) and the
slowest ``/health``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from pathlib import Path

import aiohttp

from bench.cluster import BenchLauncher
from bench.readings import read_proc
from bench.suite import add_quick, apply_quick
from devkit.processes import free_port

HOST = "127.0.0.2"
ATTACKS = ("flood", "replay", "frames")
FRAMES = 200
MIB = 1024 * 1024
SETTLE_S = 3.0


# -- the hostile publisher (its own process) ----------------------------------------------------


def _largest(seq: int, rng: random.Random) -> list[bytes]:
    """The frames of the largest batch the wire accepts: one store of 16,384 blocks of 16."""
    from sidecar.kvevents.events import BlockStored, EventBatch
    from sidecar.kvevents.wire import encode_message

    blocks = 16_384
    stored = BlockStored(
        block_hashes=tuple(rng.getrandbits(64) for _ in range(blocks)),
        parent_block_hash=None,
        token_ids=tuple(rng.randrange(2**31, 2**32) for _ in range(16 * blocks)),
        block_size=16,
        medium="GPU",
    )
    return encode_message(EventBatch(seq=seq, ts=time.time(), events=(stored,)))


def _small(seq: int) -> list[bytes]:
    from sidecar.kvevents.events import EventBatch
    from sidecar.kvevents.wire import encode_message

    return encode_message(EventBatch(seq=seq, ts=time.time(), events=()))


def hostile(attack: str, port: int, replay_port: int, seconds: float) -> None:
    import zmq

    from sidecar.kvevents.wire import decode_seq, encode_seq

    rng = random.Random(0)
    largest = [_largest(0, rng) for _ in range(4)]  # distinct blocks: the index fills too
    chunk = b"\xc0" * (2 * MIB)  # one buffer, sent by reference (copy=False): 2 MiB here
    many = [chunk] * FRAMES
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 4)  # the attacker's own memory: what does not fit is dropped
    pub.bind(f"tcp://{HOST}:{port}")
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 4)
    router.bind(f"tcp://{HOST}:{replay_port}")
    while pub.recv()[:1] != b"\x01":  # the sidecar's subscription
        pass
    seq = 0
    pub.send_multipart(_small(seq))
    time.sleep(0.5)
    seq = 100
    pub.send_multipart(_small(seq))  # a gap: the subscriber asks for a replay
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    started = time.monotonic()
    asker: bytes | None = None
    next_reply = 0
    progress_at = 0.0
    next_gap = started + 3.0
    sent = 0
    while time.monotonic() - started < seconds:
        for _ready in poller.poll(1):
            identity, _, start = router.recv_multipart()
            asker, next_reply = identity, decode_seq(start)
            progress_at = time.monotonic()
        now = time.monotonic()
        if attack == "frames":
            if asker is not None:
                with contextlib.suppress(zmq.Again):
                    router.send_multipart([asker, b"", *many], zmq.NOBLOCK, copy=False)
                asker = None
            try:
                pub.send_multipart(many, zmq.NOBLOCK, copy=False)
                sent += 1
            except zmq.Again:
                pass
            time.sleep(0.002)
        elif attack == "flood":
            if asker is not None and now >= progress_at:
                router.send_multipart([asker, b"", *_small(next_reply)], zmq.NOBLOCK)
                next_reply += 1
                progress_at = now + 1.5
            seq += 1
            frames = largest[seq % len(largest)]
            try:
                pub.send_multipart([frames[0], encode_seq(seq), frames[2]], zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
            time.sleep(0.002)
        else:
            if asker is not None:
                frames = largest[0]
                try:
                    router.send_multipart(
                        [asker, b"", frames[0], encode_seq(next_reply), frames[2]], zmq.NOBLOCK
                    )
                    sent += 1
                except zmq.Again:
                    pass
            if now >= next_gap:
                seq += 100
                pub.send_multipart(_small(seq))
                next_gap = now + 3.0
            time.sleep(0.002)
    print(f"hostile {attack}: {sent} of the largest messages sent in {seconds:.0f} s", flush=True)
    context.destroy(linger=0)


# -- the measurement ------------------------------------------------------------------------------


async def attack(
    launcher: BenchLauncher, decode_url: str, name: str, seconds: float, checkout: Path | None
) -> None:
    port, replay_port = free_port(), free_port()
    sidecar = launcher.spawn_sidecar(
        f"sidecar-{name}",
        decode_url=decode_url,
        checkout=checkout,
        settings={
            "SIDECAR_KV_EVENTS": "true",
            "SIDECAR_PREFILL_ENDPOINTS": f"{HOST}:{free_port()}",
            "SIDECAR_KV_EVENTS_PORT": str(port),
            "SIDECAR_KV_EVENTS_REPLAY_PORT": str(replay_port),
            "SIDECAR_KV_EVENTS_DECODE_PORT": "",
            "SIDECAR_KV_EVENTS_DECODE_REPLAY_PORT": "",
            "SIDECAR_LOG_LEVEL": "WARNING",
        },
    )
    await sidecar.wait_ready("/ready")
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(SETTLE_S)
        for _ in range(20):  # warm /health's path up before the baseline
            async with session.get(sidecar.url + "/health") as response:
                await response.read()
        baseline = read_proc(sidecar.pid).rss
        publisher = launcher.spawn(
            f"hostile-{name}",
            [
                sys.executable, "-m", "bench.kv_events_flood", "--hostile", name,
                "--port", str(port), "--replay-port", str(replay_port),
                "--seconds", str(seconds),
            ],
        )  # fmt: skip
        peak = baseline
        slowest = 0.0
        latencies: list[float] = []
        next_rss = 0.0
        while publisher.returncode is None:
            now = time.monotonic()
            async with session.get(sidecar.url + "/health") as response:
                await response.read()
            latency = time.monotonic() - now
            latencies.append(latency)
            slowest = max(slowest, latency)
            if now >= next_rss:
                peak = max(peak, read_proc(sidecar.pid).rss)
                next_rss = now + 0.05
            await asyncio.sleep(0.02)
        end = read_proc(sidecar.pid)
        async with session.get(sidecar.url + "/debug/scheduler") as response:
            view = (await response.json())["kv_events"]
    await sidecar.stop()
    shown = next(iter(view["endpoints"].values()))
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)] if latencies else float("nan")
    print(
        f"{name:>6}: RSS {baseline / MIB:.0f} MiB before; growth {(peak - baseline) / MIB:.0f} MiB"
        f" at its peak (VmHWM {(end.hwm - baseline) / MIB:.0f}), {(end.rss - baseline) / MIB:.0f}"
        f" MiB at the end; /health slowest {slowest * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
        f" ({len(latencies)} asked)"
    )
    print(
        f"        engine: blocks {shown['blocks']}, replays {shown['replays']}, gaps "
        f"{shown['gaps']}, resets {shown['resets']}, drops {shown['drops']}, behind "
        f"{shown.get('behind')}, source {shown['source']}"
    )


async def main(args: argparse.Namespace) -> None:
    launcher = BenchLauncher()
    try:
        decode = launcher.spawn_emulator("decode")
        await decode.wait_ready("/health")
        for name in args.attack:
            await attack(launcher, decode.url, name, args.seconds, args.checkout)
    finally:
        await launcher.close()


def main_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench kv_events_flood",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--attack", choices=ATTACKS, action="append", help="default: all")
    parser.add_argument("--seconds", type=float, default=40.0, help="each attack's length")
    parser.add_argument(
        "--checkout", type=Path, help="run the sidecar of this checkout (e.g. an older one)"
    )
    parser.add_argument("--hostile", choices=ATTACKS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--replay-port", type=int, help=argparse.SUPPRESS)
    add_quick(parser, "each attack for 3 s")
    args = apply_quick(parser, parser.parse_args(argv), seconds=3.0)
    if args.hostile is not None:
        hostile(args.hostile, args.port, args.replay_port, args.seconds)
        return 0
    args.attack = args.attack or list(ATTACKS)
    asyncio.run(main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main_cli())
