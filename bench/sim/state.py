"""Modelled state backends: what a sidecar's ``SharedView`` holds when it decides.

``redis`` is ``sidecar.scheduling.state.redis.RedisState`` in virtual time: the same protocol
(``sidecar.scheduling.state.protocol.SyncProtocol``: the table and the view, what a sync sends
and makes of the answer, when the refresh and the worker sync) driven by this module instead of
asyncio and redis-py. What is modelled here is only what production gets from the network:

- the round trip: a sync's script runs half a round trip after it is sent (Redis then holds this
  sidecar's table and answers the pool's totals and published speeds), and the answer reaches
  the protocol a whole round trip after the send;
- the script (``RedisServer``, the sidecars' tables, speeds and ejections; no leases: modelled
  sidecars never die), held to the real script by tests/scheduling/test_state_protocol.py;
- the waits: ``refresh``, before a decision, makes the decision when the answer of the sync it
  joined or began arrives, or at the state timeout, on the view there is; the worker waits for a
  wake or its heartbeat, then for the syncs it is owed. Waiters of one answer run in the order
  they came, the decisions before the worker.

Not modelled: Redis failures (so neither the backoff), leases running out.

``coalesced`` is a design, not production: the same script, sent by each sidecar in the
background every ``sync_s`` (at its own phase) instead of before each decision. A decision never
waits: it decides on the totals of the last answer, the others' reservations a round trip to
``sync_s`` plus a round trip old, its own (``SyncProtocol.view``) as they are now.

``shared`` is the idealisation (one table, every change seen at once by everyone); ``local`` is
the memory backend (each sidecar's own reservations only).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any, Protocol

from bench.sim.engines import Loop
from sidecar.scheduling.model import Speed
from sidecar.scheduling.state import Load, OwnReservations, Reservation, SharedView, prefix_share
from sidecar.scheduling.state.protocol import Reply, Sync, SyncProtocol


class ModelledState(Protocol):
    def view(self) -> SharedView: ...

    def refresh(self, then: Callable[[], None]) -> None:
        """Call ``then`` once the view is as fresh as production's ``refresh`` makes it (at
        once when there is nothing to wait for)."""
        ...

    def reserve(self, endpoint: str, tokens: int) -> Reservation: ...

    def release(self, reservation: Reservation) -> None: ...

    def publish_speed(self, endpoint: str, speed: Speed) -> None: ...


class SharedTable:
    """Every reservation, seen at once by every sidecar."""

    def __init__(self) -> None:
        self.own = OwnReservations()
        self.speeds: dict[str, Speed] = {}

    def view(self) -> SharedView:
        return SharedView(self.own.loads, self.speeds, {})

    def refresh(self, then: Callable[[], None]) -> None:
        then()

    def reserve(self, endpoint: str, tokens: int) -> Reservation:
        ahead = self.own.loads.get(endpoint, Load()).tokens
        self.own.add(endpoint, tokens, 1)
        return Reservation(endpoint, tokens, ahead)

    def release(self, reservation: Reservation) -> None:
        self.own.add(reservation.endpoint, -reservation.tokens, -1)

    def publish_speed(self, endpoint: str, speed: Speed) -> None:
        self.speeds[endpoint] = speed


class LocalTable(SharedTable):
    """The memory backend: one per sidecar. (Speeds published stay this sidecar's own.)"""


class RedisServer:
    """The sync script as the simulator models it: each sidecar's table as it last sent it, the
    speeds, the ejections; the totals kept up to date as tables are replaced."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, Load]] = {}
        self.totals: dict[str, Load] = {}
        self.speeds: dict[str, Speed] = {}
        self.ejections: dict[str, float] = {}

    def script(self, sync: Sync) -> Reply:
        totals = self.totals
        for endpoint, load in self.tables.get(sync.sidecar, {}).items():
            old = totals[endpoint]
            totals[endpoint] = Load(old.tokens - load.tokens, old.requests - load.requests)
        for endpoint, load in sync.table.items():
            old = totals.get(endpoint, Load())
            totals[endpoint] = Load(old.tokens + load.tokens, old.requests + load.requests)
        self.tables[sync.sidecar] = sync.table
        self.speeds.update(sync.speeds)
        for endpoint, until in sync.ejections.items():
            if until > self.ejections.get(endpoint, 0.0):
                self.ejections[endpoint] = until
        if self.ejections:
            self.ejections = {e: until for e, until in self.ejections.items() if until > sync.now}
        held = {endpoint: load for endpoint, load in totals.items() if load.requests > 0}
        return Reply(held, dict(self.speeds), dict(self.ejections))


class _ProtocolClient:
    """A modelled sidecar whose changes and view are its ``SyncProtocol``'s (a subclass sets
    ``_protocol`` and says when it syncs)."""

    _protocol: SyncProtocol

    def view(self) -> SharedView:
        return self._protocol.view()

    def reserve(self, endpoint: str, tokens: int) -> Reservation:
        return self._protocol.reserve(endpoint, tokens)

    def release(self, reservation: Reservation) -> None:
        self._protocol.release(reservation)

    def publish_speed(self, endpoint: str, speed: Speed) -> None:
        self._protocol.publish_speed(endpoint, speed)


class RedisClient(_ProtocolClient):
    """One sidecar's ``RedisState``: its ``SyncProtocol`` over a modelled network (see the
    module's docstring)."""

    def __init__(
        self,
        loop: Loop,
        server: RedisServer,
        sidecar: int,
        *,
        rtt_s: float,
        timeout_s: float,
        lease_s: float,
        refresh_s: float = 0.0,
    ) -> None:
        """``refresh_s`` is a what-if, not production: the worker also syncs every
        ``refresh_s`` (0: never)."""
        self._loop = loop
        self._refresh_s = refresh_s
        self._server = server
        self._rtt_s = rtt_s
        self._timeout_s = timeout_s
        self._protocol = SyncProtocol(f"sidecar-{sidecar}", lease_s=lease_s, wake=self._wake_worker)
        self._decisions: list[_Waiter] = []
        """Refreshes waiting for the sync in flight."""
        self._wake = False
        self._worker_waiting = True
        """The worker waits for a wake or its heartbeat; False while it waits for syncs."""
        self._heartbeat_version = 0
        self._arm_heartbeat()
        if refresh_s > 0:
            loop.at(loop.now + refresh_s * (1 + sidecar % 7) / 7, self._refresh)

    def _refresh(self, _: object) -> None:
        self._wake_worker()
        self._loop.at(self._loop.now + self._refresh_s, self._refresh)

    def refresh(self, then: Callable[[], None]) -> None:
        if self._protocol.in_flight is None:
            self._send()
        waiter = _Waiter(then)
        self._decisions.append(waiter)
        self._loop.at(self._loop.now + self._timeout_s, waiter.run)

    # The network and the worker.

    def _send(self) -> None:
        loop = self._loop
        loop.at(loop.now + self._rtt_s / 2, self._execute, self._protocol.begin(loop.now))

    def _execute(self, sync: Sync) -> None:
        reply = self._server.script(sync)
        self._loop.at(self._loop.now + self._rtt_s / 2, self._answer, (sync, reply))

    def _answer(self, answer: tuple[Sync, Reply]) -> None:
        self._protocol.received(*answer)
        decisions, self._decisions = self._decisions, []
        for waiter in decisions:
            waiter.run(None)
        if not self._worker_waiting:
            self._worker_step()

    def _wake_worker(self) -> None:
        self._wake = True
        if self._worker_waiting:
            self._run_worker()

    def _run_worker(self) -> None:
        """``RedisState._work`` after its wait: clear the wake, then wait for the syncs owed."""
        self._wake = False
        self._worker_waiting = False
        self._protocol.worker_woke(syncing=self._protocol.in_flight is not None)
        self._worker_step()

    def _worker_step(self) -> None:
        """While owed a sync, begin one when none is in flight (else wait for it); then wait for
        the next wake (at once if one came meanwhile) or heartbeat."""
        if self._protocol.worker_owed:
            if self._protocol.in_flight is None:
                self._send()
            return
        self._worker_waiting = True
        if self._wake:
            self._run_worker()
        else:
            self._arm_heartbeat()

    def _arm_heartbeat(self) -> None:
        self._heartbeat_version += 1
        version = self._heartbeat_version
        self._loop.at(self._loop.now + self._protocol.heartbeat_s, self._heartbeat, version)

    def _heartbeat(self, version: Any) -> None:
        if version == self._heartbeat_version and self._worker_waiting:
            self._run_worker()


