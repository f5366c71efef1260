"""The decode rank's choice and a prefill's retry read the engines' KV events, on real sockets:
decode emulators as data-parallel ranks publishing on the events port + their rank, prefill
emulators on addresses of their own (``test_wiring``'s pool), a sidecar with events on."""

from __future__ import annotations

import asyncio
import gc
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from devkit.processes import quiet_port
from sidecar.config import Settings
from sidecar.emulator import EmulatorConfig, RunningEmulator, start_emulator
from sidecar.kvevents.fleet import PromptLookup
from sidecar.server.runner import RunningSidecar, start_sidecar
from tests.conftest import StartSidecar, eventually, get_json, inject

from .helpers import Pool, events_on, publisher
from .test_wiring import (
    complete_on,
    complete_on_ids,
    in_sync,
    kv_view,
    long_prompt,
    through,
)

RANKS = 2


@pytest.fixture
async def ranked() -> AsyncIterator[Ranked]:
    made = Ranked()
    yield made
    await made.close()


def consecutive_ports(count: int, avoid: frozenset[int] = frozenset()) -> int:
    """The first of ``count`` loopback ports free right now, none in ``avoid``."""
    for _ in range(100):
        first = quiet_port()
        ports = range(first, first + count)
        if avoid.intersection(ports):
            continue
        try:
            for port in ports[1:]:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise AssertionError(f"no {count} consecutive free ports")


class Ranked:
    """Decode emulators as the ranks of one data-parallel engine, each publishing its events
    on the events port + its rank (replay: the replay port + its rank), as vLLM does; a
    sidecar in front of them."""

    def __init__(self) -> None:
        self.ranks: list[RunningEmulator] = []
        self.sidecar: RunningSidecar | None = None

    async def start(self, **settings: Any) -> RunningSidecar:
        """The ranks and the sidecar (keywords override its Settings; a ``port`` of its own
        is kept clear of the events ports, with the rank ports after it)."""
        taken = frozenset(range(settings.get("port", 0), settings.get("port", 0) + RANKS))
        port = consecutive_ports(RANKS, taken)
        replay = consecutive_ports(RANKS, taken | frozenset(range(port, port + RANKS)))
        for rank in range(RANKS):
            config = events_on("127.0.0.1", port + rank, replay + rank)
            self.ranks.append(await start_emulator(EmulatorConfig(port=0, kv_events_config=config)))
        values: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "decode_urls": ",".join(engine.url for engine in self.ranks),
            "ready_interval_s": 0.05,
            "scheduler_seed": 1,
            "kv_events": True,
            "kv_events_decode_port": port,
            "kv_events_decode_replay_port": replay,
            # The ranks' /tokenize (in this process) answers well within it even cold and on a
            # loaded machine; past the default 50 ms a request would be placed without its token
            # ids, by the approximate indexes, which these tests are not about.
            "kv_events_tokenize_timeout_ms": 5000,
        }
        values.update(settings)
        self.sidecar = await start_sidecar(Settings(**values))
        for engine in self.ranks:
            await publisher(engine).wait_subscriptions(1)
        return self.sidecar

    async def close(self) -> None:
        if self.sidecar is not None:
            await self.sidecar.close()
        for engine in self.ranks:
            await engine.close()


