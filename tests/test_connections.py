"""Client connections: the request-head deadline, the idle keep-alive timeout and the cap
(``sidecar.server.listener``). The slow clients are raw asyncio streams; the timeouts are injected
small through Settings, so that a test waits a fraction of a second, not the defaults' minutes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from sidecar.server.listener import ConnectionLimits, Connections, Slot
from sidecar.server.runner import RunningSidecar
from tests.conftest import (
    StartEmulator,
    StartSidecar,
    completion,
    eventually,
    metric,
    sse_events,
)

HEAD_TIMEOUT_S = 0.4
KEEPALIVE_S = 1.2
SLACK_S = 2.0
"""How late a close may come on a loaded machine (2 cores shared by several test runs)."""
PROBE = b"GET /health HTTP/1.1\r\nHost: sidecar\r\n\r\n"


@contextlib.asynccontextmanager
async def raw(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def closed_after(reader: asyncio.StreamReader, within: float) -> float:
    """Seconds until the server closes the connection (EOF or reset); fails the test after
    ``within`` s. Whatever the server sends before is read and dropped."""
    start = time.monotonic()
    async with asyncio.timeout(within):
        with contextlib.suppress(ConnectionResetError):
            while await reader.read(65536):
                pass
    return time.monotonic() - start


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer with a Content-Length: status, headers (lower-case), body."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


@pytest.mark.parametrize("port", ["api", "admin"])
async def test_a_connection_that_never_sends_is_closed_after_the_head_timeout(
    start_sidecar_with: StartSidecar, port: str
) -> None:
    """Before: open for aiohttp's keep-alive time (3630 s), a task and a descriptor each."""
    sidecar = await start_sidecar_with(client_header_timeout_s=HEAD_TIMEOUT_S, admin_port=0)
    async with raw(sidecar.url if port == "api" else sidecar.admin_url) as (reader, _):
        waited = await closed_after(reader, within=HEAD_TIMEOUT_S + SLACK_S)
    assert waited >= HEAD_TIMEOUT_S * 0.9, waited
    assert await metric_of(sidecar, "closed", f'listener="{port}",reason="head_timeout"') == 1


async def test_a_connection_that_never_sends_is_closed_after_a_shorter_keep_alive_timeout(
    start_sidecar_with: StartSidecar,
) -> None:
    """The listener drops aiohttp's keep-alive timer of a new connection only when the head
    deadline comes first; with a shorter keep-alive time, that timer still closes it."""
    sidecar = await start_sidecar_with(
        client_header_timeout_s=KEEPALIVE_S, client_keepalive_s=HEAD_TIMEOUT_S
    )
    async with raw(sidecar.url) as (reader, _):
        waited = await closed_after(reader, within=KEEPALIVE_S)
    assert HEAD_TIMEOUT_S * 0.9 <= waited < KEEPALIVE_S, waited
    assert await metric_of(sidecar, "closed", 'listener="api",reason="head_timeout"') == 0


async def test_a_head_dripped_a_byte_at_a_time_is_closed_after_the_head_timeout(
    sidecar_with_timeouts: RunningSidecar,
) -> None:
    """Every byte arrives well within the timeout, the head never completes: before, the
    connection stayed open as long as the drip went on (the issue checked 130 s)."""
    sidecar = sidecar_with_timeouts
    async with raw(sidecar.url) as (reader, writer):

        async def drip() -> None:
            for byte in PROBE[:-2]:  # all but the blank line that ends the head
                writer.write(bytes([byte]))
                await asyncio.sleep(HEAD_TIMEOUT_S / 8)  # the client's pace is under test

        dripping = asyncio.create_task(drip())
        try:
            waited = await closed_after(reader, within=HEAD_TIMEOUT_S + SLACK_S)
        finally:
            dripping.cancel()
        assert not dripping.done() or dripping.cancelled()  # it was still dripping
    assert waited >= HEAD_TIMEOUT_S * 0.9, waited
    assert await metric_of(sidecar, "closed", 'listener="api",reason="head_timeout"') == 1


