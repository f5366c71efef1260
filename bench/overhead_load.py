"""The overhead benchmark's load generator: P/D completions through a proxy, or both legs by hand.

A **target** is what the client talks to: a proxy (:class:`ProxyTarget`, one call per request:
the sidecar, the aiohttp floor, vllm-router) or the engines themselves (:class:`DirectTarget`,
the floor: the client sends the prefill leg, takes its ``kv_transfer_params`` and sends the decode
leg, which is all a proxy must do). Every request is a ``POST /v1/completions`` with a distinct
prompt; a streamed one must be 200 with exactly ``output_tokens`` token events and ``data:
[DONE]`` last, a non-streamed one 200 with a choice. :func:`drive` keeps ``concurrency`` requests
going until ``count`` were sent, timing each from sending to its first body byte (TTFB) and to
its end.

It is kept lean (bytes built once per request, the answer checked by counting, not parsing, its
events) because it shares a core with the emulators: its own limit shows in the floor's figures.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson

from bench.floor_proxy import PREFILL_HEADER, PREFILL_PARAMS

MODEL = "emulated-model"
PATH = "/v1/completions"
REQUEST_TIMEOUT_S = 60.0
_JSON = {"content-type": "application/json"}
_DONE = b"data: [DONE]\n\n"
_EVENT = b"data: "


@dataclass(frozen=True, slots=True)
class Workload:
    stream: bool
    output_tokens: int
    prompt_tokens: int

    @property
    def mode(self) -> str:
        return f"stream {self.output_tokens}" if self.stream else "non-stream"

    def body(self, index: int) -> dict[str, Any]:
        """Request ``index``'s body: a prompt of about ``prompt_tokens`` tokens (the emulator
        counts 4 characters each), distinct from every other request's."""
        head = f"request {index:>12} "
        return {
            "model": MODEL,
            "prompt": head + "x" * max(0, self.prompt_tokens * 4 - len(head)),
            "max_tokens": self.output_tokens,
            "stream": self.stream,
        }

    def check(self, status: int, body: bytes) -> str | None:
        """None for a complete, well-formed answer; else the kind of failure."""
        if status != 200:
            return f"status {status}"
        if not self.stream:
            return None if b'"choices":[{' in body else "no choice"
        if not body.endswith(_DONE):
            return "error event" if b'"error"' in body else "no [DONE]"
        if b'"error"' in body:
            return "error event"
        events = body.count(_EVENT) - 1
        return None if events == self.output_tokens else f"{events}/{self.output_tokens} tokens"


@dataclass(slots=True)
class PointStats:
    """What the client saw of one measured point."""

    latencies: list[float] = field(default_factory=list)
    ttfbs: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    events: int = 0
    """SSE data events received (the ``[DONE]`` included)."""

    @property
    def ok(self) -> int:
        return len(self.latencies)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def fail(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.examples.setdefault(kind, detail[:300])


class Target(Protocol):
    @property
    def name(self) -> str:
        """The variant's name."""
        ...

    async def send(
        self, session: aiohttp.ClientSession, workload: Workload, index: int
    ) -> tuple[int, bytes, float]:
        """Send request ``index``: its status, whole body and the time its first byte came."""
        ...


async def call(
    session: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str]
) -> tuple[int, bytes, float]:
    """POST and read the whole answer: status, body, ``perf_counter`` at its first byte."""
    async with session.post(url, data=data, headers=headers) as response:
        content = response.content
        first = await content.readany()
        first_at = time.perf_counter()
        parts = [first]
        while chunk := await content.readany():
            parts.append(chunk)
        return response.status, b"".join(parts), first_at


@dataclass(frozen=True, slots=True)
class ProxyTarget:
    """A proxy: one call per request, naming the prefill server when ``prefill`` is set."""

    name: str
    url: str
    prefill: str | None = None
    """``host:port`` for ``x-prefiller-host-port`` (None: the proxy knows its prefill server)."""

    async def send(
        self, session: aiohttp.ClientSession, workload: Workload, index: int
    ) -> tuple[int, bytes, float]:
        headers = dict(_JSON)
        if self.prefill is not None:
            headers[PREFILL_HEADER] = self.prefill
        return await call(session, self.url + PATH, orjson.dumps(workload.body(index)), headers)


@dataclass(frozen=True, slots=True)
class DirectTarget:
    """The floor: the client itself sends the prefill leg and then the decode leg."""

    prefill_url: str
    decode_url: str
    name: str = "floor"

    async def send(
        self, session: aiohttp.ClientSession, workload: Workload, index: int
    ) -> tuple[int, bytes, float]:
        body = workload.body(index)
        leg = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
        status, answer, _ = await call(session, self.prefill_url + PATH, orjson.dumps(leg), _JSON)
        if status != 200:
            return status, answer, time.perf_counter()
        body["kv_transfer_params"] = orjson.loads(answer)["kv_transfer_params"]
        return await call(session, self.decode_url + PATH, orjson.dumps(body), _JSON)


async def drive(
    session: aiohttp.ClientSession,
    target: Target,
    workload: Workload,
    *,
    count: int,
    concurrency: int,
    first_index: int,
    stats: PointStats,
) -> None:
    """``concurrency`` loops sending requests back to back until ``count`` were sent."""
    indexes = itertools.count(first_index)
    last = first_index + count

    async def worker() -> None:
        while (index := next(indexes)) < last:
            start = time.perf_counter()
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    status, body, first_at = await target.send(session, workload, index)
            except TimeoutError:
                stats.fail("timeout", f"no answer within {REQUEST_TIMEOUT_S:g} s")
                continue
            except (aiohttp.ClientError, OSError) as exc:
                stats.fail(f"connection: {type(exc).__name__}", repr(exc))
                continue
            end = time.perf_counter()
            problem = workload.check(status, body)
            if problem is not None:
                stats.fail(problem, body[-300:].decode(errors="replace"))
                continue
            stats.latencies.append(end - start)
            stats.ttfbs.append(first_at - start)
            if workload.stream:
                stats.events += workload.output_tokens + 1

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())


def client_session() -> aiohttp.ClientSession:
    """No connection cap (the concurrency is the cap), no aiohttp timeout (each request has
    its own), no compression asked for."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None),
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )
