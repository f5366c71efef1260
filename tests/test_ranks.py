"""Data-parallel decode ranks (SIDECAR_DECODE_URLS) through real sockets: several decode emulators
behind one sidecar — which rank takes a request, readiness, passthrough, a rank that refuses
connections, one that goes down and comes back, and every connector's decode leg."""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from devkit.processes import quiet_port
from sidecar.config import Settings
from sidecar.connectors.background import BackgroundWork
from sidecar.emulator import RunningEmulator
from sidecar.engines.monitor import EngineMonitor, MonitorOptions
from sidecar.engines.readiness import Readiness, Thresholds
from sidecar.engines.upstream import Engines
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.ranks import DecodeRanks
from sidecar.server.runner import RunningSidecar, start_sidecar
from tests.conftest import (
    StartEmulator,
    chat,
    completion,
    engine_requests,
    eventually,
    get_json,
    inject,
    metric,
    staged_blocks,
)
from tests.processes import EmulatorProcess
from tests.test_contract import SPECS, Spec

LONG = "A retrieved passage about prefill and decode disaggregation. " * 40  # ~600 tokens
StartRanked = Callable[..., Awaitable[RunningSidecar]]


class _Url:
    """An engine seen only by its URL (an emulator process, or an address nothing listens on)."""

    def __init__(self, url: str) -> None:
        self.url = url


@pytest.fixture
async def start_ranked() -> AsyncIterator[StartRanked]:
    """A sidecar in front of ``engines``, one rank each, in that order; keywords override
    Settings."""
    started: list[RunningSidecar] = []

    async def start(engines: Sequence[Any], **overrides: Any) -> RunningSidecar:
        values: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "decode_urls": ",".join(engine.url for engine in engines),
            "ready_interval_s": 0.05,
            "scrape_interval_s": 0.5,
            "scheduler_seed": 1,
        }
        values.update(overrides)
        sidecar = await start_sidecar(Settings(**values))
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        await sidecar.close()


