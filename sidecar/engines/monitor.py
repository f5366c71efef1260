"""The engine monitor: the one place that polls the engines.

Two rounds, each repeated an interval after the previous one ended, every poll of a round at once:

- **health** (every ``SIDECAR_READY_INTERVAL_S``): every decode rank's ``/health``; a poll may
  take one interval (at least a second) before it counts as no answer;
- **scrape** (every ``SIDECAR_SCRAPE_INTERVAL_S``): every decode rank's ``/metrics``, and for
  each prefill endpoint of the pool what the pool asks for — its ``/metrics``, its
  ``/health`` while it is probed after an ejection, nothing while it is ejected; a poll may take
  the interval, at most 2 s. With shared scrapes (``sidecar.engines.shared_scrapes``) a prefill
  endpoint's ``/metrics`` is scraped here only when this sidecar is one of its owners, cannot
  read the publications, or is one of its backups and its publication is missing or too old;
  otherwise the publication is handed to the pool as this sidecar's own scrape would be.

What a poll finds is published as an immutable ``EngineSnapshot``. A decode rank's, its
``/health`` polls judged by readiness's rule (``sidecar.engines.readiness.judge``: consecutive
failures before unready), becomes the rank's ``engine`` (``DecodeRanks.publish``, which also
forgets the rank's prefix index when a ``/health`` poll says the engine lost its cache): the one
value readiness (``/ready``), the rank choice and ``/debug/scheduler`` read; readiness then
reports what changed (logs, gauges). A prefill endpoint's goes to the pool
(``sidecar.scheduling.pool.PrefillPool.prefill_polled``), which owns what it means for the
endpoint (ejection, re-admission, its load). The monitor decides nothing itself.

Nothing here blocks the event loop: every poll is bounded by its timeout, the rounds are two
tasks, and ``close()`` stops them (the app's cleanup, before the scheduler and the engine pool
close).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sidecar.config import Settings
from sidecar.engines.readiness import (
    DEFAULT_THRESHOLDS,
    HealthPoll,
    Readiness,
    Thresholds,
    judge,
)
from sidecar.engines.scrape import parse_engine_load
from sidecar.engines.shared_scrapes import ScrapeShare
from sidecar.engines.upstream import Engines
from sidecar.errors import (
    EngineConnectTimeout,
    EngineError,
    EngineNotConnected,
    EngineRefused,
    EngineTimeout,
    EngineUnreachable,
)
from sidecar.fleet.load import EngineLoad
from sidecar.fleet.polls import PrefillPoll
from sidecar.fleet.snapshot import EngineHealth, EngineSnapshot
from sidecar.scheduling.ranks import DecodeRank, DecodeRanks
from sidecar.tasks import stop_task

logger = logging.getLogger("sidecar.engines.monitor")

SCRAPE_TIMEOUT_MAX_S = 2.0
"""A scrape or a probe waits the scrape interval for its answer, and never longer than this."""
HEALTH_TIMEOUT_MIN_S = 1.0
"""A decode rank's ``/health`` poll waits the ready interval for its answer, and at least this."""


@dataclass(frozen=True, slots=True)
class MonitorOptions:
    """The settings the monitor uses, under their own names (``from_settings``)."""

    ready_interval_s: float
    scrape_interval_s: float
    thresholds: Thresholds = DEFAULT_THRESHOLDS
    """The consecutive /health polls that change a decode rank's readiness."""

    @classmethod
    def from_settings(cls, settings: Settings) -> MonitorOptions:
        return cls(
            ready_interval_s=settings.ready_interval_s,
            scrape_interval_s=settings.scrape_interval_s,
            thresholds=Thresholds(
                failures=settings.ready_failure_threshold,
                successes=settings.ready_success_threshold,
            ),
        )

    @property
    def health_timeout_s(self) -> float:
        return max(HEALTH_TIMEOUT_MIN_S, self.ready_interval_s)

    @property
    def scrape_timeout_s(self) -> float:
        return min(self.scrape_interval_s, SCRAPE_TIMEOUT_MAX_S)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Take a finished future's exception, so that one left unawaited (its round cancelled) is
    not reported as never retrieved."""
    if not future.cancelled():
        future.exception()


class PolledPool(Protocol):
    """What the monitor asks of whoever owns the prefill pool (``scheduling.pool.PrefillPool``)."""

    def prefill_polls(self) -> list[PrefillPoll]:
        """This scrape round's polls: one per endpoint of the pool but the ejected ones."""
        ...

    def prefill_polled(self, poll: PrefillPoll, snapshot: EngineSnapshot) -> None:
        """What ``poll`` found."""
        ...


