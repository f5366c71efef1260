"""The scheduler's live side: the pool, what it knows of each endpoint, and placing a request.

Around the pure decider and policy it keeps, per prefill endpoint: health (ejection with growing
backoff, re-admission after a successful probe), observed speed, scraped engine load, draining;
and it keeps reservations in the state backend. Each request is first given a rank of the local
decode engine (``ranks``: the prefix index per rank, then load); the decision to prefill locally
weighs that rank. Background tasks re-resolve discovery and scrape every engine's /metrics (every
decode rank's too; probing ejected endpoints' /health); the request path does no I/O but the
backend's single bounded ``reserve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sidecar.config import REMOTE_ONLY_CONNECTORS, Settings
from sidecar.discovery import Discovery
from sidecar.endpoints import Endpoint
from sidecar.errors import EngineError, EngineUnreachable
from sidecar.metrics import Metrics
from sidecar.scheduling.decider import Decider
from sidecar.scheduling.estimates import Availability, Health, SpeedEstimate
from sidecar.scheduling.model import Candidate, Decision, LocalView, Speed
from sidecar.scheduling.policies import make_policy
from sidecar.scheduling.prompts import estimate_tokens, prompt_text
from sidecar.scheduling.ranks import DecodeRank, DecodeRanks, RankClaim
from sidecar.scheduling.scrape import EngineLoad, describe_load, merge_loads, parse_engine_load
from sidecar.scheduling.state import Reservation, StateBackend
from sidecar.upstream import Engines

logger = logging.getLogger("sidecar.scheduling")

PREFILL_PRIOR = Speed(s_per_token=1e-4, overhead_s=0.02)
"""10,000 prompt tokens/s and 20 ms per call until the endpoint's own calls say otherwise."""
LOCAL_PRIOR = Speed(s_per_token=1e-4, overhead_s=0.01)
STALE_AFTER_SCRAPES = 3
"""A scrape older than this many intervals is ignored (treated as unknown)."""
SPEED_SAMPLES_TRUSTED = 3
"""Below this many own observations, a speed shared by other sidecars is preferred."""


@dataclass(slots=True)
class EndpointState:
    endpoint: Endpoint
    health: Health
    speed: SpeedEstimate = field(default_factory=lambda: SpeedEstimate(PREFILL_PRIOR))
    load: EngineLoad | None = None
    draining: bool = False
    inflight: int = 0

    @property
    def key(self) -> str:
        return str(self.endpoint)


