"""``python -m bench NAME [args]``: run one benchmark; ``--help`` lists them all.

    python -m bench --help                          # every benchmark, with its summary
    python -m bench overhead --quick                # one, in its quick mode
    python -m bench kv_events_flood --seconds 60    # one, with its own flags
    python -m bench NAME --help                     # a benchmark's own flags
    python -m bench --smoke                         # every one in its quick mode (make bench-smoke)

Run from the repository's root (the ``bench`` package is not installed).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bench.suite import BENCHMARKS, smoke, summary


def parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<17} {summary(name)}" for name in BENCHMARKS)
    result = argparse.ArgumentParser(
        prog="python -m bench",
        description="The pd-sidecar benchmarks: run one with its own flags.",
        epilog=f"benchmarks:\n{listing}\n\n`python -m bench NAME --help` gives NAME's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    result.add_argument("name", nargs="?", choices=BENCHMARKS, metavar="NAME", help="benchmark")
    result.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    result.add_argument(
        "--smoke", action="store_true", help="every benchmark with --quick, one after the other"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = parser()
    if argv and argv[0] in BENCHMARKS:  # the rest, --help included, is the benchmark's
        module = importlib.import_module(f"bench.{argv[0]}")
        status: int = module.main_cli(argv[1:])
        return status
    args = command.parse_args(argv)
    if args.smoke and args.name is not None:
        command.error("--smoke runs every benchmark: give it no NAME (NAME --quick runs one)")
    if args.smoke:
        return smoke()
    command.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
