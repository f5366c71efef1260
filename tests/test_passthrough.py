"""Paths the sidecar does not own reach the decode engine unchanged, both ways."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiohttp import web

from tests.conftest import StartSidecar, engine_requests


async def test_models_passthrough(http, sidecar, decode) -> None:
    async with http.get(sidecar.url + "/v1/models") as response:
        assert response.status == 200
        body = await response.json()
    assert body["data"][0]["id"] == "emulated-model"


async def test_method_path_query_headers_and_body_unchanged(
    http, start_sidecar_with: StartSidecar, aiohttp_server
) -> None:
    seen: list[dict] = []

    async def echo(request: web.Request) -> web.StreamResponse:
        if request.path in ("/health", "/metrics"):  # the sidecar's readiness poller, scraper
            return web.Response()
        seen.append(
            {
                "method": request.method,
                "path_qs": request.raw_path,
                "headers": dict(request.headers),
                "body": await request.read(),
            }
        )
        response = web.StreamResponse(status=207, headers={"x-engine": "yes"})
        await response.prepare(request)
        for part in (b"one ", b"two ", b"three"):
            await response.write(part)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    engine = await aiohttp_server(app)
    sidecar = await start_sidecar_with(decode_url=f"http://127.0.0.1:{engine.port}")

    payload = b"\x00binary\xffpayload" * 1000
    async with http.request(
        "PUT",
        sidecar.url + "/v1/some/path?x=1&y=%20z",
        data=payload,
        headers={"x-custom": "kept", "x-prefiller-host-port": "127.0.0.9:1"},
    ) as response:
        assert response.status == 207
        assert response.headers["x-engine"] == "yes"
        assert await response.read() == b"one two three"
    [request] = seen
    assert request["method"] == "PUT"
    assert request["path_qs"] == "/v1/some/path?x=1&y=%20z"
    assert request["body"] == payload
    assert request["headers"]["x-custom"] == "kept"
    assert "x-prefiller-host-port" not in {k.lower() for k in request["headers"]}

    # GET on a pipeline path is not the pipeline's: it goes to the engine as is.
    async with http.get(sidecar.url + "/v1/completions") as response:
        assert response.status == 207
    assert seen[-1]["method"] == "GET"


async def test_passthrough_engine_down_is_503(http, start_sidecar_with: StartSidecar) -> None:
    sidecar = await start_sidecar_with(decode_url="http://127.0.0.1:9")
    async with http.get(sidecar.url + "/v1/models") as response:
        assert response.status == 503
        assert (await response.json())["error"]["type"] == "ServiceUnavailableError"


async def test_passthrough_silent_engine_is_504(
    http, start_sidecar_with: StartSidecar, aiohttp_server
) -> None:
    release = asyncio.Event()

    async def silent(request: web.Request) -> web.Response:
        if request.path in ("/health", "/metrics"):
            return web.Response()
        await release.wait()  # never answers while the test runs
        return web.Response()

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", silent)
    engine = await aiohttp_server(app)
    sidecar = await start_sidecar_with(
        decode_url=f"http://127.0.0.1:{engine.port}", decode_first_byte_timeout_s=0.3
    )
    async with http.get(sidecar.url + "/v1/models") as response:
        assert response.status == 504
        assert (await response.json())["error"]["type"] == "GatewayTimeoutError"
    release.set()


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/chat/completions", 405),  # the engine's answer, relayed
        ("GET", "/v1/no/such/path", 404),  # the engine's answer, relayed
        ("GET", "/health", 200),  # the sidecar's own
        ("DELETE", "/metrics", 405),  # aiohttp's router
        ("GET", "/debug/nothing-here", 404),
    ],
)
async def test_every_answer_carries_a_request_id(
    http, sidecar, decode, method: str, path: str, status: int
) -> None:
    async with http.request(method, sidecar.url + path, headers={"x-request-id": "mine-1"}) as r:
        assert r.status == status
        assert r.headers.get("x-request-id") == "mine-1"
    async with http.request(method, sidecar.url + path) as response:  # none sent: one minted
        assert response.status == status
        minted = response.headers.get("x-request-id", "")
    assert re.fullmatch(r"[0-9a-f]{32}", minted), minted
    if path.startswith("/v1/"):  # the engine saw the same id as the client
        seen = [leg["headers"].get("x-request-id") for leg in await engine_requests(http, decode)]
        assert seen[-2:] == ["mine-1", minted], seen
