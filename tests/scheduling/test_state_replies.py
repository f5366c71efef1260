"""What Redis answers is bounded before hiredis allocates it (sidecar/scheduling/state/replies.py):
the walk itself, then a hostile peer on loopback answering each client the sidecar has — its
syncs' own connection, redis-py's client (the prefix share, a URL with options, ``rediss://``)
and the cluster client — with a reply that announces two billion elements or a gigabyte."""

from __future__ import annotations

import asyncio
import functools
import random
import ssl
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import hiredis
import pytest

from sidecar.scheduling.state.redis import RedisState
from sidecar.scheduling.state.replies import (
    MAX_DEPTH,
    MAX_LINE_BYTES,
    MAX_REPLY_BYTES,
    MAX_REPLY_ELEMENTS,
    ReplyBounds,
    ReplyRefused,
)
from sidecar.scheduling.state.resp import RespConnection
from tests.conftest import eventually
from tests.tlsfiles import Pki

HUGE_ARRAY = b"*2000000000\r\n"
HUGE_BULK = b"$1000000000\r\n"
HALF = MAX_REPLY_BYTES // 2

LEGIT = [
    b"+OK\r\n",
    b"-ERR unknown command\r\n",
    b":42\r\n",
    b"$-1\r\n",
    b"*-1\r\n",
    b"*0\r\n",
    b"$0\r\n\r\n",
    b"$13\r\n*2000000000\r\n\r\n",  # a header's bytes inside a body are a body
    b"*3\r\n$3\r\none\r\n*2\r\n:1\r\n$-1\r\n*2\r\n*1\r\n+x\r\n$2\r\n\r\n\r\n",
    b"%2\r\n+a\r\n:1\r\n+b\r\n*1\r\n,1.5\r\n",
    b"~2\r\n#t\r\n_\r\n",
    b"*2\r\n$300\r\n" + b"x" * 300 + b"\r\n" + b"*2048\r\n" + b"$1\r\ny\r\n" * 2048,
]


def test_every_split_of_a_stream_of_replies_is_walked_as_hiredis_reads_it() -> None:
    stream = b"".join(LEGIT)
    reader = hiredis.Reader()
    reader.feed(stream)
    replies = 0
    while reader.gets() is not False:
        replies += 1
    assert replies == len(LEGIT)
    rng = random.Random(7)
    for cuts in [list(range(1, len(stream)))] + [
        sorted(rng.sample(range(1, len(stream)), 40)) for _ in range(200)
    ]:
        bounds = ReplyBounds()
        for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            bounds.check(stream[start:end])
        # Every reply ended: nothing carried, skipped or open.
        assert (bounds._carry, bounds._skip, bounds._open, bounds._used) == (b"", 0, [], 0)


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (HUGE_ARRAY, "2000000000 entries"),
        (HUGE_BULK, "1000000000 bytes"),
        (b"*2\r\n:1\r\n%10000\r\n", "over 16384 elements"),  # a map's pairs count twice
        (b"*1\r\n" * MAX_DEPTH + b"*1\r\n", "nested"),
        (b"*2\r\n$%d\r\n%s\r\n$%d\r\n" % (HALF, b"x" * HALF, HALF), "over 4194304 bytes"),
        (b"+" + b"x" * (MAX_LINE_BYTES + 1), "line"),
        (b"|1\r\n+a\r\n+b\r\n+c\r\n", "type '|'"),
        (b"*?\r\n", "not a RESP header"),
    ],
    ids=["array", "bulk", "elements", "depth", "reply-bytes", "line", "attribute", "streamed"],
)
def test_a_reply_over_the_bounds_is_refused_at_its_header(reply: bytes, message: str) -> None:
    """Each case ends with the header over the bounds: refused once it is whole, before any
    of what it announces."""
    bounds = ReplyBounds()
    bounds.check(b"$3\r\nabc\r\n")  # a reply before it is no part of it
    head = max(0, len(reply) - 32)
    bounds.check(reply[:head])

    def byte_by_byte() -> None:  # refused when the header is whole
        for byte in range(head, len(reply)):
            bounds.check(reply[byte : byte + 1])

    with pytest.raises(ReplyRefused, match=message):
        byte_by_byte()


