"""What idle and slow client connections cost the sidecar, and that they are let go.

    python -m bench connections [--connections 5000] [--kind silent|drip]
                                [--sidecar-nofile N] [--env SIDECAR_X=value ...] [--no-wait]

Starts ``python -m sidecar`` (its decode engine an unreachable loopback address: no request is
served, only connections held), opens ``--connections`` connections to its API port that either
never send (``silent``) or send a request head one byte every 5 s (``drip``, one task in this
process for all of them), and prints the sidecar's open files, resident memory, asyncio tasks and
client connections: before, with the connections open, and once its head timeout has passed
(unless ``--no-wait``). With them open it also times ``GET /health`` on a new connection, as the
kubelet's probe comes. ``--sidecar-nofile N`` runs the sidecar under an open-files limit of N
(soft and hard, as a container runtime may set it). The defaults are the sidecar's; ``--env``
overrides them, e.g. ``--env SIDECAR_MAX_CONNECTIONS=100000 --env
SIDECAR_CLIENT_HEADER_TIMEOUT_S=3600`` for what the connections cost with no cap and no head
timeout.

``--quick``: 300 silent connections and a head timeout of 2 s; exit status 1 when ``/health``
does not answer 200 with them open, or when the sidecar has not closed every one after its head
timeout.

Both processes need ~N descriptors: the soft open-files limit is raised to the hard one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass

import aiohttp

from bench.cluster import raise_open_files_limit
from bench.readings import Metrics, mib, read_proc
from bench.suite import add_quick, apply_quick
from devkit.processes import Child, Launcher, environment, free_port
from sidecar.config import Settings

DRIP_EVERY_S = 5.0
"""The slow client's pace: one header byte every 5 s."""
DRIP_HEAD = b"GET /health HTTP/1.1\r\nHost: sidecar\r\nX-Slow: " + b"a" * 4000
OPEN_BATCH = 250
"""Connections opened at once (the listen backlog is 2048)."""


@dataclass(frozen=True, slots=True)
class Reading:
    fds: int
    rss: int
    tasks: float
    open: float
    refused: float
    evicted: float
    head_timeouts: float


async def read(sidecar: Child, admin_url: str, http: aiohttp.ClientSession) -> Reading:
    async with http.get(admin_url + "/metrics") as response:
        metrics = Metrics.parse(await response.text())
    proc = read_proc(sidecar.pid)
    closed = "pd_sidecar_client_connections_closed_total"
    return Reading(
        fds=proc.fds,
        rss=proc.rss,
        tasks=metrics.value("pd_sidecar_asyncio_tasks"),
        open=metrics.value("pd_sidecar_client_connections", listener="api"),
        refused=metrics.value("pd_sidecar_client_connections_refused_total", listener="api"),
        evicted=metrics.value(closed, listener="api", reason="evicted"),
        head_timeouts=metrics.value(closed, listener="api", reason="head_timeout"),
    )


def show(label: str, reading: Reading) -> None:
    print(
        f"{label:<34} fds {reading.fds:>6}  RSS {mib(reading.rss):>10}  tasks "
        f"{reading.tasks:>6.0f}  open {reading.open:>6.0f}  evicted {reading.evicted:>6.0f}  "
        f"head timeouts {reading.head_timeouts:>6.0f}  refused {reading.refused:>4.0f}"
    )


async def open_connections(
    port: int, count: int
) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for start in range(0, count, OPEN_BATCH):
        batch = min(OPEN_BATCH, count - start)
        opened += await asyncio.gather(
            *(asyncio.open_connection("127.0.0.1", port) for _ in range(batch))
        )
    return opened


async def drip(writers: list[asyncio.StreamWriter]) -> None:
    """One byte of DRIP_HEAD to every connection every DRIP_EVERY_S: a head that never ends."""
    for byte in DRIP_HEAD:
        for writer in writers:
            if not writer.is_closing():
                writer.write(bytes([byte]))
        await asyncio.sleep(DRIP_EVERY_S)  # the slow clients' pace is what is measured


