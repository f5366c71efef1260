"""devkit.slowlink: requests reach the target no sooner than the delay, answers come back at once,
order and closes are kept."""

from __future__ import annotations

import asyncio
import time

import pytest

from devkit.slowlink import SlowLink

DELAY_S = 0.3


async def _echo_server(arrivals: list[float]) -> asyncio.Server:
    """Echoes every line, noting when each arrived; closes on EOF."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            arrivals.append(time.monotonic())
            writer.write(line)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


@pytest.mark.asyncio
async def test_bytes_towards_the_target_are_held_for_the_delay_answers_are_not() -> None:
    arrivals: list[float] = []
    server = await _echo_server(arrivals)
    port = server.sockets[0].getsockname()[1]
    async with server, SlowLink("127.0.0.1", port, DELAY_S) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        sent = time.monotonic()
        writer.write(b"one\n")
        writer.write(b"two\n")
        await writer.drain()
        assert await reader.readline() == b"one\n"
        assert await reader.readline() == b"two\n"
        # A second request on the same connection is held too.
        again = time.monotonic()
        writer.write(b"three\n")
        assert await reader.readline() == b"three\n"
        answered = time.monotonic()
        writer.close()
        await writer.wait_closed()

    assert len(arrivals) == 3
    assert arrivals[0] - sent >= DELAY_S
    assert arrivals[2] - again >= DELAY_S
    # The echo came straight back: not held for another delay on its way.
    assert answered - arrivals[2] < DELAY_S


@pytest.mark.asyncio
async def test_a_sender_that_closes_is_delivered_first_then_the_target_sees_the_close() -> None:
    arrivals: list[float] = []
    server = await _echo_server(arrivals)
    port = server.sockets[0].getsockname()[1]
    async with server, SlowLink("127.0.0.1", port, DELAY_S) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(b"last words\n")
        writer.write_eof()
        # The echo comes back, then the target's close reaches the client: the link ends both.
        assert await reader.read() == b"last words\n"
        writer.close()

    assert len(arrivals) == 1


@pytest.mark.asyncio
async def test_a_target_refusing_connections_closes_the_client() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()  # nothing listens on the port any more
    async with SlowLink("127.0.0.1", port, DELAY_S) as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        assert await reader.read() == b""
        writer.close()


@pytest.mark.asyncio
async def test_a_connection_whose_first_bytes_are_spared_is_relayed_at_once() -> None:
    arrivals: list[float] = []
    server = await _echo_server(arrivals)
    port = server.sockets[0].getsockname()[1]
    # A delay no test waits out: a spared connection that were held would time the test out.
    spare = SlowLink("127.0.0.1", port, 60.0, undelayed=lambda head: head.startswith(b"GET "))
    async with server, spare as link:
        reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
        writer.write(b"GET /health\n")
        assert await asyncio.wait_for(reader.readline(), 5) == b"GET /health\n"
        # The whole connection is spared, whatever follows on it.
        writer.write(b"POST later\n")
        assert await asyncio.wait_for(reader.readline(), 5) == b"POST later\n"
        writer.close()

        held_reader, held_writer = await asyncio.open_connection("127.0.0.1", link.port)
        held_writer.write(b"POST /v1/completions\n")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(held_reader.readline(), 0.3)
        held_writer.close()

    assert len(arrivals) == 2
