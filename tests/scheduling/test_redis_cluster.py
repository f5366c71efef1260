"""Shared state on a real Redis Cluster (SIDECAR_REDIS_CLUSTER=true): 3 masters and 3 replicas on
loopback, two sidecars sharing a pool, and the master holding the pool's slot killed mid-run."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from sidecar.emulator import RunningEmulator
from sidecar.scheduling.state.prefix_share import stream_key
from sidecar.scheduling.state.redis import RedisState
from sidecar.server.runner import RunningSidecar
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    completion,
    eventually,
    get_json,
    inject,
    metric,
)
from tests.processes import RedisCluster

NODE_TIMEOUT_MS = 2000
RESUME_WITHIN_S = NODE_TIMEOUT_MS / 1000 + 5
"""After the replica took over: the cluster's node timeout + 5 s (the backend's longest backoff)."""
PREFIX = "pool"
LONG = "A retrieved passage about KV caches and their transfer. " * 45


@pytest.fixture
async def cluster() -> AsyncIterator[RedisCluster]:
    nodes = RedisCluster(3, node_timeout_ms=NODE_TIMEOUT_MS)
    try:
        await nodes.start()
        yield nodes
    finally:
        await nodes.stop()


async def _scheduler(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> dict[str, Any]:
    return dict(await get_json(http, sidecar.url + "/debug/scheduler"))


async def _reserved(
    http: aiohttp.ClientSession, sidecar: RunningSidecar, endpoint: RunningEmulator
) -> int:
    snapshot = await _scheduler(http, sidecar)
    [entry] = [e for e in snapshot["endpoints"] if e["endpoint"] == endpoint.endpoint]
    return int(entry["reserved_requests"])


async def _synced_since(http: aiohttp.ClientSession, sidecar: RunningSidecar, since: float) -> bool:
    backend = (await _scheduler(http, sidecar))["state_backend"]
    return bool(backend["connected"]) and (backend["last_sync_unix"] or 0) >= since


@pytest.mark.system
@pytest.mark.timeout(120)
async def test_a_master_failover_costs_no_request_and_shared_state_resumes(
    http, cluster: RedisCluster, start_engine: StartEmulator, start_sidecar_with: StartSidecar
) -> None:
    # The state's keys and the prefill prefix index's stream (shared: a hash key is set).
    keys = (
        *RedisState("redis://unused", prefix=PREFIX, lease_s=1, timeout_s=1).keys,
        stream_key(PREFIX),
    )
    master, replica = await cluster.slot_owner(keys[0])
    held, busy = await start_engine(), await start_engine()  # reservations held / traffic
    settings = {
        "state_backend": "redis",
        "redis_cluster": True,
        # The node that will die: the client finds the others from it, and goes on without it.
        "redis_url": cluster.url(master),
        "redis_key_prefix": PREFIX,
        "state_lease_s": 1.5,
        "prefill_endpoints": f"{held.endpoint},{busy.endpoint}",
        "prefix_hash_key": "a-cluster-test-key-0123456789",
    }
    one, two = await start_sidecar_with(**settings), await start_sidecar_with(**settings)
    for sidecar in (one, two):
        await eventually(functools.partial(_synced_since, http, sidecar, 0), within=15)
        assert (await _scheduler(http, sidecar))["state_backend"]["cluster"] is True

    # Every key the backend uses hashes to the pool's slot; nothing else was written anywhere.
    assert len({await cluster.command(master, "CLUSTER", "KEYSLOT", key) for key in keys}) == 1
    written = {key.decode() for key in await cluster.command(master, "KEYS", "*")}
    assert written, "the sidecars wrote nothing"
    assert written <= set(keys), written
    for port in cluster.ports:
        if port != master and await cluster.is_master(port):
            assert await cluster.command(port, "DBSIZE") == 0

    statuses: list[int] = []
    stop = asyncio.Event()

    async def traffic() -> None:
        for index in range(10_000):
            if stop.is_set():
                return
            sidecar = (one, two)[index % 2]
            async with http.post(
                sidecar.url + "/v1/completions",
                json=completion(f"{index} {LONG}", max_tokens=2),
                headers={"x-prefiller-host-port": busy.endpoint},  # reserves on `busy`
            ) as response:
                await response.read()
                statuses.append(response.status)

    async def held_request(index: int) -> int:
        """A request through ``one`` whose prefill hangs on ``held``: its reservation stays."""
        async with http.post(
            one.url + "/v1/completions",
            json=completion(f"held {index} {LONG}"),
            headers={"x-prefiller-host-port": held.endpoint},
        ) as response:
            await response.read()
            return response.status

    def hold(index: int) -> asyncio.Task[int]:
        return asyncio.create_task(held_request(index))

    await inject(http, held, kind="hang", role="prefill", count=2)
    running = asyncio.create_task(traffic())
    holding = [hold(0)]
    await eventually(lambda: _seen(http, two, held, 1), within=10)

    cluster.kill(master)
    await cluster.until(lambda: cluster.is_master(replica), within=30)
    promoted, resumed_by = time.time(), asyncio.get_running_loop().time() + RESUME_WITHIN_S
    holding.append(hold(1))  # made after the failover, by one; seen by two once both resumed
    async with asyncio.timeout_at(resumed_by):
        for sidecar in (one, two):
            synced = functools.partial(_synced_since, http, sidecar, promoted)
            await eventually(synced, within=RESUME_WITHIN_S)
        await eventually(lambda: _seen(http, two, held, 2), within=RESUME_WITHIN_S)
    # The figure docs/scheduling.md quotes (pytest -s shows it).
    print(f"shared state resumed {time.time() - promoted:.2f} s after the promotion")

    async def both_hung() -> bool:  # a release wakes only the prefills the engine holds now
        return (await get_json(http, held.url + "/emulator/faults"))["held"] == 2

    await eventually(both_hung)
    async with http.post(held.url + "/emulator/release") as response:
        assert response.status == 200
    assert await asyncio.gather(*holding) == [200, 200]
    stop.set()
    await running
    assert len(statuses) > 0
    assert set(statuses) == {200}  # not one request failed while Redis failed over
    await eventually(lambda: _seen(http, two, held, 0), within=RESUME_WITHIN_S)


async def _seen(
    http: aiohttp.ClientSession, sidecar: RunningSidecar, endpoint: RunningEmulator, count: int
) -> bool:
    return await _reserved(http, sidecar, endpoint) == count


async def test_an_unreachable_cluster_costs_no_request(http, start_sidecar_with, prefill) -> None:
    """The cluster client's own "cannot be connected" (not a RedisError) is one more failure:
    the request goes on with the local view, and the backend keeps trying."""
    sidecar = await start_sidecar_with(
        state_backend="redis",
        redis_cluster=True,
        redis_url="redis://127.0.0.9:1/0",
        prefill_endpoints=prefill.endpoint,
        disagg_ttft_ratio=1000,
    )

    async def failed_twice() -> bool:
        backend = (await _scheduler(http, sidecar))["state_backend"]
        errors = await metric(http, sidecar.url, "pd_sidecar_state_backend_errors_total")
        return backend["connected"] is False and errors >= 2

    for index in range(3):
        async with http.post(
            sidecar.url + "/v1/completions", json=completion(f"{index} {LONG}")
        ) as response:
            assert response.status == 200
            await response.read()
    records = (await get_json(http, sidecar.url + "/debug/requests"))["recent"]
    assert {record["decision"] for record in records} == {"remote"}
    await eventually(failed_twice)  # tried again after its first failure
    backend = (await _scheduler(http, sidecar))["state_backend"]
    assert "cannot be connected" in backend["last_error"]
