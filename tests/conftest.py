"""Fixtures: emulated engines and the sidecar on real sockets, one fresh set per test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from sidecar.config import Settings
from sidecar.emulator import EmulatorConfig, RunningEmulator, start_emulator
from sidecar.observability.tracing import Tracing
from sidecar.observability.tracking import REQUEST_TASK_PREFIX
from sidecar.server.runner import RunningSidecar, start_sidecar
from tests.otlp import Receiver
from tests.processes import RedisServer, free_port

StartSidecar = Callable[..., Awaitable[RunningSidecar]]
StartEmulator = Callable[..., Awaitable[RunningEmulator]]


@pytest.fixture
async def start_engine() -> AsyncIterator[StartEmulator]:
    """Start extra emulators (``EmulatorConfig`` fields as keywords); all closed at teardown."""
    started: list[RunningEmulator] = []

    async def start(**config: Any) -> RunningEmulator:
        engine = await start_emulator(EmulatorConfig(port=0, **config))
        started.append(engine)
        return engine

    yield start
    for engine in started:
        await engine.close()


@pytest.fixture
async def prefill(start_engine: StartEmulator) -> RunningEmulator:
    return await start_engine()


@pytest.fixture
async def decode(start_engine: StartEmulator) -> RunningEmulator:
    return await start_engine()


@pytest.fixture
async def start_sidecar_with(decode: RunningEmulator) -> AsyncIterator[StartSidecar]:
    """Start a sidecar on a free port in front of ``decode``; keywords override Settings
    (``tracing``: the sidecar's tracer provider, ``tests.otlp.traced``)."""
    started: list[RunningSidecar] = []

    async def start(*, tracing: Tracing | None = None, **overrides: Any) -> RunningSidecar:
        values: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "decode_url": decode.url,
            "ready_interval_s": 0.05,
        }
        if tracing is not None:
            values["tracing"] = True
        values.update(overrides)
        sidecar = await start_sidecar(Settings(**values), tracing=tracing)
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        await sidecar.close()


@pytest.fixture
async def otlp() -> AsyncIterator[Receiver]:
    """A local OTLP/HTTP receiver (``tests.otlp``); closed after the sidecars, which flush to it
    when they close."""
    receiver = Receiver()
    await receiver.start()
    yield receiver
    await receiver.close()


@pytest.fixture
async def sidecar(start_sidecar_with: StartSidecar) -> RunningSidecar:
    return await start_sidecar_with()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    """Wait until ``check()`` holds (a condition, not a fixed delay); fail after ``within`` s."""
    async with asyncio.timeout(within):
        # The condition lives in another server, seen only over HTTP: there is no event to await.
        while not await check():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def engine_requests(http: aiohttp.ClientSession, engine: RunningEmulator) -> list[Any]:
    """Requests the emulator received, oldest first."""
    return list((await get_json(http, engine.url + "/emulator/requests"))["requests"])


async def staged_blocks(http: aiohttp.ClientSession, engine: RunningEmulator) -> int:
    return int((await get_json(http, engine.url + "/emulator/kv"))["staged_blocks"])


async def inject(http: aiohttp.ClientSession, engine: RunningEmulator, **fault: Any) -> None:
    async with http.post(engine.url + "/emulator/faults", json=fault) as response:
        assert response.status in (200, 201, 204), await response.text()


def chat(content: str = "Tell me about disaggregated serving.", **fields: Any) -> dict[str, Any]:
    return {"model": "emulated-model", "messages": [{"role": "user", "content": content}], **fields}


def completion(prompt: Any = "The KV cache moves from prefill to decode", **fields: Any) -> Any:
    return {"model": "emulated-model", "prompt": prompt, **fields}


def sse_events(raw: bytes) -> list[bytes]:
    """The data payloads of an SSE body, in order."""
    return [
        line[len(b"data: ") :]
        for event in raw.split(b"\n\n")
        for line in event.split(b"\n")
        if line.startswith(b"data: ")
    ]


def awaiting(task: asyncio.Task[Any]) -> list[str]:
    """``file:function`` of every coroutine along ``task``'s await chain, outermost first
    (``Task.get_stack`` shows only the outermost frame of a suspended task)."""
    chain: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None:
        code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
        if code is not None:
            chain.append(f"{code.co_filename}:{code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain


def tasks_in_request_code() -> list[str]:
    """Tasks of this process still doing a sidecar request's work: a request the sidecar forgot
    to finish, a prefill call left running, or a KV release that never ends. The sidecar names
    every such task ``<REQUEST_TASK_PREFIX><request id>:<part>`` where it creates it (or, for
    the handler aiohttp started, where the request enters); the emulators' tasks have other
    names."""
    return [
        task.get_name()
        for task in asyncio.all_tasks()
        if task is not asyncio.current_task() and task.get_name().startswith(REQUEST_TASK_PREFIX)
    ]


async def metric(http: aiohttp.ClientSession, url: str, sample: str) -> float:
    """The sum of the samples of ``url``'s /metrics whose line starts with ``sample`` (a name,
    or a name with its labels); 0 when there is none."""
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(sample) and not line.startswith("#")
    )


@pytest.fixture
async def redis_server() -> AsyncIterator[RedisServer]:
    """A real redis-server of the test's own, on a free loopback port."""
    server = RedisServer(free_port())
    await server.start()
    yield server
    await server.stop()
