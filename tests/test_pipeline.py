"""The P/D pipeline end to end: the exact legs each engine receives, and the failure policy."""

from __future__ import annotations

import io
import re
import socket
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy

from sidecar.connectors.nixl import PREFILL_REQUEST_PARAMS
from sidecar.emulator import RunningEmulator
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    chat,
    completion,
    engine_requests,
    eventually,
    get_json,
    inject,
    sse_events,
    staged_blocks,
)


def _pd_headers(prefill: RunningEmulator) -> dict[str, str]:
    return {"x-prefiller-host-port": prefill.endpoint}


async def _post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, CIMultiDictProxy[str]]:
    async with http.post(url, data=io.BytesIO(orjson.dumps(body)), headers=headers) as response:
        raw = await response.read()
        return response.status, raw, response.headers


async def test_chat_prefill_leg_is_exact(http, sidecar, prefill, decode) -> None:
    body = chat(
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=7,
        min_tokens=3,
        min_completion_tokens=2,
        n=2,
        temperature=0.0,
        kv_transfer_params={"remote_host": "evil.example", "do_remote_prefill": True},
    )
    status, _, _ = await _post(
        http, sidecar.url + "/v1/chat/completions", body, _pd_headers(prefill)
    )
    assert status == 200

    [leg] = await engine_requests(http, prefill)
    assert leg["path"] == "/v1/chat/completions"
    assert leg["body"] == {
        "model": "emulated-model",
        "messages": body["messages"],
        "temperature": 0.0,
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "n": 1,
        "kv_transfer_params": PREFILL_REQUEST_PARAMS,
    }
    assert PREFILL_REQUEST_PARAMS == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"max_tokens": 1}),
        ({"max_tokens": 50}, {"max_tokens": 1}),
        ({"max_completion_tokens": 9}, {"max_tokens": 1, "max_completion_tokens": 1}),
    ],
)
async def test_completions_prefill_caps_tokens(
    http, sidecar, prefill, fields: dict[str, Any], expected: dict[str, Any]
) -> None:
    status, _, _ = await _post(
        http, sidecar.url + "/v1/completions", completion(**fields), _pd_headers(prefill)
    )
    assert status == 200
    [leg] = await engine_requests(http, prefill)
    assert {k: v for k, v in leg["body"].items() if k.startswith("max_")} == expected
    assert leg["body"]["stream"] is False
    assert "n" not in leg["body"]


async def test_decode_leg_is_client_body_plus_prefill_params(
    http, sidecar, prefill, decode
) -> None:
    body = completion(max_tokens=5, stream=False, kv_transfer_params={"remote_host": "x"})
    status, raw, _ = await _post(http, sidecar.url + "/v1/completions", body, _pd_headers(prefill))
    assert status == 200

    [prefill_leg] = await engine_requests(http, prefill)
    [decode_leg] = await engine_requests(http, decode)
    del body["kv_transfer_params"]
    params = decode_leg["body"].pop("kv_transfer_params")
    assert decode_leg["body"] == body
    assert params["do_remote_prefill"] is True
    assert (
        params["remote_engine_id"]
        == (await get_json(http, prefill.url + "/emulator/kv"))["engine_id"]
    )
    assert params["remote_port"] == prefill.side_channel_port
    assert decode_leg["path"] == prefill_leg["path"] == "/v1/completions"
    # The KV was pulled: nothing stays staged on the prefill engine.
    assert await staged_blocks(http, prefill) == 0
    assert orjson.loads(raw)["choices"][0]["text"]


async def test_pd_answer_equals_local_answer(http, sidecar, prefill) -> None:
    body = completion(max_tokens=12)
    _, remote, _ = await _post(http, sidecar.url + "/v1/completions", body, _pd_headers(prefill))
    _, local, _ = await _post(http, sidecar.url + "/v1/completions", body)
    assert orjson.loads(remote)["choices"][0]["text"] == orjson.loads(local)["choices"][0]["text"]


