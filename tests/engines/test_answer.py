"""An engine's answer as the pipeline reads it."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sidecar.engines.upstream import EngineAnswer

CONTENT_TYPES = [
    "text/event-stream",
    "text/event-stream; charset=utf-8",
    "Text/Event-Stream ;charset=UTF-8",
    "application/json",
    "application/json; charset=utf-8",
    "APPLICATION/JSON",
    None,
]


@pytest.mark.parametrize("sent", CONTENT_TYPES)
async def test_the_content_type_is_what_aiohttp_would_say(sent: str | None) -> None:
    """Read off the header without aiohttp's parser (which keeps its parsed parameters on the
    response), the media type is still aiohttp's: lower case, no parameters, and
    application/octet-stream when the engine sent none."""

    async def answer(_: web.Request) -> web.StreamResponse:
        response = web.Response(body=b"{}")
        if sent is None:
            response.headers.popall("Content-Type", None)
        else:
            response.headers["Content-Type"] = sent
        return response

    app = web.Application()
    app.router.add_get("/", answer)
    async with (
        TestServer(app, host="127.0.0.1") as server,
        aiohttp.ClientSession() as http,
        http.get(server.make_url("/")) as response,
    ):
        expected = response.content_type
        assert EngineAnswer(response, "127.0.0.1:1").content_type == expected
    if sent is not None:
        assert expected == sent.split(";")[0].strip().lower()
