"""The subscriber's ZMTP reader against hostile peers: each bound is checked on a frame's header,
before its body is read, and ends the connection; heartbeats lose a silent peer and answer a
live one. Peers are raw asyncio servers speaking ZMTP on loopback (what a hostile engine can
send that libzmq would not), and pyzmq's libzmq sockets (what an engine sends)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import struct
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import zmq
import zmq.asyncio

from sidecar.kvevents import zmtp

from .helpers import WAIT_S
from .test_silent_publisher import until

KIB = 1024
MIB = 1024 * KIB
LIMITS = zmtp.Limits(max_frame_bytes=4 * KIB, max_frames=3, max_message_bytes=6 * KIB)

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One frame the client sent: its flags and body."""
    flags = (await reader.readexactly(1))[0]
    if flags & zmtp.FLAG_LONG:
        (size,) = struct.unpack(">Q", await reader.readexactly(8))
    else:
        size = (await reader.readexactly(1))[0]
    return flags, await reader.readexactly(size)


@contextlib.asynccontextmanager
async def raw_peer(
    serve: Serve, *, socket_type: bytes = b"PUB", minor: int = 1, mechanism: bytes = b"NULL"
) -> AsyncIterator[int]:
    """A ZMTP peer on loopback: its greeting (version 3.``minor``, ``mechanism``) and READY as
    ``socket_type``, the client's greeting and READY read, then ``serve``; yields its port."""
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        signature = zmtp.SIGNATURE + bytes((3, minor)) + mechanism.ljust(20, b"\x00")
        writer.write(signature.ljust(zmtp.GREETING_BYTES, b"\x00"))
        writer.write(zmtp.ready_command(socket_type))
        try:
            assert (await reader.readexactly(zmtp.GREETING_BYTES))[:11] == zmtp.SIGNATURE + b"\x03"
            flags, body = await read_frame(reader)
            assert flags & zmtp.FLAG_COMMAND
            assert body.startswith(b"\x05READY")
            await serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client ended the connection: what the tests expect of it
        finally:
            writer.close()
            done.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def connected(
    port: int, limits: zmtp.Limits = LIMITS, heartbeat_s: float = 0.0, socket_type: bytes = b"SUB"
) -> zmtp.Connection:
    return await asyncio.wait_for(
        zmtp.connect(
            "127.0.0.1",
            port,
            socket_type=socket_type,
            limits=limits,
            heartbeat_s=heartbeat_s,
            ready=asyncio.Event(),
            subscribe=b"kv" if socket_type == b"SUB" else None,
        ),
        WAIT_S,
    )


async def ended(connection: zmtp.Connection) -> str:
    """Why the connection ended, once it did (within ``WAIT_S``)."""
    await asyncio.wait_for(connection.wait(), WAIT_S)
    assert connection.error is not None
    return str(connection.error)


async def stay_open(reader: asyncio.StreamReader) -> None:
    """Read (and ignore) what the client sends until it ends the connection."""
    while await reader.read(4096):
        pass


def long_frame(size: int, *, more: bool) -> bytes:
    return zmtp.frame(b"x" * size, more=more)


async def test_a_message_of_many_frames_ends_the_connection_at_the_frame_past_its_count() -> None:
    """100 frames of 1 KiB, in one message: three are read, the fourth's header ends it: the
    reader never held more than three frames (libzmq would have held all 100 first)."""
    frames = 100

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i in range(frames):
            writer.write(long_frame(KIB, more=i < frames - 1))
        await stay_open(reader)

    async with raw_peer(serve) as port:
        connection = await connected(port)
        reason = await ended(connection)
    assert "more than 3 frames" in reason
    header = 1 + 8  # flags, an 8-byte size
    assert connection.bytes_read == 3 * (header + KIB) + header
    assert connection.messages_read == 0
    await connection.close()


async def test_a_frame_over_the_limit_is_refused_on_its_header() -> None:
    """A header announcing 1 GiB, and its body coming: the connection ends on the header, not
    one byte of the body read."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(bytes((zmtp.FLAG_LONG,)) + struct.pack(">Q", 1 << 30))
        writer.write(b"x" * (64 * KIB))
        await stay_open(reader)

    async with raw_peer(serve) as port:
        connection = await connected(port)
        reason = await ended(connection)
    assert f"a frame of {1 << 30} bytes" in reason
    assert connection.bytes_read == 9
    await connection.close()


async def test_a_message_over_its_bytes_is_refused_on_the_header_past_them() -> None:
    """Two frames of 4 KiB (each within the frame limit) in a message bounded at 6 KiB: the
    second's header ends the connection before its body."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(long_frame(4 * KIB, more=True) + long_frame(4 * KIB, more=False))
        await stay_open(reader)

    async with raw_peer(serve) as port:
        connection = await connected(port)
        reason = await ended(connection)
    assert f"more than {6 * KIB} bytes" in reason
    assert connection.bytes_read == 9 + 4 * KIB + 9
    await connection.close()


