"""Lifecycle records at /debug/requests, /metrics content, /health and /ready."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

import sidecar as sidecar_package
from sidecar.observability import metrics
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    chat,
    completion,
    eventually,
    get_json,
    inject,
)

RECORD_KEYS = {
    "id",
    "engine_id",
    "path",
    "decision",
    "reason",
    "fallback_reason",
    "prefill_endpoint",
    "prefill_attempts",
    "decode_rank",
    "decode_url",
    "prefill_predicted_ms",
    "prefill_predicted_cached_tokens",
    "cached_source",
    "tokenize_ms",
    "prefill_observed_ms",
    "state",
    "status",
    "error",
    "started_at",
    "phases",
    "durations_ms",
}


async def test_remote_record(http, sidecar, prefill, decode) -> None:
    before = time.time()
    async with http.post(
        sidecar.url + "/v1/chat/completions",
        json=chat(stream=True),
        headers={"x-prefiller-host-port": prefill.endpoint, "x-request-id": "rec-1"},
    ) as response:
        await response.read()
    record = await get_json(http, sidecar.url + "/debug/requests/rec-1")
    assert set(record) == RECORD_KEYS
    assert record["path"] == "/v1/chat/completions"
    assert (record["decision"], record["reason"]) == ("remote", "header")
    assert record["prefill_endpoint"] == prefill.endpoint
    # One decode URL: a single rank, index 0.
    assert (record["decode_rank"], record["decode_url"]) == (0, decode.url)
    assert (record["state"], record["status"], record["error"]) == ("completed", 200, None)
    assert record["fallback_reason"] is None
    assert before <= record["started_at"] <= time.time()
    phases = record["phases"]
    order = ["prefill_sent", "prefill_done", "decode_sent", "first_byte", "done"]
    assert list(sorted(phases, key=phases.get)) == order
    durations = record["durations_ms"]
    assert set(durations) == {"prefill", "ttft", "decode", "total"}
    assert durations["prefill"] == pytest.approx(
        (phases["prefill_done"] - phases["prefill_sent"]) * 1000, abs=0.01
    )
    assert durations["total"] == pytest.approx(phases["done"] * 1000, abs=0.01)


async def test_local_record_has_no_prefill_durations(http, sidecar) -> None:
    async with http.post(
        sidecar.url + "/v1/completions", json=completion(), headers={"x-request-id": "loc"}
    ) as response:
        await response.read()
    record = await get_json(http, sidecar.url + "/debug/requests/loc")
    assert (record["decision"], record["reason"]) == ("local", "pool_empty")
    assert record["durations_ms"]["prefill"] is None
    assert record["durations_ms"]["ttft"] is not None
    assert "prefill_sent" not in record["phases"]


async def test_rejected_record(http, sidecar) -> None:
    async with http.post(
        sidecar.url + "/v1/completions", data=b"nope", headers={"x-request-id": "bad"}
    ) as response:
        assert response.status == 400
    record = await get_json(http, sidecar.url + "/debug/requests/bad")
    assert (record["state"], record["status"], record["decision"]) == ("failed", 400, None)
    assert "JSON" in record["error"]


async def test_history_is_bounded_newest_first(http, start_sidecar_with: StartSidecar) -> None:
    sidecar = await start_sidecar_with(debug_history=3)
    for index in range(5):
        async with http.post(
            sidecar.url + "/v1/completions",
            json=completion(),
            headers={"x-request-id": f"h{index}"},
        ) as response:
            await response.read()
    recent = (await get_json(http, sidecar.url + "/debug/requests"))["recent"]
    assert [r["id"] for r in recent] == ["h4", "h3", "h2"]
    async with http.get(sidecar.url + "/debug/requests/h0") as response:
        assert response.status == 404
        assert (await response.json())["error"]["type"] == "NotFoundError"


async def test_filters(http, sidecar, decode) -> None:
    for index in range(3):
        async with http.post(
            sidecar.url + "/v1/completions",
            json=completion(),
            headers={"x-request-id": f"ok{index}"},
        ) as response:
            await response.read()
    async with http.post(sidecar.url + "/v1/completions", data=b"[]") as response:
        await response.read()
    failed = await get_json(http, sidecar.url + "/debug/requests?state=failed")
    assert [r["state"] for r in failed["recent"]] == ["failed"]
    limited = await get_json(http, sidecar.url + "/debug/requests?state=completed&limit=2")
    assert [r["id"] for r in limited["recent"]] == ["ok2", "ok1"]
    assert len((await get_json(http, sidecar.url + "/debug/requests?limit=999999"))["recent"]) == 4
    refused = ["state=done", "limit=0", "limit=-1", "limit=ten", "limit="]
    refused += ["foo=1", "State=failed", "limit=1&limit=2", "state=failed&limt=2"]
    for query in refused:
        async with http.get(sidecar.url + "/debug/requests?" + query) as response:
            assert response.status == 400, query
            assert (await response.json())["error"]["code"] == 400


async def test_inflight_record(http, sidecar, decode) -> None:
    await inject(http, decode, kind="hang", role="plain")

    async def send() -> int:
        async with http.post(
            sidecar.url + "/v1/completions", json=completion(), headers={"x-request-id": "hung"}
        ) as response:
            await response.read()
            return response.status

    pending = asyncio.create_task(send())
    await eventually(lambda: _inflight_ids(http, sidecar.url, {"hung"}))
    record = await get_json(http, sidecar.url + "/debug/requests/hung")
    assert record["state"] == "decoding"
    assert record["durations_ms"]["total"] is None
    decoding = await get_json(http, sidecar.url + "/debug/requests?state=decoding")
    assert [r["id"] for r in decoding["inflight"]] == ["hung"]
    assert (await get_json(http, sidecar.url + "/debug/requests?state=completed"))["inflight"] == []
    async with http.post(decode.url + "/emulator/release") as released:
        assert released.status in (200, 204)
    assert await pending == 200
    await eventually(lambda: _inflight_ids(http, sidecar.url, set()))


async def _inflight_ids(http, url: str, expected: set[str]) -> bool:
    inflight = (await get_json(http, url + "/debug/requests"))["inflight"]
    return {r["id"] for r in inflight} == expected


async def test_unknown_debug_path_is_404(http, sidecar) -> None:
    async with http.get(sidecar.url + "/debug/nothing") as response:
        assert response.status == 404


async def test_metrics(http, sidecar, prefill, start_engine: StartEmulator) -> None:
    headers = {"x-prefiller-host-port": prefill.endpoint}
    async with http.post(
        sidecar.url + "/v1/chat/completions", json=chat(), headers=headers
    ) as response:
        await response.read()
    async with http.post(sidecar.url + "/v1/completions", json=completion()) as response:
        await response.read()
    async with http.post(sidecar.url + "/v1/completions", data=b"x") as response:
        await response.read()
    await inject(http, prefill, kind="status", status=500, role="prefill")
    async with http.post(
        sidecar.url + "/v1/completions", json=completion(), headers=headers
    ) as response:
        await response.read()
    async with http.get(sidecar.url + "/v1/models") as response:
        await response.read()

    async with http.get(sidecar.url + "/metrics") as response:
        assert response.headers["content-type"].startswith("text/plain")
        text = await response.text()
    phases = "pd_sidecar_phase_duration_seconds_count"
    expected = [
        'pd_sidecar_requests_total{decision="remote",outcome="success",route="chat_completions"}'
        " 1.0",
        'pd_sidecar_requests_total{decision="local",outcome="success",route="completions"} 2.0',
        'pd_sidecar_requests_total{decision="none",outcome="client_error",route="completions"} 1.0',
        'pd_sidecar_requests_total{decision="none",outcome="success",route="other"} 1.0',
        'pd_sidecar_prefill_requests_total{outcome="success"} 1.0',
        'pd_sidecar_prefill_requests_total{outcome="server_error"} 1.0',
        'pd_sidecar_fallbacks_total{reason="prefill_error"} 1.0',
        f'{phases}{{decision="remote",phase="prefill",route="chat_completions"}} 1.0',
        f'{phases}{{decision="local",phase="prefill",route="completions"}} 1.0',
        f'{phases}{{decision="remote",phase="total",route="chat_completions"}} 1.0',
        f'{phases}{{decision="local",phase="total",route="completions"}} 2.0',
        f'{phases}{{decision="none",phase="total",route="completions"}} 1.0',
        f'{phases}{{decision="remote",phase="ttft",route="chat_completions"}} 1.0',
        f'{phases}{{decision="local",phase="ttft",route="completions"}} 2.0',
        "pd_sidecar_inflight_requests 0.0",
    ]
    for line in expected:
        assert line in text, line


async def test_health_and_ready_follow_the_decode_engine(
    http, start_sidecar_with: StartSidecar, decode
) -> None:
    sidecar = await start_sidecar_with()
    async with http.get(sidecar.url + "/health") as response:
        assert response.status == 200
    await eventually(lambda: _status(http, sidecar.url + "/ready", 200))
    await inject(http, decode, kind="health_down")
    await eventually(lambda: _status(http, sidecar.url + "/ready", 503))
    async with http.get(sidecar.url + "/ready") as response:
        assert (await response.json())["error"]["type"] == "ServiceUnavailableError"
    async with http.delete(decode.url + "/emulator/faults") as response:
        assert response.status in (200, 204)
    await eventually(lambda: _status(http, sidecar.url + "/ready", 200))
    async with http.get(sidecar.url + "/health") as response:
        assert response.status == 200


async def test_not_ready_before_first_success(http, start_sidecar_with: StartSidecar) -> None:
    sidecar = await start_sidecar_with(decode_url="http://127.0.0.1:9", ready_interval_s=60)
    async with http.get(sidecar.url + "/ready") as response:
        assert response.status == 503
    async with http.get(sidecar.url + "/health") as response:
        assert response.status == 200


async def _status(http, url: str, status: int) -> bool:
    async with http.get(url) as response:
        return response.status == status


async def test_every_label_vocabulary_is_exported_at_zero_from_the_start(http, sidecar) -> None:
    """Before any request, each series of a fixed vocabulary is already there at 0: an alert's
    rate() or increase() then counts the first fallback, release failure or error too."""
    async with http.get(sidecar.url + "/metrics") as response:
        text = await response.text()
    expected = [
        f'pd_sidecar_requests_total{{decision="{decision}",outcome="{outcome}",route="{route}"}}'
        for route in metrics.GENERATION_ROUTES
        for decision in metrics.DECISIONS
        for outcome in metrics.REQUEST_OUTCOMES
    ]
    for family, label, values in (
        ("prefill_requests_total", "outcome", metrics.PREFILL_OUTCOMES),
        ("fallbacks_total", "reason", metrics.FALLBACK_REASONS),
        ("kv_releases_total", "outcome", metrics.KV_RELEASE_OUTCOMES),
        ("prefill_disconnects_total", "action", metrics.DISCONNECT_ACTIONS),
        ("state_backend_errors_total", "kind", metrics.STATE_ERROR_KINDS),
        ("inference_pool_errors_total", "kind", metrics.INFERENCE_POOL_ERROR_KINDS),
    ):
        expected += [f'pd_sidecar_{family}{{{label}="{value}"}}' for value in values]
    expected += ['pd_sidecar_decode_rank_requests_total{rank="0"}']
    expected += ['pd_sidecar_decode_rank_inflight_requests{rank="0"}']
    expected += [
        f'pd_sidecar_tls_reloads_total{{files="{files}",outcome="{outcome}"}}'
        for files in metrics.TLS_FILES
        for outcome in metrics.TLS_RELOAD_OUTCOMES
    ]
    for series in expected:
        assert f"{series} 0.0\n" in text, series


_LITERAL_LABELS = {
    "fallbacks": metrics.FALLBACK_REASONS,
    "kv_releases": metrics.KV_RELEASE_OUTCOMES,
    "prefill_requests": metrics.PREFILL_OUTCOMES,
    "prefill_disconnects": metrics.DISCONNECT_ACTIONS,
}


def test_the_kubernetes_error_kinds_are_the_metric_vocabulary() -> None:
    from sidecar.security import kube

    kinds = {cls.kind for cls in (kube.KubeUnreachable, kube.KubeRefused, kube.KubeGone,
                                  kube.KubeBadResponse)}  # fmt: skip
    assert kinds == set(metrics.INFERENCE_POOL_ERROR_KINDS)


def test_the_code_uses_only_the_vocabularies() -> None:
    """Every label value the sidecar's code writes as a literal is in its vocabulary (else a new
    value would appear only at its first increment, and the docs would not list it)."""
    source = "\n".join(p.read_text() for p in Path(sidecar_package.__file__).parent.rglob("*.py"))
    seen = 0
    for family, values in _LITERAL_LABELS.items():
        for value in re.findall(rf"\.{family}(?:\.labels|_by)\(\"(\w+)\"\)", source):
            assert value in values, (family, value)
            seen += 1
    for reason, outcome in re.findall(r"\bFailed\(\s*\"(\w+)\",\s*\"(\w+)\"", source):
        assert reason in metrics.FALLBACK_REASONS, reason
        assert outcome in metrics.PREFILL_OUTCOMES, outcome
        seen += 1
    for kind in re.findall(r"_record_error\(\"(\w+)\"", source):
        assert kind in metrics.STATE_ERROR_KINDS, kind
        seen += 1
    assert seen >= 15, "the patterns above no longer find the code's label values"