async def test_an_idle_keep_alive_connection_lives_until_the_keep_alive_timeout(
    sidecar_with_timeouts: RunningSidecar,
) -> None:
    """Between two requests a keep-alive connection is idle, not late with a head: it outlives
    the head timeout and is served again, then is closed once idle for the keep-alive timeout
    (before: aiohttp's 3630 s, whatever the setting)."""
    sidecar = sidecar_with_timeouts
    async with raw(sidecar.url) as (reader, writer):
        writer.write(PROBE)
        assert (await read_answer(reader))[0] == 200
        await asyncio.sleep(HEAD_TIMEOUT_S * 1.5)  # idle: the time is what is under test
        writer.write(PROBE)
        status, headers, _ = await read_answer(reader)
        assert status == 200
        assert headers.get("connection", "keep-alive").lower() != "close", headers
        waited = await closed_after(reader, within=KEEPALIVE_S + SLACK_S)
    assert waited >= KEEPALIVE_S * 0.9, waited
    # Idle is not late: the keep-alive timer closed it, not the head deadline.
    assert await metric_of(sidecar, "closed", 'listener="api",reason="head_timeout"') == 0


async def test_a_head_begun_on_a_keep_alive_connection_has_the_head_timeout(
    sidecar_with_timeouts: RunningSidecar,
) -> None:
    """The next request's first byte starts its head's deadline."""
    sidecar = sidecar_with_timeouts
    async with raw(sidecar.url) as (reader, writer):
        writer.write(PROBE)
        assert (await read_answer(reader))[0] == 200
        writer.write(b"GET /heal")
        waited = await closed_after(reader, within=HEAD_TIMEOUT_S + SLACK_S)
    assert HEAD_TIMEOUT_S * 0.9 <= waited < KEEPALIVE_S, waited
    assert await metric_of(sidecar, "closed", 'listener="api",reason="head_timeout"') == 1


async def test_a_head_begun_during_the_previous_answer_has_the_head_timeout_from_the_answer(
    start_engine: StartEmulator, start_sidecar_with: StartSidecar
) -> None:
    """A client that starts its next request while a stream is being answered, then sends
    nothing more: the stream (longer than the head timeout) is not cut, and the next head's
    deadline runs from the end of the answer, not the keep-alive timeout. (Bytes of the next
    head that come in the same segment as the end of the previous request are not seen apart:
    such a connection is bounded by the keep-alive timeout, as an idle one.)"""
    decode = await start_engine(decode_s_per_token=0.05)
    sidecar = await start_sidecar_with(
        decode_url=decode.url,
        client_header_timeout_s=HEAD_TIMEOUT_S,
        client_keepalive_s=KEEPALIVE_S,
        admin_port=0,
    )
    body = orjson.dumps(completion(stream=True, max_tokens=20))  # 1 s: over the head timeout
    async with raw(sidecar.url) as (reader, writer):
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json"
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await reader.readuntil(b"data: ")  # the answer has begun
        writer.write(b"GET /heal")
        await reader.readuntil(b"data: [DONE]")
        waited = await closed_after(reader, within=HEAD_TIMEOUT_S + SLACK_S)
    assert HEAD_TIMEOUT_S * 0.9 <= waited < KEEPALIVE_S, waited
    assert await metric_of(sidecar, "closed", 'listener="api",reason="head_timeout"') == 1


