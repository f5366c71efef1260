"""The sync's own connection (sidecar/scheduling/state/resp.py), on a real redis-server: the
URLs it speaks (a password, a user, a database, a Unix socket), the script loaded again when
Redis forgot it, a connection lost and opened again, errors that fail a sync and not a
decision; and the Redis backend's syncs travelling over it rather than redis-py's pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sidecar.scheduling.prefixes import DIGEST_BYTES
from sidecar.scheduling.state import Load
from sidecar.scheduling.state.redis import RedisState
from sidecar.scheduling.state.resp import RespConnection, command, supports
from tests.conftest import eventually
from tests.processes import RedisServer, free_port

A = "127.0.0.11:8000"
PASSWORD = "s3cret"


class Clock:
    """Unix time the test moves (the backend's backoff after a failed sync is read from it)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def locked_server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    """A password for the default user, a user of its own, and a Unix socket beside the port."""
    server = RedisServer(
        free_port(),
        "--requirepass", PASSWORD,
        "--user", "sync", "on", f">{PASSWORD}2", "~*", "&*", "+@all",
        "--unixsocket", str(tmp_path / "redis.sock"), "--unixsocketperm", "700",
    )  # fmt: skip
    await server.start()
    yield server
    await server.stop()


def test_a_command_is_one_array_of_bulk_strings() -> None:
    assert command("EVALSHA", "ab", 2, b"\xff\x00") == (
        b"*4\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n2\r\n$2\r\n\xff\x00\r\n"
    )


def test_the_urls_it_speaks_and_those_left_to_redis_py() -> None:
    assert supports("redis://127.0.0.1:6379/0")
    assert supports("redis://user:pw@redis.llm.svc:6380/3")
    assert supports("unix:///run/redis.sock?db=2")
    assert not supports("rediss://redis.llm.svc:6380/0")  # TLS: redis-py's client
    assert not supports("redis://127.0.0.1:6379/0?socket_keepalive=true")


async def test_a_script_redis_forgot_is_sent_whole_and_then_called_by_its_digest(
    redis_server,
) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    conn = RespConnection(redis_server.url, timeout_s=1.0)
    sha = client.register_script("return ARGV[1]").sha
    try:
        assert await conn.call("PING") == b"PONG"
        assert await conn.evalsha(sha, "return ARGV[1]", (), ["one"]) == b"one"
        assert await conn.evalsha(sha, "return ARGV[1]", (), ["two"]) == b"two"
        await client.script_flush()
        assert await conn.evalsha(sha, "return ARGV[1]", (), ["three"]) == b"three"
        stats = await client.info("commandstats")
        assert stats["cmdstat_eval"]["calls"] == 2  # once at first, once after the flush
        assert stats["cmdstat_evalsha"]["calls"] == 3
    finally:
        conn.close()
        await client.aclose()


async def test_an_error_reply_raises_and_leaves_the_connection_in_step(redis_server) -> None:
    conn = RespConnection(redis_server.url, timeout_s=1.0)
    try:
        with pytest.raises(ResponseError, match="unknown command"):
            await conn.call("NO-SUCH-COMMAND")
        assert await conn.call("ECHO", "after") == b"after"
    finally:
        conn.close()


async def test_a_lost_connection_fails_one_call_and_the_next_opens_another(
    redis_server,
) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    conn = RespConnection(redis_server.url, timeout_s=1.0)
    try:
        await conn.call("CLIENT", "SETNAME", "the-sync")
        killed = await client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        assert killed == 1
        with pytest.raises((RedisConnectionError, OSError)):
            await conn.call("PING")
        assert await conn.call("PING") == b"PONG"
    finally:
        conn.close()
        await client.aclose()


async def test_no_reply_in_time_times_out_and_the_next_call_is_in_step(redis_server) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    conn = RespConnection(redis_server.url, timeout_s=0.2)
    try:
        await client.client_pause(500)  # Redis reads the command and answers after 0.5 s
        with pytest.raises(TimeoutError):
            await conn.call("ECHO", "late")
        await client.client_unpause()
        assert await conn.call("ECHO", "next") == b"next"  # not the late answer
    finally:
        conn.close()
        await client.aclose()


@pytest.mark.parametrize(
    "url",
    [
        "redis://:{password}@127.0.0.1:{port}/3",
        "redis://sync:{password}2@127.0.0.1:{port}/3",
        "unix://:{password}@{socket}?db=3",
    ],
    ids=["password", "user", "unix-socket"],
)
async def test_two_sidecars_share_reservations_over_each_url(locked_server, tmp_path, url) -> None:
    """Its password (or user), its database and its socket are the URL's: the reservations of
    one sidecar reach the other, in database 3."""
    url = url.format(password=PASSWORD, port=locked_server.port, socket=tmp_path / "redis.sock")
    one = RedisState(url, prefix="urls", lease_s=30, timeout_s=1)
    two = RedisState(url, prefix="urls", lease_s=30, timeout_s=1)
    check = aioredis.Redis(port=locked_server.port, password=PASSWORD, db=3)
    try:
        await one.start()
        await two.start()
        # Registered first: a refresh joins the sync in flight, and two's first sync (its
        # worker's) could otherwise have read the totals before one's reservation reached them.
        await eventually(lambda: _true(one.connected and two.connected))
        one.reserve(A, 70)
        await one.refresh()
        await two.refresh()
        assert two.view().loads[A] == Load(70, 1)
        assert one.connected
        assert two.connected
        assert await check.exists(one.keys[4]) == 1
    finally:
        await one.close()
        await two.close()
        await check.aclose()


async def test_a_wrong_password_fails_the_sync_not_the_decision(locked_server) -> None:
    clock = Clock()
    errors: list[str] = []
    url = f"redis://:wrong@127.0.0.1:{locked_server.port}/0"
    state = RedisState(url, prefix="wrong", lease_s=30, timeout_s=1, on_error=errors.append,
                       clock=clock)  # fmt: skip
    try:
        await state.start()
        state.reserve(A, 10)
        await state.refresh()
        assert not state.connected
        assert "connection" in errors
        assert "WRONGPASS" in str(state.last_error)
        assert state.view().loads[A] == Load(10, 1)  # the decision has its local view
    finally:
        await state.close()


async def test_the_backend_syncs_over_its_own_connection_and_survives_losing_it(
    redis_server,
) -> None:
    """The syncs go over one connection of their own, named after the sidecar (redis-py's
    client would name none), the script loaded on the first; killed, the next sync after the
    backoff opens another."""
    clock = Clock()
    client = aioredis.Redis.from_url(redis_server.url)
    state = RedisState(redis_server.url, prefix="own", lease_s=30, timeout_s=1, clock=clock)
    try:
        await state.start()
        state.reserve(A, 5)
        await state.refresh()
        assert state.connected
        syncs = [c for c in await client.client_list() if c["cmd"] in ("evalsha", "eval")]
        assert len(syncs) == 1
        assert syncs[0]["name"] == f"pd-sidecar-sync-{state.status()['sidecar_id']}"
        killed = await client.execute_command("CLIENT", "KILL", "ID", syncs[0]["id"])
        assert killed == 1
        await state.refresh()  # the lost connection: this sync fails, and Redis is backed off
        assert not state.connected
        clock.now += 1.0  # past the first backoff (0.5 s)
        state.reserve(A, 6)
        await state.refresh()
        assert state.connected
        assert state.view().loads[A] == Load(11, 2)
        stats = await client.info("commandstats")
        assert stats["cmdstat_eval"]["calls"] == 1  # loaded once; the digest since
    finally:
        await state.close()
        await client.aclose()


async def test_a_refresh_leaves_at_its_budget_and_the_sync_answers_the_view_later(
    redis_server,
) -> None:
    """Redis paused: the decision's refresh gives up at its budget (a timeout counted, the view
    as it was); the sync it began goes on, and its answer, when Redis resumes, is the view."""
    errors: list[str] = []
    client = aioredis.Redis.from_url(redis_server.url)
    other = RedisState(redis_server.url, prefix="late", lease_s=600, timeout_s=1)
    state = RedisState(redis_server.url, prefix="late", lease_s=600, timeout_s=0.05,
                       on_error=errors.append)  # fmt: skip
    try:
        await state.start()
        await other.start()
        await other.refresh()
        await state.refresh()  # its worker's first sync (the registration) is over by now
        await state.refresh()
        assert errors == []
        other.reserve(A, 40)
        await other.refresh()
        await client.ping()
        assert await client.execute_command("CLIENT", "PAUSE", "400", "ALL")
        loop = asyncio.get_running_loop()
        started = loop.time()
        await state.refresh()
        assert loop.time() - started < 0.3
        assert errors == ["timeout"]
        assert A not in state.view().loads
        await other.refresh()  # answered when the pause ends, after the late sync's
        await state.refresh()  # no newer sync needed: the late answer is in
        assert state.view().loads[A] == Load(40, 1)
    finally:
        await state.close()
        await other.close()
        await client.aclose()


BLOCKS = [bytes([1]) * DIGEST_BYTES, bytes([2]) * DIGEST_BYTES]
"""A prompt's block digests, as the prefix share carries them."""


def documented_acl(password: str) -> list[str]:
    """docs/deploy.md's ``ACL SETUSER`` line for the sidecars' Redis user, as an argv."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    [line] = [s.strip() for s in text.splitlines() if s.strip().startswith("ACL SETUSER ")]
    return line.replace("PASSWORD", password).split()


async def test_a_user_granted_the_documented_commands_alone_syncs_and_shares(
    redis_server, caplog
) -> None:
    """A least-privilege user (docs/deploy.md's line: no ``client|setname``) syncs, shares
    prefixes and gives its lease up, its connections unnamed: the name refused is logged, and
    no other command was (the syncs used to fail on it, every one). Database 3, so that
    ``select`` is needed."""
    clock = Clock()
    admin = aioredis.Redis.from_url(redis_server.url)
    await admin.execute_command(*documented_acl(PASSWORD))
    url = f"redis://sidecar:{PASSWORD}@127.0.0.1:{redis_server.port}/3"
    learnt: list[tuple[str, list[bytes]]] = []
    one = RedisState(url, prefix="pd-sidecar", lease_s=30, timeout_s=1, clock=clock)
    two = RedisState(url, prefix="pd-sidecar", lease_s=30, timeout_s=1, clock=clock)
    one.share_prefixes(lambda endpoint, hashes: None)
    two.share_prefixes(lambda endpoint, hashes: learnt.append((endpoint, list(hashes))))
    try:
        with caplog.at_level(logging.INFO, logger="sidecar.scheduling.state"):
            await one.start()
            await two.start()
            # Registered (their first syncs, which a refresh would join, are over).
            await eventually(lambda: _true(one.connected and two.connected))
            one.reserve(A, 70)
            one.publish_prefix(A, BLOCKS)
            await one.refresh()
            await two.refresh()
            assert two.view().loads[A] == Load(70, 1)
            assert (one.last_error, two.last_error) == (None, None)
            await eventually(lambda: _true(bool(learnt)))
            assert learnt == [(A, BLOCKS)]
            syncs = [c for c in await admin.client_list() if c["cmd"] in ("evalsha", "eval")]
            assert syncs
            assert {c["name"] for c in syncs} == {""}
        refused = [r for r in caplog.records if "refused to name" in r.getMessage()]
        assert len(refused) == 2
        assert "NOPERM" in refused[0].getMessage()
        sidecar = one.status()["sidecar_id"]
        await one.close()
        check = aioredis.Redis(port=redis_server.port, db=3)
        try:
            assert await check.zscore(one.keys[0], sidecar) is None  # its lease given up
        finally:
            await check.aclose()
        denied = {entry["object"] for entry in await admin.acl_log()}
        assert "client|setname" in denied
        assert denied <= {"client|setname", "client|setinfo"}
    finally:
        await one.close()
        await two.close()
        await admin.aclose()


async def _true(value: bool) -> bool:
    return value


async def test_a_refresh_during_close_starts_no_sync_beside_the_goodbye(redis_server) -> None:
    """A decision's refresh arriving while the backend closes: it starts no sync on the
    connection the goodbye is about to use (two commands in flight on one connection: the
    second read failed, or read the first's reply). Redis is paused so that such a sync would
    still be unanswered when the goodbye goes; the goodbye waits out the pause."""
    state = RedisState(redis_server.url, prefix="closing", lease_s=30, timeout_s=0.005)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await state.start()
        await eventually(lambda: _true(state.connected))
        sidecar = state.status()["sidecar_id"]
        assert await admin.zscore(state.keys[0], sidecar) is not None
        assert await admin.execute_command("CLIENT", "PAUSE", "300", "ALL")
        closing = asyncio.create_task(state.close())
        await asyncio.sleep(0)  # close has begun: it is stopping the worker
        await state.refresh()
        assert state._sync is None
        await closing
        assert await admin.zscore(state.keys[0], sidecar) is None  # the goodbye went through
    finally:
        await state.close()
        await admin.aclose()


async def test_a_name_refused_is_logged_once_and_not_asked_again(redis_server, caplog) -> None:
    """The connection opened anew after it was lost does not ask for the name again."""
    admin = aioredis.Redis.from_url(redis_server.url)
    await admin.execute_command(*documented_acl(PASSWORD))
    url = f"redis://sidecar:{PASSWORD}@127.0.0.1:{redis_server.port}/0"
    conn = RespConnection(url, timeout_s=1.0, name="pd-sidecar-sync-test")
    try:
        with caplog.at_level(logging.INFO, logger="sidecar.scheduling.state"):
            assert await conn.evalsha("0" * 40, "return 7", (), []) == 7
            killed = await admin.execute_command("CLIENT", "KILL", "USER", "sidecar")
            assert killed == 1
            with pytest.raises((RedisConnectionError, OSError)):
                await conn.call("EVALSHA", "0" * 40, 0)
            assert await conn.evalsha("0" * 40, "return 8", (), []) == 8
        refused = [r for r in caplog.records if "refused to name" in r.getMessage()]
        assert len(refused) == 1
        assert "NOPERM" in refused[0].getMessage()
        [entry] = await admin.acl_log()
        assert (entry["object"], entry["count"]) == ("client|setname", 1)
    finally:
        conn.close()
        await admin.aclose()


async def test_a_sync_the_worker_began_during_close_ends_before_the_goodbye(
    redis_server,
) -> None:
    """A change wakes the worker while ``close`` stops the prefix share: the sync the worker
    begins then is stopped with it, before the goodbye uses the connection. Redis is paused so
    that the sync would still be unanswered when the goodbye goes."""
    state = RedisState(redis_server.url, prefix="closing", lease_s=30, timeout_s=0.005)
    state.share_prefixes(lambda endpoint, hashes: None)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await state.start()
        await eventually(lambda: _true(state.connected))
        sidecar = state.status()["sidecar_id"]
        assert await admin.execute_command("CLIENT", "PAUSE", "300", "ALL")
        closing = asyncio.create_task(state.close())
        state.reserve(A, 10)  # wakes the worker, after close has begun
        await closing
        assert await admin.zscore(state.keys[0], sidecar) is None  # the goodbye went through
    finally:
        await state.close()
        await admin.aclose()


async def test_close_returns_though_the_prefix_sharer_missed_its_cancel(redis_server) -> None:
    """A cancel that meets a Redis answer can be lost (Python 3.11's ``asyncio.wait_for``,
    which redis-py uses): the prefix share's task, its call swallowing the cancel, still ends
    at close (one close in a few hundred never returned at 256 sidecars sharing prefixes)."""
    state = RedisState(redis_server.url, prefix="swallow", lease_s=30, timeout_s=1)
    state.share_prefixes(lambda endpoint, hashes: None)
    await state.start()
    calling = asyncio.Event()

    async def swallowing(**_: object) -> None:
        calling.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # the answer that never comes, the cancel lost

    state._share_script = swallowing
    try:
        state.publish_prefix(A, BLOCKS)
        await calling.wait()
    finally:
        async with asyncio.timeout(5):
            await state.close()


async def test_a_client_slow_to_close_fails_no_shutdown(redis_server) -> None:
    """redis-py gives up closing a connection after its timeout and raises: the backend's
    close returns all the same (an overloaded process shutting down, seen at 1,024 sidecars
    on a Cluster)."""
    state = RedisState(redis_server.url, prefix="slow-close", lease_s=30, timeout_s=1)
    await state.start()
    client = state._client
    assert client is not None
    closing = client.aclose

    async def slow_to_close() -> None:
        await closing()
        raise RedisTimeoutError("Timed out closing connection after 1.0")

    client.aclose = slow_to_close  # type: ignore[method-assign]
    await state.close()  # returns, raises nothing
    assert state._client is None
