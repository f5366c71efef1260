"""Prefill → KV over NIXL → decode through the sidecar, on two real vLLM engines (CPU, tiny model).

The tests run in file order and share one set of engines (see conftest): the healthy scenarios
first, then the ones that stop an engine — the decode engine (and restart it), the lease check
that needs the stranded KV of that scenario, batched prompts (decoded locally), and last the prefill
engine.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.e2e_vllm.conftest import (
    EXPIRED,
    FAILED_TRANSFERS,
    LEASE_S,
    PREFILLS_SERVED,
    XFER_BYTES,
    XFER_COUNT,
    Cluster,
    Route,
    assert_pd_record,
    expired_in_log,
    generate,
    kv_bytes,
    metric,
    prefill_header,
    record,
    reference,
    request_body,
    settled_metric,
    unique_prompt,
    until,
)

pytestmark = [pytest.mark.e2e_vllm, pytest.mark.asyncio(loop_scope="session")]

CASES = [
    pytest.param(route, stream, id=f"{route}-{'stream' if stream else 'json'}")
    for route in ("completions", "chat")
    for stream in (False, True)
]


@pytest.mark.timeout(300)  # the first test also starts the engines
@pytest.mark.parametrize(("route", "stream"), CASES)
async def test_pd_text_equals_a_plain_run_on_the_decode_engine(
    cluster: Cluster, http, route: Route, stream: bool
) -> None:
    request_id = f"equal-{route}-{stream}"
    body = request_body(route, unique_prompt(request_id), stream=stream)
    transfers = await metric(http, cluster.decode, XFER_COUNT)

    pd = await generate(http, cluster.sidecar.url, route, body, prefill_header(cluster, request_id))

    assert pd.status == 200, pd.body
    # Exactly one pull of this prompt's KV by the decode engine.
    assert await settled_metric(http, cluster.decode, XFER_COUNT, transfers + 1) == transfers + 1
    plain = await reference(http, cluster, route, body)
    assert plain.status == 200, plain.body
    assert pd.text, "the tiny model generated nothing"
    assert (pd.text, pd.finish_reason) == (plain.text, plain.finish_reason)
    # Same token counts; cached_tokens is the prefill's (0 for an unseen prompt), not the decode's.
    assert pd.usage == plain.usage
    assert_pd_record(await record(http, cluster, request_id), cluster)
    assert await metric(http, cluster.decode, FAILED_TRANSFERS) == 0


@pytest.mark.timeout(120)
async def test_long_prompt_moves_every_block(cluster: Cluster, http) -> None:
    """A prompt of a few thousand tokens: about 25 blocks of KV cross NIXL, text still equal."""
    request_id = "long-prompt"
    body = request_body("completions", unique_prompt(request_id, words=1400), stream=False)
    transfers = await metric(http, cluster.decode, XFER_COUNT)
    moved = await metric(http, cluster.decode, XFER_BYTES)

    pd = await generate(
        http, cluster.sidecar.url, "completions", body, prefill_header(cluster, request_id)
    )

    assert pd.status == 200, pd.body
    assert pd.usage is not None
    prompt_tokens = pd.usage["prompt_tokens"]
    assert 2000 < prompt_tokens < 4000
    assert await settled_metric(http, cluster.decode, XFER_COUNT, transfers + 1) == transfers + 1
    assert await metric(http, cluster.decode, XFER_BYTES) - moved == kv_bytes(prompt_tokens)
    plain = await reference(http, cluster, "completions", body)
    assert (pd.text, pd.usage) == (plain.text, plain.usage)
    assert_pd_record(await record(http, cluster, request_id), cluster)


@pytest.mark.timeout(240)
async def test_32_concurrent_pd_requests_all_succeed(cluster: Cluster, http) -> None:
    """No text equality here: batching in bf16 may break near-ties differently."""
    routes: list[Route] = ["completions", "chat"]
    transfers = await metric(http, cluster.decode, XFER_COUNT)

    async def one(i: int) -> None:
        request_id = f"concurrent-{i}"
        route = routes[i % 2]
        body = request_body(route, unique_prompt(request_id), stream=i % 4 >= 2, max_tokens=16)
        answer = await generate(
            http, cluster.sidecar.url, route, body, prefill_header(cluster, request_id)
        )
        assert answer.status == 200, answer.body
        assert answer.text, request_id
        assert answer.finish_reason in ("length", "stop"), request_id
        assert_pd_record(await record(http, cluster, request_id), cluster)

    await asyncio.gather(*(one(i) for i in range(32)))

    assert await settled_metric(http, cluster.decode, XFER_COUNT, transfers + 32) == transfers + 32
    assert await metric(http, cluster.decode, FAILED_TRANSFERS) == 0
    async with http.get(cluster.sidecar.url + "/debug/requests?limit=1000") as response:
        listed = {entry["id"] for entry in (await response.json())["recent"]}
    assert {f"concurrent-{i}" for i in range(32)} <= listed


@pytest.mark.timeout(180)
async def test_decode_engine_stopped_gives_a_clear_503(cluster: Cluster, http) -> None:
    """The decode engine is down: 503 in the engine's error shape; the sidecar turns unready.

    Then the decode engine is restarted in the background for the tests after this one.
    """
    served = await metric(http, cluster.prefill, PREFILLS_SERVED)
    await cluster.decode.stop()

    async def unready() -> bool:
        async with http.get(cluster.sidecar.url + "/ready") as response:
            return response.status != 200

    await until(unready, 10, "the sidecar reports unready without its decode engine")
    request_id = "decode-stopped"
    body = request_body("chat", unique_prompt(request_id), stream=False)
    answer = await generate(
        http, cluster.sidecar.url, "chat", body, prefill_header(cluster, request_id)
    )

    assert answer.status == 503
    error = answer.body["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert (error["code"], error["param"]) == (503, None)
    assert cluster.decode.endpoint in error["message"], error
    entry = await record(http, cluster, request_id)
    assert (entry["state"], entry["status"]) == ("failed", 503), entry
    # If the sidecar ran the prefill leg first, that KV now waits in vain on the prefill engine.
    now_served = await settled_metric(http, cluster.prefill, PREFILLS_SERVED, served + 1, within=3)
    stranded = now_served - served
    cluster.expected_expiries += int(stranded)
    cluster.stranded_since = time.monotonic()

    cluster.restarting = asyncio.create_task(cluster.restart_decode(), name="restart-decode")


@pytest.mark.timeout(180)
async def test_prefill_lease_expires_only_for_the_stranded_request(cluster: Cluster, http) -> None:
    """After the lease (30 s), every healthy P/D request's KV was pulled: the prefill engine counts
    expired KV only for the request stranded by the stopped decode engine (if it prefilled)."""
    assert cluster.stranded_since is not None, "run after test_decode_engine_stopped_..."
    await asyncio.sleep(max(0.0, cluster.stranded_since + LEASE_S + 3 - time.monotonic()))
    expected = cluster.expected_expiries
    expired = await settled_metric(http, cluster.prefill, EXPIRED, expected, within=10)
    assert expired == expected, f"expired on the prefill engine: {expired_in_log(cluster.prefill)}"

    assert cluster.restarting is not None
    await asyncio.wait_for(asyncio.shield(cluster.restarting), 150)
    assert cluster.decode.process is not None
    assert cluster.decode.process.running

    async def ready() -> bool:
        async with http.get(cluster.sidecar.url + "/ready") as response:
            return response.status == 200

    await until(ready, 10, "the sidecar is ready again once its decode engine is back")


@pytest.mark.timeout(120)
async def test_batched_prompts_each_get_their_own_kv(cluster: Cluster, http) -> None:
    """``prompt`` as a list: vLLM's prefill answers with the ``kv_transfer_params`` of the first
    prompt only, so forwarding them would make the decode engine pull the first prompt's KV for
    every prompt (and strand the others' on the prefill engine until the lease runs out). The
    sidecar decodes a batch locally instead, and says so in the record.

    After the lease test on purpose: a stranded KV must not disturb that count.
    """
    request_id = "batched-prompts"
    prompts = [unique_prompt(f"{request_id}-{i}") for i in range(2)]
    body = {**request_body("completions", "", stream=False), "prompt": prompts}

    pd = await generate(
        http, cluster.sidecar.url, "completions", body, prefill_header(cluster, request_id)
    )
    plain = await reference(http, cluster, "completions", body)

    assert (pd.status, plain.status) == (200, 200), (pd.body, plain.body)
    texts = [sorted((c["index"], c["text"]) for c in g.body["choices"]) for g in (pd, plain)]
    assert texts[0] == texts[1]
    entry = await record(http, cluster, request_id)
    assert (entry["decision"], entry["reason"]) == ("local", "batched_prompt"), entry


@pytest.mark.timeout(120)
async def test_prefill_engine_stopped_falls_back_to_local_decode(cluster: Cluster, http) -> None:
    await cluster.prefill.stop()
    request_id = "prefill-stopped"
    body = request_body("completions", unique_prompt(request_id), stream=True)

    answer = await generate(
        http, cluster.sidecar.url, "completions", body, prefill_header(cluster, request_id)
    )

    assert answer.status == 200, answer.body
    entry = await record(http, cluster, request_id)
    assert entry["decision"] == "local", entry
    assert entry["fallback_reason"] == "prefill_unreachable", entry
    assert (entry["state"], entry["status"]) == ("completed", 200), entry
    # Decoded locally from scratch: the same text as the decode engine's own run.
    plain = await reference(http, cluster, "completions", body)
    assert answer.text == plain.text
