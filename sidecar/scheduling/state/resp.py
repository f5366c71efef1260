"""A bare RESP2 connection to a standalone Redis, for the shared-state sync: one command at a
time, its reply parsed by hiredis, and nothing else.

Why not redis-py's client for this one call: a command through ``redis.asyncio`` takes a
connection from the pool, wraps the call in its retry and observability machinery, reads
through its parser's own timeout, and gives the connection back — about 100 µs of this process's
CPU per command on the machine of ``docs/benchmarks.md``, four times the round trip itself. The
sync is one command at a time by its protocol (``protocol.SyncProtocol``: one sync in flight),
so a connection of its own needs no pool, no lock and no multiplexing: write the command, read
until hiredis has the reply.

Opened from ``SIDECAR_REDIS_URL`` as redis-py reads it (``redis://`` or ``unix://``, a user, a
password, a database); ``rediss://`` and any other option in the URL stay with redis-py's client
(``supports``), as does a Redis Cluster (its client follows the slots).

A connection that failed — an error, a timeout, a cancellation with a command unanswered, the
peer gone, a reply over the bounds (``replies``, checked before hiredis parses it) — is closed;
the next ``call`` opens a new one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import hiredis
from redis.asyncio.connection import UnixDomainSocketConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from sidecar.scheduling.state.replies import ReplyBounds

_PLAIN = frozenset({"username", "password", "host", "port", "db", "path", "connection_class"})
"""What ``parse_url`` may return for a URL this connection speaks to (``connection_class``
only as a Unix socket's)."""
READ_BYTES = 65536

logger = logging.getLogger("sidecar.scheduling.state")


def supports(url: str) -> bool:
    """Whether ``url`` is one this connection opens (else redis-py's client does)."""
    options = parse_url(url)
    kind = options.get("connection_class", UnixDomainSocketConnection)
    return set(options) <= _PLAIN and kind is UnixDomainSocketConnection


def command(*args: str | bytes | int) -> bytes:
    """``args`` as one RESP2 array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class RespConnection:
    """One command at a time (the caller's to ensure: a second concurrent ``call`` would read
    the first's reply); ``timeout_s`` bounds opening and each command. ``name``: the
    connection's name in Redis (``CLIENT SETNAME``, shown by ``CLIENT LIST``), if any; best
    effort: refused (the user may not name its connections), it is logged once and dropped."""

    def __init__(self, url: str, *, timeout_s: float, name: str | None = None) -> None:
        self._options = parse_url(url)
        self._timeout_s = timeout_s
        self._name = name
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._parser = hiredis.Reader()
        self._bounds = ReplyBounds()

    async def call(self, *args: str | bytes | int) -> Any:
        """The reply to one command: bytes, an int, a list of them (hiredis's types). An error
        reply raises ``ResponseError`` (``NoScriptError`` for ``NOSCRIPT``), a connection
        that fails raises ``ConnectionError`` or ``OSError``, a reply over the bounds
        ``replies.ReplyRefused``, no reply in time ``TimeoutError``: the connection is then
        closed."""
        try:
            async with asyncio.timeout(self._timeout_s):
                if self._writer is None:
                    try:
                        await self._open()
                    except BaseException:
                        self.close()  # not in step, or not authenticated: never used so
                        raise
                return await self._roundtrip(command(*args))
        except ResponseError:
            raise  # Redis answered: the connection is in step
        except BaseException:
            self.close()
            raise

    async def evalsha(self, sha: str, script: str, keys: tuple[str, ...], args: list[Any]) -> Any:
        """The script by its digest, sent whole (and so loaded) when Redis does not know it
        (a restart, a failover, a ``SCRIPT FLUSH``)."""
        try:
            return await self.call("EVALSHA", sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.call("EVAL", script, len(keys), *keys, *args)

    def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        self._parser = hiredis.Reader()  # a half-read reply must not prefix the next one's
        self._bounds.reset()
        if writer is not None:
            writer.close()

    async def _open(self) -> None:
        options = self._options
        if "path" in options:
            reader, writer = await asyncio.open_unix_connection(options["path"])
        else:
            reader, writer = await asyncio.open_connection(
                options.get("host", "localhost"), options.get("port", 6379)
            )
        self._reader, self._writer = reader, writer
        password = options.get("password")
        if password is not None:
            user = options.get("username")
            auth = ("AUTH", password) if user is None else ("AUTH", user, password)
            await self._roundtrip(command(*auth))
        if options.get("db", 0):
            await self._roundtrip(command("SELECT", options["db"]))
        if self._name is not None:
            try:
                await self._roundtrip(command("CLIENT", "SETNAME", self._name))
            except ResponseError as exc:
                # A name is a convenience: a user without ``client|setname`` (an ACL granting
                # the syncs' commands alone) syncs all the same, unnamed, and is not asked again.
                logger.info(
                    "redis refused to name the shared-state sync's connection %s (%s); it "
                    "goes unnamed",
                    self._name,
                    exc,
                )
                self._name = None

    async def _roundtrip(self, packed: bytes) -> Any:
        reader, writer, parser, bounds = self._reader, self._writer, self._parser, self._bounds
        assert reader is not None
        assert writer is not None
        writer.write(packed)
        reply = parser.gets()
        while reply is False:
            data = await reader.read(READ_BYTES)
            if not data:
                raise RedisConnectionError("the connection was closed by the server")
            bounds.check(data)  # before hiredis allocates what the headers announce
            parser.feed(data)
            reply = parser.gets()
        if isinstance(reply, hiredis.ReplyError):
            text = str(reply)
            raise (NoScriptError if text.startswith("NOSCRIPT") else ResponseError)(text)
        return reply
