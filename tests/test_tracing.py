"""OpenTelemetry tracing end to end: the sidecar exports its spans to a local OTLP/HTTP receiver
(``tests.otlp``), and the emulators record the ``traceparent`` each leg carried.

The legs of every connector are checked in tests/test_contract.py; here, with NIXL: the span
tree and its attributes, a retry, a fallback, a refused decode and its release, a client that
leaves, the passthrough, tracing off, and the process configured by ``OTEL_*`` variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import secrets
import signal
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from sidecar.__main__ import load_tracing
from sidecar.app import TRACING
from sidecar.config import Settings
from sidecar.emulator import RunningEmulator
from sidecar.observability.tracing import NO_TRACING, otlp_endpoint
from tests.conftest import (
    completion,
    engine_requests,
    eventually,
    get_json,
    inject,
)
from tests.otlp import CLIENT, INTERNAL, SERVER, Receiver, Trace, traced, traceparent
from tests.processes import sidecar_process
from tests.test_config import _clean_env

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


async def _post(
    http: aiohttp.ClientSession,
    url: str,
    prefill: RunningEmulator | None,
    request_id: str,
    body: dict[str, Any] | None = None,
    **headers: str,
) -> int:
    if prefill is not None:
        headers["x-prefiller-host-port"] = prefill.endpoint
    async with http.post(
        url + "/v1/completions",
        json=body or completion(),
        headers={"x-request-id": request_id, **headers},
    ) as response:
        await response.read()
        return response.status


def _legs(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace context each logged request carried."""
    return [r["trace"] for r in requests]


async def test_the_span_tree_of_a_request_joins_the_gateway_trace(
    otlp: Receiver, http, start_sidecar_with, start_engine, decode
) -> None:
    prefill = await start_engine(prompt_tokens_details=True)
    sidecar = await start_sidecar_with(tracing=traced(otlp))
    status = await _post(
        http,
        sidecar.url,
        prefill,
        "traced-1",
        traceparent=traceparent(TRACE_ID, CLIENT_SPAN),
        tracestate="gw=1",
    )
    assert status == 200
    trace = await otlp.trace_of("traced-1", spans=5)

    request = trace.request
    assert (request.trace_id, request.parent_id) == (TRACE_ID, CLIENT_SPAN)
    assert (request.name, request.kind, request.error) == ("POST /v1/completions", SERVER, None)
    assert request.resource["service.name"] == "pd-sidecar"
    assert request.attributes["pd_sidecar.request_id"] == "traced-1"
    assert request.attributes["pd_sidecar.engine_request_id"].startswith("traced-1-")
    assert request.attributes["http.request.method"] == "POST"
    assert request.attributes["url.path"] == "/v1/completions"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["pd_sidecar.decision"] == "remote"
    assert request.attributes["pd_sidecar.reason"] == "header"
    assert request.attributes["pd_sidecar.state"] == "completed"
    assert request.attributes["pd_sidecar.prefill.endpoint"] == prefill.endpoint
    assert request.attributes["pd_sidecar.decode_rank"] == 0
    assert "pd_sidecar.fallback_reason" not in request.attributes
    # Every phase is a child of the request span.
    assert {s.parent_id for s in trace.spans if s is not request} == {request.span_id}
    assert all(s.ended for s in trace.spans)

    placement = trace.one("placement")
    assert placement.kind == INTERNAL
    assert placement.attributes["pd_sidecar.decision"] == "remote"
    assert placement.attributes["pd_sidecar.reason"] == "header"
    assert placement.attributes["pd_sidecar.prefill.endpoint"] == prefill.endpoint

    attempt = trace.one("prefill")
    assert (attempt.kind, attempt.error) == (CLIENT, None)
    assert attempt.attributes["pd_sidecar.prefill.attempt"] == 1
    assert attempt.attributes["pd_sidecar.prefill.endpoint"] == prefill.endpoint
    assert attempt.attributes["pd_sidecar.outcome"] == "success"
    assert attempt.attributes["server.address"] == "127.0.0.1"
    assert attempt.attributes["server.port"] == prefill.port
    assert attempt.attributes["url.path"] == "/v1/completions"
    assert attempt.attributes["http.response.status_code"] == 200
    assert isinstance(attempt.attributes["pd_sidecar.cached_tokens"], int)

    decode_span = trace.one("decode")
    assert (decode_span.kind, decode_span.error) == (CLIENT, None)
    assert decode_span.attributes["pd_sidecar.outcome"] == "first_byte"
    assert decode_span.attributes["server.port"] == decode.port
    assert decode_span.attributes["pd_sidecar.decode_rank"] == 0
    assert trace.one("relay").kind == INTERNAL

    # Each leg carries its own span, in the gateway's trace, with the gateway's tracestate.
    [prefill_leg] = _legs(await engine_requests(http, prefill))
    [decode_leg] = _legs(await engine_requests(http, decode))
    assert prefill_leg["trace_id"] == decode_leg["trace_id"] == TRACE_ID
    assert prefill_leg["parent_id"] == attempt.span_id
    assert decode_leg["parent_id"] == decode_span.span_id
    assert prefill_leg["sampled"] is decode_leg["sampled"] is True
    assert prefill_leg["tracestate"] == decode_leg["tracestate"] == "gw=1"
    # The request id links the trace, /debug/requests and the logs.
    record = await get_json(http, sidecar.url + "/debug/requests/traced-1")
    assert record["state"] == "completed"


