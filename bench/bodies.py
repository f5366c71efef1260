"""Large request bodies: what four big bodies in flight cost the sidecar in memory and latency.

    python -m bench bodies                          # both shapes, 4 bodies of 31 MB in flight
    python -m bench bodies --shape multimodal --rounds 3
    python -m bench bodies --quick                          # 2 bodies of 2 MB, targets not judged

Two shapes of a ~31 MB chat completion, each sent ``--in-flight`` (4) at once, every one with
the ``x-prefiller-host-port`` header (a full prefill → KV pull → streamed decode):

- ``many``: ``--messages`` (900,000) small messages, the worst case for a JSON parser (one
  Python object per field of every message);
- ``multimodal``: one user message whose content is a text part and ``--images`` (4) base64
  ``data:`` URLs — a few very large strings, what a vision request looks like.

Each shape gets a fresh cluster (bench/cluster.py: prefill emulator, decode emulator, sidecar),
so the sidecar's peak RSS (``VmHWM``) belongs to that shape alone. The emulators take any prompt
length (``--max-model-len``) with large KV blocks, so that the engines' own work stays small. After
a few small warm-up requests the sidecar's **idle RSS** is read; then, while the bodies are in
flight, two threads of this process sample the sidecar's RSS from ``/proc`` every
``--sample-ms`` and time ``GET /health`` on its API port back to back (a fresh request every
``--probe-ms``) — what a kubelet's probe meets. Per shape it prints the idle RSS, the peak (the
larger of ``VmHWM`` and the sampled maximum), the bytes in flight, the ratio
(peak - idle) / bytes in flight, ``/health``'s worst and 99th-percentile latency, and the answers'
statuses; then the verdict against the targets: peak under idle + 6 x bytes in flight for
both shapes, ``/health`` within 100 ms for ``multimodal`` and 1 s for ``many`` (``--quick``: two
bodies of 2 MB, the answers and ``/health``'s failures judged, not the targets). A shape the
sidecar refuses by design (413 for too many JSON elements, or 503 while its body budget is full)
counts: the statuses are printed.

Exit status 0 when every shape meets its targets, 1 otherwise. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.client
import multiprocessing
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson

from bench.client import MODEL, PREFILL_HEADER, client_session
from bench.cluster import Cluster, ClusterConfig, add_cluster_arguments, run
from bench.readings import Contention, load_average, mib, ms, read_proc
from bench.suite import add_quick, apply_quick
from devkit.stats import percentile

SHAPES = ("many", "multimodal")
RSS_FACTOR = 6
"""Target: peak RSS under idle RSS + this many times the bytes in flight."""
HEALTH_TARGET_S = {"many": 1.0, "multimodal": 0.1}
"""Target: ``/health``'s worst latency while the bodies are in flight, per shape."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench bodies",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--shape", choices=(*SHAPES, "both"), default="both")
    parser.add_argument("--body-bytes", type=int, default=31_000_000, help="size of each body")
    parser.add_argument("--in-flight", type=int, default=4, help="bodies sent at once")
    parser.add_argument("--rounds", type=int, default=1, help="times the bodies are sent")
    parser.add_argument("--messages", type=int, default=900_000, help="messages (many)")
    parser.add_argument("--images", type=int, default=4, help="base64 images (multimodal)")
    parser.add_argument("--output-tokens", type=int, default=20, help="tokens per answer")
    parser.add_argument(
        "--decode-s-per-token",
        type=float,
        default=0.05,
        help="decode emulator delay (answers stream for a while after the body was read)",
    )
    parser.add_argument("--max-model-len", type=int, default=1 << 30, help="emulators' limit")
    parser.add_argument("--block-size", type=int, default=4096, help="emulators' KV block")
    parser.add_argument("--sample-ms", type=float, default=2.0, help="RSS sampling period")
    parser.add_argument("--probe-ms", type=float, default=5.0, help="pause between /health")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per-request limit")
    add_cluster_arguments(parser)
    add_quick(parser, "both shapes, 2 bodies of 2 MB; only the answers and /health judged")
    args = parser.parse_args(argv)
    apply_quick(
        parser, args, body_bytes=2_000_000, in_flight=2, messages=50_000, output_tokens=5,
        decode_s_per_token=0.01,
    )  # fmt: skip
    args.prefill_s_per_token = 0.0  # the parser's default is a small prompt's; not ours
    return args


# --- the bodies ----------------------------------------------------------------------------


def many_messages(size: int, count: int) -> bytes:
    """A chat body of ``count`` short messages, padded to exactly ``size`` bytes."""
    body: dict[str, Any] = {"model": MODEL, "stream": True, "messages": []}
    roles = ("user", "assistant")
    framing = sum(len(roles[i % 2]) for i in range(count))
    framing += count * len(b'{"role":"","content":""},') + len(orjson.dumps(body)) - 1
    per = (size - framing) // count
    if per < 1:
        raise SystemExit(f"--body-bytes {size} is too small for {count} messages")
    body["messages"] = [
        {"role": roles[i % 2], "content": f"{i:0{per}d}"[-per:]} for i in range(count)
    ]
    return _padded(body, size)


