"""A prefill server with data-parallel ranks (SIDECAR_KV_EVENTS_PREFILL_DP_SIZE), on real sockets.

vLLM offsets each rank's events and replay ports by its rank; here each rank is an emulator of
its own on one loopback address (a pod's), publishing on the member's events port + its rank.
The pool member is rank 0's HTTP address (vLLM's one API server). Prompts are token ids sent
with the pool header: the decision then looks the member up without asking for token ids, and
its predicted cached tokens are exact to the block (16 tokens: a hit of a 399-token prompt is
at most 24 blocks, 384 tokens)."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError

from devkit.processes import quiet_port
from sidecar.config import Settings
from sidecar.emulator import EmulatorConfig, RunningEmulator, start_emulator
from sidecar.server.runner import RunningSidecar
from tests.conftest import StartSidecar, eventually, get_json, metric

from .helpers import WAIT_S, publisher

HOST = "127.0.0.5"
"""The data-parallel prefill server's address: every rank publishes on it."""
PROMPT = list(range(1000, 1399))
"""399 token ids: 24 whole blocks a hit may cover (it never covers the last token)."""
WHOLE = 24 * 16


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on ``HOST`` (outside the ephemeral range)."""
    for _ in range(50):
        first = quiet_port()
        probes = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind((HOST, first + offset))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return first
    raise AssertionError(f"no {count} consecutive free ports")


class Server:
    """A prefill server of ``size`` data-parallel ranks: events on ``port`` + r, replay on
    ``replay`` + r; ``start(r)`` starts rank r's emulator."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.port = free_ports(2 * size)
        self.replay = self.port + size
        self.ranks: dict[int, RunningEmulator] = {}

    async def start(self, rank: int) -> RunningEmulator:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{HOST}:{self.port + rank}",
            "replay_endpoint": f"tcp://{HOST}:{self.replay + rank}",
        }
        engine = await start_emulator(
            EmulatorConfig(host=HOST, port=0, kv_events_config=json.dumps(config))
        )
        self.ranks[rank] = engine
        return engine

    @property
    def key(self) -> str:
        """The pool member: rank 0's HTTP address (vLLM's API server)."""
        return self.ranks[0].endpoint

    def settings(self) -> dict[str, Any]:
        return {
            "prefill_endpoints": self.key,
            "kv_events": True,
            "kv_events_port": self.port,
            "kv_events_replay_port": self.replay,
            "kv_events_prefill_dp_size": self.size,
            "kv_events_decode_port": None,
            "kv_events_decode_replay_port": None,
        }

    async def close(self) -> None:
        for engine in self.ranks.values():
            await engine.close()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    made = Server(2)
    yield made
    await made.close()


async def subscribed(engine: RunningEmulator) -> None:
    """Wait until the sidecar subscribed to this rank's events."""
    await asyncio.wait_for(publisher(engine).wait_subscriptions(1), WAIT_S)


