"""Request framing: what an engine parses is exactly what the sidecar meant to send it.

The engine here frames requests as vLLM's and SGLang's server does (uvicorn, h11 and httptools:
``tests.uvengine``), and answers a route that does not take the method, or an unknown path,
without reading the body: a body shorter or longer than its framing says would leave the engine
reading the next request on the pooled connection as part of this one. Every client request is
followed by a plain one on the same pool; the engine must then have parsed exactly the requests
the sidecar accepted, each with the body the sidecar meant, and never a client's KV field.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import brotli
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.config import Settings
from sidecar.engines.upstream import HttpClient, Streamed
from sidecar.errors import EngineError
from sidecar.server.runner import RunningSidecar, start_sidecar
from tests.conftest import eventually
from tests.uvengine import RunningUvicorn, Seen, start_uvicorn_engine

pytestmark = pytest.mark.timeout(60)

KV = {"do_remote_prefill": True, "remote_host": "127.0.0.9", "remote_port": 1}
"""KV-transfer fields a client must never get to an engine."""

PIPELINE, PASSTHROUGH, GUARDED, UNKNOWN = (
    "/v1/completions",
    "/v1/models",
    "/v1/responses",
    "/v1/not-a-route",
)
ROUTES = (PIPELINE, PASSTHROUGH, GUARDED, UNKNOWN)


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


async def exchange(port: int, head: bytes, body: bytes = b"") -> Reply:
    """One request written as raw bytes on a connection of its own; the sidecar's answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        while True:
            status_line = await reader.readline()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if not status_line.split()[1].startswith(b"1"):  # 100 Continue: the answer follows
                break
        if "content-length" in headers:
            data = await reader.readexactly(int(headers["content-length"]))
        else:
            data = await reader.read()
        return Reply(int(status_line.split()[1]), headers, data)
    finally:
        writer.close()


def request_head(path: str, headers: dict[str, str], method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: sidecar"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(body: bytes) -> bytes:
    return (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"


def plain_completion(tag: str) -> bytes:
    return orjson.dumps({"model": "emulated-model", "prompt": tag, "max_tokens": 1})


async def follow_up(port: int, tag: str) -> Reply:
    """A plain completion: it reaches the engine on a pooled connection the previous request
    used, and must arrive there whole."""
    body = plain_completion(tag)
    head = request_head(
        PIPELINE, {"content-type": "application/json", "content-length": str(len(body))}
    )
    return await exchange(port, head, body)


@pytest.fixture(params=["h11", "httptools"])
async def engine(request) -> AsyncIterator[RunningUvicorn]:
    running = await start_uvicorn_engine(request.param)
    yield running
    await running.close()


@pytest.fixture
async def proxy(engine: RunningUvicorn) -> AsyncIterator[RunningSidecar]:
    # Requests one after another: each reuses the engine connection the previous one left.
    # Ready before the test starts: hypothesis runs each example in a loop.run_until_complete of
    # its own, so the loop stops between this fixture and the first example, for as long as
    # hypothesis prepares it (seconds, cold, on a loaded machine). The first /health poll, in
    # flight across that stop, would time out, and a rank never found ready is known down: 503.
    # Once ready, three polls in a row must fail, at the default interval, to change that.
    settings = Settings(host="127.0.0.1", port=0, decode_url=engine.url)
    sidecar = await start_sidecar(settings)

    async def ready() -> bool:
        return (await exchange(sidecar.port, request_head("/ready", {}, "GET"))).status == 200

    await eventually(ready)
    yield sidecar
    await sidecar.close()


def gzip_to_empty(length: int) -> bytes:
    """A gzip member of exactly ``length`` bytes (22 to 65,557) that inflates to nothing: an
    empty one (20 bytes) with an extra field (RFC 1952 FEXTRA) of the rest."""
    empty = gzip.compress(b"", mtime=0)
    extra = length - len(empty) - 2
    assert 0 <= extra <= 0xFFFF
    flags = bytes([empty[3] | 0x04])
    return (
        empty[:3] + flags + empty[4:10] + extra.to_bytes(2, "little") + b"\0" * extra + empty[10:]
    )


def assert_engine_saw(engine: RunningUvicorn, expected: list[tuple[str, bytes | None]]) -> None:
    """The engine parsed exactly ``expected`` (path, body or None for unread), no client KV."""
    served = engine.engine.served()
    assert [(seen.path, seen.body) for seen in served] == expected, served
    for seen in served:
        assert b"kv_transfer_params" not in (seen.body or b""), seen
        assert "content-encoding" not in seen.headers, seen.headers


def head_length(seen: Seen) -> int:
    """The bytes of the head the engine parsed (uvicorn keeps every header, in order)."""
    line = len(f"{seen.method} {seen.path} HTTP/1.1\r\n")
    return line + sum(len(n) + len(v) + 4 for n, v in seen.raw_headers) + 2


async def test_gzip_to_empty_body_smuggles_nothing(proxy: RunningSidecar, engine) -> None:
    """The attack: a gzip stream that inflates to nothing, as long as the head the sidecar
    writes for the next request, on a route the engine answers without reading the body; the
    next request's body is a raw generation request with the client's KV fields."""
    inner = orjson.dumps({"model": "emulated-model", "prompt": "x", "kv_transfer_params": KV})
    smuggled = (
        request_head(
            PIPELINE, {"content-type": "application/json", "content-length": str(len(inner))}
        )
        + inner
    )
    carrier = request_head(
        UNKNOWN, {"x-request-id": "carrier", "content-length": str(len(smuggled))}
    )
    # The carrier's head as the sidecar writes it to the engine: its length sizes the gzip.
    assert (await exchange(proxy.port, carrier, smuggled)).status == 404
    length = head_length(engine.engine.served()[-1])
    payload = gzip_to_empty(length)
    assert len(payload) == length
    assert gzip.decompress(payload) == b""
    engine.engine.seen.clear()

    attack = request_head(
        PASSTHROUGH, {"content-encoding": "gzip", "content-length": str(len(payload))}
    )
    reply = await exchange(proxy.port, attack, payload)
    assert reply.status == 415, reply
    assert orjson.loads(reply.body)["error"]["code"] == 415
    assert (await exchange(proxy.port, carrier, smuggled)).status == 404
    reply = await follow_up(proxy.port, "next")
    assert reply.status == 200, reply
    assert_engine_saw(engine, [(UNKNOWN, None), (PIPELINE, plain_completion("next"))])


def coded(body: bytes, coding: str) -> bytes:
    """``body`` in ``coding`` (as a client would compress it); any other name: as it is."""
    if coding == "gzip":
        return gzip.compress(body, mtime=0)
    if coding == "deflate":
        return zlib.compress(body)
    if coding == "br":
        return bytes(brotli.compress(body))
    return body


def client_body(route: str) -> bytes:
    """A body each route class takes, with a client's KV fields."""
    fields = {"model": "emulated-model", "prompt": "hello", "max_tokens": 1}
    if route == GUARDED:
        return orjson.dumps({**fields, "input": "hello"})
    return orjson.dumps({**fields, "kv_transfer_params": KV})


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "identity, gzip", "GZIP"])
async def test_a_coded_body_is_refused_on_every_route(proxy, engine, route, coding) -> None:
    """A compressed body inflates to more (or fewer) bytes than its Content-Length: refused
    before any of it reaches an engine, whatever the route."""
    body = coded(client_body(route) * 50, coding.rsplit(",", 1)[-1].strip().lower())
    head = request_head(
        route,
        {
            "content-type": "application/json",
            "content-encoding": coding,
            "content-length": str(len(body)),
        },
    )
    reply = await exchange(proxy.port, head, body)
    assert reply.status == 415, reply
    assert reply.headers["accept-encoding"] == "identity"
    error = orjson.loads(reply.body)["error"]
    assert error["type"] == "UnsupportedMediaTypeError"
    assert "Content-Encoding" in error["message"]
    assert reply.headers["x-request-id"]
    assert (await follow_up(proxy.port, "next")).status == 200
    assert_engine_saw(engine, [(PIPELINE, plain_completion("next"))])


