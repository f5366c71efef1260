"""What the sidecar accepts from a client: bodies, prefill headers, request ids."""

from __future__ import annotations

import asyncio
import logging
import re
import socket

import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.defaults import PREFILLER_HOST_PORT
from sidecar.errors import BadRequest
from sidecar.fleet.endpoints import Endpoint
from sidecar.headers import PARSED_TARGETS_KEPT, GatewayHeaders
from sidecar.server.serverlog import LINES_PER_WINDOW, ServerLog
from tests.conftest import StartSidecar, completion, engine_requests, get_json


async def _error(response) -> dict:
    assert response.headers["content-type"].startswith("application/json")
    body = await response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] is None
    assert body["error"]["code"] == response.status
    assert response.headers["x-request-id"]
    return body["error"]


@pytest.mark.parametrize(
    "raw", [b"", b"not json", b"[1, 2]", b'"text"', b"42", b"null", b'{"a": 1', b"\xff\xfe"]
)
async def test_body_not_a_json_object_is_400(http, sidecar, prefill, decode, raw: bytes) -> None:
    async with http.post(
        sidecar.url + "/v1/completions",
        data=raw,
        headers={"x-prefiller-host-port": prefill.endpoint},
    ) as response:
        assert response.status == 400
        assert (await _error(response))["type"] == "BadRequestError"
    assert await engine_requests(http, prefill) == []
    assert await engine_requests(http, decode) == []


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"prompt": "caf\xe9"}', "request body is not valid UTF-8: byte 15 (0xe9)"),
        (b"\xff\xfe", "request body is not valid UTF-8: byte 0 (0xff)"),
        (b'{"prompt": "\xed\xa0\x80"}', "request body is not valid UTF-8: byte 12 (0xed)"),
    ],
    ids=["latin-1", "bom", "surrogate"],
)
async def test_a_body_that_is_not_utf8_says_so_and_where(
    http, sidecar, decode, raw: bytes, says: str
) -> None:
    async with http.post(sidecar.url + "/v1/completions", data=raw) as response:
        assert response.status == 400
        assert (await _error(response))["message"] == says
    assert await engine_requests(http, decode) == []


async def test_body_over_limit_is_413(http, start_sidecar_with: StartSidecar, decode) -> None:
    sidecar = await start_sidecar_with(max_body_bytes=1024)
    body = orjson.dumps(completion("x" * 2000))
    async with http.post(sidecar.url + "/v1/completions", data=body) as response:
        assert response.status == 413
        assert (await _error(response))["code"] == 413

    async def chunked():  # no Content-Length: the limit applies while reading
        yield body[:600]
        yield body[600:]

    async with http.post(sidecar.url + "/v1/completions", data=chunked()) as response:
        assert response.status == 413
    assert await engine_requests(http, decode) == []
    small = orjson.dumps(completion("x" * 10))
    async with http.post(sidecar.url + "/v1/completions", data=small) as response:
        assert response.status == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"x-prefiller-host-port": ""},
        {"x-prefiller-host-port": "prefill"},
        {"x-prefiller-host-port": "prefill:http"},
        {"x-prefiller-host-port": "bad host:8000"},
        {"x-prefiller-host-port": ",127.0.0.9:1"},
        {"x-prefiller-host-port": "::1:8000"},
        {"x-gateway-prefill-endpoints": "127.0.0.9"},
        {"x-prefiller-host-port": "https://127.0.0.9:1"},  # SIDECAR_PREFILL_TLS decides
        {"x-prefiller-host-port": "grpc://127.0.0.9:1"},
        {"x-prefiller-host-port": "http://127.0.0.9:1/v1"},
    ],
)
async def test_malformed_prefill_header_is_400(http, sidecar, decode, headers) -> None:
    async with http.post(
        sidecar.url + "/v1/completions", json=completion(), headers=headers
    ) as response:
        assert response.status == 400
        error = await _error(response)
        assert next(iter(headers)) in error["message"]
    assert await engine_requests(http, decode) == []


