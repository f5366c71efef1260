"""A prototype of the exact prefix index kept once in Redis for a whole pool: written by a few
owners per engine from its KV events, queried by every sidecar with one parallel round per
decision. Not wired into the scheduler; ``bench/kv_shared.py`` measures what it costs.

**Keys every process agrees on.** ``KVIndex`` keys a block with Python's ``hash``, which differs
from process to process; here a block's **digest** is a keyed BLAKE2b (``DIGEST_BYTES``) under
the pool's secret, chained as ``KVIndex`` chains its keys: block *i*'s digest hashes block
*i − 1*'s, the block's token ids as 4-byte little-endian unsigned ints, and its ``extra_keys``
entry without the LoRA name (the cache salt on block 0); the root names the block size and
the adapter (its name; a store naming only the engine's id of it is rooted at that id, which no
query names: never a false hit on the base model). A sidecar computes a prompt's digests the
same way from its token ids, on the event loop (``digests``: a 16k-token prompt of 16-token
blocks took 0.78 ms at best, 1.37 ms median, 4.6 ms p90 on a loaded 2-core machine, load 2.5;
the loop serves nothing else meanwhile), so a query matches exactly the blocks an engine stored
for the same tokens under the same identity. Without the secret nobody can compute a prompt's
digests (nor learn anything from the keys but their number), and Redis holds digests and
bitmaps, never token ids or text.

**Where a block is.** The keyspace has ``SHARDS`` shards, each a hash tag of its own
(``ShardLayout``): a block's key is ``{tag of shard d mod S}`` followed by its digest *d*. The tags
are chosen once (by CRC16, ``redis.crc.key_slot``) so that the default even split of a Cluster of
``MASTERS`` masters (what ``redis-cli --cluster create`` makes: 0–5460, 5461–10922,
10923–16383) gives each master ``SHARDS / MASTERS`` shards: a query's keys go to every master in
equal parts. Another split still works (the client asks the cluster where each tag lives), only
less evenly. A key's value is a bitmap: bit *e* (``SETBIT``'s order) set while the endpoint of
index *e* holds the block on GPU. Endpoints get small stable indices (below ``MAX_ENDPOINTS``)
from one hash on the pool's own tag; an index is never reused while that hash lives.

**Writes** (``EngineOwner``): an owner of an engine applies its ``EventBatch``es in order, keeping
what removal needs (the engine's hash → digest, the copies, ``KVIndex``'s "copies under one
hash"), bounded by ``max_blocks`` (``MAX_BLOCKS``; beyond, the least recently stored are
forgotten), and queues ``SETBIT`` 1 (with ``PEXPIRE`` retention) for a store, ``SETBIT`` 0
(with ``PEXPIRE`` retention ``NX``: a key the removal makes again, after it expired, expires
too; Redis 7.0 on) for a removal. ``AllBlocksCleared`` or a ``reset`` clear its bit on every
block it holds: set aside and queued by the next flushes, at most ``CLEAR_CHUNK`` each and as
the queue has room, so a big engine's reset is never dropped for room (a block stored again
meanwhile keeps its bit). The queue is flushed in one pipeline per master every ``FLUSH_S`` or
``FLUSH_OPS`` operations, and bounded (``MAX_PENDING``: beyond, operations are dropped and
counted).

**Retention**: a key expires ``retention_s`` after its last store by any owner; an owner writes
its held blocks again (``sweep``) once they are half that old, so a block an engine keeps is not
forgotten, and a key no engine stores any more is gone within the retention. The expiry is the
key's, not each endpoint's bit's: a bit left set wrongly lasts as long as any other engine keeps
the block (see "Known limits").

**Queries** (``SharedKVIndex.query``): of a prompt's blocks, only ``sample_positions`` are asked
(every block up to ``DENSE_BLOCKS``, then positions growing by ``SPACING`` each, and the prompt's
last full block: 34 keys for a 16k-token prompt of 16-token blocks, 31 for 8k), grouped by shard:
one ``MGET`` on a standalone Redis; on a Cluster one ``MGET`` per shard, pipelined per master, the
masters asked at once: one parallel round, bounded by ``timeout_s``. An endpoint's hit is the last
sampled position up to which every sampled position has its bit: an **under-estimate by less than
the gap to the next sampled position** (none up to ``DENSE_BLOCKS``, then below ``1 − 1/SPACING``
≈ 23 % of the true hit). A block missing between two sampled ones that are held would be
missed, an over-estimate; vLLM frees a request's blocks tail first (in reverse order), so the
blocks an engine holds of a prefix run from block 0 without such holes. A value read back that
is not a bitmap of at most ``MAX_VALUE_BYTES`` is skipped (as if no endpoint held that block)
and counted; a read that fails or times out answers no hits and never raises; after
``FAILURES_BEFORE_BACKOFF`` in a row the next queries wait out a backoff (0.5 s doubling to 5 s),
answering no hits at once.

**Left out** of this prototype: KV-cache groups other than one full-attention group (a store in
another group is skipped and counted), media other than GPU (skipped and counted), hits on
blocks of a LoRA named by id only (never matched), unix sockets (a URL other than
``redis://`` or ``rediss://``, TLS, is refused; TLS is tested on a standalone Redis only),
choosing owners (rendezvous over live members, as ``engines/shared_scrapes`` does) and their
hand-over, wiring into the scheduler and settings, reclaiming endpoint indices, retrying a failed
flush (a lost store under-predicts; a lost removal: see "Known limits"), and a Cluster's
topology change mid-run beyond re-reading it: a round refused with ``MOVED``/``ASK``/
``CLUSTERDOWN`` or failed to connect re-reads it in the background (never under a query's
deadline; a timed-out round re-reads nothing; a master still at its host:port keeps its
connection), a flush re-reads it before taking the queue, and no test reshards a Cluster.
While the topology cannot be read, each failing query (three before the backoff) and each
flush starts another reading.

**Known limits** (by design of this prototype; not fixed):

- *An endpoint's bit can outlive the retention.* The expiry is the key's, and any engine that
  holds the block stores or sweeps the key again every half retention. So a bit left set wrongly
  stays set as long as any other engine keeps that block (a hot prefix: indefinitely), and the
  query credits that endpoint with blocks it does not hold (an over-estimate, a false hit) when:
  a removal is lost (a failed flush, the queue full: counted in ``dropped_ops``); a pod goes
  away without an ``AllBlocksCleared`` its owner applies (a crash, a scale-down: nobody resets
  its bit); or a new pod comes up at the same host:port — endpoint indices are never reclaimed,
  so ``register`` hands it the old index and it inherits the old pod's bits. The fix: a liveness
  lease or an epoch per endpoint index (a query drops the bits of an index whose lease lapsed,
  a new registration takes a new epoch), or a per-endpoint expiry (a hash per block, a field per
  endpoint, ``HPEXPIRE``: Redis 7.4 on).
- *The owners of one engine share its bit.* Every owner writes the same bit; one owner's
  ``reset`` (an ``AllBlocksCleared``, or a gap in the events it received) clears the bit on
  every block it held, erasing what the engine's other owners wrote, until their ``sweep``
  writes those blocks again (up to half a retention later: 300 s by default). Meanwhile the
  queries under-estimate that engine. The fix: one writing owner per engine holding a lease, the
  others standing by.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import math
import ssl
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from sidecar.kvevents.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    EventBatch,
)
from sidecar.kvevents.index import MAX_LOOKUP_TOKENS
from sidecar.scheduling.state.replies import BoundedHiredisParser, ReplyBounds, bound_cluster
from sidecar.scheduling.state.resp import command

log = logging.getLogger("sidecar.kvevents.shared_index")

DIGEST_BYTES = 8
"""A block's digest: two prefixes share one by chance about once in 2⁶⁴ (10⁷ blocks held in a
pool: a collision somewhere about once in 10⁵ pools)."""
SHARDS = 12
MASTERS = 3
"""The Cluster the shard tags are chosen for: ``SHARDS / MASTERS`` shards on each master."""
MAX_ENDPOINTS = 1024
MAX_VALUE_BYTES = MAX_ENDPOINTS // 8
"""A bitmap read back longer than this is no value of ours."""
MAX_ENDPOINT_BYTES = 256
DENSE_BLOCKS = 16
SPACING = 1.3
"""Beyond the first ``DENSE_BLOCKS`` blocks, each sampled position is at least this many times
the one before: 34 keys for 1,023 blocks, 42 for 8,191 (``MAX_LOOKUP_TOKENS``)."""
FLUSH_S = 0.05
FLUSH_OPS = 2048
MAX_PENDING = 65_536
"""Operations queued for Redis at most; beyond, dropped and counted."""
MAX_BLOCKS = 100_000
"""An owner's held blocks per engine at most (``owner``'s default), sized to a budget: an owner
keeps 247–292 bytes per held block (``tracemalloc``, 64,000–100,000 blocks, 64-bit int or
32-byte engine hashes: ``bench/kv_shared.py``), so 25–29 MiB per owned engine, two owned
engines within the 64 MiB a sidecar may spend on shared state. Beyond it, the blocks stored
longest ago are forgotten (their bit cleared: an under-estimate)."""
CLEAR_CHUNK = 16_384
"""A reset's clears queued per flush at most (within ``MAX_PENDING``): a big engine's reset is
written over successive flushes, its held blocks taken lazily, none dropped for room. An owner
sets aside at most twice its ``max_blocks`` (resets faster than the flushes send them: the
oldest set aside are dropped and counted in ``dropped_ops``, their bits left set)."""
RETENTION_S = 600.0
TIMEOUT_S = 0.005
"""A query's round at most. Below the round p99 measured on a loaded 2-core machine (4.5–6.3 ms
standalone, 16–43 ms on a Cluster, beside a ``PING`` round's p99 of 5.3–7.4 ms:
``docs/benchmarks.md``): there, 1 % of the queries or more answer no hits."""
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 5.0
FAILURES_BEFORE_BACKOFF = 3
"""Queries failed in a row before the next ones wait out a backoff: one slow round (a
preemption, a fork) costs one decision its hits, not half a second of decisions'."""
RESOLVE_S = 2.0
"""The longest a re-reading of a Cluster's topology (in the background) takes."""
STALL_S = 1.0
"""A connection whose oldest request has had no reply for this long is closed."""
MAX_IN_FLIGHT = 1024
"""Requests waiting on one connection at most; beyond, a request fails at once."""