def test_the_bounds_are_per_reply() -> None:
    """Two replies each within the bounds pass, however many follow one another."""
    bounds = ReplyBounds()
    half = b"*%d\r\n" % (MAX_REPLY_ELEMENTS // 2 + 1) + b":1\r\n" * (MAX_REPLY_ELEMENTS // 2 + 1)
    big = b"$%d\r\n" % (MAX_REPLY_BYTES // 2) + b"x" * (MAX_REPLY_BYTES // 2) + b"\r\n"
    for _ in range(3):
        bounds.check(half)
        bounds.check(big)


class Hostile:
    """A peer that answers whatever it is sent with ``reply``, then says nothing more and keeps
    the connection open (so a client that waits for the rest waits until its timeout): what a
    compromised Redis, or something on the path to it, could answer."""

    def __init__(self, reply: bytes, context: ssl.SSLContext | None = None) -> None:
        self.reply = reply
        self.context = context
        self.answered = 0
        self.closed = 0
        """Connections the client closed (it read EOF from us never)."""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in self._writers:
                writer.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if await reader.read(65536):
                writer.write(self.reply)
                await writer.drain()
                self.answered += 1
            while await reader.read(65536):  # whatever else it sends goes unanswered
                pass
            self.closed += 1
        except (ConnectionError, ssl.SSLError):
            self.closed += 1
        finally:
            self._writers.discard(writer)
            writer.close()


@pytest.fixture(params=[HUGE_ARRAY, HUGE_BULK], ids=["array", "bulk"])
async def hostile(request: pytest.FixtureRequest) -> AsyncIterator[Hostile]:
    peer = Hostile(request.param)
    await peer.start()
    yield peer
    await peer.close()


LAG_S = 0.5
"""The loop lag the tests allow: what the bounds prevent is seconds (two billion slots freed);
what a busy test machine adds to a 5 ms sleep is up to a few hundred milliseconds. The worst
reply the bounds let through is measured by bench/resp_bounds.py."""


class LoopLag:
    """The longest the loop was held between two turns of a 5 ms ticker."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, loop.time() - before - 0.005)


async def test_the_syncs_connection_refuses_the_reply_at_its_header(hostile) -> None:
    """Refused as soon as the header is in — no body was ever sent, and the timeout is far —
    without allocating what it announced, the loop never held, the connection closed."""
    conn = RespConnection(f"redis://127.0.0.1:{hostile.port}/0", timeout_s=5.0)
    tracemalloc.start()
    try:
        async with LoopLag() as lag:
            with pytest.raises(ReplyRefused, match="takes the reply over"):
                await conn.call("PING")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        conn.close()
    assert hostile.answered == 1
    assert peak < 1024 * 1024
    assert lag.worst < LAG_S
    await eventually(lambda: _true(hostile.closed == 1))


async def _true(value: bool) -> bool:
    return value


async def _failed(state: RedisState) -> bool:
    return state.last_error is not None


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


URLS: dict[str, Callable[[int, Pki], str]] = {
    # Options in the URL: redis-py's client syncs, as it always shares prefixes.
    "redis-py": lambda port, pki: f"redis://127.0.0.1:{port}/0?socket_keepalive=true",
    "rediss": lambda port, pki: f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={pki.ca_file}",
    "cluster": lambda port, pki: f"redis://127.0.0.1:{port}/0",
}


@pytest.mark.parametrize("client", list(URLS))
async def test_redis_pys_clients_refuse_the_reply_at_its_header(
    request: pytest.FixtureRequest, client: str, pki: Pki
) -> None:
    """The backend through redis-py's client (standalone with URL options, TLS, Cluster) against
    the hostile peer: the sync fails at once with the refusal, whichever of its commands met the
    reply first, and the loop is never held."""
    context = None
    if client == "rediss":
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(*pki.issue("127.0.0.1")[:2])
    for reply in (HUGE_ARRAY, HUGE_BULK):
        peer = Hostile(reply, context)
        await peer.start()
        errors: list[str] = []
        state = RedisState(
            URLS[client](peer.port, pki),
            prefix="hostile",
            cluster=client == "cluster",
            lease_s=30,
            timeout_s=5.0,
            on_error=errors.append,
        )
        state.share_prefixes(lambda endpoint, hashes: None)
        tracemalloc.start()
        try:
            async with LoopLag() as lag:
                await state.start()
                await eventually(functools.partial(_failed, state))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await state.close()
            await peer.close()
        assert peer.answered >= 1
        assert errors == ["connection"]
        # The refusal's own words (the cluster client wraps it in an exception of its own).
        assert "takes the reply over" in str(state.last_error), state.last_error
        assert peak < 8 * 1024 * 1024
        assert lag.worst < LAG_S
