"""Instructions per request of a proxy, counted by callgrind (the load does not move them).

A figure that does not move with the machine's load, for changes too small for CPU seconds to
show (docs/benchmarks.md).

    python -m bench instructions                          # this checkout's sidecar
    python -m bench instructions --repo ../main           # another checkout's, same interpreter
    python -m bench instructions --variants sidecar,aiohttp-floor --concurrency 16
    python -m bench instructions --baseline ../main --variants sidecar   # A/B, one run
    python -m bench instructions --sidecar-env SIDECAR_TRACING=true --sidecar-env OTEL_...=...
    python -m bench instructions --quick                  # the sidecar and the floor, 5 requests

Two emulators (``python -m sidecar.emulator``), started once, and each variant in turn under
``valgrind --tool=callgrind`` (``PYTHONHASHSEED=0``) on a free loopback port: ``sidecar`` (the
sidecar of ``--repo``, started in it so that its ``sidecar`` package is the one imported, with
``SIDECAR_CONNECT_TIMEOUT_S=60``), ``sidecar-base`` (the same for ``--baseline``) and
``aiohttp-floor`` (``bench/floor_proxy.py``, the smallest two-leg proxy on the same stack). For
each: ``--warmup`` requests of each mode, and per mode (non-streamed, then
``--output-tokens``-token streams) the counters zeroed (``callgrind_control -z``), ``--requests``
completions sent by ``--concurrency`` workers (each sends its next when the last was answered)
naming the prefill emulator in ``x-prefiller-host-port``, a pause of ``--settle-s`` (a batch of
spans the tracer exports on its schedule), and the counters dumped: the instructions (``Ir``) of
every thread of the proxy process over those requests, less what the proxy does per second when
idle (the sidecar's readiness polls and engine scrapes, counted over ``--idle-s`` with no request
before the batches, times the batch's duration: under callgrind on a loaded machine a batch lasts
minutes, and that work is not the requests'), divided by their number (the raw figure is printed
too). With the floor among the variants, each other variant's figure is also given as a ratio to
the floor's. The dumps stay in ``--out`` for ``callgrind_annotate``. Callgrind counts instructions
in user space only: a system call (``getpid``, ``send``) counts as the few instructions that make
it.

Needs valgrind (``apt-get install valgrind``). Under callgrind the sidecar runs about 50 times
slower: the defaults take a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import re
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import aiohttp

from bench.suite import add_quick, apply_quick

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("sidecar", "sidecar-base", "aiohttp-floor")
FLOOR = "aiohttp-floor"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench instructions",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose sidecar runs")
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another checkout: its sidecar as sidecar-base"
    )
    parser.add_argument(
        "--variants",
        default="sidecar",
        help=f"comma-separated, of {', '.join(VARIANTS)} (sidecar-base with --baseline)",
    )
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    parser.add_argument("--requests", type=int, default=300, help="counted requests per mode")
    parser.add_argument("--warmup", type=int, default=50, help="requests before counting")
    parser.add_argument("--output-tokens", type=int, default=64, help="max_tokens per request")
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause before each dump")
    parser.add_argument(
        "--idle-s", type=float, default=10.0, help="idle window for the per-second work (0: none)"
    )
    parser.add_argument(
        "--sidecar-env", action="append", default=[], metavar="NAME=VALUE", help="repeatable"
    )
    parser.add_argument("--out", type=Path, default=None, help="callgrind files (default: tmp)")
    add_quick(parser, "the sidecar and the floor, 5 requests per mode, no idle window")
    args = parser.parse_args(argv)
    apply_quick(
        parser, args, variants="sidecar,aiohttp-floor", requests=5, warmup=2, output_tokens=8,
        settle_s=0.5, idle_s=0.0,
    )  # fmt: skip
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.baseline is not None and "sidecar-base" not in args.variants:
        args.variants.insert(0, "sidecar-base")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or ("sidecar-base" in args.variants and args.baseline is None):
        parser.error(f"variants: {unknown or 'sidecar-base needs --baseline'}")
    return args


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 600) -> None:
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)  # a process starting: nothing to await but its port
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g}s")


def instructions(out: Path, pid: int) -> int:
    """``Ir`` of the newest callgrind dump of ``pid``."""
    dumps = sorted(glob.glob(f"{out}/callgrind.{pid}*"), key=os.path.getmtime)
    match = re.search(r"^(?:summary|totals): (\d+)", Path(dumps[-1]).read_text(), re.M)
    assert match, dumps[-1]
    return int(match.group(1))


async def callgrind_control(flag: str, pid: int) -> None:
    control = await asyncio.create_subprocess_exec(
        "callgrind_control",
        flag,
        str(pid),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    if await control.wait() != 0:
        raise RuntimeError(f"callgrind_control {flag} {pid} failed")


async def measure(args: argparse.Namespace, out: Path, log: IO[str]) -> dict[str, dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDECAR_", "OTEL_"))}
    env["PYTHONHASHSEED"] = "0"
    prefill, decode = free_port(), free_port()
    emulators = [
        await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "sidecar.emulator", "--port", str(p)),
            cwd=args.repo,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        for p in (prefill, decode)
    ]
    figures: dict[str, dict[str, float]] = {}
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        ) as session:
            for url in (f"http://127.0.0.1:{p}/health" for p in (prefill, decode)):
                await ready(session, url)
            for variant in args.variants:
                figures[variant] = await measure_one(
                    args, variant, session, env, prefill, decode, out, log
                )
    finally:
        for process in emulators:
            process.terminate()
        for process in emulators:
            await process.wait()
    return figures


def proxy_command(
    args: argparse.Namespace, variant: str, env: dict[str, str], port: int, decode: int
) -> tuple[list[str], Path, dict[str, str]]:
    """The command line, working directory and environment of one variant."""
    decode_url = f"http://127.0.0.1:{decode}"
    if variant == FLOOR:
        command = [sys.executable, "-m", "bench.floor_proxy", "--port", str(port)]
        return [*command, "--decode-url", decode_url], REPO, env
    sidecar_env = {
        **env,
        "SIDECAR_HOST": "127.0.0.1",
        "SIDECAR_PORT": str(port),
        "SIDECAR_DECODE_URL": decode_url,
        "SIDECAR_LOG_LEVEL": "WARNING",
        # Under callgrind every step is ~50 times slower: a connection to an emulator can take
        # longer than the default allows when the machine is loaded.
        "SIDECAR_CONNECT_TIMEOUT_S": "60",
    }
    for item in args.sidecar_env:
        name, _, value = item.partition("=")
        sidecar_env[name] = value
    repo = args.baseline if variant == "sidecar-base" else args.repo
    return [sys.executable, "-m", "sidecar"], repo, sidecar_env


async def measure_one(
    args: argparse.Namespace,
    variant: str,
    session: aiohttp.ClientSession,
    env: dict[str, str],
    prefill: int,
    decode: int,
    out: Path,
    log: IO[str],
) -> dict[str, float]:
    port = free_port()
    command, cwd, proxy_env = proxy_command(args, variant, env, port, decode)
    dumps = out / variant
    dumps.mkdir(parents=True, exist_ok=True)
    valgrind = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={dumps}/callgrind.%p")
    proxy = await asyncio.create_subprocess_exec(
        *valgrind,
        *command,
        cwd=cwd,
        env=proxy_env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=log,
    )
    per_request: dict[str, float] = {}
    base = f"http://127.0.0.1:{port}"
    retried: list[str] = []
    try:
        await ready(session, base + ("/health" if variant == FLOOR else "/ready"))

        async def one(index: int, stream: bool) -> None:
            body = {
                "model": "emulated-model",
                "prompt": f"request {index} " + "x" * 256,
                "max_tokens": args.output_tokens,
                "stream": stream,
            }
            headers = {"x-prefiller-host-port": f"127.0.0.1:{prefill}"}
            for attempt in range(3):
                async with session.post(base + "/v1/completions", json=body, headers=headers) as r:
                    text = await r.text()
                    if r.status == 200:
                        return
                    # Under callgrind a kept-alive engine connection the emulator has just
                    # closed can fail a leg (503): sent again, and counted.
                    assert r.status == 503, text
                    assert attempt < 2, text
                    retried.append(text)

        async def batch(first: int, count: int, stream: bool) -> None:
            indexes = iter(range(first, first + count))

            async def worker() -> None:
                for index in indexes:
                    await one(index, stream)

            await asyncio.gather(*(worker() for _ in range(max(1, args.concurrency))))

        await batch(0, args.warmup, False)
        await batch(args.warmup, args.warmup, True)
        first = 2 * args.warmup
        idle_per_s = 0.0
        if args.idle_s > 0:
            # What the proxy does with no request (the sidecar's readiness polls and scrapes):
            # per second, not per request, and under callgrind a batch lasts minutes, so it is
            # taken out of the per-request figure below.
            await callgrind_control("-z", proxy.pid)
            began = time.monotonic()
            await asyncio.sleep(args.idle_s)
            await callgrind_control("-d", proxy.pid)
            elapsed = time.monotonic() - began
            await asyncio.sleep(args.settle_s)  # the dump is written
            idle_per_s = instructions(dumps, proxy.pid) / elapsed
            per_request["idle per second"] = idle_per_s
        for mode, stream in (("non-stream", False), ("stream", True)):
            await callgrind_control("-z", proxy.pid)
            began = time.monotonic()
            await batch(first, args.requests, stream)
            first += args.requests
            await asyncio.sleep(args.settle_s)  # spans exported on the tracer's schedule
            await callgrind_control("-d", proxy.pid)
            elapsed = time.monotonic() - began
            await asyncio.sleep(args.settle_s)  # the dump is written
            counted = instructions(dumps, proxy.pid)
            per_request[f"{mode} raw"] = counted / args.requests
            per_request[mode] = (counted - idle_per_s * elapsed) / args.requests
            per_request[f"{mode} retries"] = len(retried)
            retried.clear()
    finally:
        proxy.terminate()
        await proxy.wait()
    return per_request


def main_cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pd-sidecar-instructions-"))
    out.mkdir(parents=True, exist_ok=True)
    # SIGTERM ends the run as Ctrl-C does: the proxies and emulators are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with open(out / "valgrind.log", "w") as log:
        figures = asyncio.run(measure(args, out, log))
    settings = " ".join(args.sidecar_env) or "defaults"
    print(f"c={args.concurrency}, {args.requests} requests per mode, dumps in {out}")
    for variant, per_request in figures.items():
        where = {"sidecar": args.repo, "sidecar-base": args.baseline}.get(variant, "")
        label = f"{variant} {where} ({settings})" if where else variant
        for mode, count in per_request.items():
            if mode == "idle per second" or mode.endswith(" raw"):
                print(f"{label} {mode}: {count:,.0f} instructions")
                continue
            if mode.endswith("retries"):
                if count:
                    print(f"{label} {mode}: {count:g} (503s sent again, their cost included)")
                continue
            ratio = ""
            if FLOOR in figures and variant != FLOOR:
                ratio = f"  = {count / figures[FLOOR][mode]:.3f}x the floor"
            net = f"{count:,.0f} instructions per request, net of the idle work"
            print(f"{label} {mode}: {net}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main_cli())