_ROOT = b"pd-sidecar shared kv index 1"
_WIDTH = MAX_VALUE_BYTES * 8
_ERRORS = (RedisError, RedisClusterException, OSError, TimeoutError)
_TOKEN = "I"
if array(_TOKEN).itemsize != 4:  # pragma: no cover - every platform CPython supports today
    _TOKEN = "L"


# -- digests --------------------------------------------------------------------------------------


class Hasher:
    """Digests under one pool secret (the same in every process that has it)."""

    __slots__ = ("_base",)

    def __init__(self, secret: bytes) -> None:
        if not 16 <= len(secret) <= 64:
            raise ValueError("the pool secret must be 16 to 64 bytes")
        self._base = hashlib.blake2b(key=secret, digest_size=DIGEST_BYTES)

    def root(self, block_size: int, lora: str | None, lora_id: int | None = None) -> bytes:
        """The digest block 0 chains from: the adapter's name (what a request names), else the
        engine's id of it (as ``index._adapter``: no prompt can name it, so such blocks never
        match, never a false hit on the base model)."""
        h = self._base.copy()
        h.update(_ROOT)
        h.update(block_size.to_bytes(4, "big"))
        if lora is not None:
            h.update(b"\x01" + lora.encode("utf-8", "surrogatepass"))
        elif lora_id is not None:
            h.update(b"\x02" + str(lora_id).encode())
        return h.digest()

    def chain(
        self, parent: bytes, data: bytes, block_bytes: int, extras: Sequence[bytes], count: int
    ) -> list[bytes]:
        """The digests of the first ``count`` blocks of ``data`` (token ids as bytes) after
        ``parent``; ``extras[i]``: block *i*'s ``extra_keys`` entry encoded (``_extra``)."""
        out: list[bytes] = []
        base = self._base
        digest = parent
        for i in range(count):
            h = base.copy()
            h.update(digest)
            h.update(data[i * block_bytes : (i + 1) * block_bytes])
            if extras[i]:
                h.update(extras[i])
            digest = h.digest()
            out.append(digest)
        return out

    def prompt(
        self, token_ids: Sequence[int], block_size: int, *, lora: str | None, salt: str | None
    ) -> list[bytes]:
        """A prompt's digests, of the blocks a hit may cover (vLLM computes at least the last
        token; at most ``MAX_LOOKUP_TOKENS``); [] when a token id is no 32-bit unsigned int."""
        count = min(max(0, len(token_ids) - 1), MAX_LOOKUP_TOKENS) // block_size
        if count <= 0:
            return []
        packed = getattr(token_ids, "packed", None)  # ``tokens.TokenIds``: checked and packed
        if isinstance(packed, bytes) and sys.byteorder == "little":
            data = packed[: count * block_size * 4]
        else:
            try:
                data = _pack(token_ids[: count * block_size])
            except (OverflowError, TypeError):
                return []
        extras = [b""] * count
        if salt:
            extras[0] = _extra((salt,))
        return self.chain(self.root(block_size, lora), data, block_size * 4, extras, count)


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as 4-byte little-endian unsigned ints (the same bytes on every host)."""
    ids = array(_TOKEN, token_ids)
    if sys.byteorder != "little":  # pragma: no cover - every host this runs on
        ids.byteswap()
    return ids.tobytes()


def _freeze(value: object) -> object:
    if isinstance(value, list | tuple):
        return tuple(_freeze(item) for item in value)
    return value


def _extra(entry: object) -> bytes:
    """An ``extra_keys`` entry as hashed: nothing for None, else its ``repr`` (ints, strings,
    tuples of them: the same in every process)."""
    return b"" if entry is None else b"\x00" + repr(_freeze(entry)).encode()


def _store_extras(event: BlockStored, count: int) -> list[bytes] | None:
    """The store's entries without the LoRA name vLLM puts first (as ``index._event_extras``);
    None when they are not one per block."""
    extras = event.extra_keys
    if not extras:
        return [b""] * count
    if len(extras) != count:
        return None
    out = []
    for entry in extras:
        if entry and event.lora_name is not None and entry[0] == event.lora_name:
            entry = entry[1:] or None
        out.append(_extra(entry))
    return out


def sample_positions(count: int) -> list[int]:
    """The block positions a query asks of a prompt of ``count`` blocks, increasing: every one
    below ``DENSE_BLOCKS``, then each at least ``SPACING`` times the last, and the last block."""
    positions = list(range(min(count, DENSE_BLOCKS)))
    position = DENSE_BLOCKS
    while position < count - 1:
        positions.append(position)
        position = max(position + 1, math.floor(position * SPACING))
    if count > DENSE_BLOCKS:
        positions.append(count - 1)
    return positions


# -- the keyspace ---------------------------------------------------------------------------------


class ShardLayout:
    """A pool's shard tags and key names (see the module's docstring)."""

    def __init__(self, pool: str, shards: int = SHARDS, masters: int = MASTERS) -> None:
        self.pool = pool
        span = REDIS_CLUSTER_HASH_SLOTS / masters
        tags: list[bytes] = []
        n = 0
        for shard in range(shards):
            master = shard * masters // shards
            while True:
                tag = f"{pool}.kv{n}".encode()
                n += 1
                if int(key_slot(b"{" + tag + b"}") // span) == master:
                    break
            tags.append(b"{" + tag + b"}")
        self.prefixes = tuple(tags)
        self.endpoints_key = f"{{{pool}}}.kv.endpoints"
        self.next_key = f"{{{pool}}}.kv.next"

    def key(self, digest: bytes) -> bytes:
        return self.prefixes[self.shard(digest)] + digest

    def shard(self, digest: bytes) -> int:
        return int.from_bytes(digest, "big") % len(self.prefixes)


# -- the servers ----------------------------------------------------------------------------------


_SETBIT = b"*4\r\n$6\r\nSETBIT\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$1\r\n%d\r\n"
_PEXPIRE = b"*3\r\n$7\r\nPEXPIRE\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n"
_PEXPIRE_NX = b"*4\r\n$7\r\nPEXPIRE\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$2\r\nNX\r\n"
"""An expiry for a key that has none (Redis 7.0 on): what ``SETBIT`` 0 creates on a key that
expired (or never was) gets the retention too."""


def _mget(keys: Sequence[bytes]) -> bytes:
    return b"*%d\r\n$4\r\nMGET\r\n%b" % (
        len(keys) + 1,
        b"".join([b"$%d\r\n%b\r\n" % (len(key), key) for key in keys]),
    )


class _Channel:
    """One connection to one master, its commands pipelined: a request writes its commands at
    once and is answered by the next replies in order, whoever else is waiting. A request given
    up (its caller's timeout) keeps its place, so the replies after it still go to theirs. The
    connection fails as a whole (every request waiting with it): closed by the peer, a reply over
    the bounds (``ReplyBounds``, before hiredis parses it), no reply for ``STALL_S``, more than
    ``MAX_IN_FLIGHT`` requests waiting; the next request opens a new one. Why not redis-py's
    client: a command through it costs this process tens of µs, a pipeline ~100 µs plus that
    per command (``bench/kv_shared.py`` measured 84 µs of this process per block event)."""

    def __init__(
        self, host: str, port: int, options: Mapping[str, Any], tls: ssl.SSLContext | None
    ) -> None:
        self.host, self.port = host, port
        self._options = options
        self._tls = tls
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._waiting: collections.deque[tuple[int, list[Any], asyncio.Future[list[Any]], float]]
        self._waiting = collections.deque()
        self._lock = asyncio.Lock()

    async def request(self, packed: bytes, replies: int) -> list[Any]:
        """The ``replies`` replies to the commands in ``packed`` (hiredis's types; an error
        reply is a ``hiredis.ReplyError`` among them)."""
        if self._writer is None:
            async with self._lock:
                if self._writer is None:
                    await self._open()
        waiting = self._waiting
        now = time.monotonic()
        if waiting and now - waiting[0][3] > STALL_S:
            self._fail(TimeoutError(f"no reply from {self.host}:{self.port} in {STALL_S} s"))
            return await self.request(packed, replies)
        if len(waiting) >= MAX_IN_FLIGHT:
            raise RedisError(f"{MAX_IN_FLIGHT} requests wait for {self.host}:{self.port}")
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        waiting.append((replies, [], future, now))
        assert self._writer is not None
        self._writer.write(packed)
        return await future

    async def _open(self) -> None:
        if self._tls is None:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        else:
            reader, writer = await asyncio.open_connection(
                self.host, self.port, ssl=self._tls, server_hostname=self.host
            )
        self._writer = writer
        self._reading = asyncio.create_task(self._read(reader), name="shared-kv-replies")
        hello = []
        password = self._options.get("password")
        if password is not None:
            user = self._options.get("username")
            hello.append(("AUTH", password) if user is None else ("AUTH", user, password))
        if self._options.get("db", 0):
            hello.append(("SELECT", self._options["db"]))
        if hello:
            replies = await self.request(b"".join(command(*c) for c in hello), len(hello))
            for reply in replies:
                if isinstance(reply, hiredis.ReplyError):
                    self._fail(RedisError(str(reply)))
                    raise RedisError(f"{self.host}:{self.port}: {reply}")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        parser = hiredis.Reader()
        bounds = ReplyBounds()
        waiting = self._waiting
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    raise RedisConnectionError("the connection was closed by the server")
                bounds.check(data)
                parser.feed(data)
                while waiting:
                    reply = parser.gets()
                    if reply is False:
                        break
                    count, got, future, _ = waiting[0]
                    got.append(reply)
                    if len(got) == count:
                        waiting.popleft()
                        if not future.done():
                            future.set_result(got)
                else:
                    if parser.gets() is not False:
                        raise RedisConnectionError("a reply nobody asked for")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        writer, self._writer = self._writer, None
        reading, self._reading = self._reading, None
        if writer is not None:
            writer.close()
        if reading is not None and reading is not asyncio.current_task():
            reading.cancel()
        while self._waiting:
            future = self._waiting.popleft()[2]
            if not future.done():
                future.set_exception(exc)
                future.exception()  # a caller that gave up never retrieves it

    async def close(self) -> None:
        reading = self._reading
        self._fail(RedisConnectionError("closed"))
        if reading is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await reading


def _tls(options: Mapping[str, Any]) -> ssl.SSLContext | None:
    """The TLS a ``rediss://`` URL asks for, None for ``redis://``: the server's certificate
    checked against the system's CAs or ``ssl_ca_certs``, and its name, unless the URL's
    ``ssl_cert_reqs`` (none, optional) or ``ssl_check_hostname=false`` say otherwise; a client
    certificate from ``ssl_certfile``/``ssl_keyfile`` (redis-py's names for the same options)."""
    if options.get("connection_class") is not SSLConnection:
        return None
    context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
    reqs = str(options.get("ssl_cert_reqs", "required")).lower()
    if reqs not in ("none", "optional", "required"):
        raise ValueError(f"ssl_cert_reqs={reqs!r}: none, optional or required")
    if reqs != "required" or options.get("ssl_check_hostname") is False:
        context.check_hostname = False
    if reqs == "none":
        context.verify_mode = ssl.CERT_NONE
    elif reqs == "optional":
        context.verify_mode = ssl.CERT_OPTIONAL
    if options.get("ssl_certfile"):
        context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"))
    return context


class _Servers:
    """A channel per master, and which master holds each shard: one on a standalone Redis; on a
    Cluster, resolved from its slots (and again after a failed round). redis-py's client serves
    the pool's own keys (the endpoint registry) and a Cluster's topology."""

    def __init__(self, url: str, layout: ShardLayout, *, cluster: bool) -> None:
        if not url.lower().startswith(("redis://", "rediss://")):
            # ``_Channel`` speaks TCP (with TLS for rediss://): a unix:// socket it would not find.
            raise ValueError(
                f"the shared kv index takes redis:// or rediss:// URLs only (no unix socket): "
                f"{url.split('://', 1)[0]}://"
            )
        self._url = url
        self._options = parse_url(url)
        self._tls = _tls(self._options)
        self._layout = layout
        self.cluster: RedisCluster | None = None
        self.standalone: aioredis.Redis | None = None
        self.channels: list[_Channel] = []
        self.of_shard: list[int] = [0] * len(layout.prefixes)
        self._is_cluster = cluster
        self._lock = asyncio.Lock()
        self._refreshing: asyncio.Task[None] | None = None
        self.stale = True

    @property
    def control(self) -> aioredis.Redis | RedisCluster:
        """The client for the pool's own keys (the endpoint registry)."""
        control = self.cluster if self.cluster is not None else self.standalone
        if control is None:
            raise RedisError("the shared kv index is not started")
        return control

    async def resolve(self) -> None:
        async with self._lock:
            if self.stale:
                await self._resolve()

    def failed(self, exc: BaseException) -> None:
        """A round failed with ``exc``: when it says the slots moved or a master is unreachable
        (not a timeout: a slow round says nothing of the topology), re-read the topology in the
        background; the queries meanwhile go where the last reading said."""
        if isinstance(exc, TimeoutError | asyncio.CancelledError) or not isinstance(
            exc, RedisClusterException | RedisConnectionError | OSError
        ):
            return
        self.stale = True
        self.refresh()

    def refresh(self) -> None:
        """Re-read the topology in a task of its own (never under a query's deadline), unless
        one is already under way."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._refresh(), name="shared-kv-topology")

    async def _refresh(self) -> None:
        try:
            async with asyncio.timeout(RESOLVE_S):
                await self.resolve()
        except Exception as exc:
            log.warning(
                "shared kv index: reading the topology failed (%s: %s)", type(exc).__name__, exc
            )

    async def _resolve(self) -> None:
        if not self._is_cluster:
            if self.standalone is None:
                self.standalone = aioredis.Redis.from_url(
                    self._url,
                    socket_connect_timeout=1.0,
                    socket_timeout=1.0,
                    retry_on_timeout=False,
                    parser_class=BoundedHiredisParser,
                )
                host = self._options.get("host", "localhost")
                port = int(self._options.get("port", 6379))
                self.channels = [_Channel(host, port, self._options, self._tls)]
            self.stale = False
            return
        if self.cluster is None:
            self.cluster = bound_cluster(
                RedisCluster.from_url(
                    self._url,
                    socket_connect_timeout=1.0,
                    socket_timeout=1.0,
                    retry=Retry(NoBackoff(), retries=0),
                )
            )
            await self.cluster.initialize()
        else:  # a failed round: the slots may have moved
            await self.cluster.nodes_manager.initialize()
        by_node: dict[tuple[str, int], int] = {}
        old = {(channel.host, channel.port): channel for channel in self.channels}
        channels: list[_Channel] = []
        of_shard = []
        for prefix in self._layout.prefixes:
            node = self.cluster.get_node_from_key(prefix.decode())
            if node is None:
                raise RedisClusterException(f"no node serves {prefix!r}")
            place = (node.host, int(node.port))
            if place not in by_node:
                by_node[place] = len(channels)
                # A master still there keeps its connection, and the requests under way on it.
                kept = old.pop(place, None)
                channels.append(kept or _Channel(*place, self._options, self._tls))
            of_shard.append(by_node[place])
        self.channels, self.of_shard = channels, of_shard
        self.stale = False
        for channel in old.values():
            await channel.close()

    async def close(self) -> None:
        refreshing, self._refreshing = self._refreshing, None
        if refreshing is not None:
            refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refreshing
        for channel in self.channels:
            await channel.close()
        self.channels = []
        if self.cluster is not None:
            await self.cluster.aclose()
            self.cluster = None
        if self.standalone is not None:
            await self.standalone.aclose()
            self.standalone = None


# -- owners ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class OwnerStats:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    dropped: int = 0
    """Held blocks forgotten (their bit cleared) by the ``max_blocks`` cap."""
    unknown_parent: int = 0
    misaligned: int = 0
    other_group: int = 0
    other_medium: int = 0
    swept: int = 0


class EngineOwner:
    """What one owner of one engine writes (see "Writes" in the module's docstring)."""

    def __init__(self, index: SharedKVIndex, endpoint: str, bit: int, *, max_blocks: int) -> None:
        self._index = index
        self.endpoint = endpoint
        self.bit = bit
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[EngineBlockHash, list[Any]] = OrderedDict()
        """Engine hash → [digest, further copies, when last written]; oldest write first."""
        self._clearing: collections.deque[OrderedDict[EngineBlockHash, list[Any]]]
        self._clearing = collections.deque()
        """The held blocks of past resets whose bit is still to clear (``drain``)."""
        self._clearing_count = 0
        self._stored_since: set[bytes] = set()
        """Digests stored since the resets being drained, and held: their clear is not sent
        (at most the held blocks: a block cleared since leaves it)."""
        self.stats = OwnerStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            elif isinstance(event, AllBlocksCleared):
                self.stats.cleared += 1
                self.reset()

    @property
    def clearing(self) -> int:
        """Blocks of past resets whose bit is still to clear."""
        return self._clearing_count

    def reset(self) -> None:
        """Clear this engine's bit on every block it held (a clear, or a gap in its events): the
        held blocks are set aside and their clears queued by the next flushes (``drain``)."""
        if not self._blocks:
            return
        if not self._clearing:
            self._stored_since.clear()
        self._clearing.append(self._blocks)
        self._clearing_count += len(self._blocks)
        self._blocks = OrderedDict()
        while self._clearing_count > 2 * self.max_blocks:  # resets faster than flushes
            lost = self._clearing.popleft()
            self._clearing_count -= len(lost)
            self._index.counters.dropped_ops += len(lost)
        self._index._wake.set()

    def drain(self, limit: int) -> int:
        """Queue at most ``limit`` of the past resets' clears; how many were taken."""
        taken = 0
        clearing = self._clearing
        stored = self._stored_since
        write = self._index._write
        while clearing and taken < limit:
            blocks = clearing[0]
            while blocks and taken < limit:
                _, entry = blocks.popitem(last=False)
                taken += 1
                if entry[0] not in stored:
                    write(entry[0], self.bit, 0)
            if not blocks:
                clearing.popleft()
        self._clearing_count -= taken
        if not clearing:
            stored.clear()
        return taken

    def _store(self, event: BlockStored) -> None:
        count = len(event.block_hashes)
        size = event.block_size
        if event.group_idx:
            self.stats.other_group += count
            return
        if event.medium not in (None, MEDIUM_GPU):
            self.stats.other_medium += count
            return
        extras = _store_extras(event, count)
        if size <= 0 or len(event.token_ids) != size * count or extras is None:
            self.stats.misaligned += count
            return
        try:
            data = _pack(event.token_ids)
        except (OverflowError, TypeError):
            self.stats.misaligned += count
            return
        hasher = self._index.hasher
        if event.parent_block_hash is None:
            parent = hasher.root(size, event.lora_name, event.lora_id)
        else:
            known = self._blocks.get(event.parent_block_hash)
            if known is None:
                self.stats.unknown_parent += count
                return
            parent = known[0]
        digests = hasher.chain(parent, data, size * 4, extras, count)
        now = self._index.clock()
        blocks = self._blocks
        write = self._index._write
        for engine_hash, digest in zip(event.block_hashes, digests, strict=True):
            entry = blocks.get(engine_hash)
            if entry is not None and entry[0] == digest:
                if event.parent_block_hash is not None:
                    entry[1] += 1  # another block computed with the same contents
                if write(digest, self.bit, 1):  # stored again: the last the cap evicts
                    entry[2] = now
                    blocks.move_to_end(engine_hash)
                continue
            if entry is not None:  # the engine reused the hash for other contents
                write(entry[0], self.bit, 0)
                self._stored_since.discard(entry[0])
            blocks[engine_hash] = [digest, 0, now]
            blocks.move_to_end(engine_hash)
            write(digest, self.bit, 1)
            if self._clearing:
                self._stored_since.add(digest)
        self.stats.stored += count
        while len(blocks) > self.max_blocks:
            _, entry = blocks.popitem(last=False)
            write(entry[0], self.bit, 0)
            self._stored_since.discard(entry[0])
            self.stats.dropped += 1

    def _remove(self, event: BlockRemoved) -> None:
        if event.group_idx or event.medium not in (None, MEDIUM_GPU):
            return
        blocks = self._blocks
        for engine_hash in event.block_hashes:
            entry = blocks.get(engine_hash)
            if entry is None:
                continue
            self.stats.removed += 1
            if entry[1]:
                entry[1] -= 1  # one copy went; another still holds the block
                continue
            del blocks[engine_hash]
            self._index._write(entry[0], self.bit, 0)
            self._stored_since.discard(entry[0])

    def sweep(self, now: float, limit: int) -> int:
        """Write again (at most ``limit``, and as the queue has room: a block not queued stays
        due) held blocks last written half a retention ago, so their keys do not expire while
        the engine keeps them; how many."""
        horizon = now - self._index.retention_s / 2
        blocks = self._blocks
        index = self._index
        done = 0
        while blocks and done < limit and len(index._pending) < index.max_pending:
            engine_hash, entry = next(iter(blocks.items()))
            if entry[2] > horizon:
                break
            index._write(entry[0], self.bit, 1)
            entry[2] = now
            blocks.move_to_end(engine_hash)
            done += 1
        self.stats.swept += done
        return done


# -- the index ------------------------------------------------------------------------------------


@dataclass(slots=True)
class IndexCounters:
    queries: int = 0
    answered: int = 0
    failed: int = 0
    """Queries whose round failed or timed out (answered no hits)."""
    backoff: int = 0
    """Queries answered no hits without asking: a backoff after a failure."""
    skipped_values: int = 0
    """Values read back that were no bitmap of ours."""
    skipped_endpoints: int = 0
    flushed: int = 0
    dropped_ops: int = 0
    """Operations lost: the queue was full, or their flush failed."""
    flush_errors: int = 0
    refused_ops: int = 0
    """Operations Redis refused (a key of another type, a slot that moved)."""
    last_error: str | None = field(default=None)


class SharedKVIndex:
    """One process's handle on a pool's shared index: its owners' writes and its queries."""

    def __init__(
        self,
        url: str,
        *,
        pool: str,
        secret: bytes,
        cluster: bool = False,
        shards: int = SHARDS,
        block_size: int = 16,
        retention_s: float = RETENTION_S,
        timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        on_round: Callable[[float], None] = lambda seconds: None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        """``timeout_s``: the longest a query waits for its round. ``on_round(seconds)``: a
        query's round ended (answered), in that many seconds (from sending to its last reply)."""
        self.on_round = on_round
        self.layout = ShardLayout(pool, shards)
        self.hasher = Hasher(secret)
        self.block_size = block_size
        self.retention_s = retention_s
        self.timeout_s = timeout_s
        self.clock = clock
        self._servers = _Servers(url, self.layout, cluster=cluster)
        self._pending: list[tuple[bytes, int, int]] = []
        self.max_pending = max_pending
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._owners: dict[str, EngineOwner] = {}
        self._names: dict[int, str] = {}
        """Endpoint index → endpoint, as last read (``refresh_endpoints``)."""
        self._down_until = -math.inf
        self._backoff_s = BACKOFF_FIRST_S
        self._failing = False
        self._in_a_row = 0
        """Queries failed since the last answered one."""
        self.counters = IndexCounters()

    async def start(self, *, flusher: bool = True) -> None:
        """Connect; with ``flusher``, flush the owners' writes in the background."""
        await self._servers.resolve()
        if flusher:
            self._flusher = asyncio.create_task(self._flush_loop(), name="shared-kv-flush")

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        with contextlib.suppress(*_ERRORS):
            async with asyncio.timeout(1.0):
                await self.flush()
        await self._servers.close()

    # -- endpoints

    async def register(self, endpoint: str) -> int:
        """``endpoint``'s index in the pool (given once, kept while the registry lives)."""
        control = self._servers.control
        key, counter = self.layout.endpoints_key, self.layout.next_key
        found: Any = await control.hget(key, endpoint)
        if found is None:
            index = int(await control.incr(counter)) - 1
            if index >= MAX_ENDPOINTS:
                raise RedisError(f"the pool has {MAX_ENDPOINTS} endpoint indices already")
            if await control.hsetnx(key, endpoint, str(index)):
                return index
            found = await control.hget(key, endpoint)  # another won
        index = int(found)
        if not 0 <= index < MAX_ENDPOINTS:
            raise RedisError(f"{endpoint}'s index {found!r} is out of range")
        return index

    async def refresh_endpoints(self) -> None:
        """The index → endpoint map the queries translate bits with (off the request path)."""
        raw: Any = await self._servers.control.hgetall(self.layout.endpoints_key)
        names: dict[int, str] = {}
        skipped = 0
        for name, value in raw.items():
            try:
                index = int(value)
                text = name.decode("ascii")
            except (ValueError, UnicodeDecodeError, AttributeError):
                skipped += 1
                continue
            if not (0 <= index < MAX_ENDPOINTS and 0 < len(text) <= MAX_ENDPOINT_BYTES):
                skipped += 1
            elif text.isprintable() and index not in names:
                names[index] = text
            else:
                skipped += 1
        self.counters.skipped_endpoints += skipped
        self._names = names

    async def owner(self, endpoint: str, *, max_blocks: int = MAX_BLOCKS) -> EngineOwner:
        """This process's writer for ``endpoint``'s events."""
        made = self._owners.get(endpoint)
        if made is None:
            bit = await self.register(endpoint)
            made = self._owners[endpoint] = EngineOwner(self, endpoint, bit, max_blocks=max_blocks)
        return made

    # -- writes

    def _write(self, digest: bytes, bit: int, value: int) -> bool:
        """Queue one ``SETBIT``; False when the queue is full (dropped and counted)."""
        if len(self._pending) >= self.max_pending:
            self.counters.dropped_ops += 1
            return False
        self._pending.append((digest, bit, value))
        if len(self._pending) >= FLUSH_OPS:
            self._wake.set()
        return True

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> None:
        """Send what is queued: one pipeline per master, all at once. Raises on failure (the
        operations are lost and counted)."""
        self._drain()
        if not self._pending:
            return
        servers = self._servers
        if servers.stale:  # before taking the queue: a failure here loses nothing
            await servers.resolve()
        ops, self._pending = self._pending, []
        layout = self.layout
        retention = b"%d" % max(1, round(self.retention_s * 1000))
        expire = len(retention)
        parts: list[list[bytes]] = [[] for _ in servers.channels]
        counts = [0] * len(parts)
        of_shard = servers.of_shard
        prefixes = layout.prefixes
        shards = len(prefixes)
        expiring: set[bytes] = set()
        bounded: set[bytes] = set()
        for digest, bit, value in ops:
            shard = int.from_bytes(digest, "big") % shards
            key = prefixes[shard] + digest
            master = of_shard[shard]
            position = b"%d" % bit
            parts[master].append(_SETBIT % (len(key), key, len(position), position, value))
            counts[master] += 1
            if value and key not in expiring:
                expiring.add(key)
                parts[master].append(_PEXPIRE % (len(key), key, expire, retention))
                counts[master] += 1
            elif not value and key not in expiring and key not in bounded:
                bounded.add(key)
                parts[master].append(_PEXPIRE_NX % (len(key), key, expire, retention))
                counts[master] += 1
        try:
            replies = await asyncio.gather(
                *(
                    channel.request(b"".join(part), count)
                    for channel, part, count in zip(servers.channels, parts, counts, strict=True)
                    if count
                )
            )
        except BaseException as exc:
            self.counters.dropped_ops += len(ops)
            servers.failed(exc)
            raise
        refused = [r for answer in replies for r in answer if isinstance(r, hiredis.ReplyError)]
        if refused:
            # A key of another type (SETBIT refuses it: the block is not written), or a slot
            # that moved (the next flush asks the cluster again).
            self.counters.refused_ops += len(refused)
            self.counters.last_error = f"flush: {refused[0]}"
            if any(str(r).startswith(("MOVED", "ASK", "CLUSTERDOWN")) for r in refused):
                servers.failed(RedisClusterException(str(refused[0])))
        self.counters.flushed += len(ops)

    def _drain(self) -> None:
        """Queue the owners' pending clears, as many as the queue has room for."""
        room = min(CLEAR_CHUNK, self.max_pending - len(self._pending))
        more = False
        for owner in self._owners.values():
            if room > 0:
                room -= owner.drain(room)
            more = more or owner.clearing > 0
        if more:
            self._wake.set()  # the next flush takes more

    async def _flush_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLUSH_S):
                    await self._wake.wait()
            self._wake.clear()
            now = self.clock()
            for owner in list(self._owners.values()):
                owner.sweep(now, FLUSH_OPS)
            try:
                async with asyncio.timeout(1.0):
                    await self.flush()
            except Exception as exc:
                self.counters.flush_errors += 1
                self.counters.last_error = f"flush: {type(exc).__name__}: {exc}"
                if not isinstance(exc, _ERRORS):
                    log.exception("shared kv index: a flush failed unexpectedly")

    # -- queries

    def digests(
        self, token_ids: Sequence[int], *, lora: str | None = None, salt: str | None = None
    ) -> list[bytes]:
        """A prompt's digests, every block a hit may cover (the CPU of a query: about 1 µs a
        block)."""
        return self.hasher.prompt(token_ids, self.block_size, lora=lora, salt=salt)

    async def query(
        self, token_ids: Sequence[int], *, lora: str | None = None, salt: str | None = None
    ) -> dict[str, int]:
        """Per endpoint holding at least the prompt's first block, the leading tokens it holds
        (sampled: see the module's docstring). Never raises: {} when Redis fails or is slow."""
        return await self.lookup(self.digests(token_ids, lora=lora, salt=salt))

    async def lookup(self, digests: Sequence[bytes]) -> dict[str, int]:
        """``query`` of a prompt whose ``digests`` are known."""
        self.counters.queries += 1
        if not digests:
            return {}
        positions = sample_positions(len(digests))
        now = self.clock()
        if now < self._down_until:
            self.counters.backoff += 1
            return {}
        began = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                values = await self._read([digests[p] for p in positions])
        except Exception as exc:  # the servers' errors, a timeout, an answer of another shape
            self._failed(now, exc)
            return {}
        self.on_round(time.perf_counter() - began)
        if self._failing:
            log.info("shared kv index: queries answered again")
            self._failing = False
        self._in_a_row = 0
        self._backoff_s = BACKOFF_FIRST_S
        self.counters.answered += 1
        return self._hits(positions, values)

    async def ping(self) -> float:
        """One ``PING`` round to every master at once, as a query's round goes; its seconds.
        Raises on failure (for a readiness check, and the benchmark's floor)."""
        servers = self._servers
        if servers.stale:
            await servers.resolve()
        began = time.perf_counter()
        await asyncio.gather(*(c.request(b"*1\r\n$4\r\nPING\r\n", 1) for c in servers.channels))
        return time.perf_counter() - began

    async def _read(self, keys: list[bytes]) -> list[object]:
        """The values of ``keys``, in order: one parallel round (an ``MGET`` per shard, those of
        a master sent together; one ``MGET`` in all on a standalone Redis)."""
        servers = self._servers
        if servers.stale:
            servers.refresh()  # in the background: this round goes where the last reading said
        if not servers.channels:
            raise RedisError("the shared kv index has not read its servers yet")
        try:
            return await self._round(servers, keys)
        except BaseException as exc:
            servers.failed(exc)
            raise

    async def _round(self, servers: _Servers, keys: list[bytes]) -> list[object]:
        prefixes = self.layout.prefixes
        shards = len(prefixes)
        if servers.cluster is None:
            named = [prefixes[int.from_bytes(k, "big") % shards] + k for k in keys]
            [reply] = await servers.channels[0].request(_mget(named), 1)
            return _values(reply, len(keys))
        by_shard: dict[int, list[int]] = {}
        for i, digest in enumerate(keys):
            by_shard.setdefault(int.from_bytes(digest, "big") % shards, []).append(i)
        parts: list[list[bytes]] = [[] for _ in servers.channels]
        asked: list[list[list[int]]] = [[] for _ in servers.channels]
        for shard, places in by_shard.items():
            master = servers.of_shard[shard]
            prefix = prefixes[shard]
            parts[master].append(_mget([prefix + keys[i] for i in places]))
            asked[master].append(places)
        replies = await asyncio.gather(
            *(
                channel.request(b"".join(part), len(part))
                for channel, part in zip(servers.channels, parts, strict=True)
                if part
            )
        )
        values: list[object] = [None] * len(keys)
        answered = [a for a in asked if a]
        for master_replies, master_asked in zip(replies, answered, strict=True):
            for reply, places in zip(master_replies, master_asked, strict=True):
                for i, value in zip(places, _values(reply, len(places)), strict=True):
                    values[i] = value
        return values

    def _hits(self, positions: list[int], values: list[object]) -> dict[str, int]:
        alive = -1
        last = -1
        hits: dict[int, int] = {}
        skipped = 0
        for position, value in zip(positions, values, strict=True):
            if value is None:
                held = 0
            elif isinstance(value, bytes) and len(value) <= MAX_VALUE_BYTES:
                held = int.from_bytes(value.ljust(MAX_VALUE_BYTES, b"\0"), "big")
            else:
                skipped += 1
                held = 0
            if alive == -1:
                alive = held
            else:
                gone = alive & ~held
                alive &= held
                _credit(hits, gone, (last + 1) * self.block_size)
            last = position
            if not alive:
                break
        if alive > 0:
            _credit(hits, alive, (last + 1) * self.block_size)
        if skipped:
            self.counters.skipped_values += skipped
        names = self._names
        return {names[bit]: tokens for bit, tokens in hits.items() if bit in names}

    def _failed(self, now: float, exc: BaseException) -> None:
        self.counters.failed += 1
        if not self._failing:
            log.warning(
                "shared kv index: a query failed (%s: %s); no hits until one is answered",
                type(exc).__name__,
                exc,
            )
            self._failing = True
        self.counters.last_error = f"query: {type(exc).__name__}: {exc}"
        self._in_a_row += 1
        if self._in_a_row >= FAILURES_BEFORE_BACKOFF:
            self._down_until = now + self._backoff_s
            self._backoff_s = min(BACKOFF_MAX_S, 2 * self._backoff_s)


def _values(reply: object, count: int) -> list[object]:
    """An ``MGET``'s reply: its ``count`` values (each checked by the caller); raises when the
    reply is an error (a slot that moved) or not a list of ``count``."""
    if isinstance(reply, hiredis.ReplyError):
        if str(reply).startswith(("MOVED", "ASK", "CLUSTERDOWN")):
            raise RedisClusterException(str(reply))
        raise RedisError(str(reply))
    if not isinstance(reply, list) or len(reply) != count:
        raise RedisError("an MGET answered no list of its keys' values")
    return reply


def _credit(hits: dict[int, int], mask: int, tokens: int) -> None:
    """``tokens`` to every endpoint whose bit is set in ``mask`` (a bitmap read as one int,
    endpoint 0 its highest bit)."""
    while mask:
        low = mask & -mask
        hits[_WIDTH - low.bit_length()] = tokens
        mask ^= low
