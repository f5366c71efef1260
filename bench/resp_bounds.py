"""What bounding Redis's replies costs, and the worst the bounds let through.

    python -m bench resp_bounds
    python -m bench resp_bounds --iterations 5000
    python -m bench resp_bounds --quick         # 100 iterations

``sidecar.scheduling.state.replies.ReplyBounds`` walks every byte read from Redis before hiredis
parses it. Printed, per reply (microseconds, median of ``--iterations``): the walk and hiredis's
parse of a sync's reply for a pool of 8 endpoints (loads and speeds) and for 1,024 endpoints
with the longest names (the most a sync reads); then the replies just within the bounds
that cost the loop most — the walk, the parse and the release of what hiredis built, in
milliseconds, once each: these are the longest a hostile Redis can hold the loop per reply.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

import hiredis

from bench.suite import add_quick, apply_quick
from sidecar.scheduling.state.protocol import MAX_ENTRIES, MAX_KEY_BYTES
from sidecar.scheduling.state.replies import (
    MAX_LINE_BYTES,
    MAX_REPLY_BYTES,
    MAX_REPLY_ELEMENTS,
    ReplyBounds,
)


def resp(value: object) -> bytes:
    """``value`` (bytes, int, list) as RESP2."""
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(resp(item) for item in value)
    if isinstance(value, int):
        return b":%d\r\n" % value
    assert isinstance(value, bytes)
    return b"$%d\r\n%s\r\n" % (len(value), value)


def sync_reply(endpoints: int, name_bytes: int) -> bytes:
    """A sync's reply as the script answers (loads and speeds of ``endpoints``): one string, a
    line of counts, a line of sizes, the fields joined by newlines."""
    names = [b"%d" % i + b"e" * (name_bytes - len(b"%d" % i)) for i in range(endpoints)]
    fields = [f for value in (b"64000 32", b"0.0001 0.02") for name in names for f in (name, value)]
    head = b"0 %d %d 0 0\n" % (2 * endpoints, 2 * endpoints)
    sizes = b" ".join(b"%d" % len(field) for field in fields)
    return resp(head + sizes + b"\n" + b"\n".join(fields))


def per_call_us(action: Callable[[], object], iterations: int) -> float:
    samples = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        action()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def parse(data: bytes) -> object:
    reader = hiredis.Reader()
    reader.feed(data)
    return reader.gets()


def worst(name: str, data: bytes) -> None:
    """One reply within the bounds: walk, parse, release, each timed once (ms)."""
    assert len(data) <= MAX_REPLY_BYTES + 16, (name, len(data))
    start = time.perf_counter()
    bounds = ReplyBounds()
    for offset in range(0, len(data), 65536):  # as read from the socket
        bounds.check(data[offset : offset + 65536])
    walked = time.perf_counter()
    reply = parse(data)
    parsed = time.perf_counter()
    del reply
    freed = time.perf_counter()
    print(
        f"  {name:<34} {len(data) / 1048576:5.2f} MiB  walk {1000 * (walked - start):6.1f} ms"
        f"  parse {1000 * (parsed - walked):6.1f} ms  release {1000 * (freed - parsed):5.1f} ms"
        f"  total {1000 * (freed - start):6.1f} ms"
    )


def main_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench resp_bounds", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--iterations", type=int, default=2000)
    add_quick(parser, "100 iterations")
    args = apply_quick(parser, parser.parse_args(argv), iterations=100)
    print("a sync's reply (median per reply):")
    for label, endpoints, name_bytes, iterations in (
        ("8 endpoints", 8, 15, args.iterations),
        (f"{MAX_ENTRIES} endpoints, {MAX_KEY_BYTES}-byte names", MAX_ENTRIES, MAX_KEY_BYTES, 50),
    ):
        data = sync_reply(endpoints, name_bytes)
        walk = per_call_us(functools.partial(ReplyBounds().check, data), iterations)
        hired = per_call_us(functools.partial(parse, data), iterations)
        print(f"  {label:<34} {len(data):>8} B  walk {walk:8.1f} us  hiredis {hired:8.1f} us")
    n = MAX_REPLY_ELEMENTS
    print("the costliest replies within the bounds (once each):")
    worst("errors", b"*%d\r\n" % n + b"-E\r\n" * n)
    worst("empty arrays", b"*%d\r\n" % n + b"*0\r\n" * n)
    worst("integers", b"*%d\r\n" % n + b":1\r\n" * n)
    size = MAX_REPLY_BYTES // n - 16  # with its header and CRLF, within the bytes
    worst("bulk strings", b"*%d\r\n" % n + (b"$%d\r\n" % size + b"x" * size + b"\r\n") * n)
    line = MAX_LINE_BYTES - 8
    lines = MAX_REPLY_BYTES // (line + 3)
    worst("long simple strings", b"*%d\r\n" % lines + (b"+" + b"x" * line + b"\r\n") * lines)
    big = MAX_REPLY_BYTES - 32
    worst("one bulk string", b"$%d\r\n" % big + b"x" * big + b"\r\n")
    return 0


if __name__ == "__main__":
    sys.exit(main_cli())
