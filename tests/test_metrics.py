"""The metrics an operator tunes with: phase durations by decision and route, prefill calls per
endpoint (bounded, removed with the pool member), and no ``_created`` series."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from sidecar.config import Settings
from sidecar.emulator import RunningEmulator
from sidecar.observability.endpoint_labels import OTHER, EndpointLabels
from sidecar.observability.histograms import LoopCounter, LoopHistogram
from sidecar.observability.metrics import _BUCKETS, PREFILL_OUTCOMES
from sidecar.server.runner import RunningSidecar, start_sidecar
from tests.conftest import StartSidecar, chat, completion, eventually

LONG = "A retrieved passage about prefill and decode disaggregation. " * 40  # ~600 tokens
PHASE = "pd_sidecar_phase_duration_seconds"
CALLS = "pd_sidecar_prefill_endpoint_requests_total"


async def exposition(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> str:
    async with http.get(sidecar.url + "/metrics") as response:
        assert response.status == 200
        return await response.text()


def samples(text: str) -> dict[str, float]:
    """Every sample line: ``name{labels}`` → value."""
    lines = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {series: float(value) for series, value in lines}


async def post(http: aiohttp.ClientSession, url: str, body: object, **headers: str) -> None:
    async with http.post(url, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        await response.read()


async def test_phase_durations_are_labelled_by_decision_and_route(
    http, start_sidecar_with: StartSidecar, prefill: RunningEmulator
) -> None:
    sidecar = await start_sidecar_with()
    await post(http, sidecar.url + "/v1/chat/completions", chat(), **{
        "x-prefiller-host-port": prefill.endpoint
    })  # fmt: skip
    await post(http, sidecar.url + "/v1/completions", completion())  # no pool: local
    async with http.post(sidecar.url + "/v1/completions", data=b"{") as response:
        assert response.status == 400  # rejected before a decision
    found = samples(await exposition(http, sidecar))

    def count(phase: str, decision: str, route: str) -> float | None:
        key = f'{PHASE}_count{{decision="{decision}",phase="{phase}",route="{route}"}}'
        return found.get(key)

    for phase in ("prefill", "ttft", "decode", "total"):
        assert count(phase, "remote", "chat_completions") == 1, phase
    assert count("prefill", "local", "completions") == 0  # no fallback: no prefill leg
    for phase in ("ttft", "decode", "total"):
        assert count(phase, "local", "completions") == 1, phase
    assert count("total", "none", "completions") == 1
    assert count("ttft", "none", "completions") is None  # a series that cannot happen
    # Only what happened: no remote completion, no local chat.
    assert not [key for key in found if key.startswith(PHASE) and "remote" in key and
                'route="completions"' in key]  # fmt: skip
    # The whole histogram still adds up across the new labels (dashboards: sum by (le)).
    total = sum(v for k, v in found.items() if k.startswith(f"{PHASE}_count") and "total" in k)
    assert total == 3


async def test_no_created_series(http, sidecar, prefill) -> None:
    await post(http, sidecar.url + "/v1/completions", completion(), **{
        "x-prefiller-host-port": prefill.endpoint
    })  # fmt: skip
    text = await exposition(http, sidecar)
    assert "pd_sidecar_requests_total{" in text
    assert [line for line in text.splitlines() if "_created" in line] == []


@pytest.fixture
async def dns_sidecar(
    decode: RunningEmulator, prefill: RunningEmulator
) -> AsyncIterator[tuple[RunningSidecar, list[str]]]:
    """A sidecar whose pool is a headless Service's DNS answer, which the test sets (the list:
    the addresses it answers now, re-resolved every 20 ms)."""
    answer = ["127.0.0.1"]

    async def resolver(name: str, port: int) -> list[str]:
        return list(answer)

    settings = Settings(
        host="127.0.0.1",
        port=0,
        decode_url=decode.url,
        prefill_dns=f"prefill.llm.svc:{prefill.port}",
        discovery_interval_s=0.02,
        ready_interval_s=0.05,
    )
    sidecar = await start_sidecar(settings, resolver=resolver)
    try:
        yield sidecar, answer
    finally:
        await sidecar.close()


async def test_prefill_calls_per_pool_member_go_when_it_leaves(
    http, dns_sidecar: tuple[RunningSidecar, list[str]], prefill: RunningEmulator
) -> None:
    sidecar, answer = dns_sidecar
    member = f"127.0.0.1:{prefill.port}"
    found = samples(await exposition(http, sidecar))
    for outcome in PREFILL_OUTCOMES:  # a member's counts exist at 0 from its join
        key = f'{CALLS}{{endpoint="{member}",outcome="{outcome}"}}'
        assert found[key] == 0, key

    await post(http, sidecar.url + "/v1/completions", completion(LONG))  # scheduled remote
    found = samples(await exposition(http, sidecar))
    success = f'{CALLS}{{endpoint="{member}",outcome="success"}}'
    assert found[success] == 1
    duration = f'pd_sidecar_prefill_endpoint_duration_seconds_count{{endpoint="{member}"}}'
    assert found[duration] == 1

    answer.clear()  # the pod left the Service: it drains (nothing in flight) and leaves

    async def gone() -> bool:
        return f'endpoint="{member}"' not in await exposition(http, sidecar)

    await eventually(gone)


async def test_header_targets_beyond_the_slots_share_other(
    http, start_sidecar_with: StartSidecar
) -> None:
    """Targets no pool holds: the first ``HEADER_ENDPOINT_SLOTS`` have their own series, the
    rest count as ``other``. Unreachable loopback ports: each call fails at once (unreachable)
    and the request is decoded locally."""
    from sidecar.observability.endpoint_labels import HEADER_ENDPOINT_SLOTS

    sidecar = await start_sidecar_with(prefill_retries=0)
    targets = [f"127.0.0.9:{port}" for port in range(1, HEADER_ENDPOINT_SLOTS + 4)]
    for target in targets:
        await post(http, sidecar.url + "/v1/completions", completion(), **{
            "x-prefiller-host-port": target
        })  # fmt: skip
    found = samples(await exposition(http, sidecar))

    def unreachable(endpoint: str) -> float | None:
        family = "pd_sidecar_prefill_endpoint_requests_total"
        return found.get(f'{family}{{endpoint="{endpoint}",outcome="unreachable"}}')

    for target in targets[:HEADER_ENDPOINT_SLOTS]:
        assert unreachable(target) == 1, target
    for target in targets[HEADER_ENDPOINT_SLOTS:]:
        assert unreachable(target) is None, target
    assert unreachable(OTHER) == 3
    assert found['pd_sidecar_prefill_requests_total{outcome="unreachable"}'] == len(targets)
    # No success, so no duration: a failed call's time says nothing of the endpoint's speed.
    assert not [key for key in found if key.startswith("pd_sidecar_prefill_endpoint_duration")]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_header_slot_goes_to_a_new_target() -> None:
    evicted: list[str] = []
    clock = Clock()
    labels = EndpointLabels(evicted.append, slots=2, idle_s=600, clock=clock)
    assert labels.label("a:1") == "a:1"
    clock.now = 100
    assert labels.label("b:1") == "b:1"
    clock.now = 599
    assert labels.label("c:1") == OTHER  # both still busy
    clock.now = 650
    assert labels.label("b:1") == "b:1"  # b called again: a is the idlest
    assert labels.label("c:1") == "c:1"  # a idle 650 s: its slot is c's
    assert evicted == ["a:1"]
    assert labels.header_targets() == ["b:1", "c:1"]
    assert labels.label("a:1") == OTHER  # back, but b and c are busy


def test_pool_members_have_their_own_label_and_free_a_header_slot() -> None:
    evicted: list[str] = []
    labels = EndpointLabels(evicted.append, slots=1, clock=Clock())
    assert labels.label("a:1") == "a:1"
    assert labels.label("b:1") == OTHER
    labels.joined("b:1")
    assert labels.label("b:1") == "b:1"
    labels.joined("a:1")  # a header target joined the pool: its slot is free, its series kept
    assert labels.header_targets() == []
    assert labels.label("c:1") == "c:1"
    labels.left("b:1")
    assert labels.label("b:1") == OTHER  # no longer a member; the one slot is c's
    assert evicted == []


def test_the_loop_histogram_writes_what_prometheus_client_writes() -> None:
    """Line for line, bounds and +Inf included, after removing a series."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("x_seconds", "Help.", ["k"], buckets=_BUCKETS, registry=ours)
    reference = Histogram("x_seconds", "Help.", ["k"], buckets=_BUCKETS, registry=theirs)
    for value in (0, 0.005, 0.0051, 0.3, 1, 599.9, 600, 601, 1e9, -1):
        for family in (loop, reference):
            family.labels("a").observe(value)
            family.labels("b").observe(value / 2)
    loop.remove("b")
    reference.remove("b")
    expected = [line for line in generate_latest(theirs).splitlines() if b"_created" not in line]
    assert generate_latest(ours).splitlines() == expected
    assert len(expected) == 2 + len(_BUCKETS) + 3


def test_the_loop_counter_writes_what_prometheus_client_writes() -> None:
    """Line for line (``_created`` aside, which ``Metrics`` leaves out), after removing a series;
    and, as prometheus_client's, it refuses to go down."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopCounter("x", "Help.", ["k", "j"], registry=ours)
    reference = Counter("x", "Help.", ["k", "j"], registry=theirs)
    for family in (loop, reference):
        family.labels("a", "1").inc()
        family.labels("a", "1").inc(2.5)
        family.labels("b", "2").inc()
        family.labels("c", "3")
        family.remove("b", "2")
    expected = [line for line in generate_latest(theirs).splitlines() if b"_created" not in line]
    assert generate_latest(ours).splitlines() == expected
    assert b'x_total{j="1",k="a"} 3.5' in expected
    with pytest.raises(ValueError, match="only go up"):
        loop.labels("a", "1").inc(-1)
    with pytest.raises(ValueError, match="expected labels"):
        loop.labels("a")