async def test_header_forms_pick_the_first_entry(http, sidecar, start_engine) -> None:
    first, second = await start_engine(), await start_engine()
    forms = [
        [("x-prefiller-host-port", f"{first.endpoint},{second.endpoint}")],
        [("x-prefiller-host-port", first.endpoint), ("x-prefiller-host-port", second.endpoint)],
        [("x-prefiller-host-port", f"http://{first.endpoint}")],
        [("x-gateway-prefill-endpoints", f"{first.endpoint}, {second.endpoint}")],
        # The llm-d header wins over the proposed standard one.
        [
            ("x-gateway-prefill-endpoints", second.endpoint),
            ("x-prefiller-host-port", first.endpoint),
        ],
    ]
    for headers in forms:
        async with http.post(
            sidecar.url + "/v1/completions", json=completion(), headers=headers
        ) as response:
            assert response.status == 200
    assert len(await engine_requests(http, first)) == len(forms)
    assert await engine_requests(http, second) == []


async def test_ipv6_prefill_header(http, sidecar, start_engine) -> None:
    try:
        engine = await start_engine(host="::1", side_channel_host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion(),
        headers={"x-prefiller-host-port": f"[::1]:{engine.port}"},
    ) as response:
        assert response.status == 200
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert record["decision"] == "remote"
    assert record["prefill_endpoint"] == f"[::1]:{engine.port}"


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ("client-id-1", True),
        ("a" * 128, True),
        ("with spaces and ~!@#", True),
        ("a" * 129, False),
        ("ünïcode", False),
        ("tab\tinside", False),
    ],
)
async def test_request_id_rules(http, sidecar, decode, sent: str, kept: bool) -> None:
    async with http.post(
        sidecar.url + "/v1/completions",
        json=completion(),
        headers={"x-request-id": sent.encode().decode("latin-1")},
    ) as response:
        assert response.status == 200
        returned = response.headers["x-request-id"]
    [leg] = await engine_requests(http, decode)
    assert leg["headers"]["x-request-id"].startswith(returned + "-")  # its engine id
    if kept:
        assert returned == sent
    else:
        assert re.fullmatch(r"[0-9a-f]{32}", returned)


async def test_request_id_minted_when_absent(http, sidecar, decode) -> None:
    ids = set()
    for _ in range(2):
        async with http.post(sidecar.url + "/v1/completions", json=completion()) as response:
            ids.add(response.headers["x-request-id"])
    assert len(ids) == 2
    legs = await engine_requests(http, decode)
    assert {leg["headers"]["x-request-id"].rsplit("-", 1)[0] for leg in legs} == ids


async def test_a_new_header_name_is_opt_in(
    http, start_sidecar_with: StartSidecar, start_engine, decode
) -> None:
    first, second = await start_engine(), await start_engine()
    headers = {"x-prefill-endpoint": first.endpoint, "x-prefiller-host-port": second.endpoint}
    # Default: the new name is not read (a gateway that does not know it would let clients
    # choose).
    default = await start_sidecar_with()
    async with http.post(
        default.url + "/v1/completions",
        json=completion(),
        headers={"x-prefill-endpoint": first.endpoint, "x-request-id": "not-read"},
    ) as response:
        assert response.status == 200
    assert await engine_requests(http, first) == []
    record = await get_json(http, default.url + "/debug/requests/not-read")
    assert (record["decision"], record["reason"], record["fallback_reason"]) == (
        "local",
        "pool_empty",
        None,
    )
    async with http.delete(decode.url + "/emulator/requests") as response:
        assert response.status == 200
    # Configured first, it wins over the default name; both are stripped from every leg.
    configured = await start_sidecar_with(
        prefill_headers="x-prefill-endpoint,x-prefiller-host-port"
    )
    async with http.post(
        configured.url + "/v1/completions", json=completion(), headers=headers
    ) as response:
        assert response.status == 200
    [leg] = await engine_requests(http, first)
    assert await engine_requests(http, second) == []
    legs = [leg, *await engine_requests(http, decode)]
    for sent in legs:
        assert not {"x-prefill-endpoint", "x-prefiller-host-port"} & set(sent["headers"])