async def test_a_request_without_trace_context_starts_a_trace(
    otlp: Receiver, http, start_sidecar_with, prefill, decode
) -> None:
    sidecar = await start_sidecar_with(tracing=traced(otlp))
    assert await _post(http, sidecar.url, prefill, "fresh-1") == 200
    trace = await otlp.trace_of("fresh-1", spans=5)
    assert trace.request.parent_id is None
    assert trace.request.trace_id != TRACE_ID
    [prefill_leg] = _legs(await engine_requests(http, prefill))
    [decode_leg] = _legs(await engine_requests(http, decode))
    assert prefill_leg["trace_id"] == decode_leg["trace_id"] == trace.request.trace_id
    assert prefill_leg["tracestate"] is None
    assert (prefill_leg["parent_id"], decode_leg["parent_id"]) == (
        trace.one("prefill").span_id,
        trace.one("decode").span_id,
    )


async def test_an_unsampled_gateway_trace_is_followed(
    otlp: Receiver, http, start_sidecar_with, prefill, decode
) -> None:
    """The default sampler is parent-based: a gateway's "not sampled" exports nothing, and the
    legs still carry the trace (not sampled) for the engines to follow: the request span's
    context, since an unrecorded request starts no span per leg."""
    sidecar = await start_sidecar_with(tracing=traced(otlp))
    context = traceparent(TRACE_ID, CLIENT_SPAN, sampled=False)
    assert await _post(http, sidecar.url, prefill, "unsampled", traceparent=context) == 200
    assert await _post(http, sidecar.url, prefill, "sampled") == 200
    await otlp.trace_of("sampled", spans=5)
    assert not [s for s in otlp.spans if s.trace_id == TRACE_ID]
    first_leg = _legs(await engine_requests(http, prefill))[0]
    decode_leg = _legs(await engine_requests(http, decode))[0]
    assert (first_leg["trace_id"], first_leg["sampled"]) == (TRACE_ID, False)
    assert (decode_leg["trace_id"], decode_leg["sampled"]) == (TRACE_ID, False)
    # The sidecar's request span (not recorded), not the gateway's.
    assert first_leg["parent_id"] == decode_leg["parent_id"] != CLIENT_SPAN