class CoalescedClient(_ProtocolClient):
    """One sidecar of the coalesced design (see the module's docstring): its ``SyncProtocol``
    synced by a background round every ``sync_s``, never by a decision or a change."""

    def __init__(
        self,
        loop: Loop,
        server: RedisServer,
        sidecar: int,
        *,
        rtt_s: float,
        lease_s: float,
        sync_s: float,
        phase_s: float,
        eager: bool = False,
    ) -> None:
        """``phase_s``: when the first round is sent (then every ``sync_s``). ``eager``: a
        change (a reservation, a release) sends the round at once when the last one began at
        least ``sync_s`` ago, and the rounds go on ``sync_s`` after it: still at most one a
        ``sync_s``, and a sidecar that decides less often than that publishes each change
        without waiting for its phase. Otherwise a change waits for the next round."""
        if sync_s <= 0:
            raise ValueError("a coalesced sidecar syncs every sync_s > 0 seconds")
        self._loop = loop
        self._server = server
        self._rtt_s = rtt_s
        self._sync_s = sync_s
        self._last = -math.inf
        """When the last round was sent."""
        self._timer = 0
        """The round timer's version: an eager round cancels the one armed before it."""
        wake = self._changed if eager else _nothing
        self._protocol = SyncProtocol(f"sidecar-{sidecar}", lease_s=lease_s, wake=wake)
        loop.at(loop.now + phase_s, self._round, self._timer)

    def refresh(self, then: Callable[[], None]) -> None:
        then()

    def _changed(self) -> None:
        loop = self._loop
        if self._protocol.in_flight is None and loop.now - self._last >= self._sync_s:
            self._timer += 1
            self._round(self._timer)

    def _round(self, timer: int) -> None:
        if timer != self._timer:
            return
        loop = self._loop
        if self._protocol.in_flight is None:  # a round trip longer than sync_s: skip a round
            self._last = loop.now
            sync = self._protocol.begin(loop.now)
            loop.at(loop.now + self._rtt_s / 2, self._execute, sync)
        loop.at(loop.now + self._sync_s, self._round, timer)

    def _execute(self, sync: Sync) -> None:
        reply = self._server.script(sync)
        self._loop.at(self._loop.now + self._rtt_s / 2, self._answer, (sync, reply))

    def _answer(self, answer: tuple[Sync, Reply]) -> None:
        self._protocol.received(*answer)


