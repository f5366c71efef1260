"""What the metrics cost a request: the sidecar's ``Metrics`` timed alone in a hot loop.

    python bench/metrics_cost.py                          # this checkout
    python bench/metrics_cost.py --baseline ../main       # A/B: both, alternated, medians

Times (``timeit``, best of ``--repeat``, microseconds per call) what the request path does with
the metrics once a request has ended: ``Metrics.observe_request`` for a remote request (four
phase observations and the request counter) and for a local one (three), and the count of its
prefill leg (``Metrics.observe_prefill`` where the checkout has it: the total, the endpoint's
counter and its latency; before it, the total alone). ``remote request`` is the sum for a remote
request: its ``observe_request`` and its prefill count. A checkout is measured in a process of its
own whose ``sidecar`` package is that checkout's; with ``--baseline``, the two alternate
``--rounds`` times and each figure is the median of the rounds (docs/benchmarks.md, "Metrics").
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import timeit
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ENDPOINT = "127.0.0.7:8000"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose sidecar is timed")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout: A/B")
    parser.add_argument("--number", type=int, default=20000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings; the best is kept")
    parser.add_argument("--rounds", type=int, default=3, help="A/B: alternations")
    parser.add_argument("--json", action="store_true", help="one JSON object, nothing else")
    return parser.parse_args(argv)


def measure(repo: Path, number: int, repeat: int) -> dict[str, float]:
    """Microseconds per call of each piece, with ``repo``'s sidecar."""
    sys.path.insert(0, str(repo))
    metrics_module = importlib.import_module("sidecar.observability.metrics")
    tracking = importlib.import_module("sidecar.observability.tracking")
    metrics = metrics_module.Metrics()
    remote = tracking.RequestRecord(id="r", path="/v1/completions", engine_id="r-e")
    remote.decision, remote.state = tracking.Decision.REMOTE, tracking.State.COMPLETED
    remote.phases.update(prefill_sent=0.001, prefill_done=0.02, decode_sent=0.021)
    remote.phases.update(first_byte=0.03, done=0.2)
    local = tracking.RequestRecord(id="l", path="/v1/completions", engine_id="l-e")
    local.decision, local.state = tracking.Decision.LOCAL, tracking.State.COMPLETED
    local.phases.update(decode_sent=0.001, first_byte=0.03, done=0.2)
    if hasattr(metrics, "observe_prefill"):

        def prefill() -> None:
            metrics.observe_prefill(ENDPOINT, "success", 0.019)
    else:  # before the per-endpoint metrics: the total alone

        def prefill() -> None:
            metrics.prefill_requests_by("success").inc()

    def best(call: Any) -> float:
        return min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6

    pieces = {
        "observe_request remote": best(lambda: metrics.observe_request("completions", remote)),
        "observe_request local": best(lambda: metrics.observe_request("completions", local)),
        "prefill count": best(prefill),
    }
    pieces["remote request"] = pieces["observe_request remote"] + pieces["prefill count"]
    return pieces


def run_child(repo: Path, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--repo", str(repo), "--json"]
    command += ["--number", str(args.number), "--repeat", str(args.repeat)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    result: dict[str, float] = json.loads(out)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.baseline is None:
        result = measure(args.repo, args.number, args.repeat)
        if args.json:
            print(json.dumps(result))
            return
        for name, us in result.items():
            print(f"{name:<24} {us:6.2f} µs")
        return
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "this": []}
    for _ in range(args.rounds):
        runs["baseline"].append(run_child(args.baseline.resolve(), args))
        runs["this"].append(run_child(args.repo.resolve(), args))
    print(f"{'µs per call (median of ' + str(args.rounds) + ')':<30} {'baseline':>9} {'this':>9}")
    for name in runs["this"][0]:
        a = statistics.median(r[name] for r in runs["baseline"])
        b = statistics.median(r[name] for r in runs["this"])
        print(f"{name:<30} {a:9.2f} {b:9.2f}")


if __name__ == "__main__":
    main()
