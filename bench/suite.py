"""The benchmark suite: which modules of ``bench`` are benchmarks, and their quick mode.

A benchmark is a module of this package with a one-line summary (its docstring's first line), a
``main_cli(argv) -> int`` and a ``--quick`` flag: the smoke run, seconds of wall time, which
judges no timing and fails when something does not run (a request that failed, a process that
could not start) or a bound the benchmark guards does not hold (a leak, memory past a cap).
``python -m bench NAME`` runs one; ``python -m bench --smoke`` runs every one in its quick mode
(with :data:`SMOKE_ARGS`; some more than once, :data:`SMOKE_MORE`), each in a process of its
own (``make bench-smoke``).

The other modules are the benchmarks' parts: libraries (the load generator, the launcher, the
readings, the simulator in ``bench/sim``) and programs run as ``python -m bench.X``: the aiohttp
floor proxy and the sidecar under tracemalloc, which the benchmarks start, and an OTLP sink to
point a traced sidecar at.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent

BENCHMARKS = (
    "bodies",
    "calibrate",
    "connections",
    "decision_cost",
    "exact_sweep",
    "fleet",
    "instructions",
    "kv_events",
    "kv_events_flood",
    "kv_index",
    "kv_shared",
    "load",
    "overhead",
    "prefill_answer",
    "prefix_live",
    "resp_bounds",
    "saturation",
    "simulate",
    "soak",
    "stream_memory",
)
"""Every benchmark, by module name: what ``python -m bench NAME`` accepts."""

SMOKE_TIMEOUT_S = 300.0
"""A quick run that has not ended by then fails the smoke run (the slowest, instructions under
callgrind, takes 70-170 s here)."""
SMOKE_ARGS: dict[str, tuple[str, ...]] = {
    # The simulator's own --quick searches every scenario on three seeds (minutes): one
    # scenario, one seed, short runs, the checks (which need the full runs) not judged.
    "simulate": ("--scenario", "standard", "--seeds", "1", "--requests", "300", "--no-checks"),
}
"""Flags the smoke run gives a benchmark besides ``--quick``."""
SMOKE_MORE: dict[str, tuple[tuple[str, ...], ...]] = {
    # fleet's quick run plays today's reservations: the counters by epoch get their own.
    "fleet": (("--reservations", "counters"),),
}
"""More quick runs of a benchmark, each with these flags besides ``--quick``."""


def summary(name: str) -> str:
    """The first line of benchmark ``name``'s docstring, read without importing it."""
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    docstring = ast.get_docstring(tree) or ""
    return docstring.split("\n\n")[0].replace("\n", " ").strip()


def add_quick(parser: argparse.ArgumentParser, what: str) -> None:
    """The ``--quick`` flag; ``what`` says what the quick run does."""
    parser.add_argument("--quick", action="store_true", help=f"the smoke run: {what}")


def apply_quick(
    parser: argparse.ArgumentParser, args: argparse.Namespace, **values: object
) -> argparse.Namespace:
    """With ``--quick``, ``values`` replace the defaults of the flags the command line left at
    their defaults (a flag given explicitly keeps its value)."""
    if getattr(args, "quick", False):
        for name, value in values.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    return args


def smoke(names: tuple[str, ...] = BENCHMARKS) -> int:
    """Every benchmark in ``names`` with ``--quick``, one after the other, each in a process of
    its own; the wall time of each, then the failed ones. Exit status 1 when one failed."""
    failed: list[str] = []
    times: list[tuple[str, float]] = []
    began = time.monotonic()
    runs = [
        (name, flags)
        for name in names
        for flags in (SMOKE_ARGS.get(name, ()), *SMOKE_MORE.get(name, ()))
    ]
    for benchmark, flags in runs:
        name = (
            " ".join([benchmark, *flags]) if flags in SMOKE_MORE.get(benchmark, ()) else benchmark
        )
        argv = ["-m", "bench", benchmark, "--quick", *flags]
        print(f"[smoke] python {' '.join(argv)}", flush=True)
        started = time.monotonic()
        try:
            status = subprocess.run(
                [sys.executable, *argv], cwd=PACKAGE.parent, timeout=SMOKE_TIMEOUT_S
            ).returncode
        except subprocess.TimeoutExpired:  # the child is killed: a hang fails, not CI's clock
            status = -1
            print(f"[smoke] {name}: no end within {SMOKE_TIMEOUT_S:.0f} s", flush=True)
        times.append((name, time.monotonic() - started))
        if status != 0:
            failed.append(f"{name} (exit status {status})")
        print(f"[smoke] {name}: {times[-1][1]:.1f} s, exit status {status}", flush=True)
    print()
    for name, seconds in times:
        print(f"{name:<30} {seconds:>6.1f} s")
    print(f"{'total':<30} {time.monotonic() - began:>6.1f} s")
    if failed:
        print("FAILED: " + ", ".join(failed))
        return 1
    return 0
