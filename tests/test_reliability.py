"""Failure policy, timeouts, KV release, SSRF allowlist, admin port, bad input."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson
import pytest

from tests.conftest import (
    StartEmulator,
    StartSidecar,
    completion,
    engine_requests,
    eventually,
    get_json,
    inject,
    sse_events,
    staged_blocks,
)

LONG = "Retrieved context for a retrieval-augmented answer. " * 45  # ~600 tokens


async def _last_record(http, sidecar) -> dict:
    return (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]


async def _status_via(http, sidecar, target: str) -> int:
    """Status of a completion whose gateway header names ``target`` as prefill server."""
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion(),
        headers={"x-prefiller-host-port": target},
    ) as response:
        await response.read()
        return response.status


async def _metrics(http, url: str) -> str:
    async with http.get(url + "/metrics") as response:
        return await response.text()


# --- failure policy -------------------------------------------------------------------------


async def test_transient_failure_retries_on_another_endpoint(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    pool = sorted([await start_engine(), await start_engine()], key=lambda e: e.endpoint)
    sidecar = await start_sidecar_with(
        prefill_endpoints=",".join(p.endpoint for p in pool), scheduler_policy="round_robin"
    )
    # Round robin starts with the first endpoint by name: it fails once with a 503.
    await inject(http, pool[0], kind="status", status=503, role="prefill")
    async with http.post(sidecar.url + "/v1/completions", json=completion(LONG)) as response:
        assert response.status == 200
    record = await _last_record(http, sidecar)
    assert (record["decision"], record["prefill_attempts"]) == ("remote", 2)
    assert record["prefill_endpoint"] == pool[1].endpoint
    assert [len(await engine_requests(http, p)) for p in pool] == [1, 1]
    assert [await staged_blocks(http, p) for p in pool] == [0, 0]
    assert "pd_sidecar_prefill_retries_total 1.0" in await _metrics(http, sidecar.url)


async def test_4xx_is_never_retried(http, sidecar, prefill) -> None:
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion(model="unknown-model"),
        headers={"x-prefiller-host-port": prefill.endpoint},
    ) as response:
        assert response.status == 404
    assert len(await engine_requests(http, prefill)) == 1
    assert (await _last_record(http, sidecar))["prefill_attempts"] == 1


async def test_fallback_fail_answers_503(
    http, start_sidecar_with: StartSidecar, prefill, decode
) -> None:
    sidecar = await start_sidecar_with(prefill_fallback="fail")
    await inject(http, prefill, kind="status", status=500, role="prefill")
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion(),
        headers={"x-prefiller-host-port": prefill.endpoint, "x-request-id": "ff"},
    ) as response:
        assert response.status == 503
        error = (await response.json())["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert "prefill answered 500" in error["message"]
    assert await engine_requests(http, decode) == []
    record = await _last_record(http, sidecar)
    assert (record["state"], record["fallback_reason"]) == ("failed", "prefill_error")


# --- timeouts --------------------------------------------------------------------------------


async def test_prefill_timeout_is_transient(
    http, start_sidecar_with: StartSidecar, prefill, decode
) -> None:
    sidecar = await start_sidecar_with(prefill_timeout_s=0.3)
    await inject(http, prefill, kind="hang", role="prefill")  # the retry gets an answer
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion(),
        headers={"x-prefiller-host-port": prefill.endpoint},
    ) as response:
        assert response.status == 200
    record = await _last_record(http, sidecar)
    assert (record["decision"], record["prefill_attempts"]) == ("remote", 2)
    await inject(http, prefill, kind="hang", role="prefill", count=2)
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion("another"),
        headers={"x-prefiller-host-port": prefill.endpoint},
    ) as response:
        assert response.status == 200
    record = await _last_record(http, sidecar)
    assert (record["decision"], record["fallback_reason"]) == ("local", "prefill_timeout")
    assert 'pd_sidecar_prefill_requests_total{outcome="timeout"} 3.0' in await _metrics(
        http, sidecar.url
    )


async def test_decode_first_byte_timeout_is_504_and_frees_the_kv(
    http, start_sidecar_with: StartSidecar, prefill, decode
) -> None:
    sidecar = await start_sidecar_with(decode_first_byte_timeout_s=0.3)
    await inject(http, decode, kind="hang", role="decode")
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion(),
        headers={"x-prefiller-host-port": prefill.endpoint},
    ) as response:
        assert response.status == 504
        assert (await response.json())["error"]["type"] == "GatewayTimeoutError"
    # The hung decode never pulled: the sidecar released the staged blocks itself.
    await eventually(lambda: _staged_is(http, prefill, 0))


async def _staged_is(http, engine, count: int) -> bool:
    return await staged_blocks(http, engine) == count


async def test_stream_idle_timeout_ends_the_stream(
    http, start_sidecar_with: StartSidecar, decode
) -> None:
    sidecar = await start_sidecar_with(stream_idle_timeout_s=0.3)
    await inject(http, decode, kind="stall", role="plain", after_chunks=2)
    async with http.post(
        sidecar.url + "/v1/completions", json=completion(stream=True, max_tokens=10)
    ) as response:
        assert response.status == 200
        events = sse_events(await response.read())
    assert b"[DONE]" not in events
    record = await _last_record(http, sidecar)
    assert record["state"] == "failed"
    assert orjson.loads(events[-1])["error"]["message"] == (
        f"the engine sent nothing within the stream's idle timeout (request id {record['id']})"
    )
    assert record["error"] == f"{decode.endpoint} broke the stream: no data within the idle timeout"
    async with http.post(decode.url + "/emulator/release") as response:
        assert response.status in (200, 204)


async def test_stream_idle_timeout_cuts_only_the_silent_stream(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    # Streams share their idle timer (sidecar.engines.upstream.IdleQueue): one that stalls is
    # cut on time while another, flowing for many timeouts beside it, is not.
    slow = await start_engine(decode_s_per_token=0.05)
    sidecar = await start_sidecar_with(decode_url=slow.url, stream_idle_timeout_s=0.3)
    await inject(http, slow, kind="stall", role="plain", after_chunks=2)

    async def stream(max_tokens: int) -> tuple[int, list[bytes]]:
        body = completion(stream=True, max_tokens=max_tokens)
        async with http.post(sidecar.url + "/v1/completions", json=body) as response:
            return response.status, sse_events(await response.read())

    stalled = asyncio.create_task(stream(10))
    await eventually(lambda: _inflight_is(http, sidecar, 1))
    flowing = await stream(40)  # 2 s of tokens: more than six idle timeouts
    status, events = await stalled
    assert status == 200
    assert b"[DONE]" not in events
    assert "idle timeout" in orjson.loads(events[-1])["error"]["message"]
    assert flowing[0] == 200
    assert flowing[1][-1] == b"[DONE]"
    async with http.post(slow.url + "/emulator/release") as response:
        assert response.status in (200, 204)


async def _inflight_is(http, sidecar, count: int) -> bool:
    async with http.get(sidecar.url + "/debug/requests") as response:
        return len((await response.json())["inflight"]) == count


async def test_request_timeout_cuts_a_long_stream(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    slow = await start_engine(decode_s_per_token=0.1)
    sidecar = await start_sidecar_with(decode_url=slow.url, request_timeout_s=0.5)
    async with http.post(
        sidecar.url + "/v1/completions", json=completion(stream=True, max_tokens=50)
    ) as response:
        assert response.status == 200
        events = sse_events(await response.read())
    error = orjson.loads(events[-1])["error"]
    assert (error["type"], error["code"]) == ("GatewayTimeoutError", 504)
    assert 2 <= len(events) < 20


async def test_slow_client_body_is_408(http, start_sidecar_with: StartSidecar, decode) -> None:
    sidecar = await start_sidecar_with(client_body_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    await writer.wait_closed()
    assert b" 408 " in status_line
    assert await engine_requests(http, decode) == []


# --- KV release on disconnect -----------------------------------------------------------------


@pytest.mark.parametrize("release", [True, False])
async def test_client_gone_before_decode_answers(
    http, start_sidecar_with: StartSidecar, prefill, decode, release: bool
) -> None:
    sidecar = await start_sidecar_with(release_on_disconnect=release)
    await inject(http, decode, kind="hang", role="decode")

    async def leave_early() -> None:
        async with (
            aiohttp.ClientSession() as own,
            own.post(
                sidecar.url + "/v1/completions",
                json=completion(),
                headers={"x-prefiller-host-port": prefill.endpoint},
            ) as response,
        ):
            await response.read()

    client = asyncio.create_task(leave_early())

    async def decoding() -> bool:
        inflight = (await get_json(http, sidecar.url + "/debug/requests"))["inflight"]
        return [r["state"] for r in inflight] == ["decoding"]

    await eventually(decoding)
    assert await staged_blocks(http, prefill) > 0
    client.cancel()
    with pytest.raises(asyncio.CancelledError):
        await client
    await eventually(lambda: _recent_cancelled(http, sidecar))
    if release:
        await eventually(lambda: _staged_is(http, prefill, 0))
        assert 'pd_sidecar_kv_releases_total{outcome="sent"} 1.0' in await _metrics(
            http, sidecar.url
        )
    else:  # left to the engine's own expiry
        assert await staged_blocks(http, prefill) > 0


async def _recent_cancelled(http, sidecar) -> bool:
    debug = await get_json(http, sidecar.url + "/debug/requests")
    return not debug["inflight"] and debug["recent"][0]["state"] == "cancelled"


# --- SSRF allowlist ---------------------------------------------------------------------------


async def test_header_target_outside_pool_is_403(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator, decode
) -> None:
    member, stranger = await start_engine(), await start_engine()
    sidecar = await start_sidecar_with(prefill_endpoints=member.endpoint)
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion(),
        headers={"x-prefiller-host-port": stranger.endpoint},
    ) as response:
        assert response.status == 403
        error = (await response.json())["error"]
    assert error["type"] == "PermissionDeniedError"
    assert stranger.endpoint in error["message"]
    assert await engine_requests(http, stranger) == []
    assert await engine_requests(http, decode) == []
    assert await _status_via(http, sidecar, member.endpoint) == 200


async def test_pool_member_matched_by_resolved_ip(
    http, start_sidecar_with: StartSidecar, prefill
) -> None:
    sidecar = await start_sidecar_with(prefill_endpoints=f"localhost:{prefill.port}")
    assert await _status_via(http, sidecar, f"127.0.0.1:{prefill.port}") == 200


@pytest.mark.parametrize(
    ("allow", "target", "status"),
    [
        ({"prefill_allowed_cidrs": "127.0.0.0/8"}, "127.0.0.1:{port}", 200),
        ({"prefill_allowed_cidrs": "10.0.0.0/8"}, "127.0.0.1:{port}", 403),
        ({"prefill_allowed_hosts": "localhost"}, "localhost:{port}", 200),
        ({"prefill_allowed_hosts": "prefill.internal"}, "localhost:{port}", 403),
        # A name is checked through every address it resolves to, then pinned to one.
        ({"prefill_allowed_cidrs": "127.0.0.0/8,::1/128"}, "localhost:{port}", 200),
        ({"prefill_allowed_cidrs": "10.0.0.0/8"}, "localhost:{port}", 403),
    ],
)
async def test_allowlists(
    http, start_sidecar_with: StartSidecar, prefill, allow, target: str, status: int
) -> None:
    sidecar = await start_sidecar_with(**allow)
    assert await _status_via(http, sidecar, target.format(port=prefill.port)) == status
    if status == 403:
        assert await engine_requests(http, prefill) == []


async def test_gateway_mode_accepts_any_target_and_warns(
    http, start_sidecar_with: StartSidecar, prefill, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sidecar.security.trust"):
        sidecar = await start_sidecar_with()
    assert sum("any prefill target" in r.message for r in caplog.records) == 1
    assert await _status_via(http, sidecar, prefill.endpoint) == 200


# --- admin port, secrets ----------------------------------------------------------------------


async def test_admin_port_separates_metrics_and_debug(
    http, start_sidecar_with: StartSidecar
) -> None:
    sidecar = await start_sidecar_with(admin_port=0)
    assert sidecar.admin_url != sidecar.url
    for path in ("/metrics", "/debug/requests", "/debug/scheduler"):
        async with http.get(sidecar.url + path) as response:
            assert response.status == 404, path
        async with http.get(sidecar.admin_url + path) as response:
            assert response.status == 200, path
    for base in (sidecar.url, sidecar.admin_url):
        async with http.get(base + "/health") as response:
            assert response.status == 200


async def test_authorization_is_forwarded_never_shown_or_logged(
    http,
    start_sidecar_with: StartSidecar,
    prefill,
    decode,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "Bearer sk-very-secret-token"
    with caplog.at_level(logging.DEBUG):
        sidecar = await start_sidecar_with(log_requests=True, log_level="DEBUG")
        await inject(http, prefill, kind="status", status=500, role="prefill")
        async with http.post(
            sidecar.url + "/v1/completions",
            json=completion(),
            headers={"authorization": secret, "x-prefiller-host-port": prefill.endpoint},
        ) as response:
            assert response.status == 200
    legs = await engine_requests(http, prefill) + await engine_requests(http, decode)
    assert {leg["headers"]["authorization"] for leg in legs} == {secret}
    async with http.get(sidecar.url + "/debug/requests") as response:
        assert "sk-very-secret" not in await response.text()
    assert "sk-very-secret" not in caplog.text


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"messages": "hello"},
        {"prompt": 42},
        {"prompt": "x", "stream": "yes"},
        {"prompt": "x", "stream_options": []},
        {"prompt": "x", "n": "2"},
        {"prompt": "x", "n": True},
        {"prompt": "x", "max_tokens": 1.5},
        {"prompt": "x", "max_completion_tokens": "10"},
        {"prompt": "x", "kv_transfer_params": "pull from evil"},
    ],
)
async def test_wrong_field_types_are_400(http, sidecar, decode, body) -> None:
    async with http.post(sidecar.url + "/v1/completions", json=body) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["type"] == "BadRequestError"
    assert error["message"].startswith("'")
    assert await engine_requests(http, decode) == []


async def test_oversized_header_is_400_and_the_sidecar_keeps_serving(http, sidecar, decode) -> None:
    async with http.post(
        sidecar.url + "/v1/completions", json=completion(), headers={"x-big": "a" * 10000}
    ) as response:
        assert response.status == 400
    assert await engine_requests(http, decode) == []
    async with http.post(sidecar.url + "/v1/completions", json=completion()) as response:
        assert response.status == 200