def _nothing() -> None:
    pass


StateFactory = Callable[[int], ModelledState]


def state_factory(
    mode: str,
    loop: Loop,
    *,
    sync_s: float = 0.0,
    eager: bool = False,
    seed: int = 0,
    **redis: float,
) -> StateFactory:
    """One modelled backend per sidecar index. ``coalesced``: every ``sync_s``, each sidecar
    at a phase drawn from ``seed`` (``eager``: ``CoalescedClient``'s)."""
    if mode == "shared":
        table = SharedTable()
        return lambda _: table
    if mode == "local":
        return lambda _: LocalTable()
    server = RedisServer()
    if mode == "coalesced":
        phases = random.Random(f"coalesced-{seed}")
        return lambda index: CoalescedClient(
            loop,
            server,
            index,
            rtt_s=redis["rtt_s"],
            lease_s=redis["lease_s"],
            sync_s=sync_s,
            phase_s=phases.random() * sync_s,
            eager=eager,
        )
    return lambda index: RedisClient(
        loop,
        server,
        index,
        rtt_s=redis["rtt_s"],
        timeout_s=redis["timeout_s"],
        lease_s=redis["lease_s"],
        refresh_s=redis.get("refresh_s", 0.0),
    )


class _Waiter:
    """A decision waiting for a reply or the state timeout, whichever comes first."""

    __slots__ = ("_then",)

    def __init__(self, then: Callable[[], None]) -> None:
        self._then: Callable[[], None] | None = then

    def run(self, _: object) -> None:
        then, self._then = self._then, None
        if then is not None:
            then()


