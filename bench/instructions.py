"""Instructions per request of the sidecar, counted by callgrind: a figure that does not move
with the machine's load, for changes too small for CPU seconds to show (docs/benchmarks.md,
"Tracing's cost").

    python bench/instructions.py                          # this checkout's sidecar
    python bench/instructions.py --repo ../main           # another checkout's, same interpreter
    python bench/instructions.py --sidecar-env SIDECAR_TRACING=true --sidecar-env OTEL_...=...

Two emulators (``python -m sidecar.emulator``) and the sidecar under ``valgrind --tool=callgrind``
(``PYTHONHASHSEED=0``), each on a free loopback port, every process started in ``--repo`` so that
its ``sidecar`` package is the one imported; then ``--warmup`` requests, and per mode
(non-streamed, then ``--output-tokens``-token streams) the counters zeroed
(``callgrind_control -z``), ``--requests`` completions sent one at a time through the sidecar
naming the prefill emulator in ``x-prefiller-host-port``, a pause of ``--settle-s`` (a batch of
spans the tracer exports on its schedule), and the counters dumped: the instructions (``Ir``) of
every thread of the sidecar process over those requests, divided by their number.

Needs valgrind (``apt-get install valgrind``). Under callgrind the sidecar runs about 50 times
slower: the defaults take a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import aiohttp

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose sidecar runs")
    parser.add_argument("--requests", type=int, default=300, help="counted requests per mode")
    parser.add_argument("--warmup", type=int, default=50, help="requests before counting")
    parser.add_argument("--output-tokens", type=int, default=64, help="max_tokens per request")
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause before each dump")
    parser.add_argument(
        "--sidecar-env", action="append", default=[], metavar="NAME=VALUE", help="repeatable"
    )
    parser.add_argument("--out", type=Path, default=None, help="callgrind files (default: tmp)")
    return parser.parse_args(argv)


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


async def measure(args: argparse.Namespace, out: Path, log: IO[str]) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIDECAR_", "OTEL_"))}
    env["PYTHONHASHSEED"] = "0"
    prefill, decode, port = free_port(), free_port(), free_port()
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
    sidecar_env = {
        **env,
        "SIDECAR_HOST": "127.0.0.1",
        "SIDECAR_PORT": str(port),
        "SIDECAR_DECODE_URL": f"http://127.0.0.1:{decode}",
        "SIDECAR_LOG_LEVEL": "WARNING",
    }
    for item in args.sidecar_env:
        name, _, value = item.partition("=")
        sidecar_env[name] = value
    valgrind = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/callgrind.%p")
    sidecar = await asyncio.create_subprocess_exec(
        *valgrind,
        *(sys.executable, "-m", "sidecar"),
        cwd=args.repo,
        env=sidecar_env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=log,
    )
    per_request: dict[str, float] = {}
    try:
        async with aiohttp.ClientSession() as session:
            for url in (f"http://127.0.0.1:{p}/health" for p in (prefill, decode)):
                await ready(session, url)
            base = f"http://127.0.0.1:{port}"
            await ready(session, base + "/ready")

            async def one(index: int, stream: bool) -> None:
                body = {
                    "model": "emulated-model",
                    "prompt": f"request {index} " + "x" * 256,
                    "max_tokens": args.output_tokens,
                    "stream": stream,
                }
                headers = {"x-prefiller-host-port": f"127.0.0.1:{prefill}"}
                async with session.post(base + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

            for index in range(args.warmup):
                await one(index, index % 2 == 0)
            for mode, stream in (("non-stream", False), ("stream", True)):
                await callgrind_control("-z", sidecar.pid)
                for index in range(args.requests):
                    await one(args.warmup + index, stream)
                await asyncio.sleep(args.settle_s)  # spans exported on the tracer's schedule
                await callgrind_control("-d", sidecar.pid)
                await asyncio.sleep(args.settle_s)  # the dump is written
                per_request[mode] = instructions(out, sidecar.pid) / args.requests
    finally:
        for process in (sidecar, *emulators):
            process.terminate()
        for process in (sidecar, *emulators):
            await process.wait()
    return per_request


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="pd-sidecar-instructions-"))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "valgrind.log", "w") as log:
        per_request = asyncio.run(measure(args, out, log))
    settings = " ".join(args.sidecar_env) or "defaults"
    for mode, count in per_request.items():
        print(f"{args.repo} ({settings}) {mode}: {count:,.0f} instructions per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
