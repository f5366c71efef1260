"""What an oversized prefill answer costs the sidecar: its peak RSS, and what it read.

    python -m bench prefill_answer                          # 4 answers of 400 MiB, one at a time
    python -m bench prefill_answer --size-mib 100 --requests 8 --concurrency 4
    python -m bench prefill_answer --quick                  # 2 answers of 100 MiB

Same processes as bench/load.py. The prefill emulator is armed with ``bloat`` faults: each
prefill answer carries ``--size-mib`` of padding before its own fields, chunked (no
``Content-Length`` says how long it is) — a header-named target in open mode can answer that.
``--requests`` generation requests name it in ``x-prefiller-host-port``, ``--concurrency`` at
once. Printed: the sidecar's RSS before, its peak RSS (``VmHWM``) after, the answers' statuses,
the fallback reasons counted, and how much padding the emulator managed to write (what the
sidecar let through before it stopped reading).

Exit status 0 when every request was answered 200 (decoded locally after the failed prefill,
the default ``SIDECAR_PREFILL_FALLBACK=local``) and the peak stayed within ``--max-growth-mib``
of the RSS before; 1 otherwise. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter

from bench.cluster import Cluster, ClusterConfig, add_cluster_arguments, run
from bench.readings import mib, read_proc
from bench.suite import add_quick, apply_quick

MIB = 1024 * 1024


async def main(args: argparse.Namespace) -> int:
    config = ClusterConfig.from_args(args, decode_s_per_token=0.0)
    async with Cluster(config) as cluster:
        http = cluster.session
        fault = {"kind": "bloat", "role": "prefill", "size": args.size_mib * MIB}
        async with http.post(
            cluster.prefill.url + "/emulator/faults", json={**fault, "count": args.requests}
        ) as response:
            response.raise_for_status()
        before = read_proc(cluster.sidecar.pid)
        statuses: Counter[int] = Counter()
        slots = asyncio.Semaphore(args.concurrency)
        endpoint = cluster.prefill.url.removeprefix("http://")

        async def one(index: int) -> None:
            body = {"prompt": f"request {index}: " + "a long prompt " * 200, "max_tokens": 2}
            async with (
                slots,
                http.post(
                    cluster.sidecar.url + "/v1/completions",
                    json=body,
                    headers={"x-prefiller-host-port": endpoint},
                ) as response,
            ):
                await response.read()
                statuses[response.status] += 1

        await asyncio.gather(*(one(index) for index in range(args.requests)))
        after = read_proc(cluster.sidecar.pid)
        metrics = await cluster.sidecar_metrics()
        reasons = {
            reason: count
            for (reason,), count in metrics.by_label("pd_sidecar_fallbacks_total", "reason").items()
            if count
        }
        faults = await cluster.get_json(cluster.prefill.url + "/emulator/faults")
    growth = after.hwm - before.rss
    print(
        f"{args.requests} prefill answers of {args.size_mib} MiB, {args.concurrency} at once\n"
        f"  sidecar RSS before      {mib(before.rss)}\n"
        f"  sidecar peak RSS after  {mib(after.hwm)}  (+{mib(growth)})\n"
        f"  answers                 {dict(statuses)}\n"
        f"  fallbacks               {reasons}\n"
        f"  padding written         {mib(faults['padding_sent'])} "
        f"of {mib(args.requests * args.size_mib * MIB)} (what the sidecar let through)"
    )
    ok = statuses == Counter({200: args.requests}) and growth <= args.max_growth_mib * MIB
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench prefill_answer", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--size-mib", type=int, default=400, help="padding per prefill answer")
    parser.add_argument("--requests", type=int, default=4, help="requests sent")
    parser.add_argument("--concurrency", type=int, default=1, help="requests at once")
    parser.add_argument(
        "--max-growth-mib", type=int, default=64, help="peak RSS growth allowed over the start"
    )
    add_cluster_arguments(parser)
    add_quick(parser, "2 answers of 100 MiB, judged as the full run")
    return apply_quick(parser, parser.parse_args(argv), size_mib=100, requests=2)


def main_cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run(lambda: main(args))


if __name__ == "__main__":
    sys.exit(main_cli())
