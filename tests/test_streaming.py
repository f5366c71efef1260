"""The relay: streams flow as they are produced, answers stay byte for byte, broken streams end
with an error event, and cached_tokens reports the prefill's figure."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.conftest import (
    StartEmulator,
    StartSidecar,
    chat,
    completion,
    eventually,
    get_json,
    inject,
    sse_events,
    staged_blocks,
)


async def test_first_event_arrives_while_decode_still_generates(
    http, sidecar, prefill, decode
) -> None:
    await inject(http, decode, kind="stall", role="decode", after_chunks=1)
    async with http.post(
        sidecar.url + "/v1/chat/completions",
        json=chat(stream=True, max_tokens=8),
        headers={"x-prefiller-host-port": prefill.endpoint},
    ) as response:
        assert response.status == 200
        first = await response.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        # The decode engine is stalled after its first event: the request is still decoding.
        [record] = (await get_json(http, sidecar.url + "/debug/requests"))["inflight"]
        assert record["state"] == "decoding"
        assert record["phases"]["first_byte"] >= record["phases"]["decode_sent"]
        async with http.post(decode.url + "/emulator/release") as released:
            assert released.status in (200, 204)
        rest = await response.read()
    assert sse_events(first + rest)[-1] == b"[DONE]"


async def test_answer_is_relayed_byte_for_byte(
    http, start_sidecar_with: StartSidecar, aiohttp_server
) -> None:
    odd_json = b'{ "choices" :[ {"text":"x"} ] ,\n "usage": {"prompt_tokens": 3}}  '
    odd_sse = b'data:{"a":1}\n\n: comment\n\ndata: {"usage": {}}\n\ndata: [DONE]\n\n'

    async def engine(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=odd_json, content_type="application/json")
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for part in (odd_sse[:5], odd_sse[5:30], odd_sse[30:]):
            await response.write(part)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", engine)
    app.router.add_get("/health", _healthy)
    server = await aiohttp_server(app)
    sidecar = await start_sidecar_with(decode_url=f"http://127.0.0.1:{server.port}")
    async with http.post(sidecar.url + "/v1/completions", json=completion()) as response:
        assert await response.read() == odd_json
        assert response.headers["content-length"] == str(len(odd_json))
    async with http.post(sidecar.url + "/v1/completions", json=completion(stream=True)) as response:
        assert await response.read() == odd_sse


async def test_decode_breaks_mid_stream(
    http, sidecar, prefill, decode, caplog: pytest.LogCaptureFixture
) -> None:
    await inject(http, decode, kind="disconnect", role="decode", after_chunks=2)
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion(stream=True, max_tokens=10),
        headers={"x-prefiller-host-port": prefill.endpoint, "x-request-id": "broken-1"},
    ) as response:
        assert response.status == 200
        events = sse_events(await response.read())
    assert b"[DONE]" not in events
    assert len(events) == 3
    # The client reads a sentence that does not change with the engine or aiohttp, and which
    # request it was; the engine's address and the exception are for the log and the record.
    assert orjson.loads(events[-1])["error"] == {
        "message": "the engine's answer broke off before its end (request id broken-1)",
        "type": "BadGatewayError",
        "param": None,
        "code": 502,
    }
    record = await get_json(http, sidecar.url + "/debug/requests/broken-1")
    assert (record["state"], record["status"]) == ("failed", 200)
    assert record["error"].startswith(f"{decode.endpoint} broke the stream: ")
    [logged] = [
        r for r in caplog.records if r.name == "sidecar.pipeline" and r.levelname == "WARNING"
    ]
    assert logged.getMessage() == (
        f"request broken-1: the answer was cut after it started: {record['error']}"
    )
    metrics = await _metrics(http, sidecar.url)
    assert (
        'pd_sidecar_requests_total{decision="remote",outcome="server_error",'
        'route="completions"} 1.0' in metrics
    )


async def test_decode_breaks_mid_json_body_truncates(http, sidecar, decode) -> None:
    await inject(http, decode, kind="disconnect", role="plain", after_chunks=1)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(
            sidecar.url + "/v1/completions", json=completion(max_tokens=50)
        ) as response:
            await response.read()
    await eventually(
        lambda: _recent_state(http, sidecar.url, "failed"),
    )


async def _recent_state(http, url: str, state: str) -> bool:
    recent = (await get_json(http, url + "/debug/requests"))["recent"]
    return bool(recent) and recent[0]["state"] == state


@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_come_from_the_prefill(
    http, start_sidecar_with: StartSidecar, start_engine: StartEmulator, stream: bool
) -> None:
    prefill = await start_engine(prompt_tokens_details=True)
    decode = await start_engine(prompt_tokens_details=True)
    sidecar = await start_sidecar_with(decode_url=decode.url)
    prompt = "A long shared system prompt. " * 20  # 580 characters: 145 tokens, 9 full blocks
    body = completion(prompt, max_tokens=3, stream=stream, stream_options={"include_usage": True})
    if not stream:
        del body["stream_options"]
    seen = []
    for _ in range(2):  # the second time, the prefill engine has the prompt's blocks cached
        async with http.post(
            sidecar.url + "/v1/completions",
            json=body,
            headers={"x-prefiller-host-port": prefill.endpoint},
        ) as response:
            raw = await response.read()
        answer = orjson.loads(sse_events(raw)[-2] if stream else raw)
        seen.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    # The decode engine alone would report every pulled token as cached (145 both times).
    assert seen == [0, 144]
    assert await staged_blocks(http, prefill) == 0


async def test_inflight_back_to_zero(http, sidecar, prefill) -> None:
    for stream in (False, True):
        async with http.post(
            sidecar.url + "/v1/completions",
            json=completion(stream=stream),
            headers={"x-prefiller-host-port": prefill.endpoint},
        ) as response:
            await response.read()
    debug = await get_json(http, sidecar.url + "/debug/requests")
    assert debug["inflight"] == []
    assert "pd_sidecar_inflight_requests 0.0" in await _metrics(http, sidecar.url)


async def _metrics(http, url: str) -> str:
    async with http.get(url + "/metrics") as response:
        return await response.text()


async def test_break_mid_event_still_ends_with_a_parsable_error(
    http, start_sidecar_with: StartSidecar, aiohttp_server
) -> None:
    async def engine(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": " a"}]}\n\ndata: {"choi')
        assert request.transport is not None
        request.transport.close()  # broken off in the middle of the second event
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", engine)
    app.router.add_get("/health", _healthy)
    server = await aiohttp_server(app)
    sidecar = await start_sidecar_with(decode_url=f"http://127.0.0.1:{server.port}")
    async with http.post(sidecar.url + "/v1/completions", json=completion(stream=True)) as response:
        raw = await response.read()
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: ")
    assert orjson.loads(last[len(b"data: ") :])["error"]["code"] == 502


async def _healthy(request: web.Request) -> web.Response:
    """A fake engine's ``/health``, as vLLM's: otherwise its 404s make it known down."""
    return web.Response()