async def test_a_retry_is_a_second_attempt_span(
    otlp: Receiver, http, start_sidecar_with, prefill, decode
) -> None:
    sidecar = await start_sidecar_with(tracing=traced(otlp), prefill_retry_backoff_s=0)
    await inject(http, prefill, kind="status", status=503, role="prefill")
    assert await _post(http, sidecar.url, prefill, "retried") == 200
    trace = await otlp.trace_of("retried", spans=6)
    first, second = sorted(
        trace.named("prefill"), key=lambda s: s.attributes["pd_sidecar.prefill.attempt"]
    )
    assert first.attributes["pd_sidecar.prefill.attempt"] == 1
    assert first.attributes["pd_sidecar.outcome"] == "server_error"
    assert first.attributes["http.response.status_code"] == 503
    assert first.error == "prefill answered 503"
    assert second.attributes["pd_sidecar.prefill.attempt"] == 2
    assert (second.attributes["pd_sidecar.outcome"], second.error) == ("success", None)
    assert trace.request.attributes["pd_sidecar.prefill.attempts"] == 2
    assert trace.request.error is None
    # Each attempt's leg names its own span.
    legs = _legs(await engine_requests(http, prefill))
    assert [leg["parent_id"] for leg in legs] == [first.span_id, second.span_id]


async def test_a_failed_prefill_marks_its_attempt_and_the_fallback(
    otlp: Receiver, http, start_sidecar_with, prefill, decode
) -> None:
    sidecar = await start_sidecar_with(tracing=traced(otlp))
    await inject(http, prefill, kind="status", status=500, role="prefill")  # not retried
    assert await _post(http, sidecar.url, prefill, "fell-back") == 200
    trace = await otlp.trace_of("fell-back", spans=5)
    attempt = trace.one("prefill")
    assert attempt.attributes["pd_sidecar.outcome"] == "server_error"
    assert attempt.error == "prefill answered 500"
    request = trace.request
    assert request.attributes["pd_sidecar.fallback_reason"] == "prefill_error"
    assert request.attributes["pd_sidecar.decision"] == "local"
    assert request.error is None  # the client got its answer
    [decode_leg] = _legs(await engine_requests(http, decode))
    assert decode_leg["parent_id"] == trace.one("decode").span_id


async def test_a_prefill_that_fails_the_request_marks_it(
    otlp: Receiver, http, start_sidecar_with, prefill, decode
) -> None:
    sidecar = await start_sidecar_with(tracing=traced(otlp), prefill_fallback="fail")
    await inject(http, prefill, kind="status", status=500, role="prefill")
    assert await _post(http, sidecar.url, prefill, "failed") == 503
    trace = await otlp.trace_of("failed", spans=3)  # request, placement, prefill
    assert trace.request.attributes["http.response.status_code"] == 503
    assert trace.request.attributes["pd_sidecar.state"] == "failed"
    assert trace.request.error is not None
    assert "fallback is 'fail'" in trace.request.error
    assert trace.one("prefill").failed


async def test_a_refused_decode_and_its_release(
    otlp: Receiver, http, start_sidecar_with, prefill, decode
) -> None:
    sidecar = await start_sidecar_with(tracing=traced(otlp))
    await inject(http, decode, kind="status", status=500, role="decode")
    assert await _post(http, sidecar.url, prefill, "refused") == 500
    trace = await otlp.trace_of("refused", spans=6)
    decode_span = trace.one("decode")
    assert decode_span.attributes["http.response.status_code"] == 500
    assert decode_span.error == "decode answered 500"
    release = trace.one("kv_release")
    assert (release.kind, release.parent_id) == (CLIENT, trace.request.span_id)
    assert release.attributes["pd_sidecar.outcome"] == "sent"
    assert trace.request.error is not None  # a 5xx to the client
    decode_leg, release_leg = _legs(await engine_requests(http, decode))
    assert decode_leg["parent_id"] == decode_span.span_id
    assert release_leg["parent_id"] == release.span_id