async def test_a_long_stream_outlives_both_timeouts(
    http: aiohttp.ClientSession, start_engine: StartEmulator, start_sidecar_with: StartSidecar
) -> None:
    """A request whose head arrived is never cut by the head or keep-alive timeouts, however
    long its answer streams."""
    decode = await start_engine(decode_s_per_token=0.05)
    sidecar = await start_sidecar_with(
        decode_url=decode.url, client_header_timeout_s=0.2, client_keepalive_s=0.2
    )
    started = time.monotonic()
    body = completion(stream=True, max_tokens=20)  # 1 s of tokens: 5 times either timeout
    async with http.post(sidecar.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        raw_body = await response.read()
    assert time.monotonic() - started >= 20 * 0.05 * 0.9
    events = sse_events(raw_body)
    assert events[-1] == b"[DONE]", events[-3:]
    assert len(events) >= 20


async def test_a_body_slower_than_the_head_timeout_is_not_cut(
    sidecar_with_timeouts: RunningSidecar,
) -> None:
    """Once the head is complete the head deadline is over: the body has its own timeout
    (SIDECAR_CLIENT_BODY_TIMEOUT_S, 30 s here)."""
    sidecar = sidecar_with_timeouts
    body = orjson.dumps(completion(max_tokens=2))
    async with raw(sidecar.url) as (reader, writer):
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json"
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        await asyncio.sleep(HEAD_TIMEOUT_S * 2)  # the client's pace is under test
        writer.write(body)
        status, _, answer = await read_answer(reader)
    assert status == 200, answer
    assert orjson.loads(answer)["choices"][0]["text"], answer


async def test_at_the_cap_a_new_connection_is_refused_and_counted_while_probes_answer(
    http: aiohttp.ClientSession, start_engine: StartEmulator, start_sidecar_with: StartSidecar
) -> None:
    """Two connections busy with streams fill a cap of 2: a third gets 503 and is closed, while
    the kubelet's probes, each on a new connection, still get 200. Once the streams end, new
    connections are served again."""
    decode = await start_engine(decode_s_per_token=0.05)
    sidecar = await start_sidecar_with(decode_url=decode.url, max_connections=2, admin_port=0)
    await eventually(lambda: status_of(http, sidecar.admin_url + "/ready", 200))
    # Each stream on a connection of its own.
    streams = [asyncio.create_task(stream_on_new_connection(sidecar.url)) for _ in range(2)]
    await eventually(lambda: _open_connections(sidecar, 2))

    async with raw(sidecar.url) as (reader, writer):
        request = b"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\nContent-Length: 2\r\n\r\n{}"
        writer.write(request)
        status, headers, body = await read_answer(reader)
        assert status == 503, body
        assert headers["connection"].lower() == "close", headers
        assert b"SIDECAR_MAX_CONNECTIONS" in body, body
        await closed_after(reader, within=SLACK_S)
    assert await metric_of(sidecar, "refused", 'how="answered",listener="api"') == 1

    for path in ("/health", "/ready"):
        async with raw(sidecar.url) as (reader, writer):
            writer.write(f"GET {path} HTTP/1.1\r\nHost: sidecar\r\n\r\n".encode())
            status, headers, body = await read_answer(reader)
            assert status == 200, (path, body)
            assert headers["connection"].lower() == "close", headers
    assert not any(stream.done() for stream in streams)  # the cap was full all along

    assert await asyncio.gather(*streams) == [True, True]
    await eventually(lambda: _open_connections(sidecar, 0))
    async with http.post(sidecar.url + "/v1/completions", json=completion(max_tokens=2)) as after:
        assert after.status == 200, await after.text()
    assert await metric_of(sidecar, "refused", 'how="answered",listener="api"') == 1


async def test_at_the_cap_a_new_connection_takes_the_place_of_the_oldest_waiting_one(
    http: aiohttp.ClientSession, start_sidecar_with: StartSidecar
) -> None:
    """Connections that have sent no request (a slow client's, a silent one's) give way to a
    new one: a cap filled by them does not keep anyone out."""
    sidecar = await start_sidecar_with(max_connections=2, admin_port=0)
    async with raw(sidecar.url) as (first, _), raw(sidecar.url):
        await eventually(lambda: _open_connections(sidecar, 2))
        async with http.post(sidecar.url + "/v1/completions", json=completion()) as response:
            assert response.status == 200, await response.text()
        await closed_after(first, within=SLACK_S)  # the oldest made room
        # The second one and the client's kept-alive one: the second was left open.
        assert await _open_connections(sidecar, 2)
    assert await metric_of(sidecar, "closed", 'listener="api",reason="evicted"') == 1
    assert await metric_of(sidecar, "refused", "how=") == 0


async def stream_on_new_connection(url: str) -> bool:
    """A streamed completion of 2 s on a connection of its own; True when it ended in [DONE]."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url + "/v1/completions", json=completion(stream=True, max_tokens=40)
        ) as response,
    ):
        body = await response.read()
    return response.status == 200 and sse_events(body)[-1] == b"[DONE]"


async def status_of(http: aiohttp.ClientSession, url: str, status: int) -> bool:
    async with http.get(url) as response:
        return response.status == status


async def _open_connections(sidecar: RunningSidecar, count: int) -> bool:
    async with aiohttp.ClientSession() as session:
        return (
            await metric(
                session, sidecar.admin_url, 'pd_sidecar_client_connections{listener="api"}'
            )
            == count
        )


async def metric_of(sidecar: RunningSidecar, family: str, labels: str) -> float:
    """``pd_sidecar_client_connections_<family>_total``'s samples whose labels (in the
    exposition's alphabetical order) start with ``labels``, summed."""
    async with aiohttp.ClientSession() as session:
        sample = f"pd_sidecar_client_connections_{family}_total{{{labels}"
        return await metric(session, sidecar.admin_url, sample)


@pytest.fixture
async def sidecar_with_timeouts(start_sidecar_with: StartSidecar) -> RunningSidecar:
    return await start_sidecar_with(
        client_header_timeout_s=HEAD_TIMEOUT_S, client_keepalive_s=KEEPALIVE_S, admin_port=0
    )


class Waiting:
    """What the book needs of a connection: its place, and a close."""

    def __init__(self) -> None:
        self.slot: Slot | None = None
        self.booked = False
        self.served = False
        self.closed = False
        self.tier: dict[Waiting, None] | None = None

    def force_close(self) -> None:
        self.closed = True


def test_the_book_past_the_probe_only_places_closes_at_once() -> None:
    """The order of the places, without sockets: full, then the oldest waiting one gives way
    (never-served before idle keep-alive), then probe-only, then the oldest waiting probe-only
    one gives way, then nothing: closed at once, counted."""
    refused: list[str] = []
    closed: list[str] = []
    book = Connections(
        ConnectionLimits(head_timeout_s=1, keepalive_s=1, max_connections=2, overflow=1),
        on_refused=refused.append,
        on_closed=closed.append,
    )

    def connect(waiting: bool = True) -> Waiting:
        connection = Waiting()
        connection.slot = book.admit(connection)  # type: ignore[arg-type]
        connection.booked = connection.slot is not None
        if waiting and connection.booked:
            book.waiting(connection)  # type: ignore[arg-type]
        return connection

    idle, fresh = connect(), connect()
    idle.served = True
    book.busy(idle)  # type: ignore[arg-type]
    book.waiting(idle)  # type: ignore[arg-type]  # back from an answer: keep-alive
    third = connect()
    assert (third.slot, fresh.closed, idle.closed) == (Slot.FULL, True, False)
    book.busy(third)  # type: ignore[arg-type]  # its head came
    fourth = connect()
    assert (fourth.slot, idle.closed, third.closed) == (Slot.FULL, True, False)
    book.busy(fourth)  # type: ignore[arg-type]
    probe = connect()
    assert probe.slot is Slot.PROBE
    second_probe = connect()
    assert (second_probe.slot, probe.closed) == (Slot.PROBE, True)
    book.busy(second_probe)  # type: ignore[arg-type]
    assert connect().slot is None
    assert (refused, closed) == (["closed"], ["evicted"] * 3)
    assert book.open == 3
    book.release(third)  # type: ignore[arg-type]
    book.release(third)  # type: ignore[arg-type]  # idempotent
    assert book.open == 2
    assert connect().slot is Slot.FULL
