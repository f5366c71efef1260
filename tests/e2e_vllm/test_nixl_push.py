"""vLLM's NixlPushConnector through the sidecar (``SIDECAR_CONNECTOR=nixl-push``).

In push mode the decode engine allocates blocks for the prompt and registers them with the prefill
engine, which then writes its KV into them. The prefill engine matches a registration to the KV it
holds by request id: the decode engine's id (``cmpl-`` or ``chatcmpl-`` + the ``x-request-id``,
then a random suffix) must have the same base as the prefill's. So every decode leg, and every
release, carries the prefill leg's exact ``x-request-id`` on the same path. A decode request under
another id would wait for a push that never comes (up to vLLM's 480 s registration timeout), and
the prefill engine would hold the KV for its 30 s lease.

A pair of its own, started once for this module (it stops the session's NixlConnector pair: push
and pull engines cannot pair, and two pairs would not fit two cores). The transfer is the prefill
engine's work here: it counts ``vllm:nixl_xfer_time_seconds_count`` and
``vllm:nixl_bytes_transferred_sum``; the decode engine counts the pushed prompt tokens as
``vllm:external_prefix_cache_hits_total``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from e2e.engines import MAX_MODEL_LEN
from tests.e2e_vllm.conftest import (
    EXPIRED,
    FAILED_TRANSFERS,
    XFER_BYTES,
    XFER_COUNT,
    Cluster,
    Route,
    assert_pd_record,
    generate,
    kv_bytes,
    log_dir_for,
    metric,
    prefill_header,
    prefill_kv_blocks,
    record,
    reference,
    request_body,
    settled_metric,
    settled_prefill_kv_blocks,
    settled_sidecar_metric,
    sidecar_metric,
    start_cluster,
    unique_prompt,
    warm_pair,
)

pytestmark = [
    pytest.mark.e2e_vllm,
    pytest.mark.asyncio(loop_scope="session"),
    # Runs with E2E_VLLM_PUSH=1 only: vLLM 0.32's push mode on CPU stalls a request for up to
    # its 30 s lease, with or without the sidecar (docs/e2e.md, "Push mode: vLLM's stall").
    pytest.mark.skipif(
        os.environ.get("E2E_VLLM_PUSH") != "1",
        reason="NixlPushConnector pair runs with E2E_VLLM_PUSH=1 (vLLM's push stall: docs/e2e.md)",
    ),
]

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
"""Decode engine: prompt tokens whose KV came from outside (here: pushed by the prefill)."""
RELEASES = "pd_sidecar_kv_releases_total"
KV_FREED_WITHIN_S = 10.0
"""Far below the prefill engine's 30 s lease; a release takes about 0.1 s."""
REFUSED_MAX_TOKENS = 5000
assert REFUSED_MAX_TOKENS > MAX_MODEL_LEN