async def ranks_view(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> list[dict[str, Any]]:
    return list((await kv_view(http, sidecar))["decode_ranks"])


async def until_ready(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> None:
    async def ready() -> bool:
        shown = (await get_json(http, sidecar.url + "/debug/scheduler"))["decode_ranks"]
        return all(rank["ready"] for rank in shown)

    await eventually(ready)


async def until_idle(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> None:
    """Until every rank is ready, holds none of this sidecar's requests and was last scraped
    with none waiting: the choice then weighs what the ranks hold alone. (A scrape taken while
    the previous request was queued counts a waiting request, 1,000 tokens, against its rank
    until the next scrape; on a loaded machine that can outweigh a cached prompt.)"""

    async def idle() -> bool:
        return all(
            rank["ready"] and rank["inflight"] == 0 and not (rank["scraped"] or {}).get("waiting")
            for rank in (await get_json(http, sidecar.url + "/debug/scheduler"))["decode_ranks"]
        )

    await eventually(idle)


async def until_applied(
    http: aiohttp.ClientSession, sidecar: RunningSidecar, rank: int, batches: int
) -> None:
    """Until rank ``rank``'s index has applied ``batches`` batches (it is in sync then)."""

    async def applied() -> bool:
        shown = (await ranks_view(http, sidecar))[rank]
        return shown.get("batches_applied") == batches and shown["source"] == "events"

    await eventually(applied)


async def test_a_rank_whose_events_hold_the_prompt_takes_it_from_the_approximate_holder(
    ranked: Ranked, http: aiohttp.ClientSession
) -> None:
    sidecar = await ranked.start()
    await until_ready(http, sidecar)
    prompt = long_prompt()
    # No rank's events in sync yet: placed by the prefix indexes, which then guess it there.
    first = await through(http, sidecar, prompt)
    guessed = first["decode_rank"]
    other = 1 - guessed
    assert first["cached_source"] is None
    await until_applied(http, sidecar, guessed, 1)
    # That engine lost it (a cache reset: an event), the other one computed it for a client of
    # its own: the prefix indexes still guess the first rank, the events say the other.
    async with http.post(ranked.ranks[guessed].url + "/reset_prefix_cache") as response:
        assert response.status == 200
    await until_applied(http, sidecar, guessed, 2)
    assert (await ranks_view(http, sidecar))[guessed]["blocks"] == 0
    await complete_on(http, ranked.ranks[other], prompt)
    await until_applied(http, sidecar, other, 1)
    again = await through(http, sidecar, prompt)
    assert (again["decode_rank"], again["decode_url"]) == (other, ranked.ranks[other].url)
    assert again["cached_source"] == "events"
    sources = (await kv_view(http, sidecar))["last_decision"]["sources"]
    assert sources == {"decode:0": "events", "decode:1": "events"}  # both candidates looked up


async def test_a_prompt_only_one_ranks_events_hold_goes_to_that_rank(
    ranked: Ranked, http: aiohttp.ClientSession
) -> None:
    sidecar = await ranked.start()
    await until_ready(http, sidecar)
    # Rank 1 holds four prompts, by its own account; rank 0 holds another one. The sidecar sent
    # neither anything: its prefix indexes guess nothing, and load alone would split them.
    prompts = [long_prompt() for _ in range(4)]
    await complete_on(http, ranked.ranks[0], long_prompt())
    for prompt in prompts:
        await complete_on(http, ranked.ranks[1], prompt)
    await until_applied(http, sidecar, 0, 1)
    await until_applied(http, sidecar, 1, len(prompts))
    for prompt in prompts:
        await until_idle(http, sidecar)
        record = await through(http, sidecar, prompt)
        assert record["decode_rank"] == 1
        assert record["cached_source"] == "events"


async def test_a_rank_the_request_names_keeps_it_whatever_the_events_say(
    ranked: Ranked, http: aiohttp.ClientSession
) -> None:
    port = consecutive_ports(RANKS)
    sidecar = await ranked.start(rank_ports=True, port=port)
    await until_ready(http, sidecar)
    on_zero, on_one = long_prompt(), long_prompt()
    await complete_on(http, ranked.ranks[0], on_zero)
    await complete_on(http, ranked.ranks[1], on_one)
    await until_applied(http, sidecar, 0, 1)
    await until_applied(http, sidecar, 1, 1)
    for named, prompt in ((0, on_one), (1, on_zero)):
        request_id = uuid.uuid4().hex
        body = {"model": "emulated-model", "prompt": prompt, "max_tokens": 1}
        url = f"http://127.0.0.1:{port + named}/v1/completions"
        async with http.post(url, json=body, headers={"x-request-id": request_id}) as response:
            assert response.status == 200, await response.text()
            await response.read()
        record = await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")
        assert record["decode_rank"] == named
        assert record["cached_source"] == "events"  # its own rank's events: it holds nothing


def token_ids(count: int) -> list[int]:
    """A prompt of ``count`` token ids no other prompt of the test shares a block with."""
    start = 1000 + uuid.uuid4().int % 10**6 * 1000
    return list(range(start, start + count))


async def test_a_retry_goes_where_the_events_hold_the_prompt(
    pool: Pool, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    holder, empty, partial = await pool.add(), await pool.add(), await pool.add()
    sidecar = await start_sidecar_with(prefill_retry_backoff_s=0, **pool.settings())
    for engine in pool.engines:
        await publisher(engine).wait_subscriptions(1)
    # The whole prompt on one endpoint, its first 200 tokens on another, nothing of it on the
    # third (which holds another prompt, to be in sync): by their events alone, the sidecar sent
    # them nothing.
    ids = token_ids(1000)
    await complete_on_ids(http, holder, ids)
    await complete_on_ids(http, partial, ids[:200])
    await complete_on_ids(http, empty, token_ids(100))
    await in_sync(http, sidecar, *(engine.endpoint for engine in pool.engines))
    # The holder is chosen, and fails transiently: the retry is to choose between the others.
    await inject(http, holder, kind="status", status=503, role="prefill")
    request_id = uuid.uuid4().hex
    body = {"model": "emulated-model", "prompt": ids, "max_tokens": 1}
    async with http.post(
        sidecar.url + "/v1/completions", json=body, headers={"x-request-id": request_id}
    ) as response:
        assert response.status == 200, await response.text()
        await response.read()
    record = await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")
    assert (record["decision"], record["reason"]) == ("remote", "scheduled")
    assert record["prefill_attempts"] == 2
    assert record["prefill_endpoint"] == partial.endpoint
    assert record["cached_source"] == "events"
    assert record["prefill_predicted_cached_tokens"] == 192  # 12 whole blocks of 16 tokens
    assert record["fallback_reason"] is None
    sources = (await kv_view(http, sidecar))["last_decision"]["sources"]
    assert sources == {engine.endpoint: "events" for engine in pool.engines}


def lookups_alive() -> int:
    """``PromptLookup``s alive in this process (the sidecar runs in it)."""
    gc.collect()
    return sum(1 for thing in gc.get_objects() if isinstance(thing, PromptLookup))


async def test_the_lookups_live_as_long_as_the_prefill_leg_not_the_stream(
    pool: Pool,
    start_sidecar_with: StartSidecar,
    decode: RunningEmulator,
    http: aiohttp.ClientSession,
) -> None:
    engine = await pool.add()
    sidecar = await start_sidecar_with(**pool.settings())
    await publisher(engine).wait_subscriptions(1)
    prompt = long_prompt()
    await complete_on(http, engine, prompt)
    await in_sync(http, sidecar, engine.endpoint)
    await inject(http, engine, kind="hang", role="prefill")
    await inject(http, decode, kind="stall", role="decode", after_chunks=1)
    body = {"model": "emulated-model", "prompt": prompt, "max_tokens": 8, "stream": True}
    streaming, finish = asyncio.Event(), asyncio.Event()

    async def client() -> int:
        async with http.post(sidecar.url + "/v1/completions", json=body) as response:
            await response.content.readany()  # its first chunk: the decode then stalls
            streaming.set()
            await finish.wait()
            await response.read()
            return response.status

    async def held() -> bool:
        return bool((await get_json(http, engine.url + "/emulator/faults"))["held"] == 1)

    streamed = asyncio.create_task(client())
    await eventually(held)
    assert lookups_alive() == 1  # while its prefill runs, a retry may need them
    async with http.post(engine.url + "/emulator/release") as released:
        assert released.status == 200
    await asyncio.wait_for(streaming.wait(), 10)
    assert lookups_alive() == 0  # the stream is open, its prefill leg over
    finish.set()
    async with http.post(decode.url + "/emulator/release") as released:
        assert released.status == 200
    assert await streamed == 200
