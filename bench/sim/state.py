"""Modelled state backends: what a sidecar's ``SharedView`` holds when it decides.

``redis`` follows ``sidecar.scheduling.state.redis.RedisState`` step by step in virtual time:

- the view is the other sidecars' reservations as the last sync's reply gave them, plus this
  sidecar's own (always fresh);
- a sync sends this sidecar's whole table; the script runs half a round trip later (Redis then
  holds that table and answers the pool's totals and published speeds), and the reply is
  applied a whole round trip after the send;
- ``refresh``, before a decision, joins the sync in flight or starts one, and the decision is
  made when its reply is applied (or at the state timeout, on the view there is);
- ``reserve``, ``release`` and ``publish_speed`` change the local table at once; the first two
  wake the background worker. The worker, woken or after a heartbeat (a third of the lease),
  first waits for a sync in flight that is not its own (a decision's refresh, which may have
  left before the change), then starts a sync unless one started since, waits for it and goes
  back to waiting;
- waiters of one reply run in the order they came, the decisions before the worker.

``shared`` is the idealisation (one table, every change seen at once by everyone); ``local`` is
the memory backend (each sidecar's own reservations only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from bench.sim.engines import Loop
from sidecar.scheduling.model import Speed
from sidecar.scheduling.state import Load, OwnReservations, Reservation, SharedView


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
    """Redis as the sync script sees it: each sidecar's table as it last sent it, the speeds."""

    def __init__(self) -> None:
        self.tables: dict[int, dict[str, Load]] = {}
        self.totals: dict[str, Load] = {}
        self.speeds: dict[str, Speed] = {}

    def sync(
        self, sidecar: int, table: dict[str, Load], speeds: dict[str, Speed]
    ) -> tuple[dict[str, Load], dict[str, Speed]]:
        totals = self.totals
        for endpoint, load in self.tables.get(sidecar, {}).items():
            old = totals[endpoint]
            totals[endpoint] = Load(old.tokens - load.tokens, old.requests - load.requests)
        for endpoint, load in table.items():
            old = totals.get(endpoint, Load())
            totals[endpoint] = Load(old.tokens + load.tokens, old.requests + load.requests)
        self.tables[sidecar] = table
        self.speeds.update(speeds)
        return dict(totals), dict(self.speeds)


class RedisClient:
    """One sidecar's ``RedisState`` (see the module docstring)."""

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
        self._id = sidecar
        self._rtt_s = rtt_s
        self._timeout_s = timeout_s
        self._heartbeat_s = lease_s / 3
        self.own = OwnReservations()
        self._others: dict[str, Load] = {}
        self._speeds: dict[str, Speed] = {}
        self._pending: dict[str, Speed] = {}
        self._syncing = False
        self._decisions: list[_Waiter] = []
        """Refreshes waiting for the sync in flight."""
        self._wake = False
        self._worker_waiting = True
        """The worker waits for a wake or its heartbeat; False while it awaits a sync."""
        self._worker_awaits: str | None = None
        """The sync the worker awaits: ``other`` (in flight when it woke), ``own``, or None."""
        self._heartbeat_version = 0
        self.syncs = 0
        self._arm_heartbeat()
        if refresh_s > 0:
            loop.at(loop.now + refresh_s * (1 + sidecar % 7) / 7, self._refresh)

    def _refresh(self, _: object) -> None:
        self._wake_worker()
        self._loop.at(self._loop.now + self._refresh_s, self._refresh)

    def view(self) -> SharedView:
        loads = dict(self._others)
        for endpoint, own in self.own.loads.items():
            other = loads.get(endpoint, Load())
            loads[endpoint] = Load(other.tokens + own.tokens, other.requests + own.requests)
        return SharedView(loads, self._speeds, {})

    def refresh(self, then: Callable[[], None]) -> None:
        if not self._syncing:
            self._start_sync()
        waiter = _Waiter(then)
        self._decisions.append(waiter)
        self._loop.at(self._loop.now + self._timeout_s, waiter.run)

    def reserve(self, endpoint: str, tokens: int) -> Reservation:
        ahead = self.view().loads.get(endpoint, Load()).tokens
        self.own.add(endpoint, tokens, 1)
        self._wake_worker()
        return Reservation(endpoint, tokens, ahead)

    def release(self, reservation: Reservation) -> None:
        self.own.add(reservation.endpoint, -reservation.tokens, -1)
        self._wake_worker()

    def publish_speed(self, endpoint: str, speed: Speed) -> None:
        # Stored and sent with the next sync; production does not wake the worker for it.
        self._pending[endpoint] = speed
        self._speeds[endpoint] = speed

    # The sync and the worker.

    def _start_sync(self) -> None:
        self._syncing = True
        self.syncs += 1
        table = dict(self.own.loads)
        speeds, self._pending = self._pending, {}
        loop = self._loop
        loop.at(loop.now + self._rtt_s / 2, self._execute, (table, speeds))

    def _execute(self, sent: tuple[dict[str, Load], dict[str, Speed]]) -> None:
        table, speeds = sent
        totals, published = self._server.sync(self._id, table, speeds)
        self._loop.at(self._loop.now + self._rtt_s / 2, self._reply, (table, totals, published))

    def _reply(self, reply: tuple[dict[str, Load], dict[str, Load], dict[str, Speed]]) -> None:
        table, totals, published = reply
        others = {}
        for endpoint, total in totals.items():
            mine = table.get(endpoint, Load())
            if total.requests - mine.requests > 0:
                others[endpoint] = Load(total.tokens - mine.tokens, total.requests - mine.requests)
        self._others = others
        self._speeds = published
        self._syncing = False
        decisions, self._decisions = self._decisions, []
        for waiter in decisions:
            waiter.run(None)
        if self._worker_awaits == "other":
            # Its wait for the sync in flight is over: one of its own, unless one started since.
            if not self._syncing:
                self._start_sync()
            self._worker_awaits = "own"
        elif self._worker_awaits == "own":
            self._worker_awaits = None
            self._worker_waiting = True
            if self._wake:
                self._run_worker()
            else:
                self._arm_heartbeat()

    def _wake_worker(self) -> None:
        self._wake = True
        if self._worker_waiting:
            self._run_worker()

    def _run_worker(self) -> None:
        """One turn of ``RedisState._work`` after its wait: clear the wake, then wait for the
        sync in flight if there is one, else start one and wait for it."""
        self._wake = False
        self._worker_waiting = False
        if self._syncing:
            self._worker_awaits = "other"
        else:
            self._start_sync()
            self._worker_awaits = "own"

    def _arm_heartbeat(self) -> None:
        self._heartbeat_version += 1
        version = self._heartbeat_version
        self._loop.at(self._loop.now + self._heartbeat_s, self._heartbeat, version)

    def _heartbeat(self, version: Any) -> None:
        if version == self._heartbeat_version and self._worker_waiting:
            self._run_worker()


StateFactory = Callable[[int], ModelledState]


def state_factory(mode: str, loop: Loop, **redis: float) -> StateFactory:
    """One modelled backend per sidecar index."""
    if mode == "shared":
        table = SharedTable()
        return lambda _: table
    if mode == "local":
        return lambda _: LocalTable()
    server = RedisServer()
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
