"""What Redis answers, bounded before hiredis allocates it.

hiredis parses a reply as it arrives and allocates each aggregate at its header: ``*2000000000``
(13 bytes) made it allocate a list of two billion slots, whose release took about 5 s of the
event loop on every sync; a bulk string's header makes it buffer whatever follows until the
announced length is in. hiredis bounds its buffer (``setmaxbuf``), not what a header announces.
So every byte read from Redis is first walked by ``ReplyBounds``, which reads each header (the
type byte and its number, skipping bulk bodies by their length) and refuses a reply that
announces more than ``MAX_REPLY_BYTES`` bytes, ``MAX_REPLY_ELEMENTS`` aggregate elements or
``MAX_DEPTH`` nested aggregates — when the header is read, before hiredis sees it and before the
body is read. A refusal raises ``ReplyRefused`` (a redis-py ``InvalidResponse``: the connection
is out of step and is closed).

Every path that parses Redis's replies goes through it: the syncs' own connection (``resp``),
and redis-py's client (the prefix share, ``rediss://``, a Redis Cluster, whose topology replies
too), through ``BoundedHiredisParser``. The bounds are far above any reply of ours (a sync's
is one string of at most 1.2 MiB; the prefix share's at most 1,024 entries, ~250 KiB; a
cluster's layout a few elements per slot range), and low enough that the worst reply within
them holds the loop tens of milliseconds, not seconds (``bench/resp_bounds.py``).
"""

from __future__ import annotations

from typing import Any

from redis._parsers import _AsyncHiredisParser
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse

MAX_REPLY_BYTES = 4 * 1024 * 1024
"""Bytes of one reply, headers included."""
MAX_REPLY_ELEMENTS = 16384
"""Elements of one reply's aggregates together (a map's pair counts twice)."""
MAX_DEPTH = 8
"""Aggregates open inside one another (ours nest three deep at most)."""
MAX_LINE_BYTES = 64 * 1024
"""A header or a simple reply (``+``, ``-``, ``:``, ...) longer than this is refused."""

_AGGREGATES = {ord("*"): 1, ord("~"): 1, ord(">"): 1, ord("%"): 2}
"""RESP2 and RESP3 aggregate types, and the elements each announced entry holds."""
_BULKS = frozenset(b"$=!")
_LINES = frozenset(b"+-:,#_(")


class ReplyRefused(InvalidResponse):
    """A reply announced more than the bounds allow, or is not RESP; nothing of it was parsed."""