async def test_a_client_that_leaves_still_ends_and_exports_every_span(
    otlp: Receiver, http, start_sidecar_with, prefill, decode
) -> None:
    sidecar = await start_sidecar_with(tracing=traced(otlp))
    await inject(http, decode, kind="hang", role="decode")

    async def client() -> None:
        async with aiohttp.ClientSession() as own:
            await _post(own, sidecar.url, prefill, "left")

    leaving = asyncio.create_task(client())

    async def decode_held() -> bool:
        return int((await get_json(http, decode.url + "/emulator/faults"))["held"]) == 1

    await eventually(decode_held)
    leaving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await leaving
    trace = await otlp.trace_of("left", spans=5)  # request, placement, prefill, decode, release
    assert trace.request.attributes["pd_sidecar.state"] == "cancelled"
    assert trace.request.error is None  # the client's choice, not the sidecar's failure
    assert trace.one("decode").attributes["pd_sidecar.outcome"] == "cancelled"
    assert trace.one("kv_release").attributes["pd_sidecar.outcome"] == "sent"
    assert all(s.ended for s in trace.spans)
    async with http.post(decode.url + "/emulator/release"):
        pass


async def test_the_passthrough_is_one_span_named_on_its_leg(
    otlp: Receiver, http, start_sidecar_with, decode
) -> None:
    sidecar = await start_sidecar_with(tracing=traced(otlp))
    context = traceparent(TRACE_ID, CLIENT_SPAN)
    headers = {"traceparent": context, "x-request-id": "models-1"}
    async with http.get(sidecar.url + "/v1/models", headers=headers) as response:
        assert response.status == 200
    trace = await otlp.trace_of("models-1", spans=1)
    span = trace.request
    # No route template for a path the sidecar does not own: named by the method alone.
    assert (span.name, span.kind, span.parent_id) == ("GET", SERVER, CLIENT_SPAN)
    assert span.attributes["url.path"] == "/v1/models"
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["pd_sidecar.state"] == "completed"
    [leg] = _legs(await engine_requests(http, decode))
    assert (leg["trace_id"], leg["parent_id"]) == (TRACE_ID, span.span_id)


async def test_tracing_off_passes_the_trace_context_through_untouched(
    http, sidecar, prefill, decode
) -> None:
    context = traceparent(TRACE_ID, CLIENT_SPAN)
    assert await _post(http, sidecar.url, prefill, "off-1", traceparent=context, tracestate="a=b")
    assert await _post(http, sidecar.url, prefill, "off-2") == 200
    async with http.get(sidecar.url + "/v1/models", headers={"traceparent": context}):
        pass
    with_context, without = _legs(await engine_requests(http, prefill))
    assert with_context["traceparent"] == context
    assert with_context["tracestate"] == "a=b"
    assert without is None  # nothing invented
    decode_legs = _legs(await engine_requests(http, decode))
    assert [leg and leg["traceparent"] for leg in decode_legs] == [context, None, context]


async def test_tracing_off_is_the_null_object(sidecar) -> None:
    """Off, the app holds ``NO_TRACING``, never None: the modules call it, none checks."""
    assert sidecar.app[TRACING] is NO_TRACING


async def test_a_disabled_sdk_passes_the_trace_context_through(
    otlp: Receiver, http, start_sidecar_with, prefill, decode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")  # read by the SDK's provider
    sidecar = await start_sidecar_with(tracing=traced(otlp))
    context = traceparent(TRACE_ID, CLIENT_SPAN)
    assert await _post(http, sidecar.url, prefill, "disabled", traceparent=context) == 200
    [prefill_leg] = _legs(await engine_requests(http, prefill))
    [decode_leg] = _legs(await engine_requests(http, decode))
    assert prefill_leg["traceparent"] == decode_leg["traceparent"] == context


# --- the process, configured by the OTEL_* variables ------------------------------------------


@pytest.mark.system
async def test_the_process_exports_where_the_otel_variables_say(
    otlp: Receiver, http, prefill, decode
) -> None:
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url,
        "OTEL_SERVICE_NAME": "decode-pod-7",
        "OTEL_BSP_SCHEDULE_DELAY": "20",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "1.0",
    }
    async with sidecar_process(
        until="/ready",
        environ=otel,
        decode_url=decode.url,
        ready_interval_s="0.05",
        tracing="true",
    ) as process:
        request_id = f"proc-{secrets.token_hex(4)}"
        assert await _post(http, process.url, prefill, request_id) == 200
        trace: Trace = await otlp.trace_of(request_id, spans=5, within=10)
        process.process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.process.wait(), 15) == 0
        log = await process.log()
    assert trace.request.resource["service.name"] == "decode-pod-7"
    [line] = [line for line in log.splitlines() if "tracing on:" in line]
    assert "service decode-pod-7" in line
    assert "TraceIdRatioBased{1.0}" in line
    assert f"OTLP http/protobuf to {otlp.url}/v1/traces" in line


