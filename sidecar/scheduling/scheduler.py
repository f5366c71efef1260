"""The scheduler's live side: placing a request, and retrying its prefill elsewhere.

The pure part (per-endpoint knowledge, candidates, the decision, what is reserved and learnt) is
``placement.Planner``, which the simulator runs too; the prefill pool (discovery, health and
ejection, what the engine monitor polls, the endpoints' gauges) is ``pool.PrefillPool``. Around
the planner this keeps the request path's I/O: reservations in the state backend, metrics. Each
request is first given a rank of the local decode engine (``ranks``: the prefix index per rank,
or the rank's KV events where they are in sync, then load); the decision to prefill locally
weighs that rank. A decision reads the prompt's prefix hashes only as far as its look-ups go
(``LazyHashes``); what the placement teaches the indexes (the rank's and the prefill endpoint's
blocks, the prefix published) is recorded after the decision returns, in the loop's next turn,
and in any case before the next decision or anything else reads those indexes (``_record``;
after a decision's refresh too, when placements were decided while it waited) or a rank's index
is forgotten: no decision sees less than it did when the recording was part of it. The request
path does no I/O but the backend's single bounded ``reserve``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.config import Settings
from sidecar.discovery import Discovery
from sidecar.fleet.connectors import CONNECTORS
from sidecar.fleet.endpoints import Endpoint
from sidecar.fleet.load import describe_load, merge_loads
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.decider import Decider
from sidecar.scheduling.exact import ExactIndexes, PromptLookup
from sidecar.scheduling.model import Candidate, Decision
from sidecar.scheduling.placement import (
    STALE_AFTER_SCRAPES,
    Placement,
    Planner,
    PrefillOutlook,
    reserved_tokens,
    speed_dict,
)
from sidecar.scheduling.policies import make_policy
from sidecar.scheduling.pool import PoolOptions, PrefillPool
from sidecar.scheduling.prefixes import PrefillPrefixes, PrefixGuess, PrefixHasher, blocks_within
from sidecar.scheduling.prompts import LazyHashes, estimate_tokens, prompt_text
from sidecar.scheduling.ranks import DecodeRank, DecodeRanks, RankClaim
from sidecar.scheduling.state import SharedView, StateBackend
from sidecar.tasks import OnFailure

logger = logging.getLogger("sidecar.scheduling")


@dataclass(frozen=True, slots=True)
class SchedulerOptions:
    """The settings the scheduler uses, under their own names, and the one fact of the connector
    it needs (``from_settings``)."""

    decode_ranks: tuple[str, ...]
    scheduler_policy: str
    scheduler_choices: int
    scheduler_seed: int | None
    disagg_min_tokens: int
    disagg_ttft_ratio: float
    disagg_stall_weight: float
    disagg_stall_burst_s: float
    disagg_tpot_slo_s: float
    remote_only: bool
    """The connector's decode server cannot prefill: every request goes remote."""
    speed_half_life_s: float
    speed_idle_half_life_s: float
    scheduler_retest_s: float
    prefix_block_tokens: int
    prefix_cache_blocks: int
    prefill_prefix_index: bool
    prefill_prefix_block_tokens: int
    prefill_cache_tokens: int
    prefill_prefix_trust: float
    prefix_index_memory_mib: float
    prefix_hash_key: bytes | None
    scrape_interval_s: float
    pool: PoolOptions

    @classmethod
    def from_settings(cls, settings: Settings) -> SchedulerOptions:
        return cls(
            decode_ranks=settings.decode_ranks,
            scheduler_policy=settings.scheduler_policy,
            scheduler_choices=settings.scheduler_choices,
            scheduler_seed=settings.scheduler_seed,
            disagg_min_tokens=settings.disagg_min_tokens,
            disagg_ttft_ratio=settings.disagg_ttft_ratio,
            disagg_stall_weight=settings.disagg_stall_weight,
            disagg_stall_burst_s=settings.disagg_stall_burst_s,
            disagg_tpot_slo_s=settings.disagg_tpot_slo_ms / 1000,
            remote_only=CONNECTORS[settings.connector].remote_only,
            speed_half_life_s=settings.speed_half_life_s,
            speed_idle_half_life_s=settings.speed_idle_half_life_s,
            scheduler_retest_s=settings.scheduler_retest_s,
            prefix_block_tokens=settings.prefix_block_tokens,
            prefix_cache_blocks=settings.prefix_cache_blocks,
            prefill_prefix_index=settings.prefill_prefix_index,
            prefill_prefix_block_tokens=settings.prefill_prefix_block_tokens,
            prefill_cache_tokens=settings.prefill_cache_tokens,
            prefill_prefix_trust=settings.prefill_prefix_trust,
            prefix_index_memory_mib=settings.prefix_index_memory_mib,
            prefix_hash_key=None
            if settings.prefix_hash_key is None
            else settings.prefix_hash_key.get_secret_value().encode(),
            scrape_interval_s=settings.scrape_interval_s,
            pool=PoolOptions.from_settings(settings),
        )


