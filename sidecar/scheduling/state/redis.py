"""The Redis backend: every sidecar's reservations, speed estimates and ejections, shared.

The protocol itself — the sync script, what a sync sends and makes of the answer, when to sync —
is ``protocol.SyncProtocol``, without I/O; this module drives it with asyncio (as the simulator
drives it in virtual time): the connection, the tasks, the waits, the log and the counters. The
syncs go over a bare connection of their own (``resp``) when the URL is one it speaks and Redis
is not a cluster, else through redis-py's client, which the prefix share always uses.

On the request path only ``refresh`` talks to Redis, before the scheduler decides where a
prompt prefills: it joins the sync in flight or starts one, waits for its answer at most
``timeout_s`` and never raises, so the decision reads every sidecar's reservations one round trip
old rather than as of this sidecar's last sync (with few prefills per sidecar, seconds old: the
reservations of a wide pool of sidecars were then seen too late and the prefill queues
unbalanced, docs/scheduling.md). A slow or absent Redis leaves the decision to the view it has.
Reservations, releases, speeds and ejections change the local table at once and wake a background
worker, which syncs them (and heartbeats, and reconnects) off the request path.

Five keys, all sharing one hash tag (``{prefix}``): ``sidecars`` (a sorted set, lease deadline per
sidecar id), ``reservations`` (a hash, one field per sidecar: its reservations, one ``endpoint
tokens requests`` line each), ``totals`` (a hash, one field per endpoint: every live sidecar's
reservations summed, kept by the script as tables change and sidecars go), ``speeds`` and
``ejections`` (hashes, one field per endpoint). The script touches only the keys it is given as
``KEYS`` — nothing by a name built inside it — so it runs as it is on a standalone Redis and on a
Redis Cluster (``cluster=True``: redis-py's cluster client), where the five keys live in one
slot, are redirected together and fail over together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from sidecar.scheduling.model import Speed
from sidecar.scheduling.state import Reservation, SharedView, prefix_share, resp
from sidecar.scheduling.state.prefix_share import PrefixShare, stream_key
from sidecar.scheduling.state.protocol import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    SCRIPT,
    Sync,
    SyncProtocol,
    decode_reply,
    keys,
)
from sidecar.scheduling.state.replies import BoundedHiredisParser, bound_cluster
from sidecar.tasks import stop_task

logger = logging.getLogger("sidecar.scheduling.state")

SCRAPERS_KEEP_MS = 300_000
"""The shared scrapes' member list outlives its last renewal by at least this (its entries
lapse by their scores; the key goes when nobody shares any more)."""

_ERRORS = (RedisError, RedisClusterException, OSError, TimeoutError)
"""What a Redis call may raise (the cluster client's "cannot be connected" and "slots not
covered" are not RedisErrors)."""


def _settle(waiter: asyncio.Future[bool], answered: bool) -> None:
    """``waiter``'s outcome: whichever of the sync's end and the budget comes first."""
    if not waiter.done():
        waiter.set_result(answered)


class RedisState:
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        cluster: bool = False,
        lease_s: float,
        timeout_s: float,
        max_ejection_s: float = 3600.0,
        on_error: Callable[[str], None] = lambda kind: None,
        on_skipped: Callable[[str, int], None] = lambda kind, count: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``max_ejection_s``: the longest ejection a sidecar publishes (SIDECAR_EJECT_MAX_S);
        one read back that ends later is not believed. ``on_skipped(kind, count)``: entries
        read back and left out (kind ``load``, ``speed``, ``ejection``; ``over_limit`` for what
        the script left out), since they do not parse, are out of range or beyond the bounds."""
        self._url = url
        self._cluster = cluster
        self.keys = keys(prefix)
        self._tag = "{" + prefix + "}"
        """Every key the backend touches, in the script's ``KEYS`` order."""
        self._timeout_s = timeout_s
        self._max_ejection_s = max_ejection_s
        self._on_error = on_error
        self._on_skipped = on_skipped
        self._clock = clock
        self._wake = asyncio.Event()
        self._protocol = SyncProtocol(uuid.uuid4().hex, lease_s=lease_s, wake=self._wake.set)
        self._share: PrefixShare | None = None
        self._stream = stream_key(prefix)
        self._learnt: Callable[[str, Sequence[bytes]], None] = lambda endpoint, hashes: None
        self._share_wake = asyncio.Event()
        self._share_script: Any = None
        self._sharer: asyncio.Task[None] | None = None
        self._client: aioredis.Redis | RedisCluster | None = None
        self._script: Any = None
        self._resp: resp.RespConnection | None = None
        """The syncs' own connection (a standalone Redis whose URL it speaks: ``resp``)."""
        self._sync: asyncio.Task[None] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._closing = False
        """``close`` has begun: no sync starts any more (the goodbye owns the connection)."""
        self.describe_scrapes: Callable[[], dict[str, Any]] | None = None
        """The shared scrapes' part of ``status``, when they go through this backend."""
        self.connected = False
        self.last_error: str | None = None
        self.last_sync_unix: float | None = None

    async def start(self) -> None:
        # Socket timeouts bound the background worker; the request path has its own, shorter wait.
        if self._cluster:
            # One attempt per sync, like the standalone client: a failed one backs off (below),
            # and the next re-reads the slots from the nodes left (a promoted replica included).
            self._client = bound_cluster(
                RedisCluster.from_url(
                    self._url,
                    socket_connect_timeout=1.0,
                    socket_timeout=1.0,
                    retry=Retry(NoBackoff(), retries=0),
                )
            )
        else:
            self._client = aioredis.Redis.from_url(
                self._url,
                socket_connect_timeout=1.0,
                socket_timeout=1.0,
                retry_on_timeout=False,
                parser_class=BoundedHiredisParser,  # replies bounded before hiredis allocates
            )
        self._script = self._client.register_script(SCRIPT)
        if not self._cluster and resp.supports(self._url):
            name = f"pd-sidecar-sync-{self._protocol.sidecar}"
            self._resp = resp.RespConnection(self._url, timeout_s=1.0, name=name)
        self._worker = asyncio.create_task(self._work(), name="redis-state-sync")
        if self._share is not None:
            self._share_script = self._client.register_script(prefix_share.SCRIPT)
            self._sharer = asyncio.create_task(self._share_work(), name="redis-prefix-share")

    async def close(self) -> None:
        # No refresh starts a sync from now on, and the worker's last one (or a decision's) is
        # stopped after the worker: the goodbye below must be the connection's one command in
        # flight (a second would read the first's reply).
        self._closing = True
        self._share_wake.set()  # the sharer ends at its next turn should it miss the cancel
        for task in (self._sharer, self._worker):
            if task is not None:
                await stop_task(task)
        if self._sync is not None:
            await stop_task(self._sync)
        if self._client is not None:
            with contextlib.suppress(*_ERRORS):
                async with asyncio.timeout(0.5):
                    await self._leave(self._client)
            # A connection slow to close (an overloaded process, a peer gone) fails no
            # shutdown: redis-py gives up on it after its timeout and says so.
            with contextlib.suppress(*_ERRORS):
                await self._client.aclose()
            self._client = None
        if self._resp is not None:
            self._resp.close()
            self._resp = None

    async def _leave(self, client: aioredis.Redis | RedisCluster) -> None:
        """Best effort, when closing: let the others stop counting this sidecar now rather than
        after the lease. An empty table through the script takes ours off the totals; then the
        lease goes."""
        sidecar = self._protocol.sidecar
        goodbye = [sidecar, repr(self._clock()), repr(self._protocol.lease_s), "", 0, 0]
        await self._call_script(goodbye)
        await client.zrem(self.keys[0], sidecar)
        if self.describe_scrapes is not None:  # it shared scrapes: not any more
            await client.zrem(self.scrapers_key, sidecar)

    def view(self) -> SharedView:
        return self._protocol.view()

    async def refresh(self, endpoints: Collection[str] = ()) -> None:
        if self._closing or not self._protocol.decision_waits(self._clock()):
            # Closing, or Redis is down: decide on the view there is rather than wait.
            return
        sync = self._sync
        if sync is None:
            sync = self._sync = asyncio.create_task(self._run_sync())
        await self._within_budget(sync, "no answer within the decision budget")

    async def _within_budget(self, task: asyncio.Task[None], late: str) -> None:
        """Wait for ``task``'s end or the decision's budget, whichever comes first; ``late``
        is recorded (a timeout) when the budget came first."""
        # The task goes on without the decision (it owes the view its answer): the decision
        # waits for its end or the budget on a future of its own, which is what the timeout
        # and the shield of ``asyncio.timeout(...): await shield(task)`` do, for about half the
        # instructions (docs/benchmarks.md).
        waiter = asyncio.get_running_loop().create_future()
        task.add_done_callback(lambda _: _settle(waiter, True))
        timer = waiter.get_loop().call_later(self._timeout_s, _settle, waiter, False)
        try:
            answered = await waiter
        finally:
            timer.cancel()
        if not answered:
            self._record_error("timeout", late)

    def reserve(self, endpoint: str, tokens: int) -> Reservation:
        return self._protocol.reserve(endpoint, tokens)

    def release(self, reservation: Reservation) -> None:
        self._protocol.release(reservation)

    def publish_speed(self, endpoint: str, speed: Speed) -> None:
        self._protocol.publish_speed(endpoint, speed)

    def publish_ejection(self, endpoint: str, until_unix: float) -> None:
        self._protocol.publish_ejection(endpoint, until_unix)

    def share_prefixes(self, learnt: Callable[[str, Sequence[bytes]], None]) -> bool:
        self._share = PrefixShare(self._protocol.sidecar)
        self._learnt = learnt
        return True

    def publish_prefix(self, endpoint: str, hashes: Sequence[bytes]) -> None:
        if self._share is not None:
            self._share.publish(endpoint, hashes)
            self._share_wake.set()

    # The shared scrapes' store (``sidecar.engines.shared_scrapes.ScrapeStore``).

    @property
    def member_id(self) -> str:
        return self._protocol.sidecar

    def scrape_key(self, endpoint: str) -> str:
        """Where an endpoint's scrape is published: the pool's hash tag, so that one read of
        every endpoint's is one command on one node of a Redis Cluster."""
        return f"{self._tag}:scrape:{endpoint}"

    @property
    def scrapers_key(self) -> str:
        """The sidecars that share scrapes, each with the Unix time its membership ends."""
        return f"{self._tag}:scrapers"

    async def read_scrapes(
        self, endpoints: Sequence[str], *, members: int, wall: float, member_until: float
    ) -> tuple[list[bytes | None], list[bytes] | None]:
        if self._client is None or self._closing:
            raise RedisError("the state backend is not started")
        names = [self.scrape_key(endpoint) for endpoint in endpoints]
        if not members:
            # Most rounds: one command, not a pipeline (a cluster client's pipeline costs this
            # process several times as much).
            values = await self._client.execute_command("MGET", *names) if names else []
            return list(values), None
        # Membership renewed, long-lapsed ones dropped, the live ones read: one round trip, on
        # the pool's hash tag (one node of a cluster). The writes may fail (Redis read-only,
        # full, a narrower ACL) without failing the read: this sidecar's membership then lapses
        # and the others own its endpoints.
        key, horizon = self.scrapers_key, member_until - wall
        pipe = self._client.pipeline(transaction=False)
        if names:
            pipe.execute_command("MGET", *names)  # redis-py refuses a cluster pipeline's mget()
        pipe.zrangebyscore(key, repr(wall), "+inf", start=0, num=members)
        pipe.zadd(key, {self.member_id: member_until})
        # Dropped a horizon after they lapsed: a reader whose clock runs ahead deletes no live
        # member. The key outlives the last member long enough for any member's settings.
        pipe.zremrangebyscore(key, "-inf", f"({wall - horizon!r}")
        pipe.pexpire(key, max(SCRAPERS_KEEP_MS, round(2 * horizon * 1000)))
        replies = await pipe.execute(raise_on_error=False)
        read = replies[: 2 if names else 1]
        for reply in read:
            if isinstance(reply, BaseException):
                raise reply
        return (list(read[0]) if names else []), list(read[-1])

    async def write_scrapes(self, values: Mapping[str, str], *, expire_s: float) -> None:
        if self._client is None or self._closing:
            raise RedisError("the state backend is not started")
        pipe = self._client.pipeline(transaction=False)
        for endpoint, value in values.items():
            pipe.set(self.scrape_key(endpoint), value, px=max(1, round(expire_s * 1000)))
        await pipe.execute()

    def status(self) -> dict[str, Any]:
        share = self._share
        return {
            "backend": self.name,
            "prefix_share": None
            if share is None
            else {"pending": share.pending, "dropped": share.dropped, "cursor": share.cursor},
            "connected": self.connected,
            "sidecar_id": self._protocol.sidecar,
            "last_sync_unix": self.last_sync_unix,
            "last_error": self.last_error,
            "lease_s": self._protocol.lease_s,
            "cluster": self._cluster,
            "shared_scrapes": None if self.describe_scrapes is None else self.describe_scrapes(),
        }

    async def _work(self) -> None:
        """Sync after every change, and at least three times per lease (the heartbeat)."""
        protocol = self._protocol
        heartbeat = protocol.heartbeat_s
        # Register at once (this also loads the script, so requests never pay for that).
        self._wake.set()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(heartbeat):
                    await self._wake.wait()
            self._wake.clear()
            wait = protocol.backoff_left(self._clock())
            if wait > 0:
                await asyncio.sleep(min(wait, heartbeat))
            # A sync in flight is a decision's refresh, which may have left before the change
            # that woke us: the worker is owed the one after it.
            protocol.worker_woke(syncing=self._sync is not None)
            while protocol.worker_owed:
                if self._sync is None:
                    self._sync = asyncio.create_task(self._run_sync())
                await self._join_sync()

    async def _join_sync(self) -> None:
        """Wait for the sync in flight, if any. Its cancellation (by ``close``) is not the
        worker's: only the worker's own ends the worker."""
        sync = self._sync
        if sync is None:
            return
        try:
            await asyncio.shield(sync)
        except asyncio.CancelledError:
            worker = asyncio.current_task()
            if worker is not None and worker.cancelling():
                raise

    async def _run_sync(self) -> None:
        sync = self._protocol.begin(self._clock())
        try:
            raw = await self._call_script(sync.args())
            reply = decode_reply(raw, now=self._clock(), max_ejection_s=self._max_ejection_s)
        except asyncio.CancelledError:
            self._protocol.cancelled(sync)
            raise
        except Exception as exc:
            # Whatever failed — the connection, the cluster's routing, an answer of the wrong
            # shape — the sync is lost, never the worker or a request: what it published goes
            # with the next one, after a backoff.
            if not isinstance(exc, _ERRORS):
                logger.exception("shared-state sync failed unexpectedly")
            self._protocol.failed(sync, self._clock())
            self._record_error("connection", f"{type(exc).__name__}: {exc}")
        else:
            # Entries that do not parse or are out of range were skipped, never the sync:
            # whoever can write the keys cannot stall or steer every sidecar.
            for kind, count in reply.skipped.items():
                self._on_skipped(kind, count)
            self._repaired(reply.repaired)
            self._protocol.received(sync, reply)
            self._synced(sync)
            if not self.connected:
                logger.info("redis state backend connected")
            self.connected = True
            self.last_sync_unix = self._clock()
        finally:
            self._sync = None

    def _synced(self, sync: Sync) -> None:
        """``sync`` was answered (for a subclass to follow; nothing here)."""

    async def _call_script(self, args: list[Any]) -> Any:
        if self._resp is not None:
            return await self._resp.evalsha(self._script.sha, SCRIPT, self.keys, args)
        return await self._script(keys=self.keys, args=args)

    async def _share_work(self) -> None:
        """The prefix share's syncs: a batch of placements at most every ``SYNC_S``, and a read
        of the others' every ``4 × SYNC_S`` when there is nothing to send; backs off on failure
        as the state sync does. Off the request path: a decision never waits for it."""
        share = self._share
        assert share is not None
        assert self._share_script is not None
        backoff = 0.0
        # Until closing, not forever: a cancel that meets a Redis answer can be lost (Python
        # 3.11's ``asyncio.wait_for``, which redis-py uses), and ``close`` would wait for good.
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(4 * prefix_share.SYNC_S):
                    await self._share_wake.wait()
            self._share_wake.clear()
            await asyncio.sleep(max(backoff, prefix_share.SYNC_S))
            if self._closing:
                return
            args, sending = share.begin()
            try:
                reply = await self._share_script(keys=[self._stream], args=args)
            except Exception as exc:
                if not isinstance(exc, _ERRORS):
                    logger.exception("prefix share sync failed unexpectedly")
                share.failed(sending)
                backoff = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, 2 * backoff))
                continue
            backoff = 0.0
            if share.pending:  # more than one sync carries: the rest goes next
                self._share_wake.set()
            learnt, skipped, repaired = share.received(reply)
            if skipped:
                self._on_skipped("prefix", skipped)
            if repaired:
                self._on_skipped("wrong_type", len(repaired))
                self._repaired(repaired)
            for entry in learnt:
                self._learnt(entry.endpoint, entry.hashes)

    def _repaired(self, repaired: tuple[tuple[str, str], ...]) -> None:
        """Log the keys of the pool a script found of another type, and deleted."""
        for key, held in repaired:
            logger.warning(
                "redis state backend: %s was a %s, not what the pool keeps there: deleted",
                key,
                held,
            )

    def _record_error(self, kind: str, detail: str) -> None:
        if self.connected or self.last_error is None:
            logger.warning("redis state backend: %s (%s); deciding on the local view", kind, detail)
        if kind == "connection":
            self.connected = False
        self.last_error = f"{kind}: {detail}"
        self._on_error(kind)
