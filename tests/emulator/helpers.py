"""Helpers shared by the emulator tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from sidecar.emulator import RunningEmulator


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def post_json(
    session: aiohttp.ClientSession,
    url: str,
    body: Any,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """Parse an SSE body into JSON events; the final ``[DONE]`` becomes the string "[DONE]"."""
    events: list[Any] = []
    async for line in resp.content:
        text = line.decode().strip()
        if not text:
            continue
        assert text.startswith("data: "), text
        payload = text[len("data: ") :]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


async def metrics_text(session: aiohttp.ClientSession, emulator: RunningEmulator) -> str:
    async with session.get(f"{emulator.url}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def metric_value(text: str, name: str) -> float:
    """The value of the first sample named exactly ``name`` (labels ignored)."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        if sample.split("{", 1)[0] == name:
            return float(value)
    raise AssertionError(f"metric {name} not found")


async def eventually(check: Callable[[], Awaitable[bool]], attempts: int = 1000) -> None:
    """Poll ``check`` every 5 ms until it holds (about 5 s at most)."""
    for _ in range(attempts):
        if await check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never became true")
