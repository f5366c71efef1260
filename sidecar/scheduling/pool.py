"""The prefill pool: which endpoints are in it, and whether each is in service.

Discovery's answer decides membership (``refresh``: new endpoints join, missing ones drain and
leave once their last prefill ended; a background task re-resolves DNS). Health is the pool's
too: an endpoint that fails is ejected with growing backoff (logged, counted, published to the
other sidecars through the state backend) and re-admitted after a successful probe. The engine
monitor (``sidecar.engines.monitor``) asks the pool what to poll (``prefill_polls``: scrapes,
probes of endpoints after an ejection) and hands it what it found (``prefill_polled``); the pool
alone writes what is known of an endpoint's health and load. Per-endpoint gauges and the
endpoints' part of ``/debug/scheduler`` are read from here.

The endpoints' states live in the planner (``placement.Planner.pool``), which the scheduler
places on; the pool changes them only between decisions, after the scheduler's deferred
bookkeeping (``record``) is applied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.config import Settings
from sidecar.discovery import Discovery
from sidecar.fleet.endpoints import Endpoint
from sidecar.fleet.polls import PrefillPoll
from sidecar.fleet.snapshot import EngineSnapshot
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.estimates import Availability, Health
from sidecar.scheduling.placement import EndpointState, Planner
from sidecar.scheduling.prefixes import PrefillPrefixes
from sidecar.scheduling.state import StateBackend
from sidecar.tasks import stop_task

logger = logging.getLogger("sidecar.scheduling")


@dataclass(frozen=True, slots=True)
class PoolOptions:
    """The settings the pool uses, under their own names (``from_settings``): how often
    discovery is re-resolved, when and for how long an endpoint is ejected."""

    discovery_interval_s: float
    eject_after_failures: int
    eject_base_s: float
    eject_max_s: float

    @classmethod
    def from_settings(cls, settings: Settings) -> PoolOptions:
        return cls(
            discovery_interval_s=settings.discovery_interval_s,
            eject_after_failures=settings.eject_after_failures,
            eject_base_s=settings.eject_base_s,
            eject_max_s=settings.eject_max_s,
        )


class PrefillPool:
    def __init__(
        self,
        options: PoolOptions,
        *,
        discovery: Discovery,
        planner: Planner,
        backend: StateBackend,
        metrics: Metrics,
        prefixes: PrefillPrefixes | None,
        record: Callable[[], None],
    ) -> None:
        """``record``: applies the placements' bookkeeping not applied yet (the scheduler's),
        called before the pool reads or changes what a placement would have recorded."""
        self._options = options
        self._discovery = discovery
        self._planner = planner
        self._states = planner.pool
        self._backend = backend
        self._metrics = metrics
        self._prefixes = prefixes
        self._record = record
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        if self._discovery.uses_dns:
            self._task = asyncio.create_task(self._discover(), name="discovery")

    async def close(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
            self._task = None

    async def _discover(self) -> None:
        while True:
            await asyncio.sleep(self._options.discovery_interval_s)
            await self.refresh()

    async def refresh(self) -> None:
        """Apply discovery's current answer: new endpoints join, missing ones drain."""
        current = {str(e): e for e in await self._discovery.resolve()}
        for key, endpoint in current.items():
            state = self._states.get(key)
            if state is None:
                self._planner.join(endpoint, self.new_health())
                self._metrics.endpoint_joined(key)
                logger.info("prefill endpoint %s joined the pool", key)
            elif state.draining:
                state.draining = False
                logger.info("prefill endpoint %s is back in the pool", key)
        for key, state in list(self._states.items()):
            if key not in current and not state.draining:
                state.draining = True
                logger.info("prefill endpoint %s left discovery: draining", key)
            if state.draining and state.inflight == 0:
                self.leave(state)

    def new_health(self) -> Health:
        return Health(
            eject_after=self._options.eject_after_failures,
            base_s=self._options.eject_base_s,
            max_s=self._options.eject_max_s,
        )

    def leave(self, state: EndpointState) -> None:
        """A draining endpoint leaves, its last prefill ended: forgotten, its series gone."""
        self._planner.leave(state.key)
        self._metrics.forget_endpoint(state.key)

    def endpoints(self) -> list[Endpoint]:
        """Every endpoint of the pool, draining ones included (for the header allowlist)."""
        return [state.endpoint for state in self._states.values()]

    def failed(self, state: EndpointState) -> None:
        """A prefill or a poll of ``state``'s endpoint failed: ejected after enough failures
        (or again, when it fails its probe)."""
        now = time.monotonic()
        was = state.health.refresh(now)
        state.health.failure(now)
        if state.health.state == Availability.EJECTED and was != Availability.EJECTED:
            logger.warning(
                "prefill endpoint %s ejected for %.1fs after %d failure(s)",
                state.key,
                state.health.ejected_until - now,
                state.health.failures,
            )
            self._backend.publish_ejection(
                state.key, time.time() + state.health.ejected_until - now
            )
            if was == Availability.HEALTHY:  # taken out of service; a failed probe is not new
                self._metrics.endpoint_ejections.labels(state.key).inc()

    # --- what the engine monitor polls ------------------------------------------------------

    def prefill_polls(self) -> list[PrefillPoll]:
        """The pool's polls in the monitor's scrape round: an endpoint in service is scraped,
        one whose ejection ran out is probed on ``/health``, an ejected one is left alone."""
        polls = []
        for state in list(self._states.values()):
            availability = state.health.refresh(time.monotonic())
            if availability == Availability.EJECTED:
                continue
            probe = availability == Availability.PROBING
            polls.append(PrefillPoll(state.key, state.endpoint, probe))
        return polls

    def prefill_polled(self, poll: PrefillPoll, snapshot: EngineSnapshot) -> None:
        """What the monitor found: a probe re-admits the endpoint or ejects it again; a scrape
        brings its load, and one that could not reach it (refused or reset) is a failure."""
        self._record()
        state = self._states.get(poll.key)
        if state is None:  # it left the pool while polled
            return
        if poll.probe:
            if snapshot.ready:
                state.health.success()
                logger.info("prefill endpoint %s passed its probe: re-admitted", state.key)
            else:
                self.failed(state)
            return
        state.load = snapshot.load
        capacity = snapshot.load.cache_tokens if snapshot.load is not None else None
        if capacity and self._prefixes is not None:
            self._prefixes.set_capacity(state.key, capacity)
        if snapshot.unreachable:
            self.failed(state)

    # --- what is read of it -----------------------------------------------------------------

    def publish_gauges(self) -> None:
        """Per-endpoint gauges, brought up to date when /metrics is read."""
        view = self._backend.view()
        for key, state in self._states.items():
            load = view.loads.get(key)
            self._metrics.endpoint_reserved_tokens.labels(key).set(load.tokens if load else 0)
            waiting = self._planner.fresh(state.load, "waiting", time.monotonic())
            self._metrics.endpoint_waiting.labels(key).set(
                waiting if waiting is not None else float("nan")
            )
            healthy = not state.draining and state.health.available(time.monotonic())
            self._metrics.endpoint_healthy.labels(key).set(1 if healthy else 0)
            # Present at 0 from the start: the first ejection then shows in increase().
            self._metrics.endpoint_ejections.labels(key)

    def describe_discovery(self) -> dict[str, Any]:
        return self._discovery.describe()

    def describe(self, now: float, wall: float) -> list[dict[str, Any]]:
        """Every endpoint's ``/debug/scheduler`` entry."""
        return self._planner.describe(self._backend.view(), now, wall)