async def test_same_request_id_on_both_legs_and_answer(http, sidecar, prefill, decode) -> None:
    headers = {**_pd_headers(prefill), "x-request-id": "req-42"}
    status, _, response_headers = await _post(
        http, sidecar.url + "/v1/chat/completions", chat(), headers
    )
    assert status == 200
    assert response_headers["x-request-id"] == "req-42"
    [prefill_leg] = await engine_requests(http, prefill)
    [decode_leg] = await engine_requests(http, decode)
    # Both legs carry the request's engine id: the client's and a suffix of its own.
    record = await get_json(http, sidecar.url + "/debug/requests/req-42")
    assert re.fullmatch(r"req-42-[0-9a-f]{16}", record["engine_id"])
    assert (
        prefill_leg["headers"]["x-request-id"]
        == decode_leg["headers"]["x-request-id"]
        == record["engine_id"]
    )


async def test_prefill_headers_never_reach_engines(http, sidecar, prefill, decode) -> None:
    headers = {
        "x-prefiller-host-port": prefill.endpoint,
        "x-gateway-prefill-endpoints": "127.0.0.9:1",
        "x-prefiller-url": "http://127.0.0.9:2",
        "authorization": "Bearer secret",
    }
    status, _, _ = await _post(http, sidecar.url + "/v1/completions", completion(), headers)
    assert status == 200
    for leg in await engine_requests(http, prefill) + await engine_requests(http, decode):
        assert not {"x-prefiller-host-port", "x-gateway-prefill-endpoints", "x-prefiller-url"} & (
            leg["headers"].keys()
        )
        assert leg["headers"]["authorization"] == "Bearer secret"


async def test_local_decode_without_header_or_pool(http, sidecar, decode) -> None:
    raw_body = b'{"model": "emulated-model",   "prompt": "spaces kept", "max_tokens": 3}'
    async with http.post(sidecar.url + "/v1/completions", data=raw_body) as response:
        assert response.status == 200
        await response.read()
    [leg] = await engine_requests(http, decode)
    assert "kv_transfer_params" not in leg["body"]
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert record["decision"] == "local"
    assert record["prefill_endpoint"] is None


async def test_client_kv_params_removed_on_local_decode(http, sidecar, decode) -> None:
    body = completion(kv_transfer_params={"do_remote_prefill": True, "remote_host": "127.0.0.9"})
    status, _, _ = await _post(http, sidecar.url + "/v1/completions", body)
    assert status == 200
    [leg] = await engine_requests(http, decode)
    assert "kv_transfer_params" not in leg["body"]


