"""What one connector does that the shared contract suite (tests/test_contract.py) cannot say.

Every connector: its facts (``sidecar/fleet/connectors.py``) under its name. SGLang: rooms, the
bootstrap port, every request disaggregated (no healthy prefill server: 503), a retry restarting
both legs (on the same server or another), a refused prefill ending its decode at once, both legs'
timings. Shared storage: the client's usage says what the prefill found cached, not what the
decode found in the store the prefill just wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import aiohttp
import orjson
import pytest

from sidecar.config import Settings
from sidecar.connectors.nixl import NixlConnector
from sidecar.connectors.nixl_push import NixlPushConnector
from sidecar.connectors.sglang import ROOM_LIMIT, SglangConnector, new_room
from sidecar.connectors.shared_storage import SharedStorageConnector
from sidecar.emulator import RunningEmulator
from sidecar.errors import BadRequest
from sidecar.fleet.connectors import CONNECTORS
from sidecar.sanitize import BOOTSTRAP_PORT, BOOTSTRAP_ROOM
from sidecar.server.runner import RunningSidecar
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    completion,
    engine_requests,
    eventually,
    get_json,
    inject,
    metric,
)

SGLANG_PREFILL = {"kv_protocol": "sglang", "disaggregation_mode": "prefill"}
SGLANG_DECODE = {"kv_protocol": "sglang", "disaggregation_mode": "decode"}


async def _post(
    http: aiohttp.ClientSession, sidecar: RunningSidecar, body: Any, **headers: str
) -> tuple[int, Any]:
    async with http.post(sidecar.url + "/v1/completions", json=body, headers=headers) as response:
        return response.status, orjson.loads(await response.read())


async def _record(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> Any:
    return (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]


async def _nothing_waits(http: aiohttp.ClientSession, decode: RunningEmulator) -> None:
    """No decode leg waits for a room (SGLang would keep one for 300 s)."""

    async def none() -> bool:
        kv = await get_json(http, decode.url + "/emulator/kv")
        return int(kv["rooms_waiting"]) == 0

    await eventually(none)


# --- SGLang -----------------------------------------------------------------------------------


def test_every_connector_has_its_facts_under_its_name() -> None:
    """``sidecar.fleet.connectors`` says what the settings and the scheduler know of each
    protocol without importing it: under the names of the connector classes, which
    SIDECAR_CONNECTOR accepts."""
    names = [
        NixlConnector.name,
        NixlPushConnector.name,
        SglangConnector.name,
        SharedStorageConnector.name,
    ]
    assert names == list(CONNECTORS)
    assert get_args(Settings.model_fields["connector"].annotation) == tuple(CONNECTORS)


def test_rooms_are_63_bit_one_per_prompt_of_a_batch() -> None:
    rooms = {new_room(completion()) for _ in range(64)}
    assert len(rooms) == 64  # from a CSPRNG: never the same twice in practice
    assert all(isinstance(r, int) and 0 <= r < ROOM_LIMIT for r in rooms)
    batch = new_room(completion(["one prompt", "another", "a third"]))
    assert isinstance(batch, list)
    assert len(set(batch)) == 3
    assert isinstance(new_room(completion([1, 2, 3])), int)  # token ids: one prompt
    # n > 1: one room; SGLang gives sample i the room + i itself (and refuses a list then).
    sampled = new_room(completion(n=4))
    assert isinstance(sampled, int)
    assert sampled + 3 < ROOM_LIMIT
    both = new_room(completion(["one prompt", "another"], n=3))  # SGLang spreads it over all 6
    assert isinstance(both, int)
    assert both + 5 < ROOM_LIMIT
    with pytest.raises(BadRequest, match="'n' is too large"):
        new_room(completion(n=2**62))


@pytest.fixture
async def sglang_pair(start_engine: StartEmulator) -> tuple[RunningEmulator, RunningEmulator]:
    return await start_engine(**SGLANG_PREFILL), await start_engine(**SGLANG_DECODE)


async def test_every_request_disaggregates_with_the_pool_entrys_bootstrap_port(
    http: aiohttp.ClientSession,
    sglang_pair: tuple[RunningEmulator, RunningEmulator],
    start_sidecar_with: StartSidecar,
) -> None:
    prefill, decode = sglang_pair
    sidecar = await start_sidecar_with(
        connector="sglang",
        decode_url=decode.url,
        # The entry's own bootstrap port wins over the setting (which names nothing here).
        prefill_endpoints=f"{prefill.endpoint}#{prefill.bootstrap_port}",
        sglang_bootstrap_port=1,
        disagg_min_tokens=100_000,  # would keep every prompt local for another connector
    )
    for _ in range(2):
        status, answer = await _post(http, sidecar, completion(max_tokens=3))
        assert status == 200, answer
        record = await _record(http, sidecar)
        assert (record["decision"], record["reason"]) == ("remote", "scheduled")
    legs = [leg["body"] for leg in await engine_requests(http, decode)]
    assert [leg[BOOTSTRAP_PORT] for leg in legs] == [prefill.bootstrap_port] * 2
    assert legs[0][BOOTSTRAP_ROOM] != legs[1][BOOTSTRAP_ROOM]
    assert [leg["body"] for leg in await engine_requests(http, prefill)] == legs


async def test_dns_discovered_servers_use_the_bootstrap_port_setting(
    http: aiohttp.ClientSession,
    sglang_pair: tuple[RunningEmulator, RunningEmulator],
    start_sidecar_with: StartSidecar,
) -> None:
    """Servers found by DNS (SIDECAR_PREFILL_DNS) have no entry of their own to carry a
    ``#bootstrap_port``: the setting's port goes to both legs."""
    prefill, decode = sglang_pair
    sidecar = await start_sidecar_with(
        connector="sglang",
        decode_url=decode.url,
        prefill_dns=f"localhost:{prefill.port}",
        sglang_bootstrap_port=prefill.bootstrap_port,
        scrape_interval_s=0.05,
        eject_after_failures=1,
    )
    served = f"127.0.0.1:{prefill.port}"

    async def only_the_emulator_is_healthy() -> bool:
        endpoints = (await get_json(http, sidecar.url + "/debug/scheduler"))["endpoints"]
        # localhost may resolve to ::1 too, where the emulator does not listen: ejected.
        return served in {e["endpoint"] for e in endpoints} and all(
            e["state"] in ("ejected", "probing") for e in endpoints if e["endpoint"] != served
        )

    await eventually(only_the_emulator_is_healthy)
    status, answer = await _post(http, sidecar, completion(max_tokens=3))
    assert status == 200, answer
    assert (await _record(http, sidecar))["prefill_endpoint"] == served
    [leg] = [leg["body"] for leg in await engine_requests(http, decode)]
    assert leg[BOOTSTRAP_PORT] == prefill.bootstrap_port
    assert [leg["body"] for leg in await engine_requests(http, prefill)] == [leg]


