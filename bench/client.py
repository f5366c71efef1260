"""The load generator: streaming requests, each answer checked whole, counted as it goes.

:func:`stream_one` sends one streaming completion or chat completion and checks the whole
answer: status 200, an event stream, the expected number of token events, no error event, and
``data: [DONE]`` last. :class:`ClientStats` counts what is open at any moment, the peaks and the
errors by kind; :func:`run_workers` keeps a number of such requests going.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

PREFILL_HEADER = "x-prefiller-host-port"
MODEL = "emulated-model"
_DONE = b"data: [DONE]"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended, as the client saw it."""

    ok: bool
    error: str | None
    """None, or the kind of failure (``status 503``, ``timeout``, ``broken``, ``no [DONE]``...)."""
    ttft_s: float | None
    """Time from sending to the first byte of the answer body."""
    total_s: float
    aborted: bool = False
    """The client left on purpose before the end (soak disconnects)."""


@dataclass(slots=True)
class ClientStats:
    """Live counts of the load generator; mutated by :func:`stream_one` only."""

    started: int = 0
    finished: int = 0
    ok: int = 0
    aborted: int = 0
    inflight: int = 0
    """Requests sent and not finished."""
    open_streams: int = 0
    """Answers whose headers arrived and whose body is still being read."""
    max_inflight: int = 0
    max_open_streams: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: dict[str, str] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    events: int = 0

    def record(self, outcome: Outcome, detail: str = "") -> None:
        self.finished += 1
        if outcome.aborted:
            self.aborted += 1
        elif outcome.ok:
            self.ok += 1
            self.durations.append(outcome.total_s)
            if outcome.ttft_s is not None:
                self.ttfts.append(outcome.ttft_s)
        else:
            assert outcome.error is not None
            self.errors[outcome.error] += 1
            self.error_examples.setdefault(outcome.error, detail[:300])

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


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
    if not body.rstrip().endswith(_DONE):
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


async def run_workers(
    concurrency: int,
    ramp_s: float,
    next_spec: Callable[[], RequestSpec | None],
    send: Callable[[RequestSpec], Awaitable[Outcome]],
) -> None:
    """``concurrency`` loops, started evenly over ``ramp_s``, each sending ``next_spec()`` one
    after the other until it returns None."""

    async def worker(delay: float) -> None:
        await asyncio.sleep(delay)
        while (spec := next_spec()) is not None:
            await send(spec)

    step = ramp_s / concurrency if concurrency else 0.0
    async with asyncio.TaskGroup() as group:
        for i in range(concurrency):
            group.create_task(worker(i * step))


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    """Poll ``check`` every 0.2 s until it is true (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.2)
    return True


def client_session() -> aiohttp.ClientSession:
    """The load generator's session: no connection cap, no aiohttp timeout (each request has
    its own)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
    )