@dataclass(frozen=True, slots=True)
class PrefillOutlook:
    queued: bool
    """Probably still waiting in the engine's queue."""
    compute_s: float
    """The prompt's own predicted compute, without queue or fixed overhead."""
    remaining_s: float
    """Predicted seconds until it ends (negative: overdue)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one request prefills, and what to give back when it is done."""

    decision: Decision
    endpoint: Endpoint | None
    rank: RankClaim
    """The decode rank the request holds (a prefill retry's placement shares it); the pipeline
    ends the claim when the request ends."""
    reservation: Reservation | None = None
    local_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        *,
        discovery: Discovery,
        backend: StateBackend,
        engines: Engines,
        metrics: Metrics,
    ) -> None:
        self._settings = settings
        self._discovery = discovery
        self.backend = backend
        self._engines = engines
        self._metrics = metrics
        self._rng = random.Random(settings.scheduler_seed)
        self._decider = Decider(
            make_policy(settings.scheduler_policy, self._rng, choices=settings.scheduler_choices),
            min_tokens=settings.disagg_min_tokens,
            ttft_ratio=settings.disagg_ttft_ratio,
            # A decode server that cannot prefill: nothing to weigh, every request goes remote.
            always=settings.connector in REMOTE_ONLY_CONNECTORS,
        )
        self.ranks = DecodeRanks(
            settings.decode_ranks,
            block_tokens=settings.prefix_block_tokens,
            capacity_blocks=settings.prefix_cache_blocks,
            stale_after_s=STALE_AFTER_SCRAPES * settings.scrape_interval_s,
            # Its own stream: placing on ranks never shifts the prefill policy's seeded choices.
            rng=random.Random(settings.scheduler_seed),
        )
        self._pool: dict[str, EndpointState] = {}
        # One estimate for every rank: the same model on the same hardware.
        self._local_speed = SpeedEstimate(LOCAL_PRIOR)
        self._reasons: Counter[str] = Counter()
        self._tasks: list[asyncio.Task[None]] = []
        self._scrape_timeout_s = min(settings.scrape_interval_s, 2.0)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.backend.start()
        await self.refresh_pool()
        if self._discovery.uses_dns:
            self._tasks.append(asyncio.create_task(self._discover(), name="discovery"))
        self._tasks.append(asyncio.create_task(self._scrape_forever(), name="scraper"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.backend.close()

    async def refresh_pool(self) -> None:
        """Apply discovery's current answer: new endpoints join, missing ones drain."""
        current = {str(e): e for e in await self._discovery.resolve()}
        for key, endpoint in current.items():
            state = self._pool.get(key)
            if state is None:
                self._pool[key] = EndpointState(endpoint, self._new_health())
                logger.info("prefill endpoint %s joined the pool", key)
            elif state.draining:
                state.draining = False
                logger.info("prefill endpoint %s is back in the pool", key)
        for key, state in list(self._pool.items()):
            if key not in current and not state.draining:
                state.draining = True
                logger.info("prefill endpoint %s left discovery: draining", key)
            if state.draining and state.inflight == 0:
                del self._pool[key]
                self._metrics.forget_endpoint(key)

    def _new_health(self) -> Health:
        return Health(
            eject_after=self._settings.eject_after_failures,
            base_s=self._settings.eject_base_s,
            max_s=self._settings.eject_max_s,
        )

    # --- the request path ------------------------------------------------------------------

    async def place(
        self, body: dict[str, Any], header: Endpoint | None, *, local_reason: str | None = None
    ) -> Placement:
        """Decide which decode rank takes ``body`` and where it prefills; claim the rank and
        reserve the prompt's tokens on the prefill endpoint. ``header``: the gateway's choice of
        prefill server, used as is; ``local_reason``: why the request must prefill locally
        anyway. "Locally" means on the chosen rank: its prefix cache and queue are weighed."""
        tokens = estimate_tokens(body)
        # The chosen rank will hold this prompt's KV either way (computed or pulled).
        claim, cached = self.ranks.claim(prompt_text(body), tokens)
        try:
            return await self._place(claim, tokens, cached, header, local_reason)
        except BaseException:
            claim.end()
            raise

    async def _place(
        self,
        claim: RankClaim,
        tokens: int,
        cached: int,
        header: Endpoint | None,
        local_reason: str | None,
    ) -> Placement:
        if local_reason is not None:
            uncached = max(0, tokens - cached)
            decision = Decision(None, local_reason, tokens, uncached)
            self._count(decision)
            claim.prefilling(uncached)
            return Placement(decision, None, claim, local_tokens=uncached)
        if header is not None:
            # Not a choice, but predicted all the same, for the record.
            predicted = self._decider.remote_seconds(self._candidate(str(header)), tokens)
            uncached = max(0, tokens - cached)
            decision = Decision(str(header), "header", tokens, uncached, predicted)
            self._count(decision)
            return await self._reserve(decision, header, claim)
        rank = claim.rank
        decision = self._decider.decide(
            self._candidates(),
            LocalView(rank.ahead_tokens, self.ranks.waiting(rank), self._local()),
            prompt_tokens=tokens,
            cached_tokens=cached,
        )
        self._count(decision)
        if decision.endpoint is None:
            claim.prefilling(decision.uncached_tokens)
            return Placement(decision, None, claim, local_tokens=decision.uncached_tokens)
        return await self._reserve(decision, self._pool[decision.endpoint].endpoint, claim)

    async def retry(self, failed: Placement, tried: set[str]) -> Placement | None:
        """Where to retry a prefill that failed transiently: the same endpoint when the gateway
        named it, else another available one the policy picks (None when none is left)."""
        decision = failed.decision
        if failed.endpoint is None:
            return None
        if decision.reason == "header":
            return await self._reserve(decision, failed.endpoint, failed.rank)
        candidates = [c for c in self._candidates() if c.key not in tried]
        chosen = self._decider.policy.choose(candidates, decision.uncached_tokens)
        if chosen is None:
            return None
        retried = Decision(
            chosen.key,
            decision.reason,
            decision.prompt_tokens,
            decision.uncached_tokens,
            decision.predicted_s,
        )
        return await self._reserve(retried, self._pool[chosen.key].endpoint, failed.rank)

    def pool_endpoints(self) -> list[Endpoint]:
        """Every endpoint of the pool, draining ones included (for the header allowlist)."""
        return [state.endpoint for state in self._pool.values()]

    async def _reserve(self, decision: Decision, endpoint: Endpoint, rank: RankClaim) -> Placement:
        state = self._pool.get(str(endpoint))
        if state is None:  # a header target outside the pool: nothing to account for
            return Placement(decision, endpoint, rank)
        state.inflight += 1
        try:
            reservation = await self.backend.reserve(state.key, decision.uncached_tokens)
        except BaseException:
            state.inflight -= 1
            raise
        return Placement(decision, endpoint, rank, reservation)

    def prefill_finished(
        self, placement: Placement, *, ok: bool | None, seconds: float | None = None
    ) -> None:
        """The prefill leg ended: ``ok`` True (usable answer), False (the endpoint failed),
        None (cancelled, or the client's own fault: says nothing about the endpoint)."""
        reservation = placement.reservation
        if reservation is None:
            return
        self.backend.release(reservation)
        state = self._pool.get(reservation.endpoint)
        if state is None:
            return
        state.inflight -= 1
        if ok is True:
            state.health.success()
            if seconds is not None:
                speed = state.speed.observe(reservation.ahead_tokens + reservation.tokens, seconds)
                self.backend.publish_speed(state.key, speed)
        elif ok is False:
            self._failure(state)
        if state.draining and state.inflight == 0:
            del self._pool[state.key]
            self._metrics.forget_endpoint(state.key)

    def prefill_outlook(self, placement: Placement, elapsed_s: float) -> PrefillOutlook:
        """How a prefill stands ``elapsed_s`` after it was sent to ``placement``'s endpoint.

        Queued means: the engine's last fresh scrape showed waiting requests, and the work
        reserved ahead of this prefill when it was sent would not have drained yet. Without that
        evidence the prefill counts as computing — the error a stale scrape can cause is then to
        finish a prefill that was queued (compute spent), never to abort one that was done.
        """
        key = str(placement.endpoint)
        state = self._pool.get(key)
        speed = PREFILL_PRIOR
        waiting: float | None = None
        if state is not None:
            speed = self._speed(state, self.backend.view().speeds.get(key))
            waiting = self._fresh(state.load, "waiting")
        queue_s = 0.0
        if waiting and placement.reservation is not None:
            queue_s = speed.s_per_token * placement.reservation.ahead_tokens
        # The tokens its speed was learned on (prefill_finished): the uncached ones.
        compute_s = speed.s_per_token * placement.decision.uncached_tokens
        return PrefillOutlook(
            queued=elapsed_s < queue_s,
            compute_s=compute_s,
            remaining_s=queue_s + speed.overhead_s + compute_s - elapsed_s,
        )

    def local_first_byte(self, placement: Placement, seconds: float | None) -> None:
        """A locally prefilled request produced its first byte (``seconds`` after it arrived),
        or ended without one (None)."""
        if placement.endpoint is not None or placement.local_tokens == 0:
            return
        placement.rank.prefilled()
        if seconds is not None:
            ahead = placement.rank.rank.ahead_tokens
            self._local_speed.observe(ahead + placement.local_tokens, seconds)

    def _failure(self, state: EndpointState) -> None:
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
            self.backend.publish_ejection(state.key, time.time() + state.health.ejected_until - now)
            if was == Availability.HEALTHY:  # taken out of service; a failed probe is not new
                self._metrics.endpoint_ejections.labels(state.key).inc()

    def _candidate(self, key: str) -> Candidate:
        """``key`` as a policy would see it; an endpoint outside the pool (or unavailable) as a
        stranger: the prior speed, no load known."""
        found = [c for c in self._candidates() if c.key == key] if key in self._pool else []
        return found[0] if found else Candidate(key=key, speed=PREFILL_PRIOR)

    def _candidates(self) -> list[Candidate]:
        now, wall = time.monotonic(), time.time()
        view = self.backend.view()
        candidates = []
        for key, state in self._pool.items():
            if state.draining or not state.health.available(now):
                continue
            if view.ejected_until.get(key, 0.0) > wall:
                continue
            load = view.loads.get(key)
            candidates.append(
                Candidate(
                    key=key,
                    reserved_tokens=load.tokens if load else 0,
                    reserved_requests=load.requests if load else 0,
                    waiting=self._fresh(state.load, "waiting"),
                    running=self._fresh(state.load, "running"),
                    kv_usage=self._fresh(state.load, "kv_usage"),
                    speed=self._speed(state, view.speeds.get(key)),
                )
            )
        return candidates

    def _speed(self, state: EndpointState, shared: Speed | None) -> Speed:
        if shared is not None and state.speed.samples < SPEED_SAMPLES_TRUSTED:
            return shared
        return state.speed.value

    def _local(self) -> Speed:
        return self._local_speed.value

    def _fresh(self, load: EngineLoad | None, name: str) -> float | None:
        if load is None:
            return None
        if time.monotonic() - load.at > STALE_AFTER_SCRAPES * self._settings.scrape_interval_s:
            return None
        value: float | None = getattr(load, name)
        return value

    def _count(self, decision: Decision) -> None:
        self._reasons[decision.reason] += 1
        kind = "local" if decision.endpoint is None else "remote"
        self._metrics.scheduler_decisions.labels(kind, decision.reason).inc()

    # --- background: discovery and scraping ----------------------------------------------

    async def _discover(self) -> None:
        while True:
            await asyncio.sleep(self._settings.discovery_interval_s)
            await self.refresh_pool()

    async def _scrape_forever(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self._settings.scrape_interval_s)

    async def scrape_once(self) -> None:
        states = list(self._pool.values())
        await asyncio.gather(
            self._scrape_decode(), *(self._scrape_endpoint(state) for state in states)
        )

    async def _scrape_decode(self) -> None:
        await asyncio.gather(*(self._scrape_rank(rank) for rank in self.ranks))

    async def _scrape_rank(self, rank: DecodeRank) -> None:
        rank.load = await self._load(rank.url)

    async def _scrape_endpoint(self, state: EndpointState) -> None:
        now = time.monotonic()
        availability = state.health.refresh(now)
        if availability == Availability.EJECTED:
            return
        base = self._engines.prefill_url(state.endpoint)
        server_name = self._engines.prefill_server_name(state.endpoint)
        if availability == Availability.PROBING:
            if await self._probe(base + "/health", server_name):
                state.health.success()
                logger.info("prefill endpoint %s passed its probe: re-admitted", state.key)
            else:
                self._failure(state)
            return
        try:
            state.load = await self._load(base, raise_unreachable=True, server_name=server_name)
        except EngineUnreachable:  # refused or reset: a failure; merely slow is not
            state.load = None
            self._failure(state)

    async def _load(
        self, base_url: str, *, raise_unreachable: bool = False, server_name: str | None = None
    ) -> EngineLoad | None:
        try:
            response = await self._engines.send(
                "GET",
                base_url + "/metrics",
                headers={},
                total_s=self._scrape_timeout_s,
                poll=True,
                server_name=server_name,
            )
            body = await response.read()
        except EngineError as exc:
            if raise_unreachable and isinstance(exc, EngineUnreachable):
                raise
            return None
        if response.status != 200:
            return None  # metrics disabled or not served: schedule by reservations alone
        return parse_engine_load(body.decode(errors="replace"), time.monotonic())

    async def _probe(self, url: str, server_name: str | None) -> bool:
        try:
            response = await self._engines.send(
                "GET",
                url,
                headers={},
                total_s=self._scrape_timeout_s,
                poll=True,
                server_name=server_name,
            )
            await response.read()
        except EngineError:
            return False
        return response.status == 200

    def publish_gauges(self) -> None:
        """Per-endpoint gauges, brought up to date when /metrics is read."""
        view = self.backend.view()
        for key, state in self._pool.items():
            load = view.loads.get(key)
            self._metrics.endpoint_reserved_tokens.labels(key).set(load.tokens if load else 0)
            waiting = self._fresh(state.load, "waiting")
            self._metrics.endpoint_waiting.labels(key).set(
                waiting if waiting is not None else float("nan")
            )
            healthy = not state.draining and state.health.available(time.monotonic())
            self._metrics.endpoint_healthy.labels(key).set(1 if healthy else 0)
            # Present at 0 from the start: the first ejection then shows in increase().
            self._metrics.endpoint_ejections.labels(key)
        for rank in self.ranks:
            self._metrics.decode_rank_inflight.labels(str(rank.index)).set(rank.inflight)

    # --- /debug/scheduler ------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        now, wall = time.monotonic(), time.time()
        view = self.backend.view()
        endpoints = []
        for key, state in sorted(self._pool.items()):
            load = view.loads.get(key)
            availability = state.health.refresh(now)
            shared_until = view.ejected_until.get(key, 0.0)
            endpoints.append(
                {
                    "endpoint": key,
                    "state": "draining" if state.draining else availability.value,
                    "ejected_for_s": round(max(0.0, state.health.ejected_until - now), 3)
                    if availability == Availability.EJECTED
                    else None,
                    "ejected_elsewhere_for_s": round(shared_until - wall, 3)
                    if shared_until > wall
                    else None,
                    "consecutive_failures": state.health.failures,
                    "reserved_tokens": load.tokens if load else 0,
                    "reserved_requests": load.requests if load else 0,
                    "inflight_here": state.inflight,
                    "scraped": describe_load(state.load, now),
                    "speed": _speed_dict(self._speed(state, view.speeds.get(key))),
                    "speed_samples": state.speed.samples,
                }
            )
        return {
            "policy": self._settings.scheduler_policy,
            "choices": self._settings.scheduler_choices,
            "disagg_min_tokens": self._settings.disagg_min_tokens,
            "disagg_ttft_ratio": self._settings.disagg_ttft_ratio,
            "discovery": self._discovery.describe(),
            "state_backend": self.backend.status(),
            "decisions": dict(self._reasons),
            "local": {
                "ahead_tokens": sum(rank.ahead_tokens for rank in self.ranks),
                "scraped": describe_load(merge_loads([rank.load for rank in self.ranks]), now),
                "speed": _speed_dict(self._local_speed.value),
                "prefix_index_blocks": sum(len(rank.prefix) for rank in self.ranks),
            },
            "decode_ranks": self.ranks.describe(now),
            "endpoints": endpoints,
        }


def _speed_dict(speed: Speed) -> dict[str, float]:
    return {"s_per_token": speed.s_per_token, "overhead_s": speed.overhead_s}