async def test_no_prefill_endpoint_is_a_503(
    http: aiohttp.ClientSession,
    sglang_pair: tuple[RunningEmulator, RunningEmulator],
    start_sidecar_with: StartSidecar,
) -> None:
    _, decode = sglang_pair
    sidecar = await start_sidecar_with(connector="sglang", decode_url=decode.url)
    status, answer = await _post(http, sidecar, completion())
    assert status == 503
    assert "cannot prefill" in answer["error"]["message"]
    assert await engine_requests(http, decode) == []
    record = await _record(http, sidecar)
    assert (record["state"], record["reason"]) == ("failed", "pool_empty")


async def test_too_many_samples_for_the_rooms_is_a_400_before_any_leg(
    http: aiohttp.ClientSession,
    sglang_pair: tuple[RunningEmulator, RunningEmulator],
    start_sidecar_with: StartSidecar,
) -> None:
    prefill, decode = sglang_pair
    sidecar = await start_sidecar_with(
        connector="sglang", decode_url=decode.url, sglang_bootstrap_port=prefill.bootstrap_port
    )
    status, answer = await _post(
        http, sidecar, completion(n=2**62), **{"x-prefiller-host-port": prefill.endpoint}
    )
    assert status == 400, answer
    assert answer["error"]["type"] == "BadRequestError"
    assert "'n' is too large" in answer["error"]["message"]
    assert await engine_requests(http, prefill) == []
    assert await engine_requests(http, decode) == []


