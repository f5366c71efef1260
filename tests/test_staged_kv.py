"""Staged KV has one owner, the attempt's ``StagedKv`` handle: a connector that forgets to take
or release the KV its prefill staged still has it released, once, by the handle's exit.

The connectors here are the tests' own, plugged into a real sidecar (``start_sidecar``'s
``connector``) in front of NIXL emulators: each prefills on the vLLM NIXL wire, then decodes
locally without the KV, and forgets (or repeats) what the real connectors do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from sidecar.config import Settings
from sidecar.connectors import Connector
from sidecar.connectors.exchange import Answer, Exchange, Prefilled, Refused
from sidecar.connectors.nixl import NixlConnector
from sidecar.connectors.parts import Parts
from sidecar.connectors.prefill import Release
from sidecar.emulator import RunningEmulator
from sidecar.server.runner import RunningSidecar, start_sidecar
from tests.conftest import completion, engine_requests, eventually, get_json, metric, staged_blocks

SENT = 'pd_sidecar_kv_releases_total{outcome="sent"}'

Forget = Callable[[Any], object]
"""What a test connector does with the handle once the prefill staged KV (and then nothing)."""


class Forgetful:
    """Prefills on the NIXL wire, then decodes locally without the KV; does ``forget(kv)`` in
    between, and nothing else with the handle: no ``taken()``, no ``release()`` of its own."""

    name = "forgetful"

    def __init__(self, parts: Parts, forget: Forget) -> None:
        self._parts = parts
        self._forget = forget
        self._wire = NixlConnector(parts)
        self.prefilled = 0

    def unsupported(self, body: dict[str, Any]) -> str | None:
        return None

    def sanitize(self, body: dict[str, Any]) -> bool:
        return self._wire.sanitize(body)

    async def run(self, ex: Exchange) -> Answer | Refused:
        wire = self._wire
        release = Release(
            lambda prefilled: wire.release_body(ex.body, prefilled.kv_params, ex.route),
            wire.release_id(ex),
        )
        async for attempt in self._parts.prefill.attempts(ex):
            with attempt.staged(release) as kv:
                data = ex.encode(wire.prefill_body(ex.body, ex.route))
                outcome = await kv.prefill(data, wire._accept)
                assert isinstance(outcome, Prefilled), outcome
                self.prefilled += 1
                self._forget(kv)
            break
        return await self._parts.decode.send(ex, ex.encode(ex.body))


@pytest.fixture
async def run_forgetful(
    prefill: RunningEmulator, decode: RunningEmulator
) -> AsyncIterator[Callable[[Forget], Any]]:
    started: list[RunningSidecar] = []

    async def run(forget: Forget) -> tuple[RunningSidecar, list[Forgetful]]:
        built: list[Forgetful] = []

        def factory(settings: Settings, parts: Parts) -> Connector:
            built.append(Forgetful(parts, forget))
            return built[0]

        settings = Settings(host="127.0.0.1", port=0, decode_url=decode.url, ready_interval_s=0.05)
        sidecar = await start_sidecar(settings, connector=factory)
        started.append(sidecar)
        return sidecar, built

    yield run
    for sidecar in started:
        await sidecar.close()


async def _complete(http: aiohttp.ClientSession, sidecar: RunningSidecar, prefill: str) -> None:
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion(max_tokens=2),
        headers={"x-prefiller-host-port": prefill, "x-request-id": "forgotten"},
    ) as response:
        assert response.status == 200, await response.text()
        await response.read()


async def _releases_received(http: aiohttp.ClientSession, engine: RunningEmulator) -> list[str]:
    ids = [r["headers"].get("x-request-id", "") for r in await engine_requests(http, engine)]
    return [i for i in ids if i.endswith("-release")]


async def _settled(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> bool:
    listed = await get_json(http, sidecar.url + "/debug/requests")
    return not listed["inflight"] and await metric(http, sidecar.url, SENT) >= 1


@pytest.mark.parametrize(
    "forget",
    [
        pytest.param(lambda kv: None, id="neither-taken-nor-released"),
        pytest.param(lambda kv: (kv.release(), kv.release(), kv.taken()), id="released-twice"),
    ],
)
async def test_kv_a_connector_does_not_take_is_released_once_by_the_handle(
    http: aiohttp.ClientSession,
    prefill: RunningEmulator,
    decode: RunningEmulator,
    run_forgetful: Callable[[Forget], Any],
    forget: Forget,
) -> None:
    sidecar, [connector] = await run_forgetful(forget)
    await _complete(http, sidecar, prefill.endpoint)
    assert connector.prefilled == 1
    await eventually(lambda: _settled(http, sidecar))
    assert await staged_blocks(http, prefill) == 0  # freed now, not at the engine's expiry
    [release] = await _releases_received(http, decode)
    record = await get_json(http, sidecar.url + "/debug/requests/forgotten")
    assert release == f"{record['engine_id']}-release"
    assert await metric(http, sidecar.url, SENT) == 1


async def test_kv_taken_is_not_released(
    http: aiohttp.ClientSession,
    prefill: RunningEmulator,
    decode: RunningEmulator,
    run_forgetful: Callable[[Forget], Any],
) -> None:
    """The counterpart: a handle told ``taken()`` releases nothing on exit (this connector's
    decode does not pull, so the KV stays staged: only the engine's expiry frees it)."""
    sidecar, [connector] = await run_forgetful(lambda kv: (kv.taken(), kv.release()))
    await _complete(http, sidecar, prefill.endpoint)
    assert connector.prefilled == 1
    assert await staged_blocks(http, prefill) > 0
    assert await _releases_received(http, decode) == []
    assert await metric(http, sidecar.url, 'pd_sidecar_kv_releases_total{outcome="skipped"}') == 0