CASES = [
    pytest.param(route, stream, id=f"{route}-{'stream' if stream else 'json'}")
    for route in ("completions", "chat")
    for stream in (False, True)
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def push_pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    async with await start_cluster(
        log_dir_for(tmp_path_factory),
        kv_connector="NixlPushConnector",
        sidecar_connector="nixl-push",
    ) as running:
        yield running


@pytest.mark.timeout(300)  # the first test also starts the pair
@pytest.mark.parametrize(("route", "stream"), CASES)
async def test_push_text_equals_a_plain_run_on_the_decode_engine(
    push_pair: Cluster, http, route: Route, stream: bool
) -> None:
    """Prefill → the prefill engine pushes the KV into the decode's blocks → decode: the greedy
    text equals the decode engine's own answer; exactly one push, of every block the prompt
    touches; the decode engine took every prompt token from outside."""
    cluster = push_pair
    request_id = f"push-equal-{route}-{stream}"
    body = request_body(route, unique_prompt(request_id, words=200), stream=stream)
    pushes = await metric(http, cluster.prefill, XFER_COUNT)
    pushed = await metric(http, cluster.prefill, XFER_BYTES)
    external = await metric(http, cluster.decode, EXTERNAL_HITS)

    pd = await generate(http, cluster.sidecar.url, route, body, prefill_header(cluster, request_id))

    assert pd.status == 200, pd.body
    assert pd.usage is not None
    prompt_tokens = pd.usage["prompt_tokens"]
    assert prompt_tokens > 3 * 128, "a prompt of several blocks"
    assert await settled_metric(http, cluster.prefill, XFER_COUNT, pushes + 1) == pushes + 1
    assert await metric(http, cluster.prefill, XFER_BYTES) - pushed == kv_bytes(prompt_tokens)
    hits = await settled_metric(http, cluster.decode, EXTERNAL_HITS, external + prompt_tokens)
    assert hits - external == prompt_tokens
    plain = await reference(http, cluster, route, body)
    assert plain.status == 200, plain.body
    assert pd.text, "the tiny model generated nothing"
    assert (pd.text, pd.finish_reason) == (plain.text, plain.finish_reason)
    assert plain.usage is not None
    for count in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert pd.usage[count] == plain.usage[count], (pd.usage, plain.usage)
    # The prefill's cached tokens (0: an unseen prompt). Not created_cache_tokens (chat only):
    # the decode engine counts the prompt blocks it computed itself, 0 when they were pushed.
    assert pd.usage["prompt_tokens_details"]["cached_tokens"] == 0, pd.usage
    assert_pd_record(await record(http, cluster, request_id), cluster)
    assert await metric(http, cluster.prefill, FAILED_TRANSFERS) == 0


@pytest.mark.timeout(60)
async def test_push_leaves_no_kv_held_on_the_prefill_engine(push_pair: Cluster, http) -> None:
    """After the P/D requests above, the prefill engine holds no KV (every prefill's blocks were
    pushed and freed, none waits for the lease) and has let no lease expire."""
    held, took = await settled_prefill_kv_blocks(
        http, push_pair, at_most=0, within=KV_FREED_WITHIN_S
    )
    assert held == 0, f"{held} blocks still held after {took:.1f} s"
    assert await metric(http, push_pair.prefill, EXPIRED) == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_push_decode_refusal_releases_the_prefill_kv(
    push_pair: Cluster, http, stream: bool
) -> None:
    """The prefill leg succeeds, the decode engine refuses (400, max_tokens over its context): the
    client gets that 400, and the sidecar's release frees the prefill's KV within seconds.

    In push mode vLLM 0.32 does not free it by itself: the decode engine's cleanup of a refused
    request queues an empty receive, which sends the prefill engine nothing (docs/e2e.md). So the
    KV freed, and the one push more on the prefill engine, are the release's work — a release the
    prefill engine matched to its KV, which it does only by the request id: the release carried
    the prefill's x-request-id on the prefill's path.
    """
    cluster = push_pair
    before_warming = await metric(http, cluster.prefill, XFER_COUNT)
    await warm_pair(http, cluster, f"push-refusal-{stream}")
    pushes = await settled_metric(http, cluster.prefill, XFER_COUNT, before_warming + 1)
    held_before = await prefill_kv_blocks(http, cluster)
    released_before = await sidecar_metric(http, cluster, RELEASES, outcome="sent")
    request_id = f"push-decode-refuses-{'stream' if stream else 'json'}"
    body = request_body(
        "completions",
        unique_prompt(request_id, words=250),  # about 500 tokens: 4 blocks of KV
        stream=stream,
        max_tokens=REFUSED_MAX_TOKENS,
    )

    answer = await generate(
        http, cluster.sidecar.url, "completions", body, prefill_header(cluster, request_id)
    )

    assert answer.status == 400, answer.body
    entry = await record(http, cluster, request_id)
    assert entry["decision"] == "remote", entry
    assert "prefill_done" in entry["phases"], entry
    assert (entry["state"], entry["status"]) == ("failed", 400), entry
    held, took = await settled_prefill_kv_blocks(
        http, cluster, at_most=held_before, within=KV_FREED_WITHIN_S
    )
    released = await settled_sidecar_metric(
        http, cluster, RELEASES, released_before + 1, outcome="sent"
    )
    pushed = await settled_metric(http, cluster.prefill, XFER_COUNT, pushes + 1)
    plain = await generate(http, cluster.decode.url, "completions", body)
    print(
        f"push refusal ({'stream' if stream else 'json'}): prefill KV blocks {held_before} "
        f"before, {held} after {took:.2f} s; releases sent +{released - released_before:g}; "
        f"pushes +{pushed - pushes:g}"
    )

    assert (plain.status, answer.body) == (400, plain.body), "not the decode engine's answer"
    assert held <= held_before, f"{held} blocks held after {took:.1f} s, {held_before} before"
    assert released == released_before + 1, (
        f"{RELEASES}{{outcome=sent}} went from {released_before:g} to {released:g}"
    )
    assert pushed == pushes + 1, "the release did not take the KV by a push"
    assert await metric(http, cluster.prefill, FAILED_TRANSFERS) == 0