async def test_a_retry_restarts_both_legs_in_a_new_room(
    http: aiohttp.ClientSession,
    sglang_pair: tuple[RunningEmulator, RunningEmulator],
    start_sidecar_with: StartSidecar,
) -> None:
    prefill, decode = sglang_pair
    sidecar = await start_sidecar_with(
        connector="sglang",
        decode_url=decode.url,
        sglang_bootstrap_port=prefill.bootstrap_port,
        prefill_retries=1,
    )
    await inject(http, prefill, kind="status", status=503, role="prefill")
    status, answer = await _post(
        http, sidecar, completion(max_tokens=3), **{"x-prefiller-host-port": prefill.endpoint}
    )
    assert status == 200, answer
    first, second = [leg["body"][BOOTSTRAP_ROOM] for leg in await engine_requests(http, prefill)]
    assert first != second
    decode_rooms = [leg["body"][BOOTSTRAP_ROOM] for leg in await engine_requests(http, decode)]
    assert decode_rooms == [first, second]  # the first attempt's decode leg was aborted
    assert (await _record(http, sidecar))["prefill_attempts"] == 2
    await _nothing_waits(http, decode)


async def test_a_retry_moves_both_legs_to_another_prefill_server_in_a_new_room(
    http: aiohttp.ClientSession, start_engine: StartEmulator, start_sidecar_with: StartSidecar
) -> None:
    """A pool of two SGLang prefill servers, each with its own bootstrap port: the first one
    tried answers 503, so the retry goes to the other one with a new room, and the decode leg
    starts again towards that server's bootstrap port (the first decode leg was aborted)."""
    pool = sorted(
        [await start_engine(**SGLANG_PREFILL), await start_engine(**SGLANG_PREFILL)],
        key=lambda engine: engine.endpoint,
    )
    decode = await start_engine(**SGLANG_DECODE)
    sidecar = await start_sidecar_with(
        connector="sglang",
        decode_url=decode.url,
        prefill_endpoints=",".join(f"{p.endpoint}#{p.bootstrap_port}" for p in pool),
        scheduler_policy="round_robin",  # starts with the first endpoint by name
        prefill_retries=1,
    )
    await inject(http, pool[0], kind="status", status=503, role="prefill")
    status, answer = await _post(http, sidecar, completion(max_tokens=3))
    assert status == 200, answer
    [failed] = [leg["body"] for leg in await engine_requests(http, pool[0])]
    [served] = [leg["body"] for leg in await engine_requests(http, pool[1])]
    assert failed[BOOTSTRAP_ROOM] != served[BOOTSTRAP_ROOM]
    decode_legs = [leg["body"] for leg in await engine_requests(http, decode)]
    assert [(leg[BOOTSTRAP_PORT], leg[BOOTSTRAP_ROOM]) for leg in decode_legs] == [
        (pool[0].bootstrap_port, failed[BOOTSTRAP_ROOM]),
        (pool[1].bootstrap_port, served[BOOTSTRAP_ROOM]),
    ]
    record = await _record(http, sidecar)
    assert (record["prefill_attempts"], record["prefill_endpoint"]) == (2, pool[1].endpoint)
    await _nothing_waits(http, decode)


async def test_every_prefill_server_ejected_is_a_503_without_a_decode_leg(
    http: aiohttp.ClientSession, start_engine: StartEmulator, start_sidecar_with: StartSidecar
) -> None:
    """The pool's only prefill server refuses connections, and its scrapes eject it: a request
    then finds no healthy prefill server and gets 503 before any leg (the decider's "local"
    cannot apply: an SGLang decode server cannot prefill)."""
    decode = await start_engine(**SGLANG_DECODE)
    sidecar = await start_sidecar_with(
        connector="sglang",
        decode_url=decode.url,
        prefill_endpoints="127.0.0.9:1#1",  # loopback, nothing listens
        scrape_interval_s=0.05,
        eject_after_failures=1,
    )

    async def ejected() -> bool:
        snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
        return snapshot["endpoints"][0]["state"] in ("ejected", "probing")

    await eventually(ejected)
    status, answer = await _post(http, sidecar, completion(max_tokens=3))
    assert status == 503, answer
    assert answer["error"]["type"] == "ServiceUnavailableError"
    assert "no healthy prefill endpoint" in answer["error"]["message"], answer
    assert await engine_requests(http, decode) == []
    record = await _record(http, sidecar)
    assert (record["state"], record["reason"]) == ("failed", "pool_empty")


