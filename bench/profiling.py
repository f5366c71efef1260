"""Where a proxy's CPU goes: py-spy flame graphs under the overhead benchmark's c=16 load.

``python -m bench overhead --profile DIR`` starts the sidecar and the aiohttp floor in turn (on
the same emulators and pinning as the measurement) and, for non-streaming and streaming load at
concurrency 16, records ``--profile-s`` seconds with ``py-spy record`` (from the benchmark's
venv: ``pip install py-spy``; on the client's core, so it takes nothing from the proxy's):
``DIR/<variant>-<mode>-c16.svg``, a flame graph, and ``.txt``, the same samples' heaviest
frames, inclusive and self, as shares of the samples where the process was busy (py-spy drops
idle samples). Each is a second recording of the same load, so the two agree in proportion, not
sample for sample. With ``native`` (``--profile-native``) the stacks include C frames: uvloop's
loop, aiohttp's C HTTP parser, orjson, and the garbage collector, which a Python-only profile
charges to whatever Python frame allocated; the summary then also sums the samples in each of
those (:data:`NATIVE_PARTS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
from collections import Counter
from pathlib import Path

from bench.client import Tally, Target, Workload, client_session, drive
from bench.cluster import BenchLauncher
from bench.contenders import Pinning, start_proxy
from devkit.processes import Child

RATE_HZ = 250
CONCURRENCY = 16


def py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


NATIVE_PARTS = {
    "garbage collection": ("gc_collect", "collect_generations"),
    "aiohttp's C HTTP parser": ("_http_parser", "llhttp"),
    "uvloop's I/O polling (socket reads and their protocol callbacks)": ("uv__io_poll",),
    "socket writes": ("uv__write", "uv_try_write"),
    "orjson": ("orjson",),
}
"""Parts of a native profile, by substrings of their C frames' names."""


def heaviest(raw: str, limit: int = 40) -> list[str]:
    """The frames of py-spy's raw (collapsed) output with the most samples: inclusive (a frame
    anywhere in the stack, once per stack) and self (the innermost frame); with C frames, the
    share of :data:`NATIVE_PARTS` too."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    parts: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
        for part, markers in NATIVE_PARTS.items():
            if any(marker in frame for frame in frames for marker in markers):
                parts[part] += count
    lines = [f"{total} samples while busy at {RATE_HZ} Hz"]
    if parts:
        lines += ["", "native parts (inclusive):"]
        lines += [f"  {100 * n / total:5.1f}%  {part}" for part, n in parts.most_common()]
    lines += ["", "inclusive:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in inclusive.most_common(limit)]
    own_code = Counter({f: n for f, n in inclusive.items() if "(sidecar/" in f or "(bench/" in f})
    if own_code:
        lines += ["", "the proxy's own functions (inclusive):"]
        lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own_code.most_common(limit)]
    lines += ["", "self:"]
    lines += [f"  {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(limit)]
    return lines


async def _record(
    spy: str, pinning: Pinning, child: Child, out: Path, fmt: str, seconds: float, native: bool
) -> int:
    argv = [
        spy, "record", "--pid", str(child.pid), "--rate", str(RATE_HZ), "--function",
        "--duration", str(int(seconds)), "--format", fmt, "--output", str(out),
        *(["--native"] if native else []),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *pinning.taskset(pinning.client),
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate()
    if process.returncode != 0:
        print(f"  py-spy failed: {err.decode(errors='replace').strip()[-500:]}")
    return process.returncode or 0


def _summarize(raw: Path) -> Path | None:
    """``x.raw`` → ``x.txt`` (its heaviest frames); the raw file is removed."""
    if not raw.exists():
        return None
    summary = raw.with_suffix(".txt")
    summary.write_text("\n".join(heaviest(raw.read_text())) + "\n")
    raw.unlink()
    return summary


async def _profile_load(
    spy: str,
    pinning: Pinning,
    child: Child,
    target: Target,
    workload: Workload,
    out_dir: Path,
    seconds: float,
    native: bool,
) -> int:
    """Warm up, then two recordings (flame graph, raw samples) of ``child`` under load."""
    slug = f"{child.name}-{'stream' if workload.stream else 'nonstream'}-c{CONCURRENCY}"
    status = 0
    index = 10**9  # prompts distinct from any measurement's
    async with client_session(lean=True) as session:
        stats = Tally()
        await drive(
            session, target, workload, count=500, concurrency=CONCURRENCY,
            first_index=index, stats=stats,
        )  # fmt: skip
        for fmt, ext in (("flamegraph", "svg"), ("raw", "raw")):
            index += 10**7
            out = out_dir / f"{slug}.{ext}"
            run = drive(
                session, target, workload, count=10**7, concurrency=CONCURRENCY,
                first_index=index, stats=stats,
            )  # fmt: skip
            load = asyncio.create_task(run)
            try:
                status |= await _record(spy, pinning, child, out, fmt, seconds, native)
            finally:
                load.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await load
            print(f"  {out} ({stats.ok} requests so far, {stats.error_count} errors)")
    summary = _summarize(out_dir / f"{slug}.raw")
    if summary is not None:
        print(f"  {summary}")
    if stats.error_count:
        print(f"  errors: {dict(stats.errors)} {stats.examples}")
        status = 1
    return status


async def profile(
    launcher: BenchLauncher,
    pinning: Pinning,
    prefill: Child,
    decode: Child,
    out_dir: Path,
    seconds: float,
    sidecar_env: dict[str, str],
    native: bool = False,
) -> int:
    """Profile the sidecar and the aiohttp floor, non-streaming and streaming, at c=16."""
    spy = py_spy()
    if spy is None:
        print("py-spy not found: pip install py-spy into the benchmark's venv")
        return 1
    _prepare(out_dir)
    status = 0
    for variant in ("sidecar", "aiohttp-floor"):
        child, target = await start_proxy(
            launcher, variant, pinning=pinning, prefill=prefill, decode=decode, router=None,
            sidecar_env=sidecar_env,
        )  # fmt: skip
        assert child is not None
        try:
            for workload in (Workload(False, 64, 64), Workload(True, 64, 64)):
                status |= await _profile_load(
                    spy, pinning, child, target, workload, out_dir, seconds, native
                )
        finally:
            await child.stop(5)
    return status


def _prepare(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