@functools.cache
def _bomb() -> bytes:
    return gzip.compress(b"[" + b"0," * (16 << 20) + b"0]", mtime=0)


async def test_a_compression_bomb_is_refused_before_it_is_read(proxy, engine) -> None:
    """32 KiB of gzip that would inflate to 32 MiB: neither the body budget nor the element
    cap saw more than the 32 KiB the client sent, before."""
    bomb = await asyncio.to_thread(_bomb)
    assert len(bomb) < 64 << 10
    head = request_head(PIPELINE, {"content-encoding": "gzip", "content-length": str(len(bomb))})
    reply = await exchange(proxy.port, head, bomb)
    assert reply.status == 415, reply
    assert_engine_saw(engine, [])


@pytest.mark.parametrize("route", ROUTES)
async def test_identity_is_no_coding_and_no_framing_header_reaches_an_engine(
    proxy, engine, route
) -> None:
    """``Content-Encoding: identity`` is the body as it is: taken, and the engine frames what
    the sidecar sent by the sidecar's own headers (no Content-Encoding, no Expect of the
    client's)."""
    body = orjson.dumps({"model": "emulated-model", "prompt": "hi", "max_tokens": 1})
    head = request_head(
        route,
        {
            "content-type": "application/json",
            "content-encoding": "identity",
            "expect": "100-continue",
            "content-length": str(len(body)),
        },
    )
    reply = await exchange(proxy.port, head, body)
    assert reply.status == {PIPELINE: 200, PASSTHROUGH: 405, GUARDED: 200, UNKNOWN: 404}[route]
    assert (await follow_up(proxy.port, "next")).status == 200
    read = None if route in (PASSTHROUGH, UNKNOWN) else body
    first = engine.engine.served()[0]
    if route == PIPELINE:  # the pipeline writes its own leg
        read = first.body
        assert orjson.loads(first.body or b"")["prompt"] == "hi"
    assert_engine_saw(engine, [(route, read), (PIPELINE, plain_completion("next"))])
    for seen in engine.engine.served():
        assert "expect" not in seen.headers, seen.headers
        if seen.body is not None:
            assert int(seen.headers["content-length"]) == len(seen.body)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("transfer", ["gzip, chunked", "identity, chunked", "x-zip,chunked"])