async def test_static_pool_round_robin(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    pool = [await start_engine(), await start_engine()]
    sidecar = await start_sidecar_with(
        prefill_endpoints=",".join(p.endpoint for p in pool),
        scheduler_policy="round_robin",
        disagg_min_tokens=0,
        disagg_ttft_ratio=1000,
    )
    for _ in range(4):
        status, _, _ = await _post(http, sidecar.url + "/v1/completions", completion())
        assert status == 200
    assert [len(await engine_requests(http, p)) for p in pool] == [2, 2]
    records = (await get_json(http, sidecar.url + "/debug/requests"))["recent"]
    assert {r["reason"] for r in records} == {"scheduled"}
    # In turn: any two consecutive requests went to the two members.
    assert {r["prefill_endpoint"] for r in records[:2]} == {p.endpoint for p in pool}


async def test_header_beats_pool(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    pooled, named = await start_engine(), await start_engine()
    sidecar = await start_sidecar_with(
        prefill_endpoints=pooled.endpoint, prefill_allowed_cidrs="127.0.0.0/8"
    )
    status, _, _ = await _post(
        http, sidecar.url + "/v1/completions", completion(), _pd_headers(named)
    )
    assert status == 200
    assert len(await engine_requests(http, named)) == 1
    assert await engine_requests(http, pooled) == []


async def test_rewrite_remote_host(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator, decode
) -> None:
    # The prefill advertises "localhost"; with the option on, the decode is told its real host.
    advertising = await start_engine(side_channel_host="localhost")
    sidecar = await start_sidecar_with(rewrite_remote_host=True)
    status, _, _ = await _post(
        http, sidecar.url + "/v1/completions", completion(), _pd_headers(advertising)
    )
    assert status == 200
    [leg] = await engine_requests(http, decode)
    assert leg["body"]["kv_transfer_params"]["remote_host"] == "127.0.0.1"


async def test_remote_host_verbatim_by_default(
    http, sidecar, start_engine: StartEmulator, decode
) -> None:
    advertising = await start_engine(side_channel_host="localhost")
    status, _, _ = await _post(
        http, sidecar.url + "/v1/completions", completion(), _pd_headers(advertising)
    )
    assert status == 200
    [leg] = await engine_requests(http, decode)
    assert leg["body"]["kv_transfer_params"]["remote_host"] == "localhost"


async def test_prefill_4xx_is_returned_as_is(http, sidecar, prefill, decode) -> None:
    body = completion(model="no-such-model")
    status, raw, headers = await _post(
        http, sidecar.url + "/v1/completions", body, _pd_headers(prefill)
    )
    assert status == 404
    error = orjson.loads(raw)["error"]
    assert error["type"] == "NotFoundError"
    assert "no-such-model" in error["message"]
    assert headers["x-request-id"]
    assert await engine_requests(http, decode) == []
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert (record["state"], record["status"]) == ("failed", 404)


@pytest.mark.parametrize(
    ("status", "body", "type_name", "shown"),
    [
        (404, b"", "NotFoundError", ""),
        (
            404,
            b"<html>404 page not found</html>",
            "NotFoundError",
            ": <html>404 page not found</html>",
        ),
        (401, b'{"detail": "no"}', "AuthenticationError", ': {"detail": "no"}'),
        (400, b"x" * 300, "BadRequestError", ": " + "x" * 200),
    ],
    ids=["empty", "html", "other-json", "long"],
)
async def test_a_foreign_prefill_4xx_gets_an_engine_shaped_body(
    http, sidecar, decode, aiohttp_server, status: int, body: bytes, type_name: str, shown: str
) -> None:
    """Whatever answers at the named address is not always an engine: its 4xx keeps its status
    and reaches the client in the engine's error shape, quoting the start of what it said."""

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    stranger = await aiohttp_server(app)
    got, raw, _ = await _post(
        http,
        sidecar.url + "/v1/completions",
        completion(),
        {"x-prefiller-host-port": f"127.0.0.1:{stranger.port}"},
    )
    assert got == status
    assert orjson.loads(raw) == {
        "error": {
            "message": f"prefill target answered {status}{shown}",
            "type": type_name,
            "param": None,
            "code": status,
        }
    }
    assert await engine_requests(http, decode) == []
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert (record["state"], record["status"]) == ("failed", status)


async def test_prefill_500_falls_back_to_local(http, sidecar, prefill, decode) -> None:
    await inject(http, prefill, kind="status", status=500, role="prefill")
    code, raw, _ = await _post(
        http, sidecar.url + "/v1/completions", completion(max_tokens=4), _pd_headers(prefill)
    )
    assert code == 200
    assert orjson.loads(raw)["choices"][0]["text"]
    [leg] = await engine_requests(http, decode)
    assert "kv_transfer_params" not in leg["body"]
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert (record["decision"], record["fallback_reason"]) == ("local", "prefill_error")
    assert (record["prefill_endpoint"], record["prefill_attempts"]) == (prefill.endpoint, 1)


@pytest.mark.parametrize("status", [502, 503, 504])
async def test_transient_prefill_status_is_retried_on_the_named_pod(
    http, sidecar, prefill, decode, status
) -> None:
    await inject(http, prefill, kind="status", status=status, role="prefill")
    code, _, _ = await _post(
        http, sidecar.url + "/v1/completions", completion(), _pd_headers(prefill)
    )
    assert code == 200
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert (record["decision"], record["fallback_reason"]) == ("remote", None)
    assert record["prefill_attempts"] == 2
    [leg] = await engine_requests(http, decode)
    assert leg["body"]["kv_transfer_params"]["do_remote_prefill"] is True
    assert await staged_blocks(http, prefill) == 0


async def test_prefill_unreachable_falls_back_to_local(
    http, sidecar, start_engine: StartEmulator, decode
) -> None:
    gone = await start_engine()
    endpoint = gone.endpoint
    await gone.close()
    code, _, _ = await _post(
        http,
        sidecar.url + "/v1/completions",
        completion(),
        {"x-prefiller-host-port": endpoint},
    )
    assert code == 200
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert record["fallback_reason"] == "prefill_unreachable"
    assert len(await engine_requests(http, decode)) == 1


@pytest.mark.parametrize("fallback", ["local", "fail"])
async def test_a_prefill_name_that_does_not_resolve_is_named(
    http,
    start_sidecar_with: StartSidecar,
    decode,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fallback: str,
) -> None:
    """Said so in the fallback's log line, or in the 503 when the fallback is ``fail`` (it was
    "unknown error -2"). The resolver's NXDOMAIN is played by getaddrinfo itself: no query leaves
    the machine."""
    name = "no-such-prefill.invalid"
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == name:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    sidecar = await start_sidecar_with(prefill_fallback=fallback, prefill_retries=0)
    status, raw, _ = await _post(
        http,
        sidecar.url + "/v1/completions",
        completion(),
        {"x-prefiller-host-port": f"{name}:8000"},
    )
    said = f"the name {name} did not resolve (Name or service not known)"
    if fallback == "local":
        assert status == 200
        assert said in caplog.text
    else:
        assert status == 503
        assert said in orjson.loads(raw)["error"]["message"]
    assert "unknown error" not in caplog.text


async def test_prefill_reset_falls_back_to_local(http, sidecar, prefill) -> None:
    await inject(http, prefill, kind="reset", role="prefill", count=2)  # the retry fails too
    code, _, _ = await _post(
        http, sidecar.url + "/v1/completions", completion(), _pd_headers(prefill)
    )
    assert code == 200
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert record["fallback_reason"] == "prefill_unreachable"


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        # A prefill pod started without a KV connector answers normally, with no params.
        (b'{"choices": [{"text": "x"}], "kv_transfer_params": null}', "no_kv_params"),
        (b'{"kv_transfer_params": {"do_remote_prefill": true}}', "no_kv_params"),
        (b"<html>proxy error page</html>", "prefill_bad_response"),
    ],
)
async def test_unusable_prefill_answer_falls_back(
    http, sidecar, decode, aiohttp_server, answer: bytes, reason: str
) -> None:
    async def engine(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", engine)
    server = await aiohttp_server(app)
    code, _, _ = await _post(
        http,
        sidecar.url + "/v1/completions",
        completion(),
        {"x-prefiller-host-port": f"127.0.0.1:{server.port}"},
    )
    assert code == 200
    [leg] = await engine_requests(http, decode)
    assert "kv_transfer_params" not in leg["body"]
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert (record["decision"], record["fallback_reason"]) == ("local", reason)


async def test_decode_unreachable_is_503(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    gone = await start_engine()
    url = gone.url
    await gone.close()
    sidecar = await start_sidecar_with(decode_url=url)
    code, raw, headers = await _post(
        http, sidecar.url + "/v1/chat/completions", chat(), {"x-request-id": "r-503"}
    )
    assert code == 503
    assert orjson.loads(raw)["error"]["type"] == "ServiceUnavailableError"
    assert orjson.loads(raw)["error"]["code"] == 503
    assert headers["x-request-id"] == "r-503"


async def test_streamed_pd_request(http, sidecar, prefill) -> None:
    body = chat(stream=True, max_tokens=5)
    async with http.post(
        sidecar.url + "/v1/chat/completions", json=body, headers=_pd_headers(prefill)
    ) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(await response.read())
    assert events[-1] == b"[DONE]"
    words = [
        orjson.loads(e)["choices"][0]["delta"].get("content", "")
        for e in events[:-1]
        if orjson.loads(e)["choices"]
    ]
    assert "".join(words).strip()
    assert await staged_blocks(http, prefill) == 0


async def test_long_prompt_over_one_mebibyte(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator
) -> None:
    prefill = await start_engine(max_model_len=1_000_000)
    decode = await start_engine(max_model_len=1_000_000)
    sidecar = await start_sidecar_with(decode_url=decode.url)
    body = completion("word " * 300_000, max_tokens=2)  # 1.5 MB: sent in slices, not one write
    status, _, _ = await _post(http, sidecar.url + "/v1/completions", body, _pd_headers(prefill))
    assert status == 200
    [leg] = await engine_requests(http, decode)
    assert leg["body"]["prompt"] == body["prompt"]
    assert await staged_blocks(http, prefill) == 0


async def test_batched_prompts_are_decoded_locally(http, sidecar, prefill, decode) -> None:
    # vLLM's prefill returns the KV params of the first prompt only: no P/D for a batch.
    body = completion(max_tokens=3)
    body["prompt"] = ["first prompt of the batch", "second prompt of the batch"]
    status, raw, _ = await _post(http, sidecar.url + "/v1/completions", body, _pd_headers(prefill))
    assert status == 200
    assert orjson.loads(raw)["choices"]
    assert await engine_requests(http, prefill) == []
    [leg] = await engine_requests(http, decode)
    assert "kv_transfer_params" not in leg["body"]
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert (record["decision"], record["reason"]) == ("local", "batched_prompt")
    # A single prompt given as token ids is no batch.
    status, _, _ = await _post(
        http, sidecar.url + "/v1/completions", completion([1, 2, 3]), _pd_headers(prefill)
    )
    assert status == 200
    assert len(await engine_requests(http, prefill)) == 1


async def test_decode_unreachable_message_names_the_engine(
    http, start_sidecar_with: StartSidecar
) -> None:
    # A long poll interval: the request is sent before readiness knows the engine is down.
    sidecar = await start_sidecar_with(decode_url="http://127.0.0.1:9", ready_interval_s=3600)
    status, raw, _ = await _post(http, sidecar.url + "/v1/completions", completion())
    assert status == 503
    message = orjson.loads(raw)["error"]["message"]
    # Refused by the request's own connection, or already by the first /health poll.
    assert message in (
        "the decode engine at 127.0.0.1:9 is unreachable: connection refused",
        "the decode engine is down, nothing was sent: "
        "decode engine at 127.0.0.1:9: connection refused",
    )


async def _ready_is(http: aiohttp.ClientSession, sidecar: Any, status: int) -> bool:
    async with http.get(sidecar.url + "/ready") as response:
        return response.status == status


@pytest.mark.parametrize("how", ["closed", "health_down"])
async def test_no_prefill_while_the_decode_engine_is_known_down(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator, how: str
) -> None:
    """A 503 with Retry-After before any leg: a prefill's KV could only be stranded."""
    prefill, decode = await start_engine(), await start_engine()
    sidecar = await start_sidecar_with(decode_url=decode.url)
    await eventually(lambda: _ready_is(http, sidecar, 200))
    address = decode.url.removeprefix("http://")
    if how == "closed":
        await decode.close()
        reason = f"decode engine at {address}: connection refused"
    else:
        await inject(http, decode, kind="health_down")  # up, but its /health says 503
        reason = f"decode engine at {address}: /health answered 503"
    await eventually(lambda: _ready_is(http, sidecar, 503))
    for body, path in ((chat(), "/v1/chat/completions"), (completion(), "/v1/completions")):
        status, raw, headers = await _post(
            http, sidecar.url + path, body, {**_pd_headers(prefill), "x-request-id": "down"}
        )
        assert status == 503
        assert orjson.loads(raw)["error"] == {
            "message": f"the decode engine is down, nothing was sent: {reason}",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
        assert headers["retry-after"] == "1"  # one /health poll of 0.05 s, rounded up
        assert headers["x-request-id"] == "down"
    assert await engine_requests(http, prefill) == []
    assert (await get_json(http, prefill.url + "/emulator/kv"))["staged_blocks"] == 0
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert (record["state"], record["status"]) == ("failed", 503)
    if how == "health_down":  # back once its polls are: served again
        async with http.delete(decode.url + "/emulator/faults") as response:
            assert response.status in (200, 204)
        await eventually(lambda: _ready_is(http, sidecar, 200))
        status, _, _ = await _post(
            http, sidecar.url + "/v1/completions", completion(), _pd_headers(prefill)
        )
        assert status == 200
        assert len(await engine_requests(http, prefill)) == 1