async def test_a_refused_prefill_ends_its_decode_leg_at_once(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    start_sidecar_with: StartSidecar,
) -> None:
    prefill = await start_engine(**SGLANG_PREFILL, max_model_len=64)
    decode = await start_engine(**SGLANG_DECODE)  # waits 300 s for a room by default
    sidecar = await start_sidecar_with(
        connector="sglang", decode_url=decode.url, sglang_bootstrap_port=prefill.bootstrap_port
    )
    status, answer = await _post(
        http,
        sidecar,
        completion("far too long for the prefill server " * 40),
        **{"x-prefiller-host-port": prefill.endpoint},
    )
    assert status == 400, answer
    assert answer["error"]["code"] == 400  # the prefill's own error
    assert len(await engine_requests(http, decode)) == 1  # sent at once, then aborted
    await _nothing_waits(http, decode)
    record = await _record(http, sidecar)
    assert (record["state"], record["error"]) == ("failed", "prefill answered 400")


async def test_both_legs_timings_in_the_record_and_the_metrics(
    http: aiohttp.ClientSession,
    sglang_pair: tuple[RunningEmulator, RunningEmulator],
    start_sidecar_with: StartSidecar,
) -> None:
    prefill, decode = sglang_pair
    sidecar = await start_sidecar_with(  # a pool entry without '#': the setting's port
        connector="sglang",
        decode_url=decode.url,
        prefill_endpoints=prefill.endpoint,
        sglang_bootstrap_port=prefill.bootstrap_port,
    )
    status, answer = await _post(http, sidecar, completion(max_tokens=4, stream=False))
    assert status == 200, answer
    record = await _record(http, sidecar)
    assert set(record["phases"]) >= {"prefill_sent", "prefill_done", "decode_sent", "first_byte"}
    assert record["durations_ms"]["prefill"] is not None
    assert record["durations_ms"]["decode"] is not None
    for phase in ("prefill", "decode"):
        labels = f'decision="remote",phase="{phase}",route="completions"'
        sample = f"pd_sidecar_phase_duration_seconds_count{{{labels}}}"
        assert await metric(http, sidecar.url, sample) == 1


# --- shared storage ---------------------------------------------------------------------------


async def test_shared_storage_usage_says_what_the_prefill_found_cached(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    start_sidecar_with: StartSidecar,
    tmp_path: Path,
) -> None:
    engines = {
        "kv_protocol": "shared-storage",
        "kv_store": str(tmp_path),
        "prompt_tokens_details": True,
    }
    prefill, decode = await start_engine(**engines), await start_engine(**engines)
    sidecar = await start_sidecar_with(
        connector="shared-storage",
        decode_url=decode.url,
        prefill_endpoints=prefill.endpoint,
    )
    prompt = "A prompt long enough to fill a few blocks of sixteen tokens each. " * 8
    cached = []
    for _ in range(2):
        status, answer = await _post(
            http,
            sidecar,
            completion(prompt, max_tokens=2),
            **{"x-prefiller-host-port": prefill.endpoint},  # the prefix index would stay local
        )
        assert status == 200, answer
        assert (await _record(http, sidecar))["decision"] == "remote"
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    # The decode found the whole prompt in the store both times (the prefill had just written
    # it); the client is told what was cached before this request: nothing, then everything.
    assert cached[0] == 0
    assert cached[1] > 0
    kv = await get_json(http, decode.url + "/emulator/kv")
    assert kv["store_blocks"] > 0