class Scheduler:
    def __init__(
        self,
        options: SchedulerOptions,
        *,
        discovery: Discovery,
        backend: StateBackend,
        metrics: Metrics,
        kv_events: ExactIndexes | None = None,
    ) -> None:
        """``kv_events``: the engines' exact indexes (SIDECAR_KV_EVENTS; None: off), which
        answer for the engines whose events are in sync, the prefix indexes for the others."""
        self._options = options
        self._kv_events = kv_events
        self.backend = backend
        self._metrics = metrics
        self._rng = random.Random(options.scheduler_seed)
        self._hasher: PrefixHasher | None = None
        prefixes: PrefillPrefixes | None = None
        if options.prefill_prefix_index:
            block = options.prefill_prefix_block_tokens
            self._hasher = PrefixHasher(options.prefix_hash_key, block_tokens=block)
            prefixes = PrefillPrefixes(
                block_tokens=block,
                capacity_blocks=options.prefill_cache_tokens // block,
                max_blocks=blocks_within(
                    int(options.prefix_index_memory_mib * 2**20), options.prefix_cache_blocks
                ),
                trust=options.prefill_prefix_trust,
            )
        self._planner = Planner(
            Decider(
                make_policy(options.scheduler_policy, self._rng, choices=options.scheduler_choices),
                min_tokens=options.disagg_min_tokens,
                ttft_ratio=options.disagg_ttft_ratio,
                stall_weight=options.disagg_stall_weight,
                stall_burst_s=options.disagg_stall_burst_s,
                tpot_slo_s=options.disagg_tpot_slo_s,
                # A decode server that cannot prefill: nothing to weigh, every request goes remote.
                always=options.remote_only,
            ),
            stale_after_s=STALE_AFTER_SCRAPES * options.scrape_interval_s,
            half_life_s=options.speed_half_life_s,
            idle_half_life_s=options.speed_idle_half_life_s,
            retest_s=options.scheduler_retest_s,
            prefixes=prefixes,
        )
        self._prefixes = prefixes
        self._decider = self._planner.decider
        self.ranks = DecodeRanks(
            options.decode_ranks,
            block_tokens=options.prefix_block_tokens,
            capacity_blocks=options.prefix_cache_blocks,
            stale_after_s=STALE_AFTER_SCRAPES * options.scrape_interval_s,
            # Its own stream: placing on ranks never shifts the prefill policy's seeded choices.
            rng=random.Random(options.scheduler_seed),
            # A rank's index forgotten (its engine lost its cache) forgets the placements on it
            # decided before, recorded first: none is remembered after the forgetting.
            before_forget=self._record,
        )
        self._endpoints = self._planner.pool
        """What is known of each endpoint of the pool, by key (the planner's, which the pool
        changes as discovery and polls say)."""
        self.pool = PrefillPool(
            options.pool,
            discovery=discovery,
            planner=self._planner,
            backend=backend,
            metrics=metrics,
            prefixes=prefixes,
            record=self._record,
        )
        self._reasons: Counter[str] = Counter()
        self._unrecorded: list[tuple[Callable[[Any, Any], None], Any, Any]] = []
        """Placements' bookkeeping not applied yet, in the order of their decisions: at most
        one per placement decided since the loop's last turn (``_record`` empties it)."""
        self._recording: asyncio.Handle | None = None
        self._deferred = 0
        """Placements' bookkeeping deferred since start (``_refreshed`` compares it)."""

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        prefixes = self._prefixes
        if prefixes is not None:
            shared = self._options.prefix_hash_key is not None and self.backend.share_prefixes(
                self.learned_prefix
            )
            logger.info(
                "prefill prefix index on: blocks of %d tokens, %d blocks at most, %s; it learns "
                "what the prefill servers evicted from their answers' "
                "usage.prompt_tokens_details.cached_tokens (vLLM: --enable-prompt-tokens-details), "
                "and runs open-loop without them",
                prefixes.block_tokens,
                prefixes.max_blocks,
                "shared through the state backend"
                if shared
                else "not shared"
                + (
                    " (set SIDECAR_PREFIX_HASH_KEY, the same on every sidecar, to share it)"
                    if self.backend.name != "memory"
                    else ""
                ),
            )
        await self.backend.start()
        await self.pool.start()

    async def close(self) -> None:
        self._record()
        if self._recording is not None:
            self._recording.cancel()
            self._recording = None
        await self.pool.close()
        await self.backend.close()

    # --- the request path ------------------------------------------------------------------

    async def place_request(
        self,
        body: dict[str, Any],
        header: Endpoint | None,
        *,
        local_reason: str | None = None,
        text: bytes | None = None,
        rank: int | None = None,
    ) -> tuple[Placement, PromptLookup | None]:
        """Decide which decode rank takes ``body`` and where it prefills; claim the rank and
        reserve the prompt's tokens on the prefill endpoint. ``header``: the gateway's choice of
        prefill server, used as is; ``local_reason``: why the request must prefill locally
        anyway. "Locally" means on the chosen rank: its prefix cache and queue are weighed.
        ``text``: the prompt's text when the caller has it already (``prompt_text``). ``rank``:
        the decode rank the request named (``RankPorts``), taken as is.

        With the placement, the decision's look-ups in the exact indexes when a retry of its
        prefill is to repeat them (``retry``'s ``exact``): a remote placement the scheduler
        chose while an engine's events were in sync; None otherwise. They hold the request's
        token ids and keys: the caller keeps them for the prefill leg alone, never for the
        life of a stream."""
        fleet, exact = self._kv_events, None
        if fleet is not None:
            # The token ids for the engines' exact indexes (SIDECAR_KV_EVENTS), asked of the
            # decode engine only for a choice, and only when an engine's index is in sync.
            exact = await fleet.prompt(body, ask=header is None and local_reason is None)
        self._record()  # the placements before this one, as this decision must see them
        prompt = prompt_text(body) if text is None else text
        tokens = estimate_tokens(body, prompt)
        if exact is not None and exact.tokens:
            tokens = exact.tokens  # counted, not estimated
        local = self.ranks.blocks(prompt)
        # Each candidate rank weighed by its events where they are in sync (its prefix index's
        # figure otherwise); a rank the request named is taken as is.
        claim, cached = self.ranks.choose(
            local, tokens, prompt, rank, None if exact is None else exact.rank
        )
        # The chosen rank will hold this prompt's KV either way (computed or pulled): recorded
        # now, before the decision awaits anything (another placement may run meanwhile).
        self._defer(self._record_rank, claim.rank, local)
        with OnFailure(claim.end):
            placement = await self._place(
                claim, tokens, cached, header, local_reason, prompt, exact
            )
        if fleet is None or exact is None:
            return placement, None
        placement = fleet.decided(placement, exact)
        chosen = placement.endpoint is not None and placement.decision.reason != "header"
        return placement, exact if chosen else None

    async def _place(
        self,
        claim: RankClaim,
        tokens: int,
        cached: int,
        header: Endpoint | None,
        local_reason: str | None,
        prompt: str | bytes,
        exact: PromptLookup | None = None,
    ) -> Placement:
        if local_reason is not None:
            uncached = max(0, tokens - cached)
            decision = Decision(None, local_reason, tokens, uncached)
            self._count(decision)
            claim.prefilling(uncached)
            return Placement(decision, None, claim, local_tokens=uncached)
        # The prompt's prefix blocks, hashed as far as the look-ups on the candidates read them
        # (a short prompt too: weighing the stall, the decider may send it remote).
        hashes: Sequence[bytes] = ()
        size = 0
        if self._hasher is not None:
            data = prompt.encode() if isinstance(prompt, str) else prompt
            hashes, size = self._hasher.blocks(data), len(data)
        if header is not None:
            # Not a choice, but predicted all the same, for the record.
            candidate = self._planner.candidate(str(header), *self._now(), hashes, exact)
            predicted = self._decider.remote_seconds(candidate, tokens)
            uncached = max(0, tokens - cached)
            decision = Decision(
                str(header), "header", tokens, uncached, predicted, candidate.cached_tokens
            )
            self._count(decision)
            return self._reserve(decision, header, claim, hashes, size)
        rank = claim.rank
        await self._refreshed()  # the others' reservations as of now, not of our last sync
        view, now, wall = self._now()
        decision = self._planner.decide(
            rank,
            self.ranks.waiting(rank),
            prompt_tokens=tokens,
            cached_tokens=cached,
            view=view,
            now=now,
            wall=wall,
            hashes=hashes,
            exact=exact,
        )
        self._count(decision)
        if decision.endpoint is None:
            claim.prefilling(decision.uncached_tokens)
            return Placement(decision, None, claim, local_tokens=decision.uncached_tokens)
        endpoint = self._endpoints[decision.endpoint].endpoint
        return self._reserve(decision, endpoint, claim, hashes, size)

    async def retry(
        self, failed: Placement, tried: set[str], exact: PromptLookup | None = None
    ) -> Placement | None:
        """Where to retry a prefill that failed transiently: the same endpoint when the gateway
        named it, else another available one the policy picks (None when none is left).
        ``exact``: the first decision's look-ups in the exact indexes (``place_request``): the
        candidates' cached tokens come from their events where they are in sync now, as the
        first decision's did."""
        self._record()
        decision = failed.decision
        if failed.endpoint is None:
            return None
        guess = failed.prefix
        hashes, size = (guess.hashes, guess.prompt_bytes) if guess is not None else ((), 0)
        if decision.reason == "header":  # the same endpoint: the same prediction
            again = self._reserve(decision, failed.endpoint, failed.rank, hashes, size)
            return dataclasses.replace(
                again, tokenize_s=failed.tokenize_s, cached_source=failed.cached_source
            )
        await self._refreshed()
        if exact is not None:
            exact.again()
        candidates = [c for c in self._candidates(hashes, exact) if c.key not in tried]
        chosen = self._decider.policy.choose(candidates, decision.prompt_tokens)
        if chosen is None:
            return None
        retried = dataclasses.replace(
            decision, endpoint=chosen.key, remote_cached_tokens=chosen.cached_tokens
        )
        endpoint = self._endpoints[chosen.key].endpoint
        placement = self._reserve(retried, endpoint, failed.rank, hashes, size)
        fleet = self._kv_events
        return placement if fleet is None or exact is None else fleet.decided(placement, exact)

    async def _refreshed(self) -> None:
        """The backend's refresh, then the placements decided while it waited recorded, as the
        decision that follows must see them: decisions woken by one sync run before the loop's
        next turn would record them. Nothing is recorded when none was decided meanwhile: what
        is left is this decision's own rank, which it does not read again."""
        deferred = self._deferred
        await self.backend.refresh(self._endpoints.keys())
        if self._deferred != deferred:
            self._record()

    def _reserve(
        self,
        decision: Decision,
        endpoint: Endpoint,
        rank: RankClaim,
        hashes: Sequence[bytes] = (),
        prompt_bytes: int = 0,
    ) -> Placement:
        state = self._endpoints.get(str(endpoint))
        if state is None:  # a header target outside the pool: nothing to account for
            return Placement(decision, endpoint, rank)
        self._planner.sent(state.key, time.monotonic())  # counts it in flight
        reservation = self.backend.reserve(state.key, reserved_tokens(decision))
        guess = None
        if self._prefixes is not None and hashes:
            matched = self._prefixes.matched_blocks(state.key, hashes)
            guess = PrefixGuess(hashes, prompt_bytes, matched)
            # The endpoint is about to compute (or find) the whole prompt: it holds it next.
            self._defer(self._record_prefill, state.key, hashes)
        return Placement(decision, endpoint, rank, reservation, prefix=guess)

    # --- recording placements, after their decisions ---------------------------------------

    def _defer(self, record: Callable[[Any, Any], None], first: Any, second: Any) -> None:
        """Apply ``record(first, second)`` after the decision returns: in the loop's next turn,
        or earlier when the next decision (or anything reading the indexes) comes first."""
        self._unrecorded.append((record, first, second))
        self._deferred += 1
        if self._recording is None:
            self._recording = asyncio.get_running_loop().call_soon(self._recorded_soon)

    def _recorded_soon(self) -> None:
        self._recording = None
        self._record()

    def _record(self) -> None:
        """Apply every placement's bookkeeping not applied yet, in the order of the decisions.
        A failure is logged, never raised into the request or the loop."""
        if not self._unrecorded:
            return
        pending, self._unrecorded = self._unrecorded, []
        for record, first, second in pending:
            try:
                record(first, second)
            except Exception:
                logger.exception("recording a placement in the prefix indexes failed")

    def _record_rank(self, rank: DecodeRank, hashes: LazyHashes[int]) -> None:
        rank.prefix.insert(hashes.all())

    def _record_prefill(self, key: str, hashes: Sequence[bytes]) -> None:
        assert self._prefixes is not None
        if key not in self._endpoints:  # it left the pool since: its index is forgotten
            return
        full = hashes.all() if isinstance(hashes, LazyHashes) else hashes
        self._prefixes.placed(key, full)
        self.backend.publish_prefix(key, full)

    def prefill_finished(
        self,
        placement: Placement,
        *,
        ok: bool | None,
        seconds: float | None = None,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        """The prefill leg ended: ``ok`` True (usable answer), False (the endpoint failed),
        None (cancelled, or the client's own fault: says nothing about the endpoint). With a
        usable answer, ``prompt_tokens`` and ``cached_tokens`` are what the engine's usage said
        (None: it did not): the prefill prefix index's feedback."""
        reservation = placement.reservation
        if reservation is None:
            return
        self.backend.release(reservation)
        state = self._endpoints.get(reservation.endpoint)
        if state is None:
            return
        self._planner.ended(state.key)
        if ok is True:
            if placement.prefix is not None:
                self._record()  # the answer is weighed against the index as it stands
                self._prefix_answered(state.key, placement.prefix, prompt_tokens, cached_tokens)
            state.health.success()
            if seconds is not None:
                speed = self._planner.prefill_observed(reservation, seconds, time.monotonic())
                if speed is not None:
                    self.backend.publish_speed(state.key, speed)
        elif ok is False:
            self.pool.failed(state)
        if state.draining and state.inflight == 0:
            self.pool.leave(state)

    def _prefix_answered(
        self, key: str, guess: PrefixGuess, prompt_tokens: int | None, cached_tokens: int | None
    ) -> None:
        assert self._prefixes is not None
        feedback = self._prefixes.feedback()
        error = self._prefixes.answered(key, guess, prompt_tokens, cached_tokens)
        if error is None:
            if feedback == "none" and self._prefixes.feedback() == "open":
                logger.warning(
                    "prefill endpoint %s answered without usage.prompt_tokens_details: the "
                    "prefill prefix index runs open-loop (start vLLM prefill engines with "
                    "--enable-prompt-tokens-details to let it learn what they evicted; SGLang's "
                    "prefill answers are not read, so never say)",
                    key,
                )
            return
        assert cached_tokens is not None
        self._metrics.prefix_error.observe(error)
        self._metrics.prefix_cached_tokens.labels("predicted").inc(max(0.0, cached_tokens + error))
        self._metrics.prefix_cached_tokens.labels("reported").inc(cached_tokens)

    def learned_prefix(self, key: str, hashes: Sequence[bytes]) -> None:
        """Another sidecar placed a prompt with these ``hashes`` on ``key`` (the state backend's
        prefix share): only for endpoints of this pool."""
        self._record()
        if self._prefixes is not None and key in self._endpoints:
            self._prefixes.placed(key, hashes)

    def prefill_outlook(self, placement: Placement, elapsed_s: float) -> PrefillOutlook:
        """How a prefill stands ``elapsed_s`` after it was sent to ``placement``'s endpoint
        (``Planner.outlook``)."""
        return self._planner.outlook(
            str(placement.endpoint),
            placement.reservation,
            placement.decision.uncached_tokens,
            elapsed_s,
            self.backend.view(),
            time.monotonic(),
        )

    def local_first_byte(self, placement: Placement, seconds: float | None) -> None:
        """A locally prefilled request produced its first byte (``seconds`` after it arrived),
        or ended without one (None)."""
        if placement.endpoint is not None or placement.local_tokens == 0:
            return
        placement.rank.prefilled()
        if seconds is not None:
            ahead = placement.rank.rank.ahead_tokens
            self._planner.local_observed(ahead, placement.local_tokens, seconds)

    def _now(self) -> tuple[SharedView, float, float]:
        """The backend's view, the monotonic and the wall time: what a decision is made on."""
        return self.backend.view(), time.monotonic(), time.time()

    def _candidates(
        self, hashes: Sequence[bytes] = (), exact: PromptLookup | None = None
    ) -> list[Candidate]:
        return self._planner.candidates(*self._now(), hashes, exact)

    def _count(self, decision: Decision) -> None:
        self._reasons[decision.reason] += 1
        kind = "local" if decision.endpoint is None else "remote"
        self._metrics.scheduler_decisions_by(kind, decision.reason).inc()

    # --- what is read of it: /metrics, /debug/scheduler ------------------------------------

    def publish_gauges(self) -> None:
        """The pool's, the decode ranks' and the prefix index's gauges, brought up to date when
        /metrics is read."""
        self._record()
        self.pool.publish_gauges()
        for rank in self.ranks:
            self._metrics.decode_rank_inflight.labels(str(rank.index)).set(rank.inflight)
        if self._prefixes is not None:
            self._metrics.prefix_index_blocks.set(len(self._prefixes))

    def snapshot(self) -> dict[str, Any]:
        self._record()
        now, wall = time.monotonic(), time.time()
        return {
            "policy": self._options.scheduler_policy,
            "choices": self._options.scheduler_choices,
            "disagg_min_tokens": self._options.disagg_min_tokens,
            "disagg_ttft_ratio": self._options.disagg_ttft_ratio,
            "disagg_stall_weight": self._options.disagg_stall_weight,
            "disagg_stall_burst_s": self._options.disagg_stall_burst_s,
            "disagg_tpot_slo_s": self._options.disagg_tpot_slo_s,
            "discovery": self.pool.describe_discovery(),
            "state_backend": self.backend.status(),
            "decisions": dict(self._reasons),
            "local": {
                "ahead_tokens": sum(rank.ahead_tokens for rank in self.ranks),
                "scraped": describe_load(merge_loads([rank.load for rank in self.ranks]), now),
                "speed": speed_dict(self._planner.local_speed.value),
                "prefix_index_blocks": sum(len(rank.prefix) for rank in self.ranks),
            },
            "decode_ranks": [
                {**described, "stall_budget": self._planner.describe_budget(rank, now)}
                for rank, described in zip(self.ranks, self.ranks.describe(now), strict=True)
            ],
            "prefill_prefixes": {"enabled": False}
            if self._prefixes is None
            else {"enabled": True, **self._prefixes.describe()},
            "endpoints": self.pool.describe(now, wall),
        }
