"""The sidecar wired to its engines' KV events, on real sockets: emulators as prefill engines
publishing on vLLM's wire, each on an address of its own in 127.0.0.0/8 and all on one events
port (as pods are), a sidecar with SIDECAR_KV_EVENTS=true in front of a decode emulator."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest

from sidecar.config import Settings
from sidecar.emulator import EmulatorConfig, RunningEmulator, start_emulator
from sidecar.server.runner import RunningSidecar, start_sidecar
from tests.conftest import StartSidecar, eventually, get_json, metric
from tests.imports import imported

from .helpers import HOSTS, Pool, events_on, publisher


async def kv_view(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> dict[str, Any]:
    view: dict[str, Any] = (await get_json(http, sidecar.url + "/debug/scheduler"))["kv_events"]
    return view


async def source_of(http: aiohttp.ClientSession, sidecar: RunningSidecar, key: str) -> str | None:
    endpoint = (await kv_view(http, sidecar))["endpoints"].get(key)
    return None if endpoint is None else str(endpoint["source"])


async def complete_on(http: aiohttp.ClientSession, engine: RunningEmulator, prompt: str) -> None:
    """A completion sent to the engine itself: it stores the prompt's blocks and says so."""
    body = {"model": "emulated-model", "prompt": prompt, "max_tokens": 1}
    async with http.post(engine.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


def long_prompt(words: int = 120) -> str:
    """A prompt of ~1,000 estimated tokens (120 words) no other prompt shares a block with."""
    return " ".join(uuid.uuid4().hex for _ in range(words))


async def test_an_endpoint_that_publishes_is_exact_and_one_that_does_not_is_approximate(
    pool: Pool, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    publishing = await pool.add()
    silent = await pool.add(events=False)
    sidecar = await start_sidecar_with(**pool.settings())
    await publisher(publishing).wait_subscriptions(1)
    # Subscribed, nothing published yet: the approximate index stands in.
    assert await source_of(http, sidecar, publishing.endpoint) == "approximate"
    await complete_on(http, publishing, long_prompt())

    async def exact() -> bool:
        return await source_of(http, sidecar, publishing.endpoint) == "events"

    await eventually(exact)
    view = await kv_view(http, sidecar)
    shown = view["endpoints"][publishing.endpoint]
    assert shown["connected"] is True
    assert shown["blocks"] > 0
    assert shown["events_applied"] == shown["blocks"]
    assert shown["lag_s"] is not None
    assert view["endpoints"][silent.endpoint]["source"] == "approximate"
    assert view["endpoints"][silent.endpoint]["connected"] is False
    # The metrics say the same, labelled by the pool's key.
    assert (
        await metric(
            http, sidecar.url, f'pd_sidecar_kv_events_source{{engine="{publishing.endpoint}"}}'
        )
        == 1
    )
    assert (
        await metric(
            http, sidecar.url, f'pd_sidecar_kv_events_source{{engine="{silent.endpoint}"}}'
        )
        == 0
    )
    assert (
        await metric(
            http, sidecar.url, f'pd_sidecar_kv_events_blocks{{engine="{publishing.endpoint}"}}'
        )
        == shown["blocks"]
    )
    assert (
        await metric(
            http,
            sidecar.url,
            f'pd_sidecar_kv_events_applied_total{{engine="{publishing.endpoint}"}}',
        )
        == shown["blocks"]
    )


async def test_events_off_subscribe_to_nothing(
    pool: Pool, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    engine = await pool.add()
    settings = pool.settings()
    settings["kv_events"] = False
    sidecar = await start_sidecar_with(**settings)
    await complete_on(http, engine, long_prompt())
    assert (await kv_view(http, sidecar)) == {"enabled": False}
    assert publisher(engine).subscriptions_total == 0
    assert await metric(http, sidecar.url, "pd_sidecar_kv_events_") == 0


async def test_a_pool_member_that_leaves_is_unsubscribed(
    pool: Pool, decode: RunningEmulator, http: aiohttp.ClientSession
) -> None:
    # Two pods behind a headless Service's name: one HTTP port, one events port, two addresses.
    staying = await pool.add()
    leaving = await pool.add(port=staying.port)
    answer = [HOSTS[0], HOSTS[1]]

    async def resolver(name: str, port: int) -> list[str]:
        return list(answer)

    settings = pool.settings()
    del settings["prefill_endpoints"]
    sidecar = await start_sidecar(
        Settings(
            host="127.0.0.1",
            port=0,
            decode_url=decode.url,
            prefill_dns=f"prefill.test:{staying.port}",
            discovery_interval_s=0.05,
            **settings,
        ),
        resolver=resolver,
    )
    try:
        await publisher(staying).wait_subscriptions(1)
        await publisher(leaving).wait_subscriptions(1)
        answer = [HOSTS[0]]

        async def unsubscribed() -> bool:
            return leaving.endpoint not in (await kv_view(http, sidecar))["endpoints"]

        await eventually(unsubscribed)
        assert list((await kv_view(http, sidecar))["endpoints"]) == [staying.endpoint]
        # Its subscriber's tasks ended (this process runs them), and its series left the metrics.
        assert subscriber_tasks(HOSTS[1]) == []
        assert subscriber_tasks(HOSTS[0])
        text = await (await http.get(sidecar.url + "/metrics")).text()
        assert f'engine="{leaving.endpoint}"' not in text
        assert f'engine="{staying.endpoint}"' in text
    finally:
        await sidecar.close()


def subscriber_tasks(host: str) -> list[str]:
    """This process's tasks of a KV-event subscriber to ``host`` (``Subscriber`` names them)."""
    prefix = f"kvevents tcp://{host}:"
    return [task.get_name() for task in asyncio.all_tasks() if task.get_name().startswith(prefix)]


async def blocks_of(http: aiohttp.ClientSession, sidecar: RunningSidecar, key: str) -> int:
    return int((await kv_view(http, sidecar))["endpoints"][key]["blocks"])


async def test_an_engine_that_restarts_is_resynchronised(
    pool: Pool, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    engine = await pool.add()
    sidecar = await start_sidecar_with(**pool.settings())
    await publisher(engine).wait_subscriptions(1)
    await complete_on(http, engine, long_prompt())

    async def exact() -> bool:
        return await source_of(http, sidecar, engine.endpoint) == "events"

    await eventually(exact)
    before = await blocks_of(http, sidecar, engine.endpoint)
    assert before > 0
    # The engine goes (its cache with it) and comes back on the same addresses, empty.
    await engine.close()

    async def approximate() -> bool:
        return await source_of(http, sidecar, engine.endpoint) == "approximate"

    await eventually(approximate)
    again = await start_emulator(
        EmulatorConfig(
            host=HOSTS[0],
            port=engine.port,
            kv_events_config=events_on(HOSTS[0], pool.port, pool.replay),
        )
    )
    pool.started.append(again)
    await publisher(again).wait_subscriptions(1)  # the subscriber reconnected by itself
    short = "a new engine's first prompt " * 8
    await complete_on(http, again, short)
    await eventually(exact)
    view = (await kv_view(http, sidecar))["endpoints"][engine.endpoint]
    # What the old engine held is forgotten: the index holds the new engine's blocks alone.
    assert 0 < view["blocks"] < before
    assert view["resets"].get("reconnected", 0) >= 1


async def test_an_eviction_and_a_cache_reset_leave_the_index(
    pool: Pool, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    engine = await pool.add(num_gpu_blocks=64)
    sidecar = await start_sidecar_with(**pool.settings())
    await publisher(engine).wait_subscriptions(1)
    first = long_prompt()
    await complete_on(http, engine, first)

    async def held(count: int) -> bool:
        return await blocks_of(http, sidecar, engine.endpoint) == count

    await eventually(lambda: held(len(first) // 4 // 16))  # 4 characters a token
    await complete_on(http, engine, long_prompt())  # evicts most of the first one's blocks
    await eventually(lambda: held(64))
    async with http.post(engine.url + "/reset_prefix_cache") as response:
        assert response.status == 200
    await eventually(lambda: held(0))
    shown = (await kv_view(http, sidecar))["endpoints"][engine.endpoint]
    assert shown["source"] == "events"  # a clear is an event like any other: still in sync
    assert shown["resets"] == {}


async def through(
    http: aiohttp.ClientSession, sidecar: RunningSidecar, prompt: str, **headers: str
) -> dict[str, Any]:
    """A completion through the sidecar; its record in /debug/requests."""
    request_id = uuid.uuid4().hex
    body = {"model": "emulated-model", "prompt": prompt, "max_tokens": 1}
    async with http.post(
        sidecar.url + "/v1/completions", json=body, headers={"x-request-id": request_id, **headers}
    ) as response:
        assert response.status == 200, await response.text()
        await response.read()
    record: dict[str, Any] = await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")
    return record


async def in_sync(http: aiohttp.ClientSession, sidecar: RunningSidecar, *keys: str) -> None:
    async def synced() -> bool:
        endpoints = (await kv_view(http, sidecar))["endpoints"]
        return all(endpoints[key]["source"] == "events" for key in keys)

    await eventually(synced)


async def test_the_decision_goes_where_the_events_say_the_prompt_is_cached(
    pool: Pool, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    first, second = await pool.add(), await pool.add()
    # Scraped often: each decision below waits until the sidecar has seen both engines idle.
    sidecar = await start_sidecar_with(**pool.settings(), scrape_interval_s=0.1)
    await publisher(first).wait_subscriptions(1)
    await publisher(second).wait_subscriptions(1)
    # Each engine's events come in sync with a prompt of its own; then four prompts, two cached
    # on each engine by a client of its own (the sidecar sent them nothing: its approximate
    # index knows none of them). Equally loaded, each must go where it is cached. The prompts
    # are long (~4,000 tokens), so that computing one where it is not cached costs more than
    # a speed learnt from one prefill slowed by a loaded machine can make up.
    await complete_on(http, first, long_prompt())
    await complete_on(http, second, long_prompt())
    await in_sync(http, sidecar, first.endpoint, second.endpoint)
    cached = [(long_prompt(480), engine) for engine in (first, second, first, second)]
    for prompt, engine in cached:
        await complete_on(http, engine, prompt)

    async def applied() -> bool:
        endpoints = (await kv_view(http, sidecar))["endpoints"]
        return all(endpoints[e.endpoint]["batches_applied"] == 3 for e in (first, second))

    async def idle() -> bool:
        endpoints = (await get_json(http, sidecar.url + "/debug/scheduler"))["endpoints"]
        scraped = [e["scraped"] for e in endpoints]
        return all(s is not None and s["waiting"] == 0 and s["running"] == 0 for s in scraped)

    await eventually(applied)
    for prompt, engine in cached:
        await eventually(idle)
        record = await through(http, sidecar, prompt)
        assert (record["decision"], record["reason"]) == ("remote", "scheduled")
        if record["prefill_endpoint"] != engine.endpoint:
            # What the decision saw of each endpoint: loads, speeds learnt, reservations.
            seen = (await get_json(http, sidecar.url + "/debug/scheduler"))["endpoints"]
            pytest.fail(f"{record} went elsewhere than {engine.endpoint}; endpoints: {seen}")
        assert record["cached_source"] == "events"
        # The whole prompt but its last, partial block: counted in the engine's tokens.
        assert record["prefill_predicted_cached_tokens"] >= len(prompt) // 4 - 16
        assert record["tokenize_ms"] is not None
        assert record["tokenize_ms"] <= record["durations_ms"]["ttft"]
    view = await kv_view(http, sidecar)
    assert view["token_ids"]["answered"] == 4
    assert view["lookups"]["events"] == 4 * 2  # both candidates, four decisions
    assert view["last_decision"]["sources"] == {
        first.endpoint: "events",
        second.endpoint: "events",
        "decode:0": "approximate",  # the decode rank is not subscribed to here
    }
    assert await metric(http, sidecar.url, 'pd_sidecar_kv_events_lookups_total{source="events"}')


async def test_an_eviction_or_a_reset_takes_the_prediction_back(
    pool: Pool, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    engine = await pool.add(num_gpu_blocks=64)  # one long prompt's worth of blocks
    # The local index remembers nothing: a prompt sent twice goes remote both times.
    sidecar = await start_sidecar_with(prefix_cache_blocks=0, **pool.settings())
    await publisher(engine).wait_subscriptions(1)
    evicted, newer, reset = long_prompt(), long_prompt(), long_prompt()
    await complete_on(http, engine, evicted)
    await complete_on(http, engine, newer)  # the LRU evicts all but evicted's first blocks
    await in_sync(http, sidecar, engine.endpoint)

    async def applied(count: int) -> bool:
        shown = (await kv_view(http, sidecar))["endpoints"][engine.endpoint]
        return bool(shown["batches_applied"] == count)

    await eventually(lambda: applied(2))
    record = await through(http, sidecar, evicted)
    assert record["prefill_endpoint"] == engine.endpoint  # the only member
    assert record["cached_source"] == "events"
    # What the LRU left of it: the 64 blocks less the newer prompt's (4 characters a token).
    left = 64 - len(newer) // 4 // 16
    assert 0 < left < 8
    assert record["prefill_predicted_cached_tokens"] == left * 16
    # The sidecar's own request stored it again; a cache reset forgets everything.
    await eventually(lambda: applied(3))
    await complete_on(http, engine, reset)
    await eventually(lambda: applied(4))
    held = await through(http, sidecar, reset)
    assert held["prefill_predicted_cached_tokens"] >= len(reset) // 4 - 16
    async with http.post(engine.url + "/reset_prefix_cache") as response:
        assert response.status == 200

    async def cleared() -> bool:
        return await blocks_of(http, sidecar, engine.endpoint) == 0

    await eventually(cleared)
    record = await through(http, sidecar, reset)
    assert record["cached_source"] == "events"
    assert record["prefill_predicted_cached_tokens"] == 0


async def test_a_header_choice_asks_for_no_token_ids(
    pool: Pool, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    engine = await pool.add()
    sidecar = await start_sidecar_with(**pool.settings())
    await publisher(engine).wait_subscriptions(1)
    await complete_on(http, engine, long_prompt())
    await in_sync(http, sidecar, engine.endpoint)
    record = await through(
        http, sidecar, long_prompt(), **{"x-prefiller-host-port": engine.endpoint}
    )
    assert (record["decision"], record["reason"]) == ("remote", "header")
    assert record["tokenize_ms"] is None
    assert (await kv_view(http, sidecar))["token_ids"]["answered"] == 0
    # A prompt given as token ids needs no call: the header's target is looked up for the record.
    ids = list(range(1000, 1400))
    await complete_on_ids(http, engine, ids)

    async def stored() -> bool:
        # A batch each: the first prompt, the header request's prefill, the ids.
        shown = (await kv_view(http, sidecar))["endpoints"][engine.endpoint]
        return bool(shown["batches_applied"] == 3)

    await eventually(stored)
    request_id = uuid.uuid4().hex
    body = {"model": "emulated-model", "prompt": ids, "max_tokens": 1}
    headers = {"x-request-id": request_id, "x-prefiller-host-port": engine.endpoint}
    async with http.post(sidecar.url + "/v1/completions", json=body, headers=headers) as response:
        assert response.status == 200
        await response.read()
    record = await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")
    assert record["cached_source"] == "events"
    assert record["prefill_predicted_cached_tokens"] == 384  # 399 tokens a hit may cover: 24 blocks
    assert record["tokenize_ms"] is None
    assert (await kv_view(http, sidecar))["token_ids"]["answered"] == 0


async def complete_on_ids(
    http: aiohttp.ClientSession, engine: RunningEmulator, ids: list[int]
) -> None:
    body = {"model": "emulated-model", "prompt": ids, "max_tokens": 1}
    async with http.post(engine.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


async def test_the_local_rank_cached_by_events_prefills_locally(
    pool: Pool, http: aiohttp.ClientSession
) -> None:
    prefill = await pool.add()
    decode = await start_emulator(EmulatorConfig(kv_events_config=events_on("127.0.0.1")))
    pool.started.append(decode)
    assert decode.kv_events_port is not None
    settings = pool.settings()
    settings.update(
        kv_events_decode_port=decode.kv_events_port,
        kv_events_decode_replay_port=decode.kv_events_replay_port,
    )
    sidecar = await start_sidecar(
        Settings(host="127.0.0.1", port=0, decode_url=decode.url, **settings)
    )
    try:
        await publisher(decode).wait_subscriptions(1)
        await publisher(prefill).wait_subscriptions(1)
        prompt = long_prompt()
        await complete_on(http, decode, prompt)  # the decode engine holds it, by its own account

        async def synced() -> bool:
            return bool((await kv_view(http, sidecar))["decode_ranks"][0]["source"] == "events")

        await eventually(synced)
        record = await through(http, sidecar, prompt)
        # Without the rank's events the prompt counts as uncached here, and goes remote.
        assert (record["decision"], record["reason"]) == ("local", "prefix_cached")
        assert record["cached_source"] == "events"
    finally:
        await sidecar.close()


APP = (
    "import asyncio\n"
    "from sidecar.app import create_app\n"
    "from sidecar.config import Settings\n"
    "async def main():\n"
    "    create_app(Settings(prefill_endpoints='127.0.0.2:8000', kv_events={on}))\n"
    "asyncio.run(main())\n"
)


@pytest.mark.parametrize("on", [False, True])
def test_msgpack_is_imported_only_with_events_on_and_zmq_never(on: bool) -> None:
    """The subscriber speaks ZMTP itself (``kvevents/zmtp.py``): pyzmq is the emulator's."""
    roots = {name.split(".")[0] for name in imported("-c", APP.format(on=on))}
    assert "zmq" not in roots
    assert ("msgpack" in roots) is on