async def test_an_oversized_command_is_refused_on_its_header() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(bytes((zmtp.FLAG_COMMAND | zmtp.FLAG_LONG,)) + struct.pack(">Q", 1 << 20))
        await stay_open(reader)

    async with raw_peer(serve) as port:
        connection = await connected(port)
        assert "a command of" in await ended(connection)
    assert connection.bytes_read == 9
    await connection.close()


async def test_the_queue_of_messages_read_is_bounded() -> None:
    """A peer sending 1,000 messages to a reader nobody takes from: it reads ``max_queued``
    (and the one after, held until there is room), then stops reading the socket."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(1000):
            writer.write(zmtp.frame(b"kv", more=True) + zmtp.frame(b"x" * 100))
            await writer.drain()
        await stay_open(reader)

    async with raw_peer(serve) as port:
        connection = await connected(port)
        await asyncio.wait_for(connection.wait(), WAIT_S)
        for _ in range(50):  # room for the peer's writes to arrive, were they read
            await asyncio.sleep(0.01)
        assert connection.messages_read == LIMITS.max_queued
        assert connection.error is None
        taken = [connection.take() for _ in range(LIMITS.max_queued)]
        assert taken == [[b"kv", b"x" * 100]] * LIMITS.max_queued
        await connection.close()


async def test_a_peer_that_stops_answering_pings_is_lost() -> None:
    """Heartbeats every 50 ms: the peer reads the PINGs and answers none, and sends nothing:
    the connection is lost 150 ms after the last traffic."""
    pings: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            flags, body = await read_frame(reader)
            if flags & zmtp.FLAG_COMMAND and body.startswith(b"\x04PING"):
                pings.append(body)

    async with raw_peer(serve) as port:
        connection = await connected(port, heartbeat_s=0.05)
        assert "nothing received" in await ended(connection)
    assert len(pings) >= 2
    assert pings[0] == b"\x04PING\x00\x00"  # a TTL of 0, no context
    await connection.close()


async def test_a_peer_that_answers_pings_is_kept_and_its_pings_are_answered() -> None:
    """The peer answers each PING with a PONG and sends one PING of its own: the connection
    lives through many heartbeat timeouts, and the PONG echoes the PING's context."""
    pongs: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(zmtp.command(b"PING", b"\x00\x0a" + b"ctx"))
        while True:
            flags, body = await read_frame(reader)
            if flags & zmtp.FLAG_COMMAND and body.startswith(b"\x04PING"):
                writer.write(zmtp.command(b"PONG", body[7:]))
            elif flags & zmtp.FLAG_COMMAND and body.startswith(b"\x04PONG"):
                pongs.append(body)

    async with raw_peer(serve) as port:
        connection = await connected(port, heartbeat_s=0.02)
        await asyncio.sleep(0.3)  # 5 heartbeat timeouts
        assert connection.error is None
        assert connection.pings_sent >= 5
        await connection.close()
    assert pongs == [b"\x04PONGctx"]


async def test_a_zmtp_3_0_peer_gets_a_subscription_message_and_no_pings() -> None:
    first: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first.set_result(await read_frame(reader))
        await stay_open(reader)

    async with raw_peer(serve, minor=0) as port:
        connection = await connected(port, heartbeat_s=0.01)
        assert await asyncio.wait_for(first, WAIT_S) == (0, b"\x01kv")
        await asyncio.sleep(0.1)  # 10 intervals: no PING, and no timeout either
        assert (connection.pings_sent, connection.error) == (0, None)
        await connection.close()


async def test_a_zmtp_3_1_peer_gets_a_subscribe_command() -> None:
    first: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first.set_result(await read_frame(reader))
        await stay_open(reader)

    async with raw_peer(serve) as port:
        connection = await connected(port)
        assert await asyncio.wait_for(first, WAIT_S) == (zmtp.FLAG_COMMAND, b"\x09SUBSCRIBEkv")
        await connection.close()


