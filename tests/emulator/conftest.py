"""Fixtures: real emulators on free ports and one client session, all closed after each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from sidecar.emulator import EmulatorConfig, RunningEmulator, start_emulator
from sidecar.emulator.kv import Clock

from .helpers import FakeClock

MakeEmulator = Callable[..., Awaitable[RunningEmulator]]


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def make_emulator() -> AsyncIterator[MakeEmulator]:
    started: list[RunningEmulator] = []

    async def make(clock: Clock | None = None, **fields: Any) -> RunningEmulator:
        emulator = await start_emulator(EmulatorConfig(port=0, **fields), clock=clock)
        started.append(emulator)
        return emulator

    yield make
    for emulator in reversed(started):
        await emulator.close()


@pytest.fixture
async def emulator(make_emulator: MakeEmulator) -> RunningEmulator:
    return await make_emulator(prompt_tokens_details=True)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client