EXIT_2 = [
    (
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
        "needs opentelemetry-exporter-otlp-proto-grpc, which is not installed",
    ),
    (
        {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json is not supported",
    ),
]


@pytest.mark.parametrize(("variables", "says"), EXIT_2, ids=["grpc-missing", "http-json"])
def test_an_exporter_that_cannot_be_built_exits_2(
    variables: dict[str, str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if "grpc" in variables.values() and importlib.util.find_spec(
        "opentelemetry.exporter.otlp.proto.grpc"
    ):
        pytest.skip("the gRPC exporter is installed here")
    for name, value in variables.items():  # what the SDK reads, as test_config does for ours
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        load_tracing(Settings(tracing=True))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert error.startswith("pd-sidecar: SIDECAR_TRACING=true")
    assert says in error
    assert load_tracing(Settings(tracing=False)) is NO_TRACING


# The sidecar with every ``opentelemetry`` import failing, as without the extra: ``main`` (argv
# "main"), or an app built and a request served with tracing off (argv "app").
WITHOUT_THE_EXTRA = """
import asyncio, sys
class NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, NoOpenTelemetry())
from sidecar.__main__ import main
if sys.argv[1] == "main":
    sys.argv[1:] = []
    main()
from aiohttp.test_utils import TestClient, TestServer
from sidecar.app import create_app
from sidecar.config import Settings
async def serve():
    async with TestClient(TestServer(create_app(Settings()))) as client:
        response = await client.post("/v1/completions", data=b"not json")
        assert response.status == 400, response.status
asyncio.run(serve())
print("served without opentelemetry")
"""


@pytest.mark.system
@pytest.mark.parametrize("tracing", ["true", "false"])
def test_without_the_extra(tracing: str) -> None:
    """SIDECAR_TRACING=true without the SDK: exit status 2 and one line naming the extra. Off,
    nothing imports it: an app is built and serves a request with every such import failing."""
    mode = "main" if tracing == "true" else "app"
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_EXTRA, mode],
        env=_clean_env(SIDECAR_TRACING=tracing),
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    if tracing == "false":
        assert result.returncode == 0, result.stderr
        assert result.stdout == "served without opentelemetry\n"
        return
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "pd-sidecar: SIDECAR_TRACING=true needs the OpenTelemetry SDK, which is not installed: "
        "the image has it; from a checkout of the source: pip install '.[tracing]'\n"
    )


@pytest.mark.parametrize(
    ("protocol", "environ", "expected"),
    [
        ("http/protobuf", {}, "http://localhost:4318/v1/traces"),
        ("grpc", {}, "http://localhost:4317"),
        (
            "http/protobuf",
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
            "http://c:4318/v1/traces",
        ),
        (
            "http/protobuf",
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"},
            "http://c:4318/v1/traces",
        ),
        ("grpc", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "http://c:4317"),
        (
            "http/protobuf",
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x",
            },
            "http://t/x",
        ),
    ],
)
def test_the_start_line_names_the_exporters_endpoint_by_the_specification(
    monkeypatch: pytest.MonkeyPatch, protocol: str, environ: dict[str, str], expected: str
) -> None:
    """Read from the OTEL_* variables as the exporter does, not from its private attribute."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert otlp_endpoint(protocol) == expected