async def test_curve_and_incompatible_socket_types_are_refused() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await stay_open(reader)

    async with raw_peer(serve, mechanism=b"CURVE") as port:
        with pytest.raises(zmtp.ZmtpError, match="'CURVE' is not supported"):
            await connected(port)
    async with raw_peer(serve, socket_type=b"PUSH") as port:
        with pytest.raises(zmtp.ZmtpError, match="cannot talk to"):
            await connected(port)


async def test_a_libzmq_router_s_reply_of_many_frames_ends_the_dealer() -> None:
    """pyzmq's ROUTER (libzmq 4.3) answers the DEALER's request with a message of 200 frames
    of 64 KiB: the reader stops at the fifth frame's header."""
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    chunk = b"x" * (64 * KIB)
    limits = zmtp.Limits(max_frame_bytes=2 * MIB, max_frames=4, max_message_bytes=3 * MIB)
    try:
        dealer = await connected(port, limits, socket_type=b"DEALER")
        dealer.send([b"", b"12345678"])
        identity, empty, start = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
        assert (empty, start) == (b"", b"12345678")
        await router.send_multipart([identity, b"", *[chunk] * 199], copy=False)
        assert "more than 4 frames" in await ended(dealer)
        assert dealer.bytes_read == 2 + 3 * (9 + 64 * KIB) + 9
        await dealer.close()
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("how", ["ended", "closed"])
async def test_what_a_connection_read_is_freed_at_once(how: str) -> None:
    """Once a connection is closed, what it read is freed by reference counting alone, whether
    it ended at a bound (a 2 MiB frame, then a header past the message's bytes) or was closed
    while it read a frame (1.5 MiB of 2 MiB arrived): no error and no cancelled task keeps the
    reader's frames alive in a cycle that only the garbage collector's rare full passes free
    (a publisher that repeats either, connection after connection, grew a sidecar by 250 MiB)."""
    limits = zmtp.Limits(max_frame_bytes=2 * MIB, max_frames=3, max_message_bytes=3 * MIB)
    arrived = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if how == "ended":
            writer.write(long_frame(2 * MIB, more=True) + long_frame(2 * MIB, more=False))
        else:
            writer.write(long_frame(2 * MIB, more=False)[: 9 + 3 * MIB // 2])
        await writer.drain()
        arrived.set()
        await stay_open(reader)

    gc.disable()
    tracemalloc.start()
    try:
        async with raw_peer(serve) as port:
            before = tracemalloc.get_traced_memory()[0]
            connection = await connected(port, limits)
            if how == "ended":
                assert f"more than {3 * MIB} bytes" in await ended(connection)
            else:
                await asyncio.wait_for(arrived.wait(), WAIT_S)
                reading = connection  # the reader is inside the frame's body:
                await until(lambda: reading.bytes_read >= MIB, "1 MiB of the frame read")
                del reading
            assert connection.bytes_read >= MIB
            await connection.close()
            del connection
            held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.enable()
    assert held < 512 * KIB


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
async def test_a_libzmq_pub_takes_the_subscribe_command_and_filters_by_it(host: str) -> None:
    """vLLM publishes with a plain PUB (libzmq 4.3), which filters by what its subscribers
    asked: our ZMTP 3.1 ``SUBSCRIBE`` reaches it, the topic's messages come, others do not.
    A PUB cannot tell when a subscription arrived: it sends until one message comes through."""
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.IPV6, int(":" in host))
    bracketed = f"[{host}]" if ":" in host else host
    port = pub.bind_to_random_port(f"tcp://{bracketed}")
    try:
        sub = await zmtp.connect(
            bracketed,
            port,
            socket_type=b"SUB",
            limits=LIMITS,
            heartbeat_s=1.0,
            ready=asyncio.Event(),
            subscribe=b"kv",
        )
        assert sub.peer_minor == 1  # libzmq 4.3 speaks ZMTP 3.1
        received: list[list[bytes]] = []
        async with asyncio.timeout(WAIT_S):
            while not received:
                await pub.send_multipart([b"other", b"1", b"x"])
                await pub.send_multipart([b"kv", b"2", b"y"])
                await asyncio.sleep(0.01)
                while (message := sub.take()) is not None:
                    received.append(message)
        assert set(map(tuple, received)) == {(b"kv", b"2", b"y")}
        await sub.close()
    finally:
        context.destroy(linger=0)