async def test_a_transfer_coding_other_than_chunked_is_refused(
    proxy, engine, route, transfer
) -> None:
    body = gzip.compress(client_body(route), mtime=0)
    head = request_head(route, {"content-type": "application/json", "transfer-encoding": transfer})
    reply = await exchange(proxy.port, head, chunked(body))
    assert reply.status == 501, reply
    assert reply.headers.get("connection") == "close"
    assert orjson.loads(reply.body)["error"]["type"] == "NotImplementedError"
    assert (await follow_up(proxy.port, "next")).status == 200
    assert_engine_saw(engine, [(PIPELINE, plain_completion("next"))])


@pytest.mark.parametrize("route", [PASSTHROUGH, UNKNOWN, "/v1/echo"])
async def test_a_chunked_passthrough_body_is_framed_by_the_sidecar(proxy, engine, route) -> None:
    body = b"x" * 70_000
    head = request_head(route, {"transfer-encoding": "chunked"})
    reply = await exchange(proxy.port, head, chunked(body[:1000])[:-5] + chunked(body[1000:]))
    assert reply.status in (200, 404, 405), reply
    assert (await follow_up(proxy.port, "next")).status == 200
    expected = body if route == "/v1/echo" else None
    assert_engine_saw(engine, [(route, expected), (PIPELINE, plain_completion("next"))])


_CODINGS = st.sampled_from(
    [None, "identity", "gzip", "deflate", "br", "identity, gzip", "gzip, identity", "zstd", "x"]
)
_BODIES = st.one_of(
    st.binary(max_size=300),
    st.sampled_from(ROUTES).map(client_body),
    st.builds(
        lambda tag: orjson.dumps({"model": "emulated-model", "prompt": tag, "max_tokens": 1}),
        st.text(max_size=40),
    ),
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    route=st.sampled_from((*ROUTES, "/v1/chat/completions", "/v1/echo")),
    body=_BODIES,
    coding=_CODINGS,
    framing=st.sampled_from(["length", "chunked", "chunks"]),
    declared=st.integers(min_value=-8, max_value=8),
)
async def test_random_bodies_codings_and_lengths(
    proxy, engine, route, body, coding, framing, declared
) -> None:
    """Whatever the body, its coding and how it is framed, the engine parses at most one
    request for it, framed as the sidecar sent it, and the next request arrives whole."""
    engine.engine.seen.clear()
    sent = coded(body, (coding or "").rsplit(",", 1)[-1].strip())
    headers = {"content-type": "application/json"}
    if coding is not None:
        headers["content-encoding"] = coding
    if framing == "length":
        # A Content-Length that may not match what the coded body inflates to; the bytes on
        # the wire always match it.
        headers["content-length"] = str(len(sent))
        wire = sent
    else:
        headers["transfer-encoding"] = "chunked"
        cut = max(0, min(len(sent), len(sent) // 2 + declared))
        wire = (chunked(sent[:cut])[:-5] if cut else b"") + chunked(sent[cut:])
    reply = await exchange(proxy.port, request_head(route, headers), wire)
    if coding not in (None, "identity"):
        assert reply.status == 415, reply
    assert reply.status != 500, reply
    assert (await follow_up(proxy.port, "next")).status == 200
    served = engine.engine.served()
    assert (served[-1].path, served[-1].body) == (PIPELINE, plain_completion("next")), served
    assert len(served) <= 2, served
    for seen in served:
        assert "content-encoding" not in seen.headers
        assert "expect" not in seen.headers
        if seen.body is not None:
            if seen.path != "/v1/echo":  # not a generation route: its body goes on unchanged
                assert b"kv_transfer_params" not in seen.body, seen
            if "content-length" in seen.headers:
                assert int(seen.headers["content-length"]) == len(seen.body)
    if len(served) == 2:
        assert served[0].path == route
        if route == "/v1/echo":
            assert served[0].body == sent


async def _short(data: bytes) -> AsyncIterator[bytes]:
    yield data


@pytest.mark.parametrize(("given", "size"), [(b"12345", 10), (b"123456789012", 10)])
async def test_a_streamed_body_not_its_size_closes_the_engine_connection(
    engine, given: bytes, size: int
) -> None:
    """A body passed on as it comes that gives fewer or more bytes than its framing declared
    fails its send, and the connection is not pooled: the next request arrives whole."""
    client = HttpClient(connect_timeout_s=1.0, limit_per_host=1)
    await client.open()
    try:
        body = Streamed(_short(given), size)
        with pytest.raises(EngineError):
            await client.send("POST", engine.url + "/v1/models", headers={}, data=body)
        answer = await client.send(
            "POST",
            engine.url + PIPELINE,
            headers={"content-type": "application/json"},
            data=plain_completion("next"),
        )
        assert answer.status == 200
        await answer.read()
        answer.close()
    finally:
        await client.close()
    assert engine.engine.served()[-1].body == plain_completion("next")
    assert len(engine.engine.served()) <= 2
