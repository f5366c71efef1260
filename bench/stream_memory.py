"""What one open stream costs the sidecar in memory: its RSS, and its heap by line.

RSS at steps of held streams, and what the heap holds per stream (tracemalloc), by module and by
line.

    python -m bench stream_memory                          # steps 0,250,500,750,1000; both passes
    python -m bench stream_memory --steps 0,500,1000 --no-trace
    python -m bench stream_memory --sidecar-env SIDECAR_TRACING=true
    python -m bench stream_memory --quick                  # steps 0,20,40; both passes

Starts a prefill and a decode emulator (the decode one slow: ``--decode-s-per-token``, 1 s, so
that streams stay open while they are counted) and a sidecar (bench/cluster.py's launcher), warms
it up with one-token requests, then opens streams step by step — each a full P/D exchange through
the sidecar, read by the client as they come — and at every step, once all of them are open at
the client and in flight at the sidecar and a second has passed, reads the sidecar's RSS. The
figure is the **slope**: RSS added per additional open stream between two steps (a least-squares
line through the steps from the first non-zero one), which the fixed cost of the imports and of
the first connections does not distort. At the end the client leaves every stream.

Then (unless ``--no-trace``) the same with the sidecar under tracemalloc
(bench/traced_sidecar.py): a snapshot at the first and at the last step, and the difference per
stream held, by module and by source line (the allocation's innermost frame), and by the
outermost frame of the sidecar's own code that led to it. tracemalloc's own bookkeeping inflates
that pass's RSS, so the RSS figures come from the first pass only. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import tempfile
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path

import aiohttp

from bench.client import ClientStats, RequestSpec, client_session, stream_one, wait_until
from bench.cluster import BenchLauncher, add_launcher_arguments, raise_open_files_limit, run
from bench.readings import Metrics, load_average, read_proc
from bench.suite import add_quick, apply_quick
from devkit.processes import Child


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench stream_memory",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", default="0,250,500,750,1000", help="streams held, in order")
    parser.add_argument(
        "--decode-s-per-token", type=float, default=1.0, help="decode emulator delay per token"
    )
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (approx.)")
    parser.add_argument("--ramp-s", type=float, default=5.0, help="time to open one step's streams")
    parser.add_argument("--settle-s", type=float, default=1.0, help="wait before each reading")
    parser.add_argument("--no-trace", action="store_true", help="skip the tracemalloc pass")
    parser.add_argument(
        "--frames",
        type=int,
        default=6,
        help="tracemalloc frames kept (each one slows the traced sidecar)",
    )
    parser.add_argument("--top", type=int, default=25, help="lines of each tracemalloc table")
    add_launcher_arguments(parser)
    add_quick(parser, "steps 0,20,40, both passes")
    args = parser.parse_args(argv)
    apply_quick(parser, args, steps="0,20,40", ramp_s=1.0, settle_s=0.5, top=5)
    args.steps = [int(s) for s in args.steps.split(",") if s]
    if args.steps != sorted(args.steps) or len(args.steps) < 2 or args.steps[0] < 0:
        parser.error("--steps: at least two non-decreasing counts, from 0 or more")
    return args


class Streams:
    """Streams opened through the sidecar and kept open until :meth:`leave`."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, prefill: str, args: argparse.Namespace
    ) -> None:
        self.stats = ClientStats()
        self._session, self._url, self._prefill, self._args = session, url, prefill, args
        self._tasks: list[asyncio.Task[object]] = []
        # Long enough to outlive every step: the ramp, the readings and a snapshot each.
        hold_s = len(args.steps) * (args.ramp_s + args.settle_s + 30) + 60
        self._tokens = max(2, math.ceil(hold_s / args.decode_s_per_token))

    async def open(self, count: int) -> None:
        """Open ``count`` more streams over the ramp."""
        step = self._args.ramp_s / count if count else 0.0
        for _ in range(count):
            index = len(self._tasks)
            spec = RequestSpec(
                index=index, chat=index % 2 == 0, output_tokens=self._tokens,
                prompt_tokens=self._args.prompt_tokens, prefill=self._prefill,
                timeout_s=3600,
            )  # fmt: skip
            self._tasks.append(
                asyncio.create_task(stream_one(self._session, self._url, spec, self.stats))
            )
            await asyncio.sleep(step)

    async def leave(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def inflight(session: aiohttp.ClientSession, sidecar: Child) -> float:
    async with session.get(sidecar.url + "/metrics") as response:
        return Metrics.parse(await response.text()).value("pd_sidecar_inflight_requests")


async def one_pass(
    args: argparse.Namespace, launcher: BenchLauncher, *, traced: Path | None
) -> list[tuple[int, int]]:
    """Start the processes, open the steps' streams; (streams held, sidecar RSS bytes) per step.
    ``traced``: run the sidecar under tracemalloc, snapshots into that directory."""
    prefill, decode = await launcher.start_emulators(
        decode_flags=("--decode-s-per-token", str(args.decode_s_per_token))
    )
    settings = {"SIDECAR_LOG_LEVEL": "WARNING"}
    if traced is not None:
        # Under tracemalloc the sidecar's loop is slow enough that a connection to the decode
        # engine can outlast the default 2 s connect timeout: the memory per stream is the same.
        settings["SIDECAR_CONNECT_TIMEOUT_S"] = "30"
    settings.update(s.split("=", 1) for s in args.sidecar_env)
    under: list[str] = []
    if traced is not None:
        os.environ["BENCH_TRACEMALLOC_DIR"] = str(traced)
        os.environ["BENCH_TRACEMALLOC_FRAMES"] = str(args.frames)
        under = [sys.executable, "-m", "bench.traced_sidecar"]
    name = "sidecar-traced" if traced is not None else "sidecar"
    sidecar = launcher.spawn_sidecar(name, decode_url=decode.url, settings=settings, under=under)
    await sidecar.wait_ready("/ready", timeout_s=60 if traced is None else 300)
    readings: list[tuple[int, int]] = []
    async with client_session() as session, aiohttp.ClientSession() as control:
        warm = ClientStats()
        for index in range(20):  # one token: no decode delay
            spec = RequestSpec(index=-1 - index, chat=index % 2 == 0, output_tokens=1,
                               prompt_tokens=args.prompt_tokens, prefill=prefill.endpoint,
                               timeout_s=30)  # fmt: skip
            await stream_one(session, sidecar.url, spec, warm)
        if warm.error_count:
            raise RuntimeError(f"warm-up failed: {dict(warm.errors)} {warm.examples}")
        streams = Streams(session, sidecar.url, prefill.endpoint, args)
        held = 0
        try:
            for step, target in enumerate(args.steps):
                await streams.open(target - held)
                held = target

                async def all_open(held: int = held) -> bool:
                    return (
                        streams.stats.open_streams >= held
                        and await inflight(control, sidecar) >= held
                    )

                if not await wait_until(all_open, 120.0):
                    raise RuntimeError(
                        f"only {streams.stats.open_streams} of {held} streams opened;"
                        f" errors {dict(streams.stats.errors)} {streams.stats.examples}"
                    )
                await asyncio.sleep(args.settle_s)
                rss = read_proc(sidecar.pid).rss
                readings.append((held, rss))
                line = f"  {name}: {held:5d} streams open, RSS {rss / 2**20:6.1f} MiB"
                if traced is not None and step in (0, len(args.steps) - 1):
                    os.kill(sidecar.pid, signal.SIGUSR1)
                    path = traced / f"{1 if step == 0 else 2}.snapshot"

                    async def dumped(path: Path = path) -> bool:
                        return os.path.exists(path)  # noqa: ASYNC240 - a stat, while polling

                    started = time.monotonic()
                    if not await wait_until(dumped, 120.0):
                        raise RuntimeError(f"no snapshot {path}")
                    line += f"; snapshot in {time.monotonic() - started:.1f} s"
                print(line + f"  (load {load_average()})", flush=True)
        finally:
            await streams.leave()
    if streams.stats.error_count:
        raise RuntimeError(f"stream errors: {dict(streams.stats.errors)} {streams.stats.examples}")
    for child in (sidecar, decode, prefill):
        await child.stop(5)
    return readings


def slope(readings: list[tuple[int, int]]) -> float:
    """Bytes per additional stream: the least-squares slope through the steps with streams
    (through all of them when fewer than two have any)."""
    points = [(n, rss) for n, rss in readings if n > 0]
    if len(points) < 2:
        points = readings
    mean_n = sum(n for n, _ in points) / len(points)
    mean_r = sum(r for _, r in points) / len(points)
    spread = sum((n - mean_n) ** 2 for n, _ in points)
    return sum((n - mean_n) * (r - mean_r) for n, r in points) / spread if spread else math.nan


def _module(filename: str) -> str:
    """``aiohttp/web_protocol.py`` for a file of a package, else the file's name."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "lib"):
        if anchor in parts:
            rest = parts[len(parts) - parts[::-1].index(anchor) :]
            if rest and not rest[0].startswith("python3"):
                return "/".join(rest)
    if "sidecar" in parts:
        return "/".join(parts[parts.index("sidecar") :])
    return "/".join(parts[-2:])


def _own_frame(trace: tracemalloc.Traceback) -> str:
    """The outermost frame of the sidecar's own code in ``trace`` (most recent call first)."""
    for frame in reversed(trace):  # oldest first
        name = frame.filename
        if "/sidecar/" in name and "/site-packages/" not in name and "emulator" not in name:
            return f"{_module(name)}:{frame.lineno}"
    return "(no sidecar frame)"


def trace_report(directory: Path, streams: int, top: int) -> list[str]:
    """What the heap gained between the two snapshots, per stream held."""
    first = tracemalloc.Snapshot.load(str(directory / "1.snapshot"))
    last = tracemalloc.Snapshot.load(str(directory / "2.snapshot"))
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    first, last = first.filter_traces(ignore), last.filter_traces(ignore)
    total = sum(s.size for s in last.statistics("filename")) - sum(
        s.size for s in first.statistics("filename")
    )
    lines = [
        f"heap (tracemalloc) +{total / 2**20:.1f} MiB = {total / streams:,.0f} bytes per stream"
    ]

    by_module: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for diff in last.compare_to(first, "filename"):
        entry = by_module[_module(diff.traceback[0].filename)]
        entry[0] += diff.size_diff
        entry[1] += diff.count_diff
    lines.append("")
    lines.append("by module (innermost frame): bytes per stream, blocks per stream")
    for module, (size, count) in sorted(by_module.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / streams:9,.0f} B {count / streams:7.1f}  {module}")

    lines.append("")
    lines.append("by line (innermost frame): bytes per stream, blocks per stream")
    for diff in last.compare_to(first, "lineno")[:top]:
        frame = diff.traceback[0]
        lines.append(
            f"  {diff.size_diff / streams:9,.0f} B {diff.count_diff / streams:7.1f}"
            f"  {_module(frame.filename)}:{frame.lineno}"
        )

    by_own: dict[str, int] = defaultdict(int)
    for diff in last.compare_to(first, "traceback"):
        by_own[_own_frame(diff.traceback)] += diff.size_diff
    lines.append("")
    lines.append("by the sidecar's outermost frame (what led to the allocation): bytes per stream")
    for where, size in sorted(by_own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {size / streams:9,.0f} B  {where}")
    return lines


async def main(args: argparse.Namespace) -> int:
    raise_open_files_limit()
    print(
        f"stream memory: steps {args.steps} streams held, decode {args.decode_s_per_token:g} s a"
        f" token, ~{args.prompt_tokens}-token prompts; load average {load_average()}",
        flush=True,
    )
    async with BenchLauncher(args.log_dir, prefix="pd-sidecar-stream-memory-") as launcher:
        print(f"logs in {launcher.log_dir}", flush=True)
        readings = await one_pass(args, launcher, traced=None)
        per_stream = slope(readings)
        lines = [
            "RSS per step: " + ", ".join(f"{n} → {r / 2**20:.1f} MiB" for n, r in readings),
            f"RSS per additional stream (least squares over the steps with streams):"
            f" {per_stream / 1024:.1f} KiB",
        ]
        print("\n".join(lines), flush=True)
        if not args.no_trace:
            with tempfile.TemporaryDirectory(prefix="pd-sidecar-tracemalloc-") as directory:
                await one_pass(args, launcher, traced=Path(directory))
                held = args.steps[-1] - args.steps[0]
                print()
                print("\n".join(trace_report(Path(directory), held, args.top)))
    print(f"load average {load_average()}")
    with contextlib.suppress(OSError), open("/proc/pressure/cpu") as pressure:  # noqa: ASYNC230
        print("cpu pressure " + pressure.readline().strip())
    return 0


def main_cli(argv: list[str] | None = None) -> int:
    return run(lambda: main(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main_cli())
