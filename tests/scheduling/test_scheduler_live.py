"""The scheduler in a running sidecar (memory backend): decisions, health, scraping, discovery."""

from __future__ import annotations

import asyncio
import time

import pytest

from sidecar.app import SCHEDULER
from sidecar.config import Settings
from sidecar.discovery import Discovery
from sidecar.fleet.endpoints import Endpoint
from sidecar.fleet.load import EngineLoad
from sidecar.fleet.polls import PrefillPoll
from sidecar.fleet.snapshot import EngineSnapshot
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.scheduler import Scheduler, SchedulerOptions
from sidecar.scheduling.state import MemoryState
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    chat,
    completion,
    eventually,
    get_json,
    inject,
    metric,
)
from tests.processes import free_port

LONG = "A retrieved passage about prefill and decode disaggregation. " * 40  # ~600 tokens


async def _send(http, sidecar, body, headers=None) -> dict:
    async with http.post(
        sidecar.url + "/v1/completions", json=body, headers=headers or {}
    ) as response:
        assert response.status == 200, await response.text()
        await response.read()
        request_id = response.headers["x-request-id"]
    return await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")


async def test_decision_reasons(http, start_sidecar_with: StartSidecar, prefill) -> None:
    sidecar = await start_sidecar_with(prefill_endpoints=prefill.endpoint)
    short = await _send(http, sidecar, completion("a short question"))
    assert (short["decision"], short["reason"]) == ("local", "short_prompt")
    long = await _send(http, sidecar, completion(LONG))
    assert (long["decision"], long["reason"]) == ("remote", "scheduled")
    assert long["prefill_endpoint"] == prefill.endpoint
    assert long["prefill_predicted_ms"] > 0
    assert long["prefill_observed_ms"] == long["durations_ms"]["prefill"]
    # The same conversation continues on this pod: its history is in the local cache.
    again = await _send(http, sidecar, completion(LONG + " And a follow-up question?"))
    assert (again["decision"], again["reason"]) == ("local", "prefix_cached")
    assert again["prefill_observed_ms"] == again["durations_ms"]["ttft"]
    header = await _send(
        http, sidecar, completion("tiny"), {"x-prefiller-host-port": prefill.endpoint}
    )
    assert (header["decision"], header["reason"]) == ("remote", "header")

    snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
    assert snapshot["decisions"] == {
        "short_prompt": 1,
        "scheduled": 1,
        "prefix_cached": 1,
        "header": 1,
    }
    async with http.get(sidecar.url + "/metrics") as response:
        text = await response.text()
    assert 'pd_sidecar_scheduler_decisions_total{decision="remote",reason="scheduled"} 1.0' in text
    assert (
        'pd_sidecar_scheduler_decisions_total{decision="local",reason="short_prompt"} 1.0' in text
    )


async def test_pool_empty_and_saturated(http, start_sidecar_with: StartSidecar, prefill) -> None:
    lonely = await start_sidecar_with()
    record = await _send(http, lonely, completion(LONG))
    assert (record["decision"], record["reason"]) == ("local", "pool_empty")
    # A ratio this small means no remote prefill is ever worth its predicted TTFT.
    strict = await start_sidecar_with(prefill_endpoints=prefill.endpoint, disagg_ttft_ratio=0.01)
    record = await _send(http, strict, completion(LONG))
    assert (record["decision"], record["reason"]) == ("local", "pool_saturated")


async def test_chat_prompt_estimate(http, start_sidecar_with: StartSidecar, prefill) -> None:
    sidecar = await start_sidecar_with(prefill_endpoints=prefill.endpoint)
    async with http.post(sidecar.url + "/v1/chat/completions", json=chat(LONG)) as response:
        await response.read()
        request_id = response.headers["x-request-id"]
    record = await get_json(http, f"{sidecar.url}/debug/requests/{request_id}")
    assert record["reason"] == "scheduled"