def multimodal(size: int, images: int) -> bytes:
    """A chat body with one message: a text part and ``images`` base64 data URLs, ``size``
    bytes in all."""
    text = {"type": "text", "text": "Describe these images."}
    body: dict[str, Any] = {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "user", "content": [text]}],
    }
    empty = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}
    overhead = len(orjson.dumps(body)) + images * (len(orjson.dumps(empty)) + 1)
    each = (size - overhead) // images * 3 // 4
    parts = body["messages"][0]["content"]
    for _ in range(images):
        data = base64.b64encode(os.urandom(each)).decode()
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}})
    return _padded(body, size)


def _padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` serialized, with spaces before its closing brace up to ``size`` bytes."""
    data = orjson.dumps(body)
    return data[:-1] + b" " * max(0, size - len(data)) + b"}"


def with_max_tokens(data: bytes, tokens: int) -> bytes:
    """The body with ``"max_tokens"`` as its first field (no re-serialization of 31 MB)."""
    return b'{"max_tokens":%d,' % tokens + data[1:]


# --- the probes ----------------------------------------------------------------------------


@dataclass(slots=True)
class Probes:
    """Two threads: the sidecar's RSS every ``sample_s``, and ``GET /health`` timed back to back.

    Run in a process of their own (``probing``): this process's event loop is busy sending
    31 MB bodies, and a probe must wait neither for it nor for its interpreter lock.
    """

    pid: int
    host: str
    port: int
    sample_s: float
    probe_s: float
    rss_max: int = 0
    health_s: list[float] = field(default_factory=list)
    health_failures: Counter[str] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for target in (self._sample, self._probe):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.rss_max = max(self.rss_max, read_proc(self.pid).rss)
            self._stop.wait(self.sample_s)

    def _probe(self) -> None:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    connection.request("GET", "/health")
                    response = connection.getresponse()
                    response.read()
                    if response.status != 200:
                        self.health_failures[f"status {response.status}"] += 1
                except (OSError, http.client.HTTPException) as exc:
                    self.health_failures[type(exc).__name__] += 1
                    connection.close()
                    connection = http.client.HTTPConnection(self.host, self.port, timeout=30)
                self.health_s.append(time.perf_counter() - started)
                self._stop.wait(self.probe_s)
        finally:
            connection.close()


def _probe_child(target: tuple[int, str, int, float, float], stop: Any, results: Any) -> None:
    """In the probing process: probe until ``stop`` is set, then send what was seen."""
    probes = Probes(*target)
    probes.start()
    results.send("started")
    stop.wait()
    probes.stop()
    results.send((probes.rss_max, probes.health_s, dict(probes.health_failures)))


@contextlib.contextmanager
def probing(probes: Probes) -> Iterator[Probes]:
    """``probes`` run in a child process for the ``with`` block; their readings are in
    ``probes`` when it ends."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    receive, send = context.Pipe(duplex=False)
    target = (probes.pid, probes.host, probes.port, probes.sample_s, probes.probe_s)
    child = context.Process(target=_probe_child, args=(target, stop, send), daemon=True)
    child.start()
    try:
        receive.recv()  # probing already
        yield probes
    finally:
        stop.set()
        rss_max, health_s, failures = receive.recv()
        child.join()
    probes.rss_max, probes.health_s = rss_max, health_s
    probes.health_failures.update(failures)


# --- one shape -----------------------------------------------------------------------------


@dataclass(slots=True)
class ShapeResult:
    shape: str
    body_bytes: int
    in_flight: int
    idle_rss: int
    peak_rss: int
    hwm: int
    after_rss: int
    health_s: list[float]
    health_failures: Counter[str]
    statuses: Counter[str]
    examples: dict[str, str]
    elapsed_s: float
    sidecar_cpu_s: float

    @property
    def bytes_in_flight(self) -> int:
        return self.body_bytes * self.in_flight

    @property
    def ratio(self) -> float:
        return (self.peak_rss - self.idle_rss) / self.bytes_in_flight

    @property
    def health_max_s(self) -> float:
        return max(self.health_s, default=float("nan"))

    def failures(self, *, figures: bool = True) -> list[str]:
        """What missed: the answers and ``/health``'s failures; with ``figures``, the targets."""
        failures = []
        if figures and self.ratio >= RSS_FACTOR:
            failures.append(
                f"{self.shape}: peak RSS {mib(self.peak_rss)} >= idle + {RSS_FACTOR} x in flight"
                f" ({mib(self.idle_rss + RSS_FACTOR * self.bytes_in_flight)})"
            )
        target = HEALTH_TARGET_S[self.shape]
        if figures and not self.health_max_s <= target:
            failures.append(
                f"{self.shape}: /health took {ms(self.health_max_s)} (target {ms(target)})"
            )
        if self.health_failures:
            failures.append(f"{self.shape}: /health failed {dict(self.health_failures)}")
        unexpected = {k: v for k, v in self.statuses.items() if k not in ("200", "413", "503")}
        if unexpected:
            failures.append(f"{self.shape}: answers {unexpected}")
        return failures


async def send(
    http: aiohttp.ClientSession, url: str, data: bytes, prefill: str, timeout_s: float
) -> tuple[str, str]:
    """One body through the sidecar, its answer read to the end: (status or error, detail)."""
    headers = {PREFILL_HEADER: prefill, "content-type": "application/json"}
    try:
        async with http.post(
            url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            answer = await response.read()
            status = str(response.status)
            if response.status == 200 and not answer.rstrip().endswith(b"data: [DONE]"):
                status = "200 without [DONE]"
            return status, answer[:300].decode(errors="replace")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return type(exc).__name__, str(exc)[:300]


async def run_shape(args: argparse.Namespace, shape: str) -> ShapeResult:
    if shape == "many":
        data = many_messages(args.body_bytes, args.messages)
    else:
        data = multimodal(args.body_bytes, args.images)
    data = with_max_tokens(data, args.output_tokens)
    print(f"--- {shape}: {args.in_flight} x {len(data):,} bytes, {args.rounds} round(s)")
    emulator_args = (
        "--max-model-len",
        str(args.max_model_len),
        "--block-size",
        str(args.block_size),
        *args.emulator_arg,
    )
    config = replace(
        ClusterConfig.from_args(args, decode_s_per_token=args.decode_s_per_token),
        emulator_args=emulator_args,
        log_dir=args.log_dir / shape if args.log_dir is not None else None,
    )
    async with Cluster(config) as cluster, client_session() as http:
        url = cluster.sidecar.url + "/v1/chat/completions"
        prefill = cluster.prefill.endpoint
        small = with_max_tokens(many_messages(4000, 10), 2)
        for _ in range(5):  # connections to both engines opened, code paths warm
            status, detail = await send(http, url, small, prefill, args.timeout_s)
            if status != "200":
                raise SystemExit(f"warm-up request failed: {status} {detail}")
        await asyncio.sleep(1.0)
        idle = read_proc(cluster.sidecar.pid)
        host, port = cluster.sidecar.endpoint.rsplit(":", 1)
        probes = Probes(
            cluster.sidecar.pid, host, int(port), args.sample_ms / 1000, args.probe_ms / 1000
        )
        statuses: Counter[str] = Counter()
        examples: dict[str, str] = {}
        started = time.monotonic()
        with probing(probes):
            for _ in range(args.rounds):
                outcomes = await asyncio.gather(
                    *(send(http, url, data, prefill, args.timeout_s) for _ in range(args.in_flight))
                )
                for status, detail in outcomes:
                    statuses[status] += 1
                    examples.setdefault(status, detail)
        elapsed = time.monotonic() - started
        after = read_proc(cluster.sidecar.pid)
    return ShapeResult(
        shape=shape,
        body_bytes=len(data),
        in_flight=args.in_flight,
        idle_rss=idle.rss,
        peak_rss=max(after.hwm, probes.rss_max),
        hwm=after.hwm,
        after_rss=after.rss,
        health_s=probes.health_s,
        health_failures=probes.health_failures,
        statuses=statuses,
        examples=examples,
        elapsed_s=elapsed,
        sidecar_cpu_s=after.cpu_s - idle.cpu_s,
    )


def report(results: list[ShapeResult], contention: Contention, *, figures: bool = True) -> int:
    print()
    print("=== pd-sidecar large bodies: summary ===")
    failures = []
    for r in results:
        health = r.health_s
        print(f"{r.shape}")
        print(
            f"  bodies           {r.in_flight} in flight x {r.body_bytes:,} bytes"
            f" = {mib(r.bytes_in_flight)} in flight"
        )
        print(
            f"  sidecar RSS      idle {mib(r.idle_rss)}, peak {mib(r.peak_rss)}"
            f" (VmHWM {mib(r.hwm)}), after {mib(r.after_rss)}"
        )
        print(
            f"  ratio            (peak - idle) / in flight = {r.ratio:.2f} (target < {RSS_FACTOR})"
        )
        print(
            f"  /health          max {ms(r.health_max_s)}, p99 {ms(percentile(health, 99))},"
            f" p50 {ms(percentile(health, 50))} over {len(health)} probes"
            f" (target max {ms(HEALTH_TARGET_S[r.shape])})"
            + (f"; failures {dict(r.health_failures)}" if r.health_failures else "")
        )
        print(
            f"  answers          {dict(sorted(r.statuses.items()))} in {r.elapsed_s:.1f} s;"
            f" sidecar CPU {r.sidecar_cpu_s:.1f} s"
        )
        for status, example in r.examples.items():
            if status != "200":
                print(f"    e.g. {status}: {example!r}")
        failures.extend(r.failures(figures=figures))
    print(f"machine            {contention.describe()}; load average {load_average()}")
    print("verdict            " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return 1 if failures else 0


async def main(args: argparse.Namespace) -> int:
    shapes = SHAPES if args.shape == "both" else (args.shape,)
    contention = Contention()
    contention.start()
    results = []
    try:
        for shape in shapes:
            results.append(await run_shape(args, shape))
    finally:
        await contention.stop()
    return report(results, contention, figures=not args.quick)


def main_cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run(lambda: main(args))


if __name__ == "__main__":
    sys.exit(main_cli())
