"""A refusal of the one-token prefill leg, told in the client's own figures
(``sidecar.connectors.refusals``): the wordings vLLM has used, a client that set no limit, and a
refusal about something else, passed on as the engine wrote it."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from tests.conftest import StartSidecar, chat, completion, get_json

VLLM_0_10 = (
    "'max_tokens' or 'max_completion_tokens' is too large: 1. This model's maximum context "
    "length is 64 tokens and your request has 80 input tokens (1 > 64 - 80)."
)
"""vLLM's wording from 0.10 on, for a prompt of 80 tokens and a one-token leg."""


async def _refusing_prefill(aiohttp_server: Any, message: str) -> str:
    """A prefill engine that refuses every request with ``message``; its ``host:port``."""

    async def refuse(request: web.Request) -> web.Response:
        await request.read()
        error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
        return web.json_response({"error": error}, status=400)

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)
    app.router.add_post("/v1/chat/completions", refuse)
    server = await aiohttp_server(app)
    return f"127.0.0.1:{server.port}"


async def _ask(http: Any, sidecar: Any, path: str, body: dict[str, Any], target: str) -> Any:
    async with http.post(
        sidecar.url + path, json=body, headers={"x-prefiller-host-port": target}
    ) as response:
        assert response.status == 400
        assert response.content_type == "application/json"
        return (await response.json())["error"]


async def test_a_later_vllm_wording_is_told_in_the_clients_figures(
    http, start_sidecar_with: StartSidecar, aiohttp_server
) -> None:
    target = await _refusing_prefill(aiohttp_server, VLLM_0_10)
    sidecar = await start_sidecar_with()
    said = await _ask(http, sidecar, "/v1/completions", completion(max_tokens=16), target)
    assert said == {
        "message": "This model's maximum context length is 64 tokens. However, you requested "
        "96 tokens (80 in the messages, 16 in the completion). Please reduce the length of the "
        "messages or completion.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    [record] = (await get_json(http, sidecar.url + "/debug/requests"))["recent"]
    assert record["error"] == f"prefill answered 400: {VLLM_0_10}"


async def test_a_client_that_set_no_limit_is_told_its_prompt_fills_the_context(
    http, start_sidecar_with: StartSidecar, start_engine
) -> None:
    prefill = await start_engine(max_model_len=64)
    sidecar = await start_sidecar_with()
    body = chat("a prompt far longer than this tiny model's context " * 20)
    said = await _ask(http, sidecar, "/v1/chat/completions", body, prefill.endpoint)
    message = said["message"]
    assert message.startswith("This model's maximum context length is 64 tokens. However, your ")
    assert message.endswith(
        "input tokens, which leave no room for a completion. Please reduce "
        "the length of the messages."
    )
    assert "1 in the completion" not in message


async def test_a_refusal_about_anything_else_is_passed_on_as_the_engine_wrote_it(
    http, start_sidecar_with: StartSidecar, start_engine
) -> None:
    prefill = await start_engine()
    sidecar = await start_sidecar_with()
    body = completion(model="another-model", max_tokens=2)
    async with http.post(
        sidecar.url + "/v1/completions",
        json=body,
        headers={"x-prefiller-host-port": prefill.endpoint},
    ) as response:
        relayed = await response.read()
    async with http.post(prefill.url + "/v1/completions", json=body) as direct:
        assert (response.status, orjson.loads(relayed)) == (direct.status, await direct.json())
    assert response.status == 404