async def probe(port: int) -> tuple[int, float]:
    """``GET /health`` on a new connection, as the kubelet sends it: status and seconds."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
    status = int(status_line.split()[1]) if status_line else 0
    return status, time.monotonic() - started


def closed_by_server(opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> int:
    return sum(1 for reader, _ in opened if reader.at_eof() or reader.exception() is not None)


async def run(args: argparse.Namespace) -> int:
    limit = raise_open_files_limit()
    if args.connections + 256 > limit:
        print(f"--connections {args.connections} needs more than the open-files limit {limit}")
        return 2
    overrides = dict(pair.split("=", 1) for pair in args.env)
    port, admin_port = free_port(), free_port()
    env = {
        "SIDECAR_HOST": "127.0.0.1",
        "SIDECAR_PORT": str(port),
        "SIDECAR_ADMIN_PORT": str(admin_port),
        "SIDECAR_DECODE_URL": "http://127.0.0.9:1",  # nothing is served: only connections held
        "SIDECAR_LOG_LEVEL": "WARNING",
        **overrides,
    }
    admin_url = f"http://127.0.0.1:{admin_port}"
    # A container's limit, soft and hard: the sidecar cannot raise it.
    nofile = args.sidecar_nofile
    limited = ["prlimit", f"--nofile={nofile}:{nofile}"] if nofile else []
    print(f"open-files limit {limit}; {args.connections} {args.kind} connections; {overrides}")
    async with (
        Launcher(prefix="pd-sidecar-connections-") as launcher,
        aiohttp.ClientSession() as http,
    ):
        sidecar = await launcher.start(
            "sidecar",
            [*limited, sys.executable, "-m", "sidecar"],
            env=environment(env, drop=["SIDECAR_"]),
            url=admin_url,
            ready="/health",
        )
        before = await read(sidecar, admin_url, http)
        show("before", before)
        started = time.monotonic()
        opened = await open_connections(port, args.connections)
        writers = [writer for _, writer in opened]
        dripping = asyncio.create_task(drip(writers)) if args.kind == "drip" else None
        await asyncio.sleep(1.0)  # let the sidecar take in the last ones (nothing to wait on)
        held = await read(sidecar, admin_url, http)
        show(f"{args.connections} opened in {time.monotonic() - started:.1f} s", held)
        status, probe_s = await probe(port)
        failed = status != 200
        print(f"GET /health on a new connection: {status} in {probe_s * 1000:.1f} ms")
        if held.open > before.open:
            grown = held.rss - before.rss
            print(
                f"per connection held: {grown / (held.open - before.open) / 1024:.2f} KiB RSS, "
                f"{(held.fds - before.fds) / (held.open - before.open):.2f} fds, "
                f"{(held.tasks - before.tasks) / (held.open - before.open):.2f} tasks"
            )
        if not args.no_wait:
            default = Settings.model_fields["client_header_timeout_s"].default
            head_timeout_s = float(overrides.get("SIDECAR_CLIENT_HEADER_TIMEOUT_S", default))
            await asyncio.sleep(head_timeout_s + 2.0)  # the head timeout is what is measured
            after = await read(sidecar, admin_url, http)
            show(f"{head_timeout_s:.0f} s + 2 s later", after)
            closed = closed_by_server(opened)
            print(f"closed by the sidecar: {closed} of {len(opened)} (seen by the clients)")
            failed = failed or closed < len(opened)
        if dripping is not None:
            dripping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dripping
        for _, writer in opened:
            writer.close()
    return 1 if args.quick and failed else 0


def main_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench connections", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--kind", choices=("silent", "drip"), default="silent")
    parser.add_argument("--env", action="append", default=[], metavar="SIDECAR_X=value")
    parser.add_argument(
        "--sidecar-nofile",
        type=int,
        default=0,
        metavar="N",
        help="run the sidecar under an open-files limit of N (soft and hard, with prlimit)",
    )
    parser.add_argument("--no-wait", action="store_true", help="skip the wait for the timeout")
    add_quick(parser, "300 silent connections, a 2 s head timeout; fails when one is not closed")
    args = parser.parse_args(argv)
    apply_quick(parser, args, connections=300, env=["SIDECAR_CLIENT_HEADER_TIMEOUT_S=2"])
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main_cli())