async def store(http: aiohttp.ClientSession, engine: RunningEmulator, ids: list[int]) -> None:
    """A completion sent to one rank itself: it stores the prompt's whole blocks and says so."""
    body = {"model": "emulated-model", "prompt": ids, "max_tokens": 1}
    async with http.post(engine.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()


async def member_view(
    http: aiohttp.ClientSession, sidecar: RunningSidecar, key: str
) -> dict[str, Any]:
    view = (await get_json(http, sidecar.url + "/debug/scheduler"))["kv_events"]
    shown: dict[str, Any] = view["endpoints"][key]
    return shown


async def applied(
    http: aiohttp.ClientSession,
    sidecar: RunningSidecar,
    key: str,
    *batches: int,
    source: str = "events",
) -> None:
    """Wait until rank r's index has applied ``batches[r]`` batches at least (rank 0 also
    stores the sidecar's own prefills) and the member's source is ``source``."""

    async def done() -> bool:
        shown = await member_view(http, sidecar, key)
        counts = [rank["batches_applied"] for rank in shown["ranks"]]
        return shown["source"] == source and all(
            count >= least for count, least in zip(counts, batches, strict=True)
        )

    await eventually(done)


async def placed(
    http: aiohttp.ClientSession, sidecar: RunningSidecar, key: str, ids: list[int]
) -> dict[str, Any]:
    """A completion of ``ids`` through the sidecar, sent to the member; its record."""
    request_id = uuid.uuid4().hex
    body = {"model": "emulated-model", "prompt": ids, "max_tokens": 1}
    headers = {"x-request-id": request_id, "x-prefiller-host-port": key}
    async with http.post(sidecar.url + "/v1/completions", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        await response.read()
    record: dict[str, Any] = await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")
    assert record["prefill_endpoint"] == key
    return record


async def test_a_member_counts_what_its_least_cached_rank_holds(
    server: Server, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    first, second = await server.start(0), await server.start(1)
    sidecar = await start_sidecar_with(**server.settings())
    key = server.key
    await subscribed(first)
    await subscribed(second)
    # Rank 0 holds the prompt, rank 1 a prompt of its own: vLLM's balancer may send the
    # request to either, so the member counts nothing cached.
    await store(http, first, PROMPT)
    await store(http, second, list(range(5000, 5100)))
    await applied(http, sidecar, key, 1, 1)
    record = await placed(http, sidecar, key, PROMPT)
    assert record["cached_source"] == "events"
    assert record["prefill_predicted_cached_tokens"] == 0
    # The member's prefill went to rank 0 (this test's API server) and stored nothing new.
    # Rank 1 now holds the first 200 tokens (12 blocks): the least of the two.
    await store(http, second, PROMPT[:200])
    await applied(http, sidecar, key, 1, 2)
    record = await placed(http, sidecar, key, PROMPT)
    assert record["prefill_predicted_cached_tokens"] == 12 * 16
    # Every rank holds it whole: counted in full.
    await store(http, second, PROMPT)
    await applied(http, sidecar, key, 1, 3)
    record = await placed(http, sidecar, key, PROMPT)
    assert record["prefill_predicted_cached_tokens"] == WHOLE
    # Each rank is shown, and exported, under a name of its own.
    shown = await member_view(http, sidecar, key)
    assert [rank["engine"] for rank in shown["ranks"]] == [f"{key}:dp0", f"{key}:dp1"]
    assert [rank["counted"] for rank in shown["ranks"]] == [True, True]
    blocks = [rank["blocks"] for rank in shown["ranks"]]
    assert blocks == [24, 6 + 24]  # rank 1: its own prompt's 6 blocks and this one's
    for rank, held in enumerate(blocks):
        label = f'engine="{key}:dp{rank}"'
        assert await metric(http, sidecar.url, f"pd_sidecar_kv_events_blocks{{{label}}}") == held
        assert await metric(http, sidecar.url, f"pd_sidecar_kv_events_source{{{label}}}") == 1
    view = (await get_json(http, sidecar.url + "/debug/scheduler"))["kv_events"]
    assert view["prefill_dp_size"] == 2


async def test_a_rank_out_of_sync_makes_the_member_approximate(
    server: Server, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    first, second = await server.start(0), await server.start(1)
    sidecar = await start_sidecar_with(**server.settings())
    key = server.key
    await subscribed(first)
    await subscribed(second)
    await store(http, first, PROMPT)
    # Rank 1 is connected but has published nothing: not in sync, so neither is the member.
    await applied(http, sidecar, key, 1, 0, source="approximate")
    ranks = (await member_view(http, sidecar, key))["ranks"]
    assert [(rank["connected"], rank["in_sync"]) for rank in ranks] == [(True, True), (True, False)]
    record = await placed(http, sidecar, key, PROMPT)
    assert record["cached_source"] is None  # no engine in sync: the events are not looked up
    await store(http, second, PROMPT)
    await applied(http, sidecar, key, 1, 1)
    assert (await placed(http, sidecar, key, PROMPT))["prefill_predicted_cached_tokens"] == WHOLE
    # Rank 1 goes: what it holds is unknown, so the member is placed by the approximate index.
    await second.close()

    async def approximate() -> bool:
        return (await member_view(http, sidecar, key))["source"] == "approximate"

    await eventually(approximate)
    record = await placed(http, sidecar, key, PROMPT)
    assert record["cached_source"] is None
    ranks = (await member_view(http, sidecar, key))["ranks"]
    assert [(rank["connected"], rank["in_sync"]) for rank in ranks] == [
        (True, True),
        (False, False),
    ]
    assert [rank["source"] for rank in ranks] == ["approximate", "approximate"]
    label = f'engine="{key}:dp1"'
    assert await metric(http, sidecar.url, f"pd_sidecar_kv_events_connected{{{label}}}") == 0
    label = f'engine="{key}:dp0"'
    assert await metric(http, sidecar.url, f"pd_sidecar_kv_events_source{{{label}}}") == 0


async def test_a_rank_whose_port_never_connected_is_left_out(
    server: Server, start_sidecar_with: StartSidecar, http: aiohttp.ClientSession
) -> None:
    # External load balancing: this pod runs rank 0 alone; rank 1 is another pod's, and its
    # port here has nothing behind it.
    first = await server.start(0)
    sidecar = await start_sidecar_with(**server.settings())
    key = server.key
    await subscribed(first)
    await store(http, first, PROMPT)

    async def exact() -> bool:
        return (await member_view(http, sidecar, key))["source"] == "events"

    await eventually(exact)
    record = await placed(http, sidecar, key, PROMPT)
    assert record["cached_source"] == "events"
    assert record["prefill_predicted_cached_tokens"] == WHOLE
    ranks = (await member_view(http, sidecar, key))["ranks"]
    assert [(rank["counted"], rank["connected"]) for rank in ranks] == [
        (True, True),
        (False, False),
    ]
    assert [rank["source"] for rank in ranks] == ["events", "approximate"]


def test_one_rank_is_the_default() -> None:
    assert Settings().kv_events_prefill_dp_size == 1


@pytest.mark.parametrize(
    ("port", "replay", "size"),
    [
        (5557, 5558, 2),  # rank 0's replay port is rank 1's events port
        (5657, 5557, 101),  # rank 100's events port is rank 0's replay port
        (65535, None, 2),  # rank 1's events port would be 65536
        (5557, 65535, 2),
    ],
)
def test_ports_that_collide_or_run_past_the_last_are_refused(
    port: int, replay: int | None, size: int
) -> None:
    with pytest.raises(ValidationError, match="SIDECAR_KV_EVENTS_PREFILL_DP_SIZE"):
        Settings(kv_events_port=port, kv_events_replay_port=replay, kv_events_prefill_dp_size=size)
    # One rank: the same ports are fine.
    if replay != port:
        Settings(kv_events_port=port, kv_events_replay_port=replay)
