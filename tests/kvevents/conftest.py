"""Fixtures of the KV-event tests: a client session (emulators come from ``start_engine``), and
a pool of prefill emulators publishing events (``helpers.Pool``), closed after the test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from .helpers import Pool


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    made = Pool()
    yield made
    for engine in made.started:
        await engine.close()