async def test_a_prefill_target_that_is_the_sidecar_itself_is_400(http, sidecar, decode) -> None:
    for host in ("127.0.0.1", "127.0.0.2", "[::ffff:127.0.0.1]", "localhost", socket.gethostname()):
        target = f"{host}:{sidecar.port}"
        async with http.post(
            sidecar.url + "/v1/completions",
            json=completion(),
            headers={"x-prefiller-host-port": target},
        ) as response:
            assert response.status == 400, target
            error = await _error(response)
        assert "this sidecar itself" in error["message"]
    assert await engine_requests(http, decode) == []


def test_parsed_prefill_targets_are_remembered_within_a_bound() -> None:
    """Every request names one of a few prefill pods: the parse is remembered, for at most
    ``PARSED_TARGETS_KEPT`` distinct values (clients choose them), invalid ones included."""
    gateway = GatewayHeaders()

    def target(value: str) -> Endpoint | None:
        return gateway.prefill_target(CIMultiDictProxy(CIMultiDict({PREFILLER_HOST_PORT: value})))

    first = target("Prefill-0:8000, prefill-1:8000")
    assert first == Endpoint("prefill-0", 8000)
    assert target("Prefill-0:8000") is first  # remembered
    for index in range(3 * PARSED_TARGETS_KEPT):
        assert target(f"10.0.{index // 250}.{index % 250}:8000") is not None
        with pytest.raises(BadRequest, match="invalid x-prefiller-host-port header"):
            target(f"bad-{index}")
    assert len(gateway._parsed) <= PARSED_TARGETS_KEPT
    assert target("Prefill-0:8000") == first


MALFORMED = b"GET /v1/models HTTP/1.1\r\nHost: xyz\r\nBad Header Line\r\nX: y\r\n\r\n"
"""61 bytes aiohttp's parser refuses (a header line without a colon)."""


async def _send_raw(host: str, port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        return await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()


def _server_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(("aiohttp", "sidecar.http"))]


async def test_a_malformed_request_is_one_warning_line(sidecar, caplog) -> None:
    """aiohttp logged each with a traceback: 11 ERROR lines, 578 bytes, per 61-byte request."""
    assert len(MALFORMED) == 61
    caplog.set_level(logging.DEBUG)
    answer = await _send_raw(sidecar.host, sidecar.port, MALFORMED)
    assert answer.split(b" ", 2)[1] == b"400"  # aiohttp's own answer
    [line] = _server_lines(caplog)
    assert line.levelno == logging.WARNING
    assert line.exc_info is None
    text = line.getMessage()
    assert "\n" not in text
    assert text.startswith("malformed HTTP request from 127.0.0.1: 400 ")
    assert len(text) < 300


async def test_a_flood_of_malformed_requests_is_rate_limited(sidecar, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    for _ in range(3 * LINES_PER_WINDOW):
        await _send_raw(sidecar.host, sidecar.port, MALFORMED)
    lines = _server_lines(caplog)
    assert len(lines) == LINES_PER_WINDOW
    assert all(line.levelno == logging.WARNING for line in lines)


def test_the_next_window_says_how_many_lines_were_left_out(caplog) -> None:
    from aiohttp.http_exceptions import BadHttpMessage

    now = [0.0]
    log = ServerLog(logging.getLogger("sidecar.http"), clock=lambda: now[0], lines_per_window=2)
    caplog.set_level(logging.DEBUG, logger="sidecar.http")
    for _ in range(5):
        log.exception("Error handling request from %s", "10.0.0.1", exc_info=BadHttpMessage("x"))
    now[0] = 61.0
    log.exception("Error handling request from %s", "10.0.0.2", exc_info=BadHttpMessage("y"))
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "malformed HTTP request from 10.0.0.1: 400 x",
        "malformed HTTP request from 10.0.0.1: 400 x",
        "malformed HTTP request from 10.0.0.2: 400 y (3 more not logged)",
    ]
    caplog.clear()
    try:
        raise RuntimeError("a handler's bug")
    except RuntimeError as exc:
        log.exception("Unhandled exception", exc_info=exc)  # not a client's: logged as it was
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None
