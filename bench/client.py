"""The benchmarks' load generator: requests kept going at a concurrency, each answer checked.

Two ways to send, on one set of loops, sessions and counts:

- **Checked streams** (load, soak): :func:`stream_one` sends a :class:`RequestSpec`, a
  streaming completion or chat completion, and checks the whole answer: status 200, the expected
  number of token events, every event parsed and none an error, ``data: [DONE]`` last. It may
  abandon a request on purpose (soak disconnects). :class:`ClientStats` counts what is open at
  any moment and the peaks, besides what every :class:`Tally` holds.
- **P/D completions, lean** (overhead): :func:`drive` sends a :class:`Workload` to a
  :class:`Target` — a proxy (:class:`ProxyTarget`, one call per request: the sidecar, the aiohttp
  floor, vllm-router) or the engines themselves (:class:`DirectTarget`, the floor: the client
  sends the prefill leg, takes its ``kv_transfer_params`` and sends the decode leg, which is all
  a proxy must do) — timing each request to its first body byte (TTFB) and to its end. It is
  kept lean (bytes built once per request, the answer checked by counting, not parsing, its
  events) because it shares a core with the emulators: its own limit shows in the floor's
  figures.

Both keep their requests going with :func:`run_loops` (load and soak through :func:`run_workers`,
which sends what a function hands out until it hands out None); the bodies benchmark uses the
session and the names only.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiohttp
import orjson

from bench.floor_proxy import PREFILL_HEADER as PREFILL_HEADER  # the benchmarks' one spelling
from bench.floor_proxy import PREFILL_PARAMS

MODEL = "emulated-model"
PATH = "/v1/completions"
DONE = b"data: [DONE]"
REQUEST_TIMEOUT_S = 60.0
"""Per request of :func:`drive` (a :class:`RequestSpec` carries its own)."""
_JSON = {"content-type": "application/json"}
_DONE_EVENT = DONE + b"\n\n"
_EVENT = b"data: "

Item = TypeVar("Item")


# --- what the client saw ---------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    """What the client saw of a set of requests: the good answers' times, the failures by kind."""

    latencies: list[float] = field(default_factory=list)
    """Seconds from sending to the end of the answer, one per good answer."""
    ttfbs: list[float] = field(default_factory=list)
    """Seconds from sending to the first byte of the answer body (time to first token)."""
    errors: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    """The first failure of each kind, in at most 300 characters."""
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


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one checked stream ended, as the client saw it."""

    ok: bool
    error: str | None
    """None, or the kind of failure (``status 503``, ``timeout``, ``broken``, ``no [DONE]``...)."""
    ttft_s: float | None
    """Time from sending to the first byte of the answer body."""
    total_s: float
    aborted: bool = False
    """The client left on purpose before the end (soak disconnects)."""


@dataclass(slots=True)
class ClientStats(Tally):
    """A :class:`Tally` with live counts; mutated by :func:`stream_one` only."""

    started: int = 0
    finished: int = 0
    aborted: int = 0
    inflight: int = 0
    """Requests sent and not finished."""
    open_streams: int = 0
    """Answers whose headers arrived and whose body is still being read."""
    max_inflight: int = 0
    max_open_streams: int = 0

    def record(self, outcome: Outcome, detail: str = "") -> None:
        self.finished += 1
        if outcome.aborted:
            self.aborted += 1
        elif outcome.ok:
            self.latencies.append(outcome.total_s)
            if outcome.ttft_s is not None:
                self.ttfbs.append(outcome.ttft_s)
        else:
            assert outcome.error is not None
            self.fail(outcome.error, detail)


# --- keeping requests going ------------------------------------------------------------------


async def run_workers(
    concurrency: int,
    ramp_s: float,
    next_item: Callable[[], Item | None],
    send: Callable[[Item], Awaitable[object]],
) -> None:
    """``concurrency`` loops, started evenly over ``ramp_s``, each sending ``next_item()`` one
    after the other until it returns None."""

    async def worker() -> None:
        while (item := next_item()) is not None:
            await send(item)

    await run_loops(concurrency, ramp_s, worker)


async def run_loops(concurrency: int, ramp_s: float, loop: Callable[[], Awaitable[None]]) -> None:
    """``concurrency`` runs of ``loop()`` at once, started evenly over ``ramp_s``; returns when
    all of them have (the first that raises cancels the others)."""

    async def staggered(delay: float) -> None:
        await asyncio.sleep(delay)
        await loop()

    step = ramp_s / concurrency if concurrency else 0.0
    async with asyncio.TaskGroup() as group:
        for i in range(concurrency):
            group.create_task(staggered(i * step))


def client_session(*, lean: bool = False) -> aiohttp.ClientSession:
    """The load generator's session: no connection cap (the concurrency is the cap), no aiohttp
    timeout (each request has its own). Checked streams also give up on a connection not set up
    within 30 s; ``lean`` (the overhead benchmark) sends no ``User-Agent`` and asks for no
    compression."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=None if lean else 30),
        skip_auto_headers=("User-Agent", "Accept-Encoding") if lean else None,
    )


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    """Poll ``check`` every 0.2 s until it is true (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.2)
    return True


# --- checked streams (load, soak) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of the workload."""

    index: int
    chat: bool
    output_tokens: int
    prompt_tokens: int
    prefill: str | None
    """``host:port`` for the prefill header, or None for a local-only request."""
    timeout_s: float
    abort_after_s: float | None = None
    """Disconnect this long after sending (None: read to the end)."""