async def _ranks(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> list[dict[str, Any]]:
    return list((await get_json(http, sidecar.url + "/debug/scheduler"))["decode_ranks"])


async def _ready_ranks(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> list[bool]:
    return [rank["ready"] for rank in await _ranks(http, sidecar)]


async def _until_ready(
    http: aiohttp.ClientSession, sidecar: RunningSidecar, ready: list[bool], within: float = 10
) -> None:
    async def check() -> bool:
        return await _ready_ranks(http, sidecar) == ready

    await eventually(check, within)


async def _send(
    http: aiohttp.ClientSession,
    sidecar: RunningSidecar,
    body: dict[str, Any],
    path: str = "/v1/completions",
    **headers: str,
) -> dict[str, Any]:
    """One request, answered 200; its record."""
    async with http.post(sidecar.url + path, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        await response.read()
        request_id = response.headers["x-request-id"]
    return await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")


async def _ids(http: aiohttp.ClientSession, engine: RunningEmulator) -> list[str]:
    """The x-request-id of every /v1/* request the engine received, oldest first."""
    return [r["headers"].get("x-request-id", "") for r in await engine_requests(http, engine)]


async def _status(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url) as response:
        await response.read()
        return response.status


async def _received(http: aiohttp.ClientSession, engine: RunningEmulator, request_id: str) -> bool:
    return request_id in await _ids(http, engine)


async def _held(http: aiohttp.ClientSession, engine: RunningEmulator) -> int:
    return int((await get_json(http, engine.url + "/emulator/faults"))["held"])


async def test_a_continuation_goes_back_to_the_rank_holding_its_history(
    http, start_engine: StartEmulator, start_ranked: StartRanked
) -> None:
    engines = [await start_engine() for _ in range(3)]
    sidecar = await start_ranked(engines)
    await _until_ready(http, sidecar, [True, True, True])
    homes = []
    for conversation in range(6):
        history = f"Conversation {conversation}. {LONG}"
        first = await _send(http, sidecar, completion(history, max_tokens=2))
        home = first["decode_rank"]
        assert first["decode_url"] == engines[home].url
        homes.append(home)
        for turn in range(2):
            history += f" Follow-up question {turn} and its answer."
            record = await _send(http, sidecar, completion(history, max_tokens=2))
            assert (record["decode_rank"], record["decode_url"]) == (home, engines[home].url)
            assert record["engine_id"] in await _ids(http, engines[home])
    # New conversations are cached nowhere: they went where the load was lowest, ties at random.
    assert len(set(homes)) > 1, homes
    ranks = await _ranks(http, sidecar)
    assert [rank["placed"] for rank in ranks] == [3 * homes.count(i) for i in range(3)]
    assert all(rank["prefix_index_blocks"] > 0 for i, rank in enumerate(ranks) if i in homes)


async def test_a_chat_continuation_goes_back_too(
    http, start_engine: StartEmulator, start_ranked: StartRanked
) -> None:
    engines = [await start_engine() for _ in range(2)]
    sidecar = await start_ranked(engines)
    await _until_ready(http, sidecar, [True, True])
    messages = [{"role": "user", "content": LONG}]
    home = (await _send(http, sidecar, chat(LONG), "/v1/chat/completions"))["decode_rank"]
    for turn in range(4):
        messages += [
            {"role": "assistant", "content": f"answer {turn}"},
            {"role": "user", "content": f"question {turn}"},
        ]
        body = {"model": "emulated-model", "messages": messages, "max_tokens": 2}
        record = await _send(http, sidecar, body, "/v1/chat/completions")
        assert record["decode_rank"] == home


async def test_requests_in_flight_spread_over_the_ranks(
    http, start_engine: StartEmulator, start_ranked: StartRanked
) -> None:
    engines = [await start_engine() for _ in range(3)]
    for engine in engines:
        await inject(http, engine, kind="hang", count=9)
    sidecar = await start_ranked(engines)
    await _until_ready(http, sidecar, [True, True, True])

    async def post(index: int) -> int:
        async with http.post(
            sidecar.url + "/v1/completions", json=completion(f"{index} {LONG}")
        ) as response:
            await response.read()
            return response.status

    clients = [asyncio.create_task(post(i)) for i in range(9)]

    async def all_held() -> bool:
        return sum([await _held(http, engine) for engine in engines]) == 9

    await eventually(all_held)
    # Each was placed while the others were in flight: three on each rank, whatever the ties.
    assert [await _held(http, engine) for engine in engines] == [3, 3, 3]
    assert [rank["inflight"] for rank in await _ranks(http, sidecar)] == [3, 3, 3]
    for rank in ("0", "1", "2"):
        gauge = f'pd_sidecar_decode_rank_inflight_requests{{rank="{rank}"}}'
        assert await metric(http, sidecar.url, gauge) == 3
    for engine in engines:
        async with http.post(engine.url + "/emulator/release") as response:
            assert response.status == 200
    assert await asyncio.gather(*clients) == [200] * 9
    assert [rank["inflight"] for rank in await _ranks(http, sidecar)] == [0, 0, 0]
    sent = [
        await metric(http, sidecar.url, f'pd_sidecar_decode_rank_requests_total{{rank="{r}"}}')
        for r in ("0", "1", "2")
    ]
    assert sent == [3, 3, 3]


async def test_a_rank_with_a_scraped_queue_is_avoided(
    http, start_engine: StartEmulator, start_ranked: StartRanked
) -> None:
    queued, idle = await start_engine(max_num_seqs=1), await start_engine()
    sidecar = await start_ranked([queued, idle])
    await _until_ready(http, sidecar, [True, True])
    # Work the sidecar did not send: one request running on rank 0, one waiting behind it.
    await inject(http, queued, kind="hang")
    direct = [
        asyncio.create_task(http.post(queued.url + "/v1/completions", json=completion(f"{i}")))
        for i in range(2)
    ]

    async def scraped_waiting() -> bool:
        scraped = (await _ranks(http, sidecar))[0]["scraped"]
        return scraped is not None and scraped["waiting"] == 1

    await eventually(scraped_waiting)
    records = [await _send(http, sidecar, completion(f"{i} {LONG}")) for i in range(6)]
    assert {record["decode_rank"] for record in records} == {1}
    async with http.post(queued.url + "/emulator/release") as response:
        assert response.status == 200
    for response in await asyncio.gather(*direct):
        assert response.status == 200
        response.release()


async def test_ready_while_one_rank_is_and_unready_ranks_get_nothing(
    http, start_engine: StartEmulator, start_ranked: StartRanked
) -> None:
    engines = [await start_engine() for _ in range(2)]
    sidecar = await start_ranked(engines)
    await _until_ready(http, sidecar, [True, True])
    await inject(http, engines[0], kind="health_down")  # up, but its /health says 503
    await _until_ready(http, sidecar, [False, True])
    assert await _status(http, sidecar.url + "/ready") == 200
    before = len(await engine_requests(http, engines[0]))
    records = [await _send(http, sidecar, completion(f"{i} {LONG}")) for i in range(4)]
    records.append(await _send(http, sidecar, chat(), "/v1/chat/completions"))
    assert {record["decode_rank"] for record in records} == {1}
    for _ in range(3):  # passthrough: to a ready rank too
        assert await _status(http, sidecar.url + "/v1/models") == 200
    assert len(await engine_requests(http, engines[0])) == before
    async with http.get(sidecar.url + "/metrics") as response:
        text = await response.text()
    assert 'pd_sidecar_decode_rank_ready{rank="0"} 0.0' in text
    assert 'pd_sidecar_decode_rank_ready{rank="1"} 1.0' in text
    assert "pd_sidecar_decode_ready 1.0" in text

    await inject(http, engines[1], kind="health_down")  # no rank is ready: neither is the pod
    await _until_ready(http, sidecar, [False, False])
    async with http.get(sidecar.url + "/ready") as response:
        assert response.status == 503
        message = (await response.json())["error"]["message"]
    assert message == "no decode rank is ready: " + "; ".join(
        f"rank {i}: decode engine at {engine.url.removeprefix('http://')}: /health answered 503"
        for i, engine in enumerate(engines)
    )
    assert await metric(http, sidecar.url, "pd_sidecar_decode_ready") == 0
    for engine in engines:
        async with http.delete(engine.url + "/emulator/faults") as response:
            assert response.status in (200, 204)
    await _until_ready(http, sidecar, [True, True])
    assert await _status(http, sidecar.url + "/ready") == 200


async def test_the_prefill_decision_weighs_the_chosen_rank(
    http, start_engine: StartEmulator, start_ranked: StartRanked, prefill
) -> None:
    engines = [await start_engine() for _ in range(2)]
    sidecar = await start_ranked(engines, prefill_endpoints=prefill.endpoint)
    await _until_ready(http, sidecar, [True, True])
    first = await _send(http, sidecar, completion(LONG, max_tokens=2))
    assert (first["decision"], first["reason"]) == ("remote", "scheduled")
    home = first["decode_rank"]
    # Its rank holds the history: prefilling there is cheap.
    again = await _send(http, sidecar, completion(LONG + " A follow-up?", max_tokens=2))
    assert (again["decode_rank"], again["decision"], again["reason"]) == (
        home,
        "local",
        "prefix_cached",
    )
    # That rank is unready now: the continuation goes to the other, which has nothing cached.
    await inject(http, engines[home], kind="health_down")
    await _until_ready(http, sidecar, [home != 0, home != 1])
    moved = await _send(http, sidecar, completion(LONG + " Another follow-up?", max_tokens=2))
    assert (moved["decode_rank"], moved["decision"], moved["reason"]) == (
        1 - home,
        "remote",
        "scheduled",
    )
    assert await staged_blocks(http, prefill) == 0


async def test_a_rank_refusing_connections_passes_its_requests_on(
    http, start_engine: StartEmulator, start_ranked: StartRanked, prefill
) -> None:
    engines = [await start_engine() for _ in range(2)]
    # One poll at start, the next a minute later: the sidecar keeps believing rank 0 is ready.
    sidecar = await start_ranked(engines, ready_interval_s=60)
    await _until_ready(http, sidecar, [True, True])
    await engines[0].close()  # connections to rank 0 are refused from now on
    records = [await _send(http, sidecar, completion(f"{i} {LONG}")) for i in range(4)]
    header = {"x-prefiller-host-port": prefill.endpoint}
    records.append(await _send(http, sidecar, completion(LONG), **header))  # pulls the KV
    assert {record["decode_rank"] for record in records} == {1}
    assert {record["state"] for record in records} == {"completed"}
    for _ in range(6):  # passthrough too, wherever its least-loaded pick fell
        assert await _status(http, sidecar.url + "/v1/models") == 200
    assert await _ready_ranks(http, sidecar) == [True, True]  # not polled since: moved on
    tried = 'pd_sidecar_decode_rank_requests_total{rank="0"}'
    assert await metric(http, sidecar.url, tried) > 0  # some were placed there, and passed on
    assert [rank["inflight"] for rank in await _ranks(http, sidecar)] == [0, 0]
    assert await staged_blocks(http, prefill) == 0


async def test_each_rank_port_pins_its_rank(
    http, start_engine: StartEmulator, start_ranked: StartRanked
) -> None:
    """SIDECAR_RANK_PORTS, as llm-d's sidecar listens: rank r on SIDECAR_PORT + r, rank 0 on
    SIDECAR_PORT; the request goes there whatever the sidecar's own choice would be."""
    engines = [await start_engine() for _ in range(3)]
    sidecar = await start_ranked(engines, rank_ports=True)
    assert len(sidecar.rank_ports) == 2
    await _until_ready(http, sidecar, [True, True, True])
    for rank in (0, 1, 2, 1, 0, 2):
        # The same prompt each time: left to choose, the sidecar would send it back to its home.
        counts = [len(await engine_requests(http, engine)) for engine in engines]
        async with http.post(
            sidecar.rank_url(rank) + "/v1/completions", json=completion(LONG)
        ) as response:
            assert response.status == 200, await response.text()
            request_id = response.headers["x-request-id"]
        counts[rank] += 1
        assert [len(await engine_requests(http, engine)) for engine in engines] == counts
        record = await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")
        assert record["decode_rank"] == rank
    for rank, engine in enumerate(engines):
        before = len(await engine_requests(http, engine))
        assert await _status(http, sidecar.rank_url(rank) + "/v1/models") == 200  # passthrough
        assert len(await engine_requests(http, engine)) == before + 1
    # A prefill target naming a rank port is this sidecar too.
    header = {"x-prefiller-host-port": f"127.0.0.1:{sidecar.rank_ports[0]}"}
    async with http.post(sidecar.url + "/v1/completions", json=completion(), headers=header) as r:
        assert r.status == 400
        assert "this sidecar itself" in (await r.json())["error"]["message"]


async def test_a_pinned_rank_that_refuses_connections_is_not_replaced(
    http, start_engine: StartEmulator, start_ranked: StartRanked
) -> None:
    engines = [await start_engine() for _ in range(2)]
    sidecar = await start_ranked(engines, rank_ports=True, ready_interval_s=60)
    await _until_ready(http, sidecar, [True, True])
    await engines[1].close()
    async with http.post(sidecar.rank_url(1) + "/v1/completions", json=completion()) as response:
        assert response.status == 503
        await response.read()
    assert await _status(http, sidecar.rank_url(0) + "/v1/models") == 200


async def test_no_prefill_for_a_pinned_rank_known_down(
    http, start_engine: StartEmulator, start_ranked: StartRanked, prefill
) -> None:
    """The rank a request names by its port is down (its /health says so): 503 before the
    prefill; a request on another rank's port, or left to choose, is served."""
    engines = [await start_engine() for _ in range(2)]
    sidecar = await start_ranked(engines, rank_ports=True)
    await _until_ready(http, sidecar, [True, True])
    await inject(http, engines[1], kind="health_down")
    await _until_ready(http, sidecar, [True, False])
    header = {"x-prefiller-host-port": prefill.endpoint}
    async with http.post(
        sidecar.rank_url(1) + "/v1/completions", json=completion(), headers=header
    ) as response:
        assert response.status == 503
        assert response.headers["retry-after"] == "1"
        message = (await response.json())["error"]["message"]
    address = engines[1].url.removeprefix("http://")
    assert message == (
        f"the decode engine is down, nothing was sent: decode engine at {address}: "
        "/health answered 503"
    )
    assert await engine_requests(http, prefill) == []
    for url in (sidecar.rank_url(0), sidecar.url):
        async with http.post(url + "/v1/completions", json=completion(), headers=header) as r:
            assert r.status == 200, await r.text()
    assert len(await engine_requests(http, prefill)) == 2
    assert len(await engine_requests(http, engines[1])) == 0


async def test_rank_ports_are_bound_on_the_ports_after_sidecar_port(
    http, start_engine: StartEmulator, start_ranked: StartRanked
) -> None:
    engines = [await start_engine() for _ in range(2)]
    port = _two_quiet_ports()
    sidecar = await start_ranked(engines, rank_ports=True, port=port)
    assert (sidecar.port, sidecar.rank_ports) == (port, [port + 1])
    assert await _status(http, f"http://127.0.0.1:{port + 1}/health") == 200


def _two_quiet_ports() -> int:
    """A port free with the next one, outside the ephemeral range (where the sidecar's own
    connections to the engines take theirs)."""
    for _ in range(50):
        port = quiet_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


def test_rank_ports_that_run_past_the_last_port_or_onto_the_admin_port_are_refused() -> None:
    ranks = "http://127.0.0.1:8200,http://127.0.0.1:8201,http://127.0.0.1:8202"
    with pytest.raises(ValueError, match="run past 65535"):
        Settings(decode_urls=ranks, rank_ports=True, port=65534)
    with pytest.raises(ValueError, match="SIDECAR_ADMIN_PORT=8002 is the port of a decode rank"):
        Settings(decode_urls=ranks, rank_ports=True, port=8000, admin_port=8002)


async def test_one_unreachable_rank_is_a_503_as_before(http, start_ranked: StartRanked) -> None:
    sidecar = await start_ranked([_Url("http://127.0.0.9:1")])
    async with http.post(sidecar.url + "/v1/completions", json=completion()) as response:
        assert response.status == 503
        assert (await response.json())["error"]["type"] == "ServiceUnavailableError"
    assert await _status(http, sidecar.url + "/ready") == 503


@pytest.mark.timeout(120)
async def test_a_rank_that_goes_down_and_comes_back(http, start_ranked: StartRanked) -> None:
    ranks = [EmulatorProcess(), EmulatorProcess()]
    try:
        await asyncio.gather(*(rank.start() for rank in ranks))
        sidecar = await start_ranked(ranks)
        await _until_ready(http, sidecar, [True, True], within=30)
        statuses: list[int] = []
        placed: list[tuple[int, int]] = []  # (phase when sent, rank) per request
        ready: list[int] = []
        phase = 0
        stop = asyncio.Event()
        # Held by a request while it is in flight: the rank is killed between two requests (one
        # it is serving when it dies fails as on a single engine: docs/behavior.md).
        between = asyncio.Lock()

        async def clients() -> None:
            for index in itertools.count():
                if stop.is_set():
                    return
                sent_at = phase
                async with (
                    between,
                    http.post(
                        sidecar.url + "/v1/completions",
                        json=completion(f"{index} {LONG}", max_tokens=2),
                    ) as response,
                ):
                    await response.read()
                    statuses.append(response.status)
                    request_id = response.headers["x-request-id"]
                record = await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")
                placed.append((sent_at, record["decode_rank"]))
                ready.append(await _status(http, sidecar.url + "/ready"))

        async def sent_in(wanted: int, rank: int | None = None) -> bool:
            return any(p == wanted and (rank is None or r == rank) for p, r in placed)

        running = asyncio.create_task(clients())
        await eventually(lambda: sent_in(0, 0), within=30)  # both ranks take requests
        await eventually(lambda: sent_in(0, 1), within=30)
        async with between:
            ranks[0].kill()
            assert ranks[0].process is not None
            await ranks[0].process.wait()
        # Requests go on at once: until its next /health poll, the sidecar finds rank 0 refusing
        # connections and sends them to rank 1.
        await _until_ready(http, sidecar, [False, True])
        phase = 1  # the sidecar knows rank 0 is down
        await eventually(lambda: sent_in(1), within=30)
        phase = 2  # coming back
        await ranks[0].stop()
        await ranks[0].start()  # on the same port
        await _until_ready(http, sidecar, [True, True], within=30)
        phase = 3
        await eventually(lambda: sent_in(3, 0), within=30)  # rank 0 gets requests again
        stop.set()
        await running
    finally:
        for rank in ranks:
            await rank.stop()
    assert set(statuses) == {200}, statuses  # the requests in the gap included
    assert set(ready) == {200}  # another rank was up all along
    assert {r for p, r in placed if p == 1} == {1}


async def test_a_release_goes_to_the_rank_the_request_was_placed_on(
    http, start_engine: StartEmulator, start_ranked: StartRanked, prefill
) -> None:
    engines = [await start_engine() for _ in range(2)]
    sidecar = await start_ranked(engines)
    await _until_ready(http, sidecar, [True, True])
    for request in range(4):
        for engine in engines:  # whichever rank is chosen refuses the decode leg
            await inject(http, engine, kind="status", status=500, role="decode")
        request_id = f"refused-{request}"
        async with http.post(
            sidecar.url + "/v1/completions",
            json=completion(f"{request} {LONG}"),
            headers={"x-prefiller-host-port": prefill.endpoint, "x-request-id": request_id},
        ) as response:
            assert response.status == 500
            await response.read()
        record = await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")
        home, other = engines[record["decode_rank"]], engines[1 - record["decode_rank"]]
        release_id = f"{record['engine_id']}-release"  # from the engine id (protocol.md)
        await eventually(functools.partial(_received, http, home, release_id))
        assert not any(i.startswith(request_id) for i in await _ids(http, other))
        async with http.delete(other.url + "/emulator/faults") as response:
            assert response.status in (200, 204)
        assert await staged_blocks(http, prefill) == 0


async def test_a_release_passes_to_the_next_rank_when_its_own_refuses_connections(
    http, start_engine: StartEmulator, prefill
) -> None:
    decode = await start_engine()
    metrics = Metrics()
    engines = Engines(connect_timeout_s=1)
    await engines.open()
    background = BackgroundWork(engines=engines, metrics=metrics, enabled=True, timeout_s=5)
    try:
        async with http.post(
            prefill.url + "/v1/completions",
            json=completion(LONG, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        ) as response:
            params = (await response.json())["kv_transfer_params"]
        assert await staged_blocks(http, prefill) > 0
        body = completion(LONG, max_tokens=1, kv_transfer_params=params)
        urls = ["http://127.0.0.9:1/v1/completions", decode.url + "/v1/completions"]
        background.release("r1", urls, {"x-request-id": "r1-release"}, orjson.dumps(body))
        await background.close(10)
        assert "r1-release" in await _ids(http, decode)
        assert await staged_blocks(http, prefill) == 0
        assert 'pd_sidecar_kv_releases_total{outcome="sent"} 1.0' in metrics.render().decode()
    finally:
        await engines.close()


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
async def test_every_connector_sends_its_decode_leg_to_the_chosen_rank(
    http, spec: Spec, start_engine: StartEmulator, start_ranked: StartRanked, tmp_path: Path
) -> None:
    store = {"kv_store": str(tmp_path / "kv")} if spec.shared_store else {}
    prefill = await start_engine(**spec.prefill, **store)
    engines = [await start_engine(**spec.decode, **store) for _ in range(2)]
    extra = {"sglang_bootstrap_port": prefill.bootstrap_port} if spec.name == "sglang" else {}
    sidecar = await start_ranked(
        engines, connector=spec.name, prefill_endpoints=prefill.endpoint, **extra
    )
    await _until_ready(http, sidecar, [True, True])
    homes = set()
    for request in range(6):
        request_id = f"{spec.name}-{request}"
        record = await _send(
            http,
            sidecar,
            completion(f"{request} {LONG}", max_tokens=2),
            **{"x-prefiller-host-port": prefill.endpoint, "x-request-id": request_id},
        )
        assert record["decision"] == "remote"
        home = record["decode_rank"]
        homes.add(home)
        assert await _ids(http, engines[home]) != []
        assert record["engine_id"] in await _ids(http, engines[home])
        assert record["engine_id"] not in await _ids(http, engines[1 - home])
    assert homes == {0, 1}


async def test_a_decode_leg_leaves_a_rank_that_turned_unready_during_its_prefill(
    http, start_engine: StartEmulator, start_ranked: StartRanked, prefill
) -> None:
    """Placed on a rank, prefilled remotely, and by then that rank failed its health check: the
    decode leg goes to the ready rank (nothing had been sent to the first), the KV with it."""
    engines = [await start_engine() for _ in range(2)]
    sidecar = await start_ranked(engines)
    await _until_ready(http, sidecar, [True, True])
    await inject(http, prefill, kind="hang", role="prefill")  # held until released below
    request_id = "placed-then-unready"

    async def post() -> tuple[int, bytes]:
        headers = {"x-prefiller-host-port": prefill.endpoint, "x-request-id": request_id}
        body = completion(LONG, max_tokens=2)
        async with http.post(sidecar.url + "/v1/completions", json=body, headers=headers) as r:
            return r.status, await r.read()

    client = asyncio.create_task(post())

    async def prefilling() -> bool:
        return await _held(http, prefill) == 1

    await eventually(prefilling)
    home = (await get_json(http, f"{sidecar.url}/debug/requests/{request_id}"))["decode_rank"]
    await inject(http, engines[home], kind="health_down")
    await _until_ready(http, sidecar, [home != 0, home != 1])
    async with http.post(prefill.url + "/emulator/release") as response:
        assert response.status == 200
    status, body = await client
    assert status == 200, body
    record = await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")
    assert (record["state"], record["decode_rank"]) == ("completed", 1 - home)
    assert not await _received(http, engines[home], record["engine_id"])
    assert await _received(http, engines[1 - home], record["engine_id"])
    assert [rank["inflight"] for rank in await _ranks(http, sidecar)] == [0, 0]
    assert await staged_blocks(http, prefill) == 0


async def test_a_health_poll_that_times_out_keeps_the_ranks_history(
    http, start_engine: StartEmulator
) -> None:
    """Readiness against real sockets, through the engine monitor's /health polls: a /health
    that does not answer in time makes the rank unready but keeps its prefix index (a busy
    engine keeps its KV); a 503 or a refused connection means the engine lost it, and the
    index goes."""
    answer = asyncio.Event()
    status = [200]

    async def health(request: web.Request) -> web.Response:
        await answer.wait()
        return web.Response(status=status[0])

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    decode = DecodeRanks(
        [f"http://127.0.0.1:{port}"],
        block_tokens=16,
        capacity_blocks=1024,
        stale_after_s=3.0,
        rng=random.Random(1),
    )
    engines = Engines(connect_timeout_s=1.0)
    await engines.open()
    monitor = EngineMonitor(
        # One failed poll turns it unready here: the polls' meaning for the index is the point.
        MonitorOptions(ready_interval_s=0.2, scrape_interval_s=1.0, thresholds=Thresholds(1)),
        engines=engines,
        ranks=decode,
        readiness=Readiness(ranks=decode, metrics=Metrics()),
    )
    rank = decode[0]
    try:
        answer.set()
        assert await monitor.poll_health()
        decode.claim(LONG, 600)[0].end()
        remembered = len(rank.prefix)
        assert remembered > 0
        answer.clear()  # the next poll gets no answer within its timeout (1 s)
        assert not await monitor.poll_health()
        assert len(rank.prefix) == remembered
        answer.set()
        status[0] = 503  # its engine failed: vLLM answers 503
        assert not await monitor.poll_health()
        assert len(rank.prefix) == 0
        status[0] = 200
        assert await monitor.poll_health()
        decode.claim(LONG, 600)[0].end()
        await runner.cleanup()  # nothing listens any more
        assert not await monitor.poll_health()
        assert len(rank.prefix) == 0
    finally:
        answer.set()
        await engines.close()
        await runner.cleanup()