async def test_failing_endpoint_is_ejected_then_readmitted(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    broken, healthy = await start_engine(), await start_engine()
    sidecar = await start_sidecar_with(
        prefill_endpoints=f"{broken.endpoint},{healthy.endpoint}",
        scheduler_policy="round_robin",
        eject_after_failures=2,
        eject_base_s=0.3,
        scrape_interval_s=0.05,
    )
    # 500 is not transient: no retry, each failure is a fallback to a local decode.
    await inject(http, broken, kind="status", status=500, role="prefill", count=2)
    records = [await _send(http, sidecar, completion(f"{i} {LONG}")) for i in range(4)]
    # Round robin: the broken endpoint failed twice (fallbacks), then was skipped.
    fallbacks = [r["fallback_reason"] for r in records]
    assert fallbacks.count("prefill_error") == 2
    after = await _send(http, sidecar, completion(f"after {LONG}"))
    assert after["prefill_endpoint"] == healthy.endpoint

    async def state_of(endpoint: str) -> str:
        snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
        return next(e["state"] for e in snapshot["endpoints"] if e["endpoint"] == endpoint)

    assert await state_of(broken.endpoint) in ("ejected", "probing")
    async with http.get(sidecar.url + "/metrics") as response:
        text = await response.text()
    assert f'pd_sidecar_prefill_endpoint_healthy{{endpoint="{broken.endpoint}"}} 0.0' in text
    ejections = "pd_sidecar_prefill_endpoint_ejections_total"
    assert f'{ejections}{{endpoint="{broken.endpoint}"}} 1.0' in text
    assert f'{ejections}{{endpoint="{healthy.endpoint}"}} 0.0' in text  # present before any
    # The backoff runs out, the /health probe succeeds: back in the pool.
    await eventually(lambda: _is(state_of(broken.endpoint), "healthy"))
    chosen = {
        (await _send(http, sidecar, completion(f"x{i} {LONG}")))["prefill_endpoint"]
        for i in range(4)
    }
    assert chosen == {broken.endpoint, healthy.endpoint}


async def _is(value, expected) -> bool:
    return await value == expected


async def test_dead_endpoint_is_ejected_by_the_scraper(
    http, start_sidecar_with: StartSidecar
) -> None:
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there: connections are refused
    sidecar = await start_sidecar_with(
        prefill_endpoints=nobody,
        scrape_interval_s=0.05,
        eject_after_failures=2,
        eject_base_s=0.05,
    )

    async def ejected() -> bool:
        snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
        return snapshot["endpoints"][0]["state"] in ("ejected", "probing")

    await eventually(ejected)
    record = await _send(http, sidecar, completion(LONG))
    assert (record["decision"], record["reason"]) == ("local", "pool_empty")

    # Failed probes eject it again, for longer, without counting again: it never came back.
    async def probed_twice() -> bool:
        snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
        return snapshot["endpoints"][0]["consecutive_failures"] >= 4

    await eventually(probed_twice)
    ejections = f'pd_sidecar_prefill_endpoint_ejections_total{{endpoint="{nobody}"}}'
    assert await metric(http, sidecar.url, ejections) == 1


async def test_scraped_load_is_visible(
    http, start_sidecar_with: StartSidecar, prefill, decode
) -> None:
    sidecar = await start_sidecar_with(prefill_endpoints=prefill.endpoint, scrape_interval_s=0.05)
    await inject(http, prefill, kind="hang", role="prefill")
    pending = asyncio.create_task(_send(http, sidecar, completion(LONG)))

    async def busy() -> bool:
        snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
        endpoint = snapshot["endpoints"][0]
        scraped = endpoint["scraped"]
        return (
            scraped is not None
            and scraped["running"] == 1
            and endpoint["reserved_requests"] == 1
            and endpoint["reserved_tokens"] > 500
        )

    await eventually(busy)
    snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
    assert snapshot["local"]["scraped"]["running"] == 0
    assert snapshot["state_backend"] == {"backend": "memory", "connected": True}
    async with http.post(prefill.url + "/emulator/release") as response:
        assert response.status in (200, 204)
    assert (await pending)["decision"] == "remote"
    snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
    assert snapshot["endpoints"][0]["reserved_requests"] == 0
    assert snapshot["endpoints"][0]["speed_samples"] == 1


async def test_dns_discovery_resolves_a_and_aaaa(
    http, start_sidecar_with: StartSidecar, prefill
) -> None:
    sidecar = await start_sidecar_with(prefill_dns=f"localhost:{prefill.port}")
    snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
    endpoints = {e["endpoint"] for e in snapshot["endpoints"]}
    assert f"127.0.0.1:{prefill.port}" in endpoints
    assert endpoints <= {f"127.0.0.1:{prefill.port}", f"[::1]:{prefill.port}"}
    assert snapshot["discovery"]["dns"] == f"localhost:{prefill.port}"


async def test_pool_changes_apply_and_removed_endpoints_drain(prefill, decode) -> None:
    first = prefill
    answer = ["127.0.0.1"]

    async def resolver(name: str, port: int) -> list[str]:
        return list(answer)  # what the headless Service's DNS says right now

    discovery = Discovery((), Endpoint("svc", first.port), resolver=resolver)
    scheduler = Scheduler(
        SchedulerOptions.from_settings(
            Settings(
                decode_url=decode.url,
                scrape_interval_s=60,
                disagg_min_tokens=0,
                disagg_ttft_ratio=1000,
                scheduler_seed=3,
            )
        ),
        discovery=discovery,
        backend=MemoryState(),
        metrics=Metrics(),
    )
    await scheduler.start()
    try:
        key = f"127.0.0.1:{first.port}"
        placement, _ = await scheduler.place_request(completion(LONG), None)
        assert placement.decision.endpoint == key
        answer[:] = []  # the pod left the Service
        await scheduler.pool.refresh()
        [state] = scheduler.snapshot()["endpoints"]
        assert state["state"] == "draining"
        other, _ = await scheduler.place_request(completion("other " + LONG), None)
        assert other.decision.reason == "pool_empty"
        scheduler.prefill_finished(placement, ok=True, seconds=0.01)
        assert scheduler.snapshot()["endpoints"] == []  # drained, then gone
        answer[:] = ["127.0.0.1"]
        await scheduler.pool.refresh()
        assert [e["state"] for e in scheduler.snapshot()["endpoints"]] == ["healthy"]
    finally:
        await scheduler.close()


@pytest.mark.parametrize("policy", ["qoe", "power_of_two", "least_loaded", "round_robin", "random"])
async def test_every_policy_serves(http, start_sidecar_with: StartSidecar, prefill, policy) -> None:
    sidecar = await start_sidecar_with(prefill_endpoints=prefill.endpoint, scheduler_policy=policy)
    record = await _send(http, sidecar, completion(f"{policy} {LONG}"))
    assert record["decision"] == "remote"
    assert sidecar.app[SCHEDULER].snapshot()["policy"] == policy


async def _freeze_then_thaw(http, sidecar, frozen, freeze_s: float) -> float:
    """Freeze ``frozen``'s prefills (every one it receives hangs) under concurrent load until it
    holds two, for ``freeze_s``; then thaw it. Returns the loop time of the thaw."""
    await inject(http, frozen, kind="hang", role="prefill", count=1000)
    load = [
        asyncio.create_task(_send(http, sidecar, completion(f"frozen {i} {LONG}")))
        for i in range(8)
    ]

    async def holding_two() -> bool:
        return (await get_json(http, frozen.url + "/emulator/faults"))["held"] >= 2

    await eventually(holding_two)
    await asyncio.sleep(freeze_s)  # the freeze itself: what the estimate must learn and forget
    async with http.delete(frozen.url + "/emulator/faults") as response:
        assert response.status == 200
    async with http.post(frozen.url + "/emulator/release") as response:
        assert response.status == 200
    thawed = asyncio.get_running_loop().time()
    records = await asyncio.gather(*load)
    assert sum(r["prefill_endpoint"] == frozen.endpoint for r in records) >= 2
    return thawed


async def _until_chosen(http, sidecar, endpoint: str, within_s: float) -> dict | None:
    """Send requests one after another until one prefills on ``endpoint`` (its record), or
    ``within_s`` passed (None)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    i = 0
    while loop.time() < deadline:
        record = await _send(http, sidecar, completion(f"after {i} {LONG}"))
        if record["prefill_endpoint"] == endpoint:
            return record
        i += 1
    return None


async def test_a_stalled_endpoint_is_retested_within_the_interval_after_it_thaws(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    """Re-tests: after a freeze its fitted overhead keeps the policy away for good; the re-test
    sends it a prefill within SIDECAR_SCHEDULER_RETEST_S of its last one."""
    frozen, healthy = await start_engine(), await start_engine()
    retest_s = 1.0
    sidecar = await start_sidecar_with(
        prefill_endpoints=f"{frozen.endpoint},{healthy.endpoint}",
        scheduler_seed=1,
        disagg_ttft_ratio=1000,  # remote whatever the local engine's speed: the pool is compared
        scheduler_retest_s=retest_s,
        speed_half_life_s=3600,  # the estimate does not age within the test: the re-test does it
    )
    thawed = await _freeze_then_thaw(http, sidecar, frozen, freeze_s=0.5)
    snapshot = await get_json(http, sidecar.url + "/debug/scheduler")
    stalled = next(e for e in snapshot["endpoints"] if e["endpoint"] == frozen.endpoint)
    assert stalled["state"] == "healthy"
    assert stalled["speed"]["overhead_s"] > 0.05  # the freeze is in its fit

    # The bound: retest_s after the last prefill it was sent, which was before the thaw.
    record = await _until_chosen(http, sidecar, frozen.endpoint, within_s=retest_s + 2.0)
    assert record is not None, "the thawed endpoint was never chosen again"
    assert record["reason"] == "retest"
    assert asyncio.get_running_loop().time() - thawed <= retest_s + 1.0  # (one request's slack)
    # One re-test per interval: the next requests (well within one) go where the policy says.
    following = [await _send(http, sidecar, completion(f"next {i} {LONG}")) for i in range(5)]
    assert [r["reason"] for r in following] == ["scheduled"] * 5


async def test_a_stalled_endpoint_is_chosen_again_as_its_estimate_ages(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    """The estimate's ageing alone (no re-tests): engines slower than the prior
    (5,000 tokens/s), the frozen one's fit decays toward the prior and wins again."""
    frozen = await start_engine(prefill_s_per_token=2e-4)
    healthy = await start_engine(prefill_s_per_token=2e-4)
    half_life_s = 0.5
    sidecar = await start_sidecar_with(
        prefill_endpoints=f"{frozen.endpoint},{healthy.endpoint}",
        scheduler_seed=1,
        disagg_ttft_ratio=1000,
        scheduler_retest_s=0,
        speed_half_life_s=half_life_s,
    )
    await _freeze_then_thaw(http, sidecar, frozen, freeze_s=1.0)
    record = await _until_chosen(http, sidecar, frozen.endpoint, within_s=10 * half_life_s)
    assert record is not None, "the thawed endpoint was never chosen again"
    assert record["reason"] == "scheduled"


async def test_a_prefill_the_gateway_names_keeps_the_idle_ageing_of_a_stall(
    prefill, decode
) -> None:
    """The scheduler sends a prefill to a thawed endpoint its scrapes showed idle (named by the
    gateway's header): the idle spell's ageing is applied, not dropped because the prefill
    already counts in flight. Its scrapes are handed to the pool as the engine monitor does,
    each with the time it was taken."""
    scheduler = Scheduler(
        SchedulerOptions.from_settings(
            Settings(
                decode_url=decode.url,
                prefill_endpoints=prefill.endpoint,
                scrape_interval_s=60,  # the monitor's own scrapes stay out of the way
                disagg_min_tokens=0,
                disagg_ttft_ratio=1000,
                scheduler_retest_s=0,
                speed_half_life_s=3600,  # no ageing toward the prior within the test
                speed_idle_half_life_s=0.01,
            )
        ),
        discovery=Discovery((Endpoint("127.0.0.1", prefill.port),), None),
        backend=MemoryState(),
        metrics=Metrics(),
    )
    await scheduler.start()
    try:
        key = f"127.0.0.1:{prefill.port}"
        header = Endpoint("127.0.0.1", prefill.port)
        poll = PrefillPoll(key, header, probe=False)

        async def prefill_taking(seconds: float, i: int) -> None:
            placement, _ = await scheduler.place_request(completion(f"{i} {LONG}"), header)
            scheduler.prefill_finished(placement, ok=True, seconds=seconds)

        def speed() -> float:
            [state] = scheduler.snapshot()["endpoints"]
            return float(state["speed"]["overhead_s"] + 600 * state["speed"]["s_per_token"])

        for i in range(10):
            await prefill_taking(0.03, i)
        measured = speed()
        scheduler.pool.prefill_polled(poll, EngineSnapshot(load=None))  # unanswered: frozen
        for i in range(3):
            await prefill_taking(5.0, 10 + i)  # held by the freeze
        stalled = speed()
        assert stalled > 20 * measured
        idle_from = time.monotonic()
        for at in (idle_from, idle_from + 1.0):  # a second of idle scrapes: 100 half-lives
            idle = EngineLoad(waiting=0, running=0, kv_usage=0.0, at=at)
            scheduler.pool.prefill_polled(poll, EngineSnapshot(load=idle))
        aged = speed()
        assert aged < 2 * measured
        [state] = scheduler.snapshot()["endpoints"]  # what /debug/scheduler shows
        assert state["stall_thawed_s_ago"] is not None
        assert state["best_speed"]["s_per_token"] > 0
        placement, _ = await scheduler.place_request(completion(f"named {LONG}"), header)
        assert placement.decision.reason == "header"
        [state] = scheduler.snapshot()["endpoints"]
        assert state["inflight_here"] == 1
        assert speed() == pytest.approx(aged, rel=0.01)  # applied as read, in flight or not
        scheduler.prefill_finished(placement, ok=True, seconds=0.03)
        assert speed() < 2 * measured
    finally:
        await scheduler.close()