def request_body(spec: RequestSpec) -> bytes:
    # A distinct prompt per request, about prompt_tokens tokens (the emulator counts 4 chars).
    words = max(1, spec.prompt_tokens * 4 // 6 - 4)
    text = f"request {spec.index} " + " ".join(["words"] * words)
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": spec.output_tokens,
        "stream": True,
    }
    if spec.chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return orjson.dumps(body)


def check_stream(body: bytes, spec: RequestSpec) -> str | None:
    """None when ``body`` is a complete, well-formed answer; else the kind of failure."""
    if not body.rstrip().endswith(DONE):
        return "error event" if b'"error"' in body else "no [DONE]"
    events = [e for e in body.split(b"\n\n") if e.strip()]
    tokens = 0
    for event in events[:-1]:
        if not event.startswith(b"data: "):
            return "malformed event"
        try:
            chunk = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return "malformed event"
        if "error" in chunk:
            return "error event"
        choices = chunk.get("choices") or []
        if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
            tokens += 1
    if tokens != spec.output_tokens:
        return f"{tokens}/{spec.output_tokens} tokens"
    return None


async def stream_one(
    session: aiohttp.ClientSession, base_url: str, spec: RequestSpec, stats: ClientStats
) -> Outcome:
    """Send ``spec``, read and check the whole stream, count it in ``stats``."""
    path = "/v1/chat/completions" if spec.chat else "/v1/completions"
    headers = {"content-type": "application/json", "x-request-id": f"bench-{spec.index}"}
    if spec.prefill is not None:
        headers[PREFILL_HEADER] = spec.prefill
    stats.started += 1
    stats.inflight += 1
    stats.max_inflight = max(stats.max_inflight, stats.inflight)
    start = time.monotonic()
    ttft: float | None = None
    streaming = False
    parts: list[bytes] = []
    abort = spec.abort_after_s is not None and spec.abort_after_s < spec.timeout_s
    limit = spec.abort_after_s if abort and spec.abort_after_s is not None else spec.timeout_s
    outcome: Outcome
    detail = ""
    try:
        async with asyncio.timeout(limit):
            async with session.post(
                base_url + path, data=request_body(spec), headers=headers
            ) as response:
                if response.status != 200:
                    detail = (await response.read()).decode(errors="replace")
                    outcome = Outcome(False, f"status {response.status}", None, _since(start))
                else:
                    streaming = True
                    stats.open_streams += 1
                    stats.max_open_streams = max(stats.max_open_streams, stats.open_streams)
                    async for chunk in response.content.iter_any():
                        if ttft is None:
                            ttft = _since(start)
                        parts.append(chunk)
                    body = b"".join(parts)
                    problem = check_stream(body, spec)
                    detail = body[-300:].decode(errors="replace")
                    stats.events += body.count(b"data: ")
                    outcome = Outcome(problem is None, problem, ttft, _since(start))
    except TimeoutError:
        if abort:
            outcome = Outcome(True, None, ttft, _since(start), aborted=True)
        else:
            outcome = Outcome(False, "timeout", ttft, _since(start))
    except aiohttp.ClientPayloadError as exc:
        outcome, detail = Outcome(False, "broken stream", ttft, _since(start)), repr(exc)
    except aiohttp.ClientError as exc:
        kind = "broken stream" if streaming else f"connection: {type(exc).__name__}"
        outcome, detail = Outcome(False, kind, ttft, _since(start)), repr(exc)
    finally:
        stats.inflight -= 1
        if streaming:
            stats.open_streams -= 1
    stats.record(outcome, detail)
    return outcome


def _since(start: float) -> float:
    return time.monotonic() - start


# --- P/D completions, lean (overhead) --------------------------------------------------------


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
        if not body.endswith(_DONE_EVENT):
            return "error event" if b'"error"' in body else "no [DONE]"
        if b'"error"' in body:
            return "error event"
        events = body.count(_EVENT) - 1
        return None if events == self.output_tokens else f"{events}/{self.output_tokens} tokens"


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
    stats: Tally,
) -> None:
    """``concurrency`` loops sending requests ``first_index``, ``first_index + 1``, ... back to
    back until ``count`` were sent; a prompt is never sent twice as long as the indexes are
    not."""
    indexes = iter(range(first_index, first_index + count))

    async def loop() -> None:  # the hot path: inline, one coroutine per loop, not per request
        while (index := next(indexes, None)) is not None:
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

    await run_loops(concurrency, 0.0, loop)