class _NoPool:
    """A monitor of the decode engine alone."""

    def prefill_polls(self) -> list[PrefillPoll]:
        return []

    def prefill_polled(self, poll: PrefillPoll, snapshot: EngineSnapshot) -> None:
        raise AssertionError("no prefill endpoint was polled")


NO_POOL: PolledPool = _NoPool()


class EngineMonitor:
    """Polls every engine (the decode ranks, the prefill pool) and publishes snapshots; the only
    writer of a decode rank's ``engine``."""

    def __init__(
        self,
        options: MonitorOptions,
        *,
        engines: Engines,
        ranks: DecodeRanks,
        readiness: Readiness,
        pool: PolledPool = NO_POOL,
        share: ScrapeShare | None = None,
    ) -> None:
        """``share``: the prefill scrapes shared with the pool's other sidecars
        (``SIDECAR_SHARED_SCRAPES``), or None: every prefill endpoint scraped here."""
        self._options = options
        self._share = share
        self._engines = engines
        self._ranks = ranks
        self._readiness = readiness
        self._pool = pool
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start both rounds; each polls at once, then every interval."""
        self._tasks = [
            asyncio.create_task(
                self._every(self._options.ready_interval_s, self.poll_health, "health"),
                name="engine-monitor:health",
            ),
            asyncio.create_task(
                self._every(self._options.scrape_interval_s, self.scrape, "scrape"),
                name="engine-monitor:scrape",
            ),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            await stop_task(task)
        self._tasks.clear()

    @staticmethod
    async def _every(interval_s: float, poll: Callable[[], Awaitable[object]], name: str) -> None:
        """``poll``, then ``interval_s`` after it ended, forever; cancelled at shutdown.

        A round handles its engines' failures itself; one that raises is a bug, and it must not
        end the polling (a sidecar whose scrapes stopped would go on deciding on loads that no
        longer change): a failure is logged with its traceback, the next in a row only when
        they raise another kind of exception, and the round that works again says how many
        failed."""
        failures = 0
        logged: type[BaseException] | None = None
        while True:
            try:
                await poll()
            except Exception as exc:
                if type(exc) is not logged:
                    logger.exception("engine monitor: the %s round failed", name)
                    logged = type(exc)
                failures += 1
            else:
                if failures:
                    logger.warning(
                        "engine monitor: the %s round works again after %d failure(s)",
                        name,
                        failures,
                    )
                failures, logged = 0, None
            await asyncio.sleep(interval_s)

    # --- the health round ------------------------------------------------------------------

    async def poll_health(self) -> bool:
        """Poll every decode rank's ``/health`` once; whether the engine (a rank at least) is
        ready now."""
        was = self._ranks.ready
        await asyncio.gather(*(self._poll_health(rank) for rank in self._ranks))
        self._readiness.polled(was)
        return self._ranks.ready

    async def _poll_health(self, rank: DecodeRank) -> None:
        poll = await self._health(rank.url, self._options.health_timeout_s, role="decode engine")
        was = rank.ready
        self._ranks.publish(rank, judge(rank.engine, poll, self._options.thresholds))
        self._readiness.rank_polled(rank, was)

    # --- the scrape round ------------------------------------------------------------------

    async def scrape(self) -> None:
        """Scrape every decode rank, and poll the prefill endpoints the pool asks for; with
        shared scrapes, only those this sidecar scrapes itself, the others' publications
        handed to the pool instead."""
        polls = self._pool.prefill_polls()
        share = self._share
        if share is None:
            await asyncio.gather(
                *(self._scrape_rank(rank) for rank in self._ranks),
                *(self._poll_prefill(poll) for poll in polls),
            )
            return
        # The decode ranks' scrapes go on while the publications are read and handed, and
        # the prefill endpoints scraped, each scrape published as it ends: one slow engine
        # delays nobody's load but its own.
        ranks = asyncio.gather(*(self._scrape_rank(rank) for rank in self._ranks))
        ranks.add_done_callback(_retrieved)
        try:
            await share.read(
                [poll.key for poll in polls if not poll.probe],
                now=time.monotonic(),
                wall=time.time(),
            )
            wall = time.time()
            own = [poll for poll in polls if poll.probe or share.scrapes(poll.key, wall=wall)]
            mine = {id(poll) for poll in own}
            for poll in polls:
                if id(poll) not in mine:
                    found = share.take(poll.key, now=time.monotonic(), wall=time.time())
                    if found is not None:
                        self._pool.prefill_polled(poll, found)
            await asyncio.gather(*(self._poll_prefill(poll) for poll in own))
        except BaseException:  # cancelled (the app closing): so are the ranks' scrapes
            ranks.cancel()
            raise
        await ranks

    async def _scrape_rank(self, rank: DecodeRank) -> None:
        load, unreachable = await self._load(rank.url)
        self._ranks.publish(
            rank,
            dataclasses.replace(
                rank.engine, load=load, unreachable=unreachable, at=time.monotonic()
            ),
        )

    async def _poll_prefill(self, poll: PrefillPoll) -> None:
        base = self._engines.prefill_url(poll.endpoint)
        server_name = self._engines.prefill_server_name(poll.endpoint)
        if poll.probe:
            probe = await self._health(
                base, self._options.scrape_timeout_s, server_name, role="prefill engine"
            )
            snapshot = EngineSnapshot(
                health=probe.health,
                health_at=probe.at,
                at=probe.at,
                ready=probe.health is EngineHealth.UP,  # one probe re-admits, or not
                reason=probe.reason,
            )
        else:
            load, unreachable = await self._load(base, server_name)
            snapshot = EngineSnapshot(load=load, unreachable=unreachable, at=time.monotonic())
            if self._share is not None:
                self._share.found(poll.key, snapshot, wall=time.time())
                await self._share.publish(now=time.monotonic())
        self._pool.prefill_polled(poll, snapshot)

    # --- one poll --------------------------------------------------------------------------

    async def _health(
        self,
        base_url: str,
        timeout_s: float,
        server_name: str | None = None,
        *,
        role: str,
    ) -> HealthPoll:
        """One ``/health`` poll; a failed one says why, naming the engine (``role`` at
        ``host:port``)."""
        engine = f"{role} at {base_url.split('://', 1)[-1]}"
        try:
            response = await self._engines.polls.send(
                "GET",
                base_url + "/health",
                headers={},
                total_s=timeout_s,
                role=role,
                server_name=server_name,
            )
            await response.read()
        except EngineRefused:
            return HealthPoll(
                EngineHealth.LOST,
                time.monotonic(),
                engine,
                f"{engine}: connection refused",
                refused=True,
            )
        except EngineConnectTimeout as exc:  # its cache presumably kept: a busy host is slow
            return HealthPoll(EngineHealth.DOWN, time.monotonic(), engine, exc.message)
        except EngineNotConnected as exc:  # unresolved, untrusted certificate
            return HealthPoll(EngineHealth.LOST, time.monotonic(), engine, exc.message)
        except EngineTimeout:  # its cache presumably kept: a busy engine is slow
            reason = f"{engine}: no answer to /health within {timeout_s:g} s"
            return HealthPoll(EngineHealth.DOWN, time.monotonic(), engine, reason)
        except EngineError as exc:  # a broken answer
            return HealthPoll(EngineHealth.DOWN, time.monotonic(), engine, exc.message)
        if response.status == 200:
            return HealthPoll(EngineHealth.UP, time.monotonic(), engine)
        reason = f"{engine}: /health answered {response.status}"
        return HealthPoll(EngineHealth.LOST, time.monotonic(), engine, reason)

    async def _load(
        self, base_url: str, server_name: str | None = None
    ) -> tuple[EngineLoad | None, bool]:
        """The engine's scraped gauges (None when it served none), and whether it could not be
        reached (refused or reset; merely slow is not)."""
        try:
            response = await self._engines.polls.send(
                "GET",
                base_url + "/metrics",
                headers={},
                total_s=self._options.scrape_timeout_s,
                server_name=server_name,
            )
            body = await response.read()
        except EngineUnreachable:
            return None, True
        except EngineError:
            return None, False
        if response.status != 200:
            return None, False  # metrics disabled or not served: schedule by reservations alone
        return parse_engine_load(body.decode(errors="replace"), time.monotonic()), False