class ReplyBounds:
    """Walks a connection's incoming bytes, in the order read, ahead of the parser: ``check``
    every chunk before feeding it. Replies follow one another on the stream; each is bounded on
    its own. ``reset`` when the connection is closed (a half-read reply must not prefix the
    next connection's)."""

    __slots__ = ("_carry", "_elements", "_open", "_skip", "_used")

    def __init__(self) -> None:
        self._carry = b""
        """An incomplete header line, from the end of the previous chunk."""
        self._skip = 0
        """Bytes of a bulk body (and its CRLF) still to come."""
        self._open: list[int] = []
        """Elements still to come in each open aggregate, outermost first."""
        self._used = 0
        """Bytes of the current reply so far, bulk bodies counted in full at their header."""
        self._elements = 0

    def reset(self) -> None:
        self._carry = b""
        self._skip = 0
        self._open = []
        self._used = 0
        self._elements = 0

    def check(self, data: bytes) -> None:
        """Raises ``ReplyRefused`` if ``data`` (the next bytes read) takes a reply past the
        bounds; the state is then undefined (close the connection)."""
        skip = self._skip
        if skip:
            if skip > len(data):
                self._skip = skip - len(data)
                return
            self._skip = 0
            buf, pos = data, skip
            self._done()
        elif self._carry:
            buf, pos = self._carry + data, 0
            self._carry = b""
        else:
            buf, pos = data, 0
        size = len(buf)
        find = buf.find
        pending = self._open
        used = self._used
        while pos < size:
            end = find(b"\r\n", pos)
            if end < 0:
                if size - pos > MAX_LINE_BYTES:
                    raise ReplyRefused(f"a line of the reply is over {MAX_LINE_BYTES} bytes")
                self._used = used
                self._carry = buf[pos:]
                return
            kind = buf[pos]
            used += end + 2 - pos
            if kind in _LINES:
                if end - pos > MAX_LINE_BYTES:
                    raise ReplyRefused(f"a line of the reply is over {MAX_LINE_BYTES} bytes")
                pos = end + 2
            else:
                try:
                    count = int(buf[pos + 1 : end])
                except ValueError:
                    header = buf[pos : min(end, pos + 32)]
                    raise ReplyRefused(f"not a RESP header: {header!r}") from None
                pos = end + 2
                if kind in _BULKS:
                    if count >= 0:  # else a null
                        used += count + 2
                        if used > MAX_REPLY_BYTES:
                            raise ReplyRefused(
                                f"a bulk string of {count} bytes takes the reply over "
                                f"{MAX_REPLY_BYTES} bytes"
                            )
                        pos += count + 2
                        if pos > size:
                            self._used = used
                            self._skip = pos - size
                            return
                else:
                    per = _AGGREGATES.get(kind)
                    if per is None:
                        raise ReplyRefused(f"a reply of type {chr(kind)!r} is not read")
                    if count > 0:  # else empty, or a null: an element that ended
                        elements = self._elements + count * per
                        if elements > MAX_REPLY_ELEMENTS:
                            raise ReplyRefused(
                                f"an aggregate of {count} entries takes the reply over "
                                f"{MAX_REPLY_ELEMENTS} elements"
                            )
                        if len(pending) >= MAX_DEPTH:
                            raise ReplyRefused(f"aggregates nested over {MAX_DEPTH} deep")
                        self._elements = elements
                        pending.append(count * per)
                        continue
            # An element ended: one fewer to come in its aggregate (the rest is ``_done``'s).
            if pending and pending[-1] > 1:
                pending[-1] -= 1
            else:
                self._used = used
                self._done()
                used = self._used
        self._used = used

    def _done(self) -> None:
        """An element ended: so do the aggregates it completes, and the reply with the last."""
        pending = self._open
        while pending:
            left = pending[-1] - 1
            if left:
                pending[-1] = left
                return
            pending.pop()
        self._used = 0
        self._elements = 0


class BoundedHiredisParser(_AsyncHiredisParser):
    """redis-py's hiredis parser, each chunk read walked by ``ReplyBounds`` before it is fed
    (``parser_class`` of redis-py's connections). What it overrides is the parser's own read
    (``read_from_socket``: read, then feed hiredis), with the bounds' check between the two."""

    def on_connect(self, connection: Any) -> None:
        super().on_connect(connection)  # type: ignore[no-untyped-call]
        self._bounds = ReplyBounds()

    def on_disconnect(self) -> None:
        super().on_disconnect()  # type: ignore[no-untyped-call]
        self._bounds = ReplyBounds()

    async def read_from_socket(self) -> bool:
        stream: Any = self._stream
        buffer = await stream.read(self._read_size)
        if not buffer or not isinstance(buffer, bytes):
            raise RedisConnectionError("the connection was closed by the server") from None
        self._bounds.check(buffer)  # before hiredis allocates what the headers announce
        reader: Any = self._reader
        reader.feed(buffer)
        return True


def bound_cluster(client: RedisCluster) -> RedisCluster:
    """``client``'s connections parse with ``BoundedHiredisParser``: those of the nodes it was
    given and of those it discovers. (``RedisCluster`` takes no ``parser_class``; its nodes are
    made from its connection keywords, which the nodes it discovers share.)"""
    client.connection_kwargs["parser_class"] = BoundedHiredisParser
    for node in client.startup_nodes:
        node.connection_kwargs["parser_class"] = BoundedHiredisParser
    return client
