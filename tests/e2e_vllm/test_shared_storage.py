"""vLLM's ExampleConnector through the sidecar (``SIDECAR_CONNECTOR=shared-storage``).

Both engines run ``ExampleConnector`` (``kv_both``) on one temporary directory. An engine whose
prompt is not in the store saves the prompt's KV there, one folder per prompt (named by a hash of
its tokens, cut to whole blocks after leaving two out), and an engine whose prompt is there loads
it ("External Cache Hit!" in its log). The sidecar's prefill leg (one token, not streamed, no
``kv_transfer_params``) makes the prefill engine store the KV; the decode leg, the client's body
unchanged, finds it. A prompt shorter than a block and two tokens is never loaded, so every
prompt here has several blocks.

The store keys on the tokens only, not on ``cache_salt``: before the reference run the test
removes what the P/D run stored, so that the decode engine computes every prompt token itself.

A pair of its own, started once for this module (it stops any pair before it).
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.e2e_vllm.conftest import (
    BLOCK_TOKENS,
    Cluster,
    Route,
    assert_pd_record,
    generate,
    log_dir_for,
    metric,
    prefill_header,
    prefill_kv_blocks,
    record,
    reference,
    request_body,
    settled_metric,
    start_cluster,
    unique_prompt,
)

pytestmark = [pytest.mark.e2e_vllm, pytest.mark.asyncio(loop_scope="session")]

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
"""Engine: prompt tokens whose KV it loaded from the store."""
LOCAL_HITS = "vllm:prefix_cache_hits_total"
"""Engine: prompt tokens served by its own prefix cache."""

CASES = [
    pytest.param(route, stream, id=f"{route}-{'stream' if stream else 'json'}")
    for route in ("completions", "chat")
    for stream in (False, True)
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def storage_pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    store = tmp_path_factory.mktemp("kv-store")
    try:
        async with await start_cluster(
            log_dir_for(tmp_path_factory),
            kv_connector="ExampleConnector",
            sidecar_connector="shared-storage",
            shared_storage_path=store,
        ) as running:
            yield running
    finally:
        shutil.rmtree(store, ignore_errors=True)


def stored(cluster: Cluster) -> set[Path]:
    """The store's entries: one folder per prompt some engine saved."""
    assert cluster.shared_storage_path is not None
    return set(cluster.shared_storage_path.iterdir())


def loadable_tokens(prompt_tokens: int) -> int:
    """Tokens of a prompt the ExampleConnector stores and loads: whole blocks, after leaving
    the last two tokens out."""
    return (prompt_tokens - 2) // BLOCK_TOKENS * BLOCK_TOKENS


@pytest.mark.timeout(300)  # the first test also starts the pair
@pytest.mark.parametrize(("route", "stream"), CASES)
async def test_shared_storage_text_equals_a_plain_run_on_the_decode_engine(
    storage_pair: Cluster, http, route: Route, stream: bool
) -> None:
    """The prefill engine stores the prompt's KV; the decode engine loads it from the store
    (every loadable token an external hit, none from its own cache) and its greedy text equals
    its own answer computed from scratch."""
    cluster = storage_pair
    request_id = f"storage-equal-{route}-{stream}"
    body = request_body(route, unique_prompt(request_id, words=200), stream=stream)
    entries = stored(cluster)
    external = await metric(http, cluster.decode, EXTERNAL_HITS)
    local = await metric(http, cluster.decode, LOCAL_HITS)
    log = cluster.decode.process.log() if cluster.decode.process else ""

    pd = await generate(http, cluster.sidecar.url, route, body, prefill_header(cluster, request_id))

    assert pd.status == 200, pd.body
    assert pd.usage is not None
    prompt_tokens = pd.usage["prompt_tokens"]
    assert loadable_tokens(prompt_tokens) >= 3 * BLOCK_TOKENS, "a prompt of several blocks"
    new_entries = stored(cluster) - entries
    assert len(new_entries) == 1, "the prefill leg stored the prompt's KV, once"
    wanted = external + loadable_tokens(prompt_tokens)
    assert await settled_metric(http, cluster.decode, EXTERNAL_HITS, wanted) == wanted
    assert await metric(http, cluster.decode, LOCAL_HITS) == local
    assert cluster.decode.process is not None
    new_log = cluster.decode.process.log()[len(log) :]
    assert new_log.count("External Cache Hit!") == 1, "the decode engine loaded from the store"
    entry = await record(http, cluster, request_id)
    assert_pd_record(entry, cluster)

    for folder in new_entries:  # the reference computes every token: nothing to load
        shutil.rmtree(folder)
    external = await metric(http, cluster.decode, EXTERNAL_HITS)
    plain = await reference(http, cluster, route, body)
    assert plain.status == 200, plain.body
    assert await metric(http, cluster.decode, EXTERNAL_HITS) == external, "reference loaded KV"
    assert pd.text, "the tiny model generated nothing"
    assert (pd.text, pd.finish_reason) == (plain.text, plain.finish_reason)
    assert plain.usage is not None
    for count in ("prompt_tokens", "completion_tokens"):
        assert pd.usage[count] == plain.usage[count], (pd.usage, plain.usage)


@pytest.mark.timeout(120)  # the last test also stops the pair
async def test_shared_storage_leaves_no_kv_held_on_the_prefill_engine(
    storage_pair: Cluster, http
) -> None:
    """The prefill leg is an ordinary one-token request: its blocks are free when it answers."""
    assert await prefill_kv_blocks(http, storage_pair) == 0
