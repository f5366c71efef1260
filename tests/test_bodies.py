"""Request bodies: the byte budget across requests, the limit on JSON values, and large bodies.

Real sockets: emulators as engines, the sidecar on a free port; a client that leaves in the middle
of its body writes a raw HTTP request on a socket of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
from typing import Any

import aiohttp
import orjson
import pytest

from sidecar import body as bodies
from sidecar.body import LARGE_BODY_BYTES, ElementCount, set_aside
from sidecar.emulator import RunningEmulator
from sidecar.server.runner import RunningSidecar
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    chat,
    completion,
    engine_requests,
    eventually,
    get_json,
    inject,
    metric,
)

BUDGET = 64 * 1024
"""Room for one body of ``SIZE`` bytes, not two."""
SIZE = 40 * 1024


def _body(size: int = SIZE, **fields: Any) -> bytes:
    """A completion request of exactly ``size`` bytes."""
    empty = orjson.dumps(completion("", **fields))
    return orjson.dumps(completion("x" * (size - len(empty)), **fields))


async def _held(http: aiohttp.ClientSession, sidecar: RunningSidecar) -> float:
    return await metric(http, sidecar.url, "pd_sidecar_request_body_bytes ")


async def _refused(http: aiohttp.ClientSession, sidecar: RunningSidecar, reason: str) -> float:
    sample = f'pd_sidecar_request_bodies_refused_total{{reason="{reason}"}}'
    return await metric(http, sidecar.url, sample)


async def _post(
    http: aiohttp.ClientSession, sidecar: RunningSidecar, data: Any, prefill: RunningEmulator
) -> tuple[int, dict[str, Any] | bytes]:
    async with http.post(
        sidecar.url + "/v1/completions",
        data=data,
        headers={"x-prefiller-host-port": prefill.endpoint, "content-type": "application/json"},
    ) as response:
        raw = await response.read()
        if response.content_type == "application/json" and response.status >= 400:
            return response.status, orjson.loads(raw)["error"]
        return response.status, raw


async def _release(http: aiohttp.ClientSession, engine: RunningEmulator) -> None:
    async with http.post(engine.url + "/emulator/release") as response:
        assert response.status == 200


async def _stop(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _half_sent(sidecar: RunningSidecar, body: bytes) -> asyncio.StreamWriter:
    """A client that declared ``body``'s length and sent a quarter of it."""
    _, writer = await asyncio.open_connection(sidecar.host, sidecar.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body[: len(body) // 4]
    )
    await writer.drain()
    return writer


@pytest.mark.parametrize("ending", ["answered", "refused", "left_in_prefill", "left_mid_body"])
async def test_a_body_over_the_budget_is_503_until_the_one_holding_it_ends(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    decode: RunningEmulator,
    start_sidecar_with: StartSidecar,
    ending: str,
) -> None:
    prefill = await start_engine()
    sidecar = await start_sidecar_with(max_body_bytes=BUDGET, body_budget_bytes=BUDGET)
    first, second = _body(), _body()
    writer = None
    client = None
    if ending == "left_mid_body":
        writer = await _half_sent(sidecar, first)
    else:
        await inject(http, prefill, kind="hang", role="prefill")
        client = asyncio.create_task(_post(http, sidecar, first, prefill))

    async def first_held() -> bool:
        return await _held(http, sidecar) == len(first)

    await eventually(first_held)
    sent = len(await engine_requests(http, prefill))
    status, error = await _post(http, sidecar, second, prefill)
    assert status == 503
    assert isinstance(error, dict)
    assert error["type"] == "ServiceUnavailableError"
    assert "SIDECAR_BODY_BUDGET_BYTES" in error["message"]
    assert await _refused(http, sidecar, "budget") == 1
    assert len(await engine_requests(http, prefill)) == sent  # nothing of the second

    if writer is not None:  # the client goes away in the middle of its body
        writer.close()
        await writer.wait_closed()
    elif ending == "left_in_prefill":
        assert client is not None
        await _stop(client)
        await _release(http, prefill)
    else:
        if ending == "refused":
            await inject(http, decode, kind="status", status=500, role="decode")
        await _release(http, prefill)
        assert client is not None
        status, _ = await client
        assert status == (200 if ending == "answered" else 500)

    async def returned() -> bool:
        return await _held(http, sidecar) == 0

    await eventually(returned)
    status, _ = await _post(http, sidecar, second, prefill)
    assert status == 200


async def test_a_chunked_body_is_held_as_it_arrives(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    start_sidecar_with: StartSidecar,
) -> None:
    prefill = await start_engine()
    sidecar = await start_sidecar_with(max_body_bytes=BUDGET, body_budget_bytes=BUDGET)
    writer = await _half_sent(sidecar, _body())  # holds all it declared

    async def chunked() -> Any:  # no Content-Length: held chunk by chunk, refused on the way
        body = _body()
        for start in range(0, len(body), 4096):
            yield body[start : start + 4096]

    status, error = await _post(http, sidecar, chunked(), prefill)
    assert status == 503
    assert isinstance(error, dict)
    assert "SIDECAR_BODY_BUDGET_BYTES" in error["message"]
    writer.close()
    await writer.wait_closed()
    await eventually(lambda: _is_zero(_held(http, sidecar)))
    status, _ = await _post(http, sidecar, chunked(), prefill)
    assert status == 200
    assert await _held(http, sidecar) == 0


async def _is_zero(value: Any) -> bool:
    return await value == 0


async def test_the_body_is_returned_to_the_budget_once_the_decode_answered(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    decode: RunningEmulator,
    start_sidecar_with: StartSidecar,
) -> None:
    """A stream that goes on for long does not hold its body (nor its budget) to its end."""
    prefill = await start_engine()
    sidecar = await start_sidecar_with(max_body_bytes=BUDGET, body_budget_bytes=BUDGET)
    first = _body(stream=True, max_tokens=10)
    await inject(http, prefill, kind="hang", role="prefill")
    await inject(http, decode, kind="stall", role="decode", after_chunks=2)

    async def stream() -> bytes:
        async with http.post(
            sidecar.url + "/v1/completions",
            data=first,
            headers={"x-prefiller-host-port": prefill.endpoint},
        ) as response:
            assert response.status == 200
            return await response.read()

    client = asyncio.create_task(stream())
    await eventually(lambda: _equals(_held(http, sidecar), len(first)))
    status, _ = await _post(http, sidecar, _body(), prefill)
    assert status == 503  # held while it prefills
    await _release(http, prefill)

    async def streaming() -> bool:
        inflight = (await get_json(http, sidecar.url + "/debug/requests"))["inflight"]
        return [r["state"] for r in inflight] == ["decoding"]

    await eventually(streaming)
    await eventually(lambda: _is_zero(_held(http, sidecar)))  # at its first byte
    status, _ = await _post(http, sidecar, _body(), prefill)
    assert status == 200  # while the first still streams
    assert not client.done()
    await _release(http, decode)
    assert (await client).rstrip().endswith(b"data: [DONE]")


async def _equals(value: Any, expected: float) -> bool:
    return await value == expected


async def test_too_many_json_values_is_413_before_anything_is_parsed(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    decode: RunningEmulator,
    start_sidecar_with: StartSidecar,
) -> None:
    prefill = await start_engine()
    sidecar = await start_sidecar_with(max_body_elements=1000)
    messages = [{"role": "user", "content": f"message {i}"} for i in range(400)]  # 1,200 values
    many = orjson.dumps(chat(messages=messages))

    async def chunked() -> Any:
        for start in range(0, len(many), 1000):
            yield many[start : start + 1000]

    for data in (many, chunked()):
        async with http.post(
            sidecar.url + "/v1/chat/completions",
            data=data,
            headers={"x-prefiller-host-port": prefill.endpoint},
        ) as response:
            assert response.status == 413
            error = (await response.json())["error"]
        assert error == {
            "message": "request body has more than 1000 JSON values "
            "(SIDECAR_MAX_BODY_ELEMENTS): send fewer messages or items",
            "type": "RequestEntityTooLargeError",
            "param": None,
            "code": 413,
        }
    assert await _refused(http, sidecar, "elements") == 2
    assert await engine_requests(http, prefill) == []
    assert await engine_requests(http, decode) == []
    # As many bytes in a few values (commas and brackets in a string do not count): accepted.
    text = ", [{".join(m["content"] for m in messages)
    few = orjson.dumps(chat(text[: len(many) - 100]))
    assert len(few) > 1000
    async with http.post(
        sidecar.url + "/v1/chat/completions",
        data=few,
        headers={"x-prefiller-host-port": prefill.endpoint},
    ) as response:
        assert response.status == 200


async def test_a_large_body_reaches_the_engines_whole_and_without_client_kv_fields(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    start_sidecar_with: StartSidecar,
) -> None:
    """Its members are kept as JSON text: the legs still carry exactly the client's fields."""
    prefill = await start_engine(max_model_len=10_000_000)
    decode = await start_engine(max_model_len=10_000_000)
    sidecar = await start_sidecar_with(decode_url=decode.url)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f'm{i} é \\ " ,[{{'} for i in range(40_000)
    ]
    image = "data:image/png;base64," + "QUJD/+" * 40_000  # a long string: set aside, not parsed
    part = {"type": "image_url", "image_url": {"url": image}}
    messages.append({"role": "user", "content": [part]})
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(3)
    ]
    client = chat(messages=messages, tools=tools, max_tokens=3, temperature=0.5, user="u" * 70_000)
    hostile = {"do_remote_prefill": True, "remote_host": "127.0.0.9", "remote_port": 1}
    raw = orjson.dumps({**client, "kv_transfer_params": hostile})
    assert len(raw) > LARGE_BODY_BYTES
    async with http.post(
        sidecar.url + "/v1/chat/completions",
        data=io.BytesIO(raw),
        headers={"x-prefiller-host-port": prefill.endpoint},
    ) as response:
        assert response.status == 200
    [prefill_leg] = await engine_requests(http, prefill)
    [decode_leg] = await engine_requests(http, decode)
    params = decode_leg["body"].pop("kv_transfer_params")
    assert decode_leg["body"] == client
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_block_ids"]
    assert prefill_leg["body"]["messages"] == messages
    assert prefill_leg["body"]["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill_leg["body"]["max_tokens"] == 1
    assert await _held(http, sidecar) == 0


@pytest.mark.parametrize(
    ("carrier", "kept"),
    [
        ("vllm_xargs", "x" * 1_100_000),  # the carrier is the large member
        ("vllm_xargs", "x"),  # another member is (a small fragment)
        ("sampling_params", "x" * 1_100_000),
        ("parameters", "x" * 1_100_000),
    ],
    ids=["vllm_xargs-large", "vllm_xargs-small", "sampling_params", "parameters"],
)
async def test_a_large_body_loses_the_client_kv_fields_of_its_carriers(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    start_sidecar_with: StartSidecar,
    carrier: str,
    kept: str,
) -> None:
    """A large body's carrier of KV fields is held as JSON text (``orjson.Fragment``): the
    fields are found in it all the same, on a local decode and on both legs of a P/D one."""
    prefill, decode = await start_engine(), await start_engine()
    sidecar = await start_sidecar_with(decode_url=decode.url)
    fields = {"kv_transfer_params": "CLIENT-CHOSEN", "bootstrap_room": 7, "kept": kept}
    value = {"extra_args": fields} if carrier == "sampling_params" else fields
    client = chat(max_tokens=2, user="u" * (LARGE_BODY_BYTES - len(kept)))
    client[carrier] = value
    raw = orjson.dumps(client)
    assert len(raw) > LARGE_BODY_BYTES
    for headers in ({}, {"x-prefiller-host-port": prefill.endpoint}):
        async with http.post(
            sidecar.url + "/v1/chat/completions", data=io.BytesIO(raw), headers=headers
        ) as response:
            assert response.status == 200
    legs = await engine_requests(http, decode) + await engine_requests(http, prefill)
    assert len(legs) == 3
    rest = {"kept": kept}
    for leg in legs:
        expected = {"extra_args": rest} if carrier == "sampling_params" else rest
        assert leg["body"][carrier] == expected
        assert leg["body"]["user"] == client["user"]
    assert await _held(http, sidecar) == 0


# --- counting values --------------------------------------------------------------------------


def _reference(document: Any) -> int:
    count = 1

    def walk(node: Any) -> None:
        nonlocal count
        if isinstance(node, dict | list):
            items = list(node.values()) if isinstance(node, dict) else node
            count += len(items) + (not items)
            for item in items:
                walk(item)

    walk(document)
    return count


def _document(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["str", "num", "list", "dict", "lit"] if depth < 4 else ["str", "num"])
    if kind == "str":
        return "".join(rng.choice('ab",[{}]\\\n é') for _ in range(rng.randrange(8)))
    if kind == "num":
        return rng.choice([0, -1.5, 10**9])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "list":
        return [_document(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f'k"{i},': _document(rng, depth + 1) for i in range(rng.randrange(4))}


def test_values_are_counted_alike_however_the_body_is_cut() -> None:
    rng = random.Random(21)
    for _ in range(300):
        document = {"messages": [_document(rng) for _ in range(rng.randrange(1, 5))]}
        raw = orjson.dumps(document)
        expected = _reference(document)
        for size in (1, 2, 3, 7, len(raw)):
            count = ElementCount()
            for start in range(0, len(raw), size):
                count.feed(raw[start : start + size])
            assert count.total == expected, (raw, size)


async def test_a_large_completion_keeps_its_long_prompt_as_a_value(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    start_sidecar_with: StartSidecar,
) -> None:
    prefill = await start_engine(max_model_len=10_000_000)
    decode = await start_engine(max_model_len=10_000_000)
    sidecar = await start_sidecar_with(decode_url=decode.url)
    prompt = 'The KV cache moves "from" prefill to decode. ' * 30_000
    client = completion(prompt, max_tokens=2, stop=["x" * 70_000])
    raw = orjson.dumps(client)
    assert len(raw) > LARGE_BODY_BYTES
    async with http.post(
        sidecar.url + "/v1/completions",
        data=io.BytesIO(raw),
        headers={"x-prefiller-host-port": prefill.endpoint},
    ) as response:
        assert response.status == 200
    [prefill_leg] = await engine_requests(http, prefill)
    [decode_leg] = await engine_requests(http, decode)
    assert prefill_leg["body"]["prompt"] == prompt
    decode_leg["body"].pop("kv_transfer_params")
    assert decode_leg["body"] == client
    record = (await get_json(http, sidecar.url + "/debug/requests"))["recent"][0]
    assert record["decision"] == "remote"


def test_long_strings_set_aside_come_back_as_the_client_wrote_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bodies, "LONG_STRING_BYTES", 64)
    monkeypatch.setattr(bodies, "MEMBER_PIECE_BYTES", 64)
    monkeypatch.setattr(bodies, "CHUNK_BYTES", 50)
    rng = random.Random(4)

    def text(size: int) -> str:
        return "".join(rng.choice('ab"\\/é\n{}[],:x') for _ in range(size))

    def node(depth: int = 0) -> Any:
        kind = rng.choice(["short", "long", "list", "dict"] if depth < 3 else ["short", "long"])
        if kind == "short":
            return text(rng.randrange(5))
        if kind == "long":
            return text(rng.randrange(60, 200))
        if kind == "list":
            return [node(depth + 1) for _ in range(rng.randrange(4))]
        return {(text(70) if rng.random() < 0.1 else f"k{i}"): node(depth + 1) for i in range(3)}

    for _ in range(500):
        prompt = rng.choice([text(rng.randrange(200)), [text(100), text(3)]])
        document = {"prompt": prompt, "messages": [node(1)], text(80): node(1), "n": 1}
        raw = orjson.dumps(document)
        found = set_aside(raw)
        assert found is not None
        reduced, aside = found
        assert len(reduced) < len(raw)
        body = bodies.parse_object(reduced)
        members: dict[int, bytes] = {}
        bodies._encode_members(body, aside, members)
        assert body["prompt"] == document["prompt"]  # read by value: parsed back
        assert orjson.loads(orjson.dumps(body)) == document
        # A leg built from the body: its big members go out as pieces, the same bytes.
        leg = {**body, "max_tokens": 1}
        encoded = bodies.encode(leg, members)
        expected = orjson.dumps(leg)
        if any(id(value) in members for value in leg.values()):
            assert isinstance(encoded, bodies.Pieces)
            assert len(encoded) == len(expected)
            chunks = list(encoded.chunks())
            assert max(len(chunk) for chunk in chunks) <= bodies.CHUNK_BYTES
            assert b"".join(chunks) == expected
        else:
            assert encoded == expected


def test_a_body_with_more_quotes_than_scanned_is_parsed_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Looking for long strings costs a step of Python per quote: past the bound, none is set
    aside (the body is parsed as it is)."""
    monkeypatch.setattr(bodies, "LONG_STRING_BYTES", 64)
    monkeypatch.setattr(bodies, "MAX_QUOTES_SCANNED", 10)
    long = "x" * 100
    assert bodies.set_aside(orjson.dumps({"a": long, "b": "y"})) is not None  # 8 quotes
    assert bodies.set_aside(orjson.dumps({"a": long, "b": "y", "c": 1})) is not None  # 10
    assert bodies.set_aside(orjson.dumps({"a": long, "b": "y", "c": "z"})) is None  # 12
    assert bodies.set_aside(orjson.dumps({"a": long, "b": 'y\\"', "c": 1})) is None  # 11


async def test_a_guarded_passthrough_body_is_under_the_same_limits(
    http: aiohttp.ClientSession,
    start_engine: StartEmulator,
    decode: RunningEmulator,
    start_sidecar_with: StartSidecar,
) -> None:
    """A body to another generation route (read to check it for KV fields) counts against the
    byte budget and the size limit like the pipeline's: over either, refused, and the engine
    gets nothing of it."""
    prefill = await start_engine()
    sidecar = await start_sidecar_with(max_body_bytes=BUDGET, body_budget_bytes=BUDGET)
    responses = orjson.dumps({"model": "m", "input": "x" * SIZE})

    async def post_responses(data: bytes) -> int:
        async with http.post(
            sidecar.url + "/v1/responses", data=data, headers={"content-type": "application/json"}
        ) as response:
            return response.status

    before = len(await engine_requests(http, decode))
    assert await post_responses(orjson.dumps({"input": "x" * BUDGET})) == 413
    assert await _refused(http, sidecar, "size") == 1

    await inject(http, prefill, kind="hang", role="prefill")
    client = asyncio.create_task(_post(http, sidecar, _body(), prefill))

    async def first_held() -> bool:
        return await _held(http, sidecar) == SIZE

    await eventually(first_held)
    assert await post_responses(responses) == 503
    assert await _refused(http, sidecar, "budget") == 1
    assert len(await engine_requests(http, decode)) == before  # nothing of either
    await _release(http, prefill)
    status, _ = await client
    assert status == 200

    async def returned() -> bool:
        return await _held(http, sidecar) == 0

    await eventually(returned)
    await post_responses(responses)  # the emulator's answer to the route is not the point
    assert (await engine_requests(http, decode))[-1]["path"] == "/v1/responses"
    assert await _held(http, sidecar) == 0
