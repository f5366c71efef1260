"""Run ``python -m sidecar`` under tracemalloc; each SIGUSR1 dumps a snapshot (bench only).

    python -m bench.traced_sidecar python -m sidecar     # as bench/cluster.py's ``under``

``BENCH_TRACEMALLOC_DIR`` names the directory the snapshots go to (``1.snapshot``, ``2.snapshot``,
...; each written under a temporary name and renamed, so a reader never sees half of one);
``BENCH_TRACEMALLOC_FRAMES`` (default 6) the frames kept per allocation. The snapshot is taken
in the signal handler, on the main thread between two bytecodes: it stops the sidecar's loop for
as long as it takes (a second or two with ~100,000 live blocks), which is why this is a
measurement tool and never part of the package. Used by bench/stream_memory.py.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import tracemalloc
from pathlib import Path
from types import FrameType


def main() -> None:
    directory = Path(os.environ["BENCH_TRACEMALLOC_DIR"])
    tracemalloc.start(int(os.environ.get("BENCH_TRACEMALLOC_FRAMES", "6")))
    taken = 0

    def dump(signum: int, frame: FrameType | None) -> None:
        nonlocal taken
        taken += 1
        snapshot = tracemalloc.take_snapshot()
        partial = directory / f".{taken}.snapshot"
        snapshot.dump(str(partial))
        partial.rename(directory / f"{taken}.snapshot")

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = ["sidecar"]  # what follows this script on its command line is `python -m sidecar`
    runpy.run_module("sidecar", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
