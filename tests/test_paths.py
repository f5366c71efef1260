"""One canonical path per request, routed before anything else and sent to the engine as routed.

The emulator routes as vLLM's server does (percent-escapes decoded before routing, a trailing
slash redirected) and records each request's target as its request line carried it, so a
spelling that slips past the sidecar's routes reaches a generation endpoint there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from yarl import URL

from sidecar.errors import BadRequest
from sidecar.paths import GUARDED_ROUTES, canonical_target, is_plain
from tests.conftest import StartSidecar, chat, completion, engine_requests, get_json

CLIENT_KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "chosen-by-the-client",
    "remote_block_ids": [1, 2, 3],
    "remote_request_id": "client",
    "remote_host": "127.0.0.9",
    "remote_port": 1,
}


def _at(base: str, target: str) -> URL:
    return URL(base + target, encoded=True)  # sent as written: no client-side normalisation


async def _error(response: Any) -> dict[str, Any]:
    body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == response.status
    return dict(body["error"])


async def _raw(host: str, port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        return await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()


# --- the form itself ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "canonical"),
    [
        ("/v1/completions", "/v1/completions"),
        ("/v1/c%6Fmpletions", "/v1/completions"),
        ("/v1/./completions", "/v1/completions"),
        ("/v1//completions", "/v1/completions"),
        ("//v1///completions", "/v1/completions"),
        ("/v1/foo/../completions", "/v1/completions"),
        ("/v1/x/%2E%2E/completions", "/v1/completions"),
        ("/v1/x/%2e%2E/completions", "/v1/completions"),
        ("/v1/%2e/completions", "/v1/completions"),
        ("/../../v1/completions", "/v1/completions"),
        ("/v1/completions/", "/v1/completions"),
        ("/v1/chat/completions/?x=1", "/v1/chat/completions?x=1"),
        ("/generate/", "/generate"),
        ("/v1/models/", "/v1/models/"),  # not a generation route: the engine's own business
        ("/v1/a/b/..", "/v1/a/"),
        ("/v1/a%3bb?q=%2F", "/v1/a%3Bb?q=%2F"),  # reserved kept (upper case); query untouched
        ("/v1/%7Euser/%E2%91%A0", "/v1/~user/%E2%91%A0"),
        ("http://example.invalid/v1/completions?x=1", "/v1/completions?x=1"),
        ("HTTPS://example.invalid", "/"),
        ("/", "/"),
    ],
)
def test_the_canonical_form(target: str, canonical: str) -> None:
    assert canonical_target(target) == canonical
    assert canonical_target(canonical) == canonical  # idempotent
    assert is_plain(canonical) or canonical_target(canonical) == canonical


@pytest.mark.parametrize(
    "target",
    [
        "/v1%2Fcompletions",
        "/v1%2fcompletions",
        "/v1%5Ccompletions",
        "/v1%5ccompletions",
        "/v1\\completions",
        "/v1/completions%00",
        "/v1/completions%7f",
        "/v1/compl%zzetions",
        "/v1/completions%2",
        "*",
    ],
)
def test_refused_spellings(target: str) -> None:
    with pytest.raises(BadRequest):
        canonical_target(target)


def test_what_most_requests_look_like_is_plain() -> None:
    assert is_plain("/v1/completions")
    assert is_plain("/v1/chat/completions?stream=true")
    for suspect in ("/v1%2F", "/v1//c", "/v1/./c", "/v1\\c", "/v1/c/", "/v1/c/?x", "http://h/x"):
        assert not is_plain(suspect), suspect


# --- generation routes, however spelled ---------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/v1%2Fcompletions",
        "/v1%2fcompletions",
        "/v1%5Ccompletions",
        "/v1/chat%2Fcompletions",
        "/v1%2fchat%2Fcompletions",
        "/v1/completions%00",
    ],
)
async def test_an_encoded_slash_is_refused_and_reaches_no_engine(
    http, sidecar, decode, target: str
) -> None:
    """The hole: ``/v1%2Fcompletions`` missed the pipeline's route, and the engine's server
    decoded it to ``/v1/completions`` and pulled KV from wherever the client said."""
    async with http.post(
        _at(sidecar.url, target), json=completion(kv_transfer_params=CLIENT_KV)
    ) as r:
        assert r.status == 400, await r.text()
        assert (await _error(r))["type"] == "BadRequestError"
        assert r.headers["x-request-id"]
    assert await engine_requests(http, decode) == []


async def test_a_raw_backslash_is_refused(sidecar, decode, http) -> None:
    answer = await _raw(
        sidecar.host,
        sidecar.port,
        b"POST /v1\\completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Connection: close\r\n\r\n{}",
    )
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
    assert b"backslash" in answer
    assert await engine_requests(http, decode) == []


@pytest.mark.parametrize(
    ("target", "route"),
    [
        ("/v1/./completions", "/v1/completions"),
        ("/v1//completions", "/v1/completions"),
        ("//v1/completions", "/v1/completions"),
        ("/v1/foo/../completions", "/v1/completions"),
        ("/v1/x/%2E%2E/completions", "/v1/completions"),
        ("/v1/%2e/completions", "/v1/completions"),
        ("/v1/completions/", "/v1/completions"),
        ("/v1/c%6Fmpletions", "/v1/completions"),
        ("/v1/chat/./completions", "/v1/chat/completions"),
        ("/v1/chat/completions/", "/v1/chat/completions"),
        ("/v1/chat//completions/", "/v1/chat/completions"),
    ],
)
async def test_every_spelling_of_a_pipeline_route_goes_through_the_pipeline(
    http, sidecar, decode, target: str, route: str
) -> None:
    """Sanitized, recorded, and the engine is sent exactly the routed path (yarl would have
    resolved ``/v1/./completions`` on its way out, past the sidecar's routes)."""
    make = completion if route == "/v1/completions" else chat
    async with http.post(_at(sidecar.url, target), json=make(kv_transfer_params=CLIENT_KV)) as r:
        assert r.status == 200, await r.text()
    [seen] = await engine_requests(http, decode)
    assert seen["target"] == route
    assert "kv_transfer_params" not in seen["body"]
    recent = (await get_json(http, sidecar.url + "/debug/requests"))["recent"]
    assert [record["path"] for record in recent] == [route]


async def test_an_absolute_form_target_is_routed_by_its_path(http, sidecar, decode) -> None:
    answer = await _raw(
        sidecar.host,
        sidecar.port,
        b"GET http://example.invalid/v1/models HTTP/1.1\r\nHost: example.invalid\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert str(decode.port).encode() not in answer
    body = completion(kv_transfer_params=CLIENT_KV)
    answer = await _raw(
        sidecar.host,
        sidecar.port,
        b"POST http://example.invalid/v1/completions HTTP/1.1\r\nHost: example.invalid\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n"
        + f"Content-Length: {len(orjson.dumps(body))}\r\n\r\n".encode()
        + orjson.dumps(body),
    )
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    models, generation = await engine_requests(http, decode)
    assert (models["target"], generation["target"]) == ("/v1/models", "/v1/completions")
    assert "kv_transfer_params" not in generation["body"]


async def test_an_absolute_form_target_never_shows_the_engine_url(
    start_sidecar_with: StartSidecar,
) -> None:
    sidecar = await start_sidecar_with(decode_url="http://127.0.0.1:9")
    answer = await _raw(
        sidecar.host,
        sidecar.port,
        b"GET http://example.invalid/x HTTP/1.1\r\nHost: example.invalid\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert b"example.invalid" not in answer.partition(b"\r\n\r\n")[2]
    assert b"http://127.0.0.1:9" not in answer


# --- passthrough: the engine gets the routed path, and no client KV fields -------------------


@pytest.mark.parametrize(
    ("target", "sent"),
    [
        ("/v1/some/p%3bth?x=%20y", "/v1/some/p%3Bth?x=%20y"),
        ("/v1/%7Euser/./models", "/v1/~user/models"),
        ("/v1/a/..//models", "/v1/models"),
    ],
)
async def test_passthrough_sends_exactly_the_routed_path(
    http, sidecar, decode, target: str, sent: str
) -> None:
    async with http.get(_at(sidecar.url, target)) as response:
        await response.read()
    [seen] = await engine_requests(http, decode)
    assert seen["target"] == sent


_GUARDED = [
    ("POST", "/v1/responses", {"input": "hi", "kv_transfer_params": CLIENT_KV}, None),
    ("POST", "/v1/responses/", {"input": "hi", "kv_transfer_params": CLIENT_KV}, None),
    ("POST", "/v1/./responses", {"input": "hi", "kv_transfer_params": CLIENT_KV}, None),
    ("POST", "/v1/chat/completions/batch", chat(kv_transfer_params=CLIENT_KV), None),
    ("POST", "/v1/messages", chat(max_tokens=4, kv_transfer_params=CLIENT_KV), None),
    ("POST", "/invocations", chat(kv_transfer_params=CLIENT_KV), None),
    (
        "POST",
        "/inference/v1/generate",
        {"token_ids": [1, 2], "sampling_params": {}, "kv_transfer_params": CLIENT_KV},
        None,
    ),
    (
        "POST",
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"extra_args": {"kv_transfer_params": CLIENT_KV}}},
        "sampling_params.extra_args.kv_transfer_params",
    ),
    ("POST", "/generate", {"text": "hi", "bootstrap_host": "127.0.0.9"}, "bootstrap_host"),
    ("PUT", "/generate", {"text": "hi", "bootstrap_room": 7}, "bootstrap_room"),
    ("POST", "/generate", {"text": "hi", "bootstrap_pair_key": "k"}, "bootstrap_pair_key"),
    ("POST", "/generate", {"text": "hi", "decode_tp_size": 2}, "decode_tp_size"),
    ("POST", "/generate", {"text": "hi", "disagg_prefill_dp_rank": 1}, "disagg_prefill_dp_rank"),
    (
        "POST",
        "/vertex_generate",
        {"instances": [{"text": "hi"}], "parameters": {"bootstrap_port": 8998}},
        "parameters.bootstrap_port",
    ),
    ("POST", "/v1/chat/completions/batch", chat(vllm_xargs={"kv_transfer_params": "x"}), None),
]


@pytest.mark.parametrize(("method", "target", "body", "field"), _GUARDED)
async def test_other_generation_routes_never_carry_client_kv_fields(
    http, sidecar, decode, method: str, target: str, body: Any, field: str | None
) -> None:
    async with http.request(method, _at(sidecar.url, target), json=body) as response:
        assert response.status == 400, await response.text()
        message = (await _error(response))["message"]
    assert f"'{field or ''}" in message if field else "kv_transfer_params" in message
    assert await engine_requests(http, decode) == []


@pytest.mark.parametrize("route", sorted(GUARDED_ROUTES))
async def test_other_generation_routes_without_kv_fields_pass_unchanged(
    http, sidecar, decode, route: str
) -> None:
    body = {"model": "emulated-model", "input": "hi", "kv_transfer_params": None, "n": 1}
    async with http.post(sidecar.url + route + "/", json=body) as response:
        await response.read()
    [seen] = await engine_requests(http, decode)
    assert (seen["target"], seen["body"]) == (route, body)


async def test_a_guarded_route_refuses_a_body_it_cannot_read(http, sidecar, decode) -> None:
    raw = b'{"input": "hi", "temperature": NaN, "kv_transfer_params": {"remote_port": 1}}'
    async with http.post(sidecar.url + "/v1/responses", data=raw) as response:
        assert response.status == 400
        assert "not valid JSON" in (await _error(response))["message"]
    assert await engine_requests(http, decode) == []


async def test_a_request_routed_again_gets_one_100_continue(http, sidecar, decode) -> None:
    """aiohttp answers ``Expect: 100-continue`` when it routes a request: the canonical
    re-dispatch must not answer it a second time."""
    body = orjson.dumps(completion())
    reader, writer = await asyncio.open_connection(sidecar.host, sidecar.port)
    try:
        writer.write(
            b"POST /v1/./completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
        )
        await writer.drain()
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        await writer.drain()
        answer = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:100]
    [seen] = await engine_requests(http, decode)
    assert seen["target"] == "/v1/completions"
