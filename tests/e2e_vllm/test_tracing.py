"""One trace across the sidecar and real vLLM engines.

vLLM 0.32 exports its own spans when started with ``--otlp-traces-endpoint`` (its OpenTelemetry
packages come with it in the e2e environment): one ``llm_request`` span per request, a child of
the W3C context the request's ``traceparent`` header carried. Both engines of a NixlConnector pair
export over OTLP/HTTP (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``; vLLM's default is
gRPC) to the same local receiver (``tests/otlp.py``) as the sidecar (``SIDECAR_TRACING=true``).
The prefill engine's span must hang under the sidecar's ``prefill`` span, the decode engine's under
its ``decode`` span, all in the gateway's trace.

A pair of its own, started once for this module (it stops any pair before it).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.e2e_vllm.conftest import (
    Cluster,
    generate,
    log_dir_for,
    prefill_header,
    record,
    request_body,
    start_cluster,
    unique_prompt,
)
from tests.otlp import SERVER, ReceivedSpan, Receiver, traceparent

pytestmark = [pytest.mark.e2e_vllm, pytest.mark.asyncio(loop_scope="session")]

EXPORT_WITHIN_S = 30.0
"""Batches leave every 100 ms (``OTEL_BSP_SCHEDULE_DELAY``); vLLM ends its span when the request
finishes, in the API server's process."""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def receiver() -> AsyncIterator[Receiver]:
    running = Receiver()
    await running.start()
    yield running
    await running.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def traced_pair(
    receiver: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Cluster]:
    batches = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    async with await start_cluster(
        log_dir_for(tmp_path_factory),
        engine_args=["--otlp-traces-endpoint", receiver.url + "/v1/traces"],
        engine_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", **batches},
        sidecar_env={
            "SIDECAR_TRACING": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            **batches,
        },
    ) as running:
        yield running


@pytest.mark.timeout(300)  # starts the pair
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_the_engines_spans_join_the_sidecars_trace(
    traced_pair: Cluster, receiver: Receiver, http, stream: bool
) -> None:
    cluster = traced_pair
    request_id = f"traced-{'stream' if stream else 'json'}"
    trace_id, gateway_span = os.urandom(16).hex(), os.urandom(8).hex()
    headers = {
        **prefill_header(cluster, request_id),
        "traceparent": traceparent(trace_id, gateway_span),
    }
    body = request_body("completions", unique_prompt(request_id, words=80), stream=stream)

    answer = await generate(http, cluster.sidecar.url, "completions", body, headers)

    assert answer.status == 200, answer.body
    assert (await record(http, cluster, request_id))["decision"] == "remote"

    def engine_spans(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.trace_id == trace_id and s.name == "llm_request"]

    def sidecar_spans(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
        return {
            s.name: s
            for s in spans
            if s.trace_id == trace_id and s.resource.get("service.name") == "pd-sidecar"
        }

    def complete(spans: list[ReceivedSpan]) -> bool:
        ours = sidecar_spans(spans)
        return len(engine_spans(spans)) >= 2 and {"prefill", "decode", "relay"} <= set(ours)

    spans = await receiver.until(complete, EXPORT_WITHIN_S)
    ours = sidecar_spans(spans)
    [request] = [s for s in ours.values() if s.kind == SERVER]
    assert request.parent_id == gateway_span, request
    assert request.attributes["pd_sidecar.request_id"] == request_id
    prefill, decode = ours["prefill"], ours["decode"]
    assert prefill.parent_id == decode.parent_id == request.span_id
    # Each engine's own span is the child of the sidecar's span for that engine's leg.
    theirs = engine_spans(spans)
    parents = sorted(s.parent_id or "" for s in theirs)
    assert parents == sorted([prefill.span_id, decode.span_id]), (parents, prefill, decode)
    assert all(s.resource.get("service.name") != "pd-sidecar" for s in theirs), theirs