class PrefixShare:
    """The prefill prefix index's share (``sidecar.scheduling.state.prefix_share``) in virtual
    time: what a sidecar placed reaches the others' indexes.

    ``redis``: each sidecar runs production's ``PrefixShare`` (the pending queue, the script's
    arguments, the reply's parsing) with the worker's timing (``RedisState._share_work``: wait
    for a placement or ``4 × SYNC_S``, sleep ``SYNC_S``, sync); the script (the capped stream,
    the read after the cursor within the reply's byte budget) is modelled here, run half a round
    trip after the send, its reply applied a round trip after it. ``shared``: every placement
    reaches the others at once; ``local`` (the memory backend): never."""

    def __init__(self, loop: Loop, scenario: Any, sidecars: list[Any], seed: int) -> None:
        self._loop = loop
        # The coalesced design changes the reservations' share, not the prefix share's.
        self._mode = "redis" if scenario.state == "coalesced" else scenario.state
        self._rtt = scenario.redis_rtt_s
        self._sidecars = sidecars
        self._workers: dict[int, _ShareWorker] = {}
        self._stream: list[tuple[int, str, bytes, bytes]] = []
        self._next_id = 0
        if self._mode != "redis":
            return
        rng = random.Random(f"prefix-share-{seed}")
        for sidecar in sidecars:
            if sidecar.prefixes is not None:
                worker = _ShareWorker(prefix_share.PrefixShare(str(sidecar.index)))
                self._workers[sidecar.index] = worker
                worker.waiting = True
                # Sidecars started at different times: the first wait ends at its own phase.
                loop.at(rng.random() * 4 * prefix_share.SYNC_S, self._timeout, (sidecar.index, 0))

    def publish(self, index: int, endpoint: str, hashes: tuple[bytes, ...]) -> None:
        if self._mode == "local":
            return
        if self._mode == "shared":
            for sidecar in self._sidecars:
                if sidecar.index != index and sidecar.prefixes is not None:
                    sidecar.prefixes.placed(endpoint, hashes)
            return
        worker = self._workers[index]
        worker.share.publish(endpoint, hashes)
        if worker.waiting:
            worker.waiting = False
            worker.token += 1
            self._loop.at(self._loop.now + prefix_share.SYNC_S, self._sync, index)
        else:
            worker.woken = True

    def _wait(self, index: int) -> None:
        worker = self._workers[index]
        if worker.woken:
            worker.woken = False
            self._loop.at(self._loop.now + prefix_share.SYNC_S, self._sync, index)
            return
        worker.waiting = True
        worker.token += 1
        self._loop.at(
            self._loop.now + 4 * prefix_share.SYNC_S, self._timeout, (index, worker.token)
        )

    def _timeout(self, argument: tuple[int, int]) -> None:
        index, token = argument
        worker = self._workers[index]
        if token != worker.token:
            return
        worker.waiting = False
        self._loop.at(self._loop.now + prefix_share.SYNC_S, self._sync, index)

    def _sync(self, index: int) -> None:
        args, _ = self._workers[index].share.begin()
        loop = self._loop
        loop.at(loop.now + self._rtt / 2, self._script, (index, args))

    def _script(self, argument: tuple[int, list[Any]]) -> None:
        """The share's script (``prefix_share.SCRIPT``), as the simulator models it."""
        index, args = argument
        sid, cursor, maxlen, budget, count = args[:5]
        stream = self._stream
        for j in range(count):
            self._next_id += 1
            stream.append((self._next_id, sid, args[5 + 2 * j].encode(), args[6 + 2 * j]))
        if len(stream) > maxlen:
            del stream[: len(stream) - maxlen]
        after = int(cursor) if cursor else 0
        out: list[bytes] = []
        used, last = 0, cursor
        read = 0
        for entry_id, source, endpoint, hashes in stream:
            if entry_id <= after:
                continue
            if read == 512:
                break
            read += 1
            size = len(endpoint) + len(hashes)
            if used > 0 and used + size > budget:
                break
            last = str(entry_id)
            if source != sid:
                out += [endpoint, hashes]
                used += size
        reply = [last.encode(), out, [], 0]
        self._loop.at(self._loop.now + self._rtt / 2, self._reply, (index, reply))

    def _reply(self, argument: tuple[int, list[Any]]) -> None:
        index, reply = argument
        learnt, _, _ = self._workers[index].share.received(reply)
        prefixes = self._sidecars[index].prefixes
        for entry in learnt:
            prefixes.placed(entry.endpoint, entry.hashes)
        self._wait(index)


class _ShareWorker:
    __slots__ = ("share", "token", "waiting", "woken")

    def __init__(self, share: prefix_share.PrefixShare) -> None:
        self.share = share
        self.waiting = False
        self.woken = False
        self.token = 0
