"""Placing one request on the pool: the scheduler's pure part, which the simulator runs as is.

What is known of each prefill endpoint (``EndpointState``: health, observed speed, the last
scrape, draining), how candidates are built from it and the state backend's view (available
endpoints only; reservations; scraped gauges while fresh; the observed speed, or a speed another
sidecar published while this sidecar has too few samples of its own), the decision for a request
on its decode rank, what a placement reserves, and what is learnt from outcomes.

No I/O and no clock of its own: the caller passes the monotonic time (``now``, scrapes and
ejections) and the wall time (``wall``, ejections published by other sidecars) and the backend's
``SharedView``. The live scheduler (``scheduler.py``, with the pool of ``pool.py``: discovery,
polls, ejections) wraps it with the backend and metrics; the simulator (``bench/sim``) with a
modelled cluster in virtual time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sidecar.defaults import RETEST_S, SPEED_HALF_LIFE_S, SPEED_IDLE_HALF_LIFE_S
from sidecar.fleet.endpoints import Endpoint
from sidecar.fleet.load import EngineLoad, describe_load
from sidecar.scheduling.decider import Decider, StallBudget
from sidecar.scheduling.estimates import (
    VIRTUAL_HIGH_TOKENS,
    Availability,
    Health,
    SpeedEstimate,
    decay_weight,
    toward,
)
from sidecar.scheduling.model import Candidate, Decision, LocalView, Speed
from sidecar.scheduling.prefixes import PrefillPrefixes, PrefixGuess
from sidecar.scheduling.ranks import DecodeRank, RankClaim
from sidecar.scheduling.state import Reservation, SharedView

PREFILL_PRIOR = Speed(s_per_token=1e-4, overhead_s=0.02)
"""10,000 prompt tokens/s and 20 ms per call until the endpoint's own calls say otherwise."""
LOCAL_PRIOR = Speed(s_per_token=1e-4, overhead_s=0.01)
STALE_AFTER_SCRAPES = 3
"""A scrape older than this many intervals is ignored (treated as unknown)."""
HEALTHY = Availability.HEALTHY  # read per endpoint per decision: one global, not an enum look-up
ExactCache = Callable[[str], "int | None"]
"""An endpoint's key → the prompt's tokens its KV events say it holds, weighed by medium
(``sidecar.kvevents.fleet``); None when it has no events in sync."""
SPEED_SAMPLES_TRUSTED = 3
"""Below this many own observations, a speed shared by other sidecars is preferred."""


@dataclass(slots=True)
class EndpointState:
    endpoint: Endpoint
    health: Health
    speed: SpeedEstimate = field(default_factory=lambda: SpeedEstimate(PREFILL_PRIOR))
    scraped: EngineLoad | None = None
    """The last scrape (set through ``load``, which follows the idle spells)."""
    idle_since: float | None = None
    """The time of the first scrape of the unbroken run, up to the last, that showed it idle —
    nothing waiting, nothing running; None while the last scrape did not (``idle_spell``)."""
    unanswered: bool = False
    """Its last scrape went without gauges (no answer in time, refused, no metrics)."""
    thawed_at: float | None = None
    """The stall it is remembered to have had: the time of its first answered scrape after
    one that went unanswered (what a frozen engine looks like from outside); None once the
    stall is over (``answered``), or at the first scrape more than ``STALL_KEPT_S`` after it
    with no idle spell running and no prefill in flight: no spell can use it any more
    (``idle_spell``)."""
    idle_cut: float | None = None
    """Where the last idle spell was applied for good (``settle_idle``): the next one starts
    after it."""
    idle_half_life_s: float | None = None
    """The idle ageing's half-life (``Planner``'s; None: no idle ageing)."""
    draining: bool = False
    inflight: int = 0
    """This sidecar's prefills to it not ended yet (``Planner.sent``, ``Planner.ended``)."""
    last_sent: float | None = None
    """When this sidecar last sent it a prefill (monotonic), or first considered it."""
    rendezvous: int = 0
    """The endpoint's part of its prefix affinities (``affinity``), from its key."""
    shared: Speed | None = None
    """The speed other sidecars published, as last seen, and since when (monotonic): a shared
    speed ages from the moment this sidecar saw it change."""
    shared_since: float = 0.0

    def __post_init__(self) -> None:
        self.rendezvous = endpoint_weight(str(self.endpoint))

    @property
    def key(self) -> str:
        return str(self.endpoint)

    @property
    def load(self) -> EngineLoad | None:
        """Its last scrape, or None (unknown, or the scrape failed)."""
        return self.scraped

    @load.setter
    def load(self, load: EngineLoad | None) -> None:
        if load is None or load.waiting != 0 or load.running != 0:
            # Busy, unknown or not answering: the idle spell ends, applied up to its last scrape.
            self.settle_idle()
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = load.at
        if load is None:
            self.unanswered = True
        elif self.unanswered:
            self.unanswered, self.thawed_at = False, load.at
        self.scraped = load
        thawed = self.thawed_at
        if (
            thawed is not None
            and load is not None
            and load.at - thawed > STALL_KEPT_S
            and not self.inflight
            and self.idle_spell() is None
        ):
            # No spell runs, and the next would begin too late to use the stall: forgotten.
            self.thawed_at = None

    def idle_spell(self) -> tuple[Speed, float, float, float] | None:
        """The idle spell that ages its speed estimate toward its best, if one runs: ``(best,
        weight, start, end)``: the evidence as of ``start`` keeps ``weight`` of its own for the
        spell's length up to ``end``, its last scrape, the rest going to its best's line, and
        the whole ages toward the prior from ``start`` as any evidence does
        (``SpeedEstimate.relax``). A function of the spell as a whole — its start, its length,
        the evidence as of its start, the best — so that how often it is read changes nothing;
        applied for good when the spell ends (``settle_idle``).

        The spell: its scrapes since the latest of its idle run's first, its last answer and
        the last spell applied (a prefill sent cuts one), while no prefill of this sidecar's is
        in flight. It runs only after a stall (``thawed_at``): an unanswered scrape, the first
        answered one at most ``STALL_KEPT_S`` before the spell's start, and at that start a fit
        a stall's margin (``RETEST_SLOWER``) slower than its best, at a long prompt.

        Why: an endpoint the policy avoids for its speed gets no new evidence, and re-tests are
        rare (``Planner._due_retest``): after a stall its fit keeps the stall's seconds for
        minutes of ageing toward the prior, whose three virtual points weigh little against ten
        observations. Its scrapes, answering and showing nothing waiting and nothing running,
        say that whatever held it no longer does; what it did before is then the better guess,
        ageing as the evidence of an endpoint that did not stall. Its own best, not the pool's:
        an endpoint slower by its hardware was never faster. Only after a stall and past its
        margin: fits slowed by mispredicted cache hits or by the spread under traffic are not
        stalls, and ageing every idle endpoint toward its best made each look as fast as its
        luckiest fit (the simulator's Mooncake replay lost its goodput)."""
        thawed = self.thawed_at
        if thawed is None or self.inflight or self.idle_half_life_s is None:
            return None
        start, scraped, best = self.idle_since, self.scraped, self.speed.best
        if start is None or scraped is None or best is None:
            return None
        for moment in (self.idle_cut, self.speed.observed_at):
            if moment is not None and moment > start:
                start = moment
        end = scraped.at
        if end <= start or start - thawed > STALL_KEPT_S:
            return None
        slowed = self.speed.value_at(start).seconds(VIRTUAL_HIGH_TOKENS)
        if slowed < RETEST_SLOWER * best.seconds(VIRTUAL_HIGH_TOKENS):
            return None
        return best, decay_weight(end - start, self.idle_half_life_s), start, end

    def settle_idle(self, cut: float | None = None) -> None:
        """Apply the idle spell that runs, if any, to the speed estimate for good (it ends: a
        busy or unanswered scrape, a prefill sent at ``cut``); the next starts after it."""
        spell = self.idle_spell()
        if spell is not None:
            best, weight, start, end = spell
            self.speed.relax(best, weight, start, end)
            cut = end if cut is None else max(cut, end)
        if cut is not None and (self.idle_cut is None or cut > self.idle_cut):
            self.idle_cut = cut

    def answered(self) -> None:
        """After an answer was learnt: the stall is over once its fit is back within a stall's
        margin (``RETEST_SLOWER``) of its best. Not an answer alone: a fresh prefill answered
        at its best does not take the stall's evidence out of the fit, and prefills the stall
        held can answer after it (``idle_spell``'s window bounds the rest)."""
        best = self.speed.best
        if best is not None and self.thawed_at is not None:
            fitted = self.speed.value.seconds(VIRTUAL_HIGH_TOKENS)
            if fitted < RETEST_SLOWER * best.seconds(VIRTUAL_HIGH_TOKENS):
                self.thawed_at = None


AFFINITY_BLOCK = 4
"""A prompt's prefix affinity is read at this block of its prefix hashes (its last, if
shorter): 256 bytes, about 64 tokens. Prompts that share this much share a home; a shallower
anchor would give one home to every prompt that opens with the same few words."""
_MASK = (1 << 64) - 1


def endpoint_weight(key: str) -> int:
    """The endpoint's half of a rendezvous weight: stable across processes and restarts."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def affinity(anchor: int, endpoint: int) -> int:
    """Rendezvous (highest random weight) hashing of a prefix ``anchor`` over endpoints: each
    prefix ranks the endpoints in its own order, the same in every sidecar, and an endpoint
    leaving moves only the prefixes it ranked first. The 64-bit finaliser of SplitMix64
    (Steele, Lea and Flood, 2014) mixes the two halves; never 0 (0 means "no prefix")."""
    z = (anchor ^ endpoint) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) | 1


@dataclass(frozen=True, slots=True)
class PrefillOutlook:
    queued: bool
    """Probably still waiting in the engine's queue."""
    compute_s: float
    """The prompt's own predicted compute, without queue or fixed overhead."""
    remaining_s: float
    """Predicted seconds until it ends (negative: overdue)."""


def reserved_tokens(decision: Decision) -> int:
    """What a placement reserves on its prefill endpoint: the prompt's tokens not in the local
    decode rank's cache (the decider's ``uncached_tokens``), as estimated at decision time, or
    fewer when the endpoint is predicted to hold more of the prompt than that rank does."""
    return min(
        decision.uncached_tokens, max(0, decision.prompt_tokens - decision.remote_cached_tokens)
    )


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
    prefix: PrefixGuess | None = None
    """The prefill prefix index's prediction for the endpoint, compared with its answer."""
    tokenize_s: float | None = None
    """Seconds spent getting the prompt's token ids for the exact indexes (SIDECAR_KV_EVENTS;
    None: not asked)."""
    cached_source: str | None = None
    """Where the prefill's cached tokens were predicted from: ``events`` (the engine's exact
    index) or ``approximate``; None without KV events."""


RETEST_SLOWER = 1.5
"""How much slower than at the chosen endpoint's speed an endpoint's own speed estimate must
predict a prompt for its re-test to be worth a request: a stall's estimate is many times worse
(a frozen engine's fitted overhead runs to seconds, against the prior's 0.02 s), the spread
between healthy engines' fits is not, and re-testing that spread sent a large share of the
requests at low rates to endpoints no slower than the chosen one; this bound halves them (the
simulator's ``mooncake-evict`` scenario: docs/benchmarks.md)."""

STALL_KEPT_S = 60.0
"""How long after a stall's end (its first answered scrape) an idle spell may begin and still
be aged toward the endpoint's best speed (``EndpointState.idle_spell``). An engine that thawed
is idle within seconds once the policy avoids it, and a re-test cuts its spell every 15 s; an
endpoint that missed a scrape long ago and is slow in the books since is slow for another
reason (mispredicted cache hits, a lasting slowdown), and ages toward the prior as any."""


def _first(item: tuple[float, Candidate]) -> float:
    return item[0]


class Planner:
    """The pool as one sidecar knows it, and the decisions made on it."""

    def __init__(
        self,
        decider: Decider,
        *,
        stale_after_s: float,
        half_life_s: float | None = SPEED_HALF_LIFE_S,
        idle_half_life_s: float | None = SPEED_IDLE_HALF_LIFE_S,
        retest_s: float = RETEST_S,
        prefixes: PrefillPrefixes | None = None,
    ) -> None:
        """``stale_after_s``: a scrape older than this is ignored (three scrape intervals).
        ``half_life_s``: prefill speed estimates decay toward the prior with this half-life
        (None: never). ``idle_half_life_s``: while an endpoint's scrapes show it idle after a
        stall, its estimate decays toward its best measured speed with this one (None: never;
        ``EndpointState.idle_spell``).
        ``retest_s``: an endpoint sent nothing for this long is re-tested (0: never).
        A half-life that is neither None nor positive is a ValueError.
        ``prefixes``: what each endpoint holds (None: prefix-blind, every candidate computes
        the whole prompt)."""
        halves = {"half_life_s": half_life_s, "idle_half_life_s": idle_half_life_s}
        for name, half_life in halves.items():
            if half_life is not None and not half_life > 0.0:  # a NaN too: not > 0
                raise ValueError(f"{name} must be > 0 or None, not {half_life!r}")
        self.decider = decider
        self.prefixes = prefixes
        self.pool: dict[str, EndpointState] = {}
        # One estimate for every decode rank: the same model on the same hardware. It does not
        # decay: short prompts always prefill locally, so it never runs out of evidence.
        self.local_speed = SpeedEstimate(LOCAL_PRIOR)
        self._stale_after_s = stale_after_s
        self._half_life_s = half_life_s
        self._idle_half_life_s = idle_half_life_s
        self._retest_s = retest_s
        # Each decode rank's stall budget (the decider's docstring), by rank URL: one per rank.
        self._budgets: dict[str, StallBudget] = {}

    def join(self, endpoint: Endpoint, health: Health) -> EndpointState:
        """Add ``endpoint`` to the pool, its speed estimate decaying with the planner's
        half-life."""
        state = EndpointState(
            endpoint, health, SpeedEstimate(PREFILL_PRIOR, half_life_s=self._half_life_s)
        )
        state.idle_half_life_s = self._idle_half_life_s
        self.pool[state.key] = state
        return state

    def fresh(self, load: EngineLoad | None, name: str, now: float) -> float | None:
        """Gauge ``name`` of a scrape, None when unknown or older than the staleness bound."""
        if load is None or now - load.at > self._stale_after_s:
            return None
        value: float | None = getattr(load, name)
        return value

    def speed(self, state: EndpointState, shared: Speed | None, now: float) -> Speed:
        """The speed to predict ``state``'s endpoint with at ``now``: its own estimate, or the
        one other sidecars published while this sidecar has too few samples; either decayed
        toward the prior by its age."""
        if shared is not None and shared != state.shared:
            state.shared, state.shared_since = shared, now
        if shared is not None and state.speed.samples < SPEED_SAMPLES_TRUSTED:
            age = now - state.shared_since
            return toward(shared, PREFILL_PRIOR, decay_weight(age, self._half_life_s))
        spell = state.idle_spell()
        if spell is not None:
            best, weight, start, _ = spell
            return state.speed.relaxed_at(best, weight, start, now)
        return state.speed.value_at(now)

    def sent(self, key: str, now: float) -> None:
        """A prefill was just sent to ``key`` (chosen, named by the gateway, or a retry): an
        idle spell's ageing is kept, its answer is learnt from there, and it counts in flight
        (``EndpointState.inflight``) until ``ended``. Counted here, after the spell is applied:
        counted first, it would stop the spell (``idle_spell``) and drop its ageing."""
        state = self.pool.get(key)
        if state is not None:
            self._chosen(state, now)
            state.inflight += 1

    def ended(self, key: str) -> None:
        """A prefill ``sent`` to ``key`` ended: answered (learn it with ``prefill_observed``),
        failed or cancelled."""
        state = self.pool.get(key)
        if state is not None and state.inflight > 0:
            state.inflight -= 1

    def _chosen(self, state: EndpointState, now: float) -> None:
        state.settle_idle(cut=now)
        state.last_sent = now

    def leave(self, key: str) -> None:
        """``key`` left the pool."""
        self.pool.pop(key, None)
        if self.prefixes is not None:
            self.prefixes.forget(key)

    def candidates(
        self,
        view: SharedView,
        now: float,
        wall: float,
        hashes: Sequence[bytes] = (),
        exact: ExactCache | None = None,
    ) -> list[Candidate]:
        """Every available endpoint as a policy sees it: not draining, not ejected here, not
        ejected by another sidecar (``view.ejected_until``, Unix time); with ``hashes`` (the
        prompt's prefix blocks), what each is predicted to hold of it. ``exact``: what an
        endpoint's KV events say it holds (None for an endpoint without them: the prefix
        index answers for it)."""
        prefixes = self.prefixes if hashes else None
        anchor = 0
        if hashes:
            anchor = int.from_bytes(hashes[min(len(hashes), AFFINITY_BLOCK) - 1][:8], "little")
        candidates = []
        for key, state in self.pool.items():
            health = state.health  # a healthy endpoint stays so without a failure: no refresh
            if state.draining or (health.state is not HEALTHY and not health.available(now)):
                continue
            if view.ejected_until.get(key, 0.0) > wall:
                continue
            load = view.loads.get(key)
            scraped = state.scraped  # its gauges, while fresh (``fresh``, read once)
            if scraped is not None and now - scraped.at > self._stale_after_s:
                scraped = None
            cached = None if exact is None else exact(key)
            if cached is None:
                cached = (
                    0
                    if prefixes is None
                    else prefixes.predicted_tokens(prefixes.matched_blocks(key, hashes))
                )
            # Positional, in the fields' order: a candidate per endpoint per decision.
            candidates.append(
                Candidate(
                    key,
                    load.tokens if load else 0,
                    load.requests if load else 0,
                    None if scraped is None else scraped.waiting,
                    None if scraped is None else scraped.running,
                    None if scraped is None else scraped.kv_usage,
                    self.speed(state, view.speeds.get(key), now),
                    cached,
                    affinity(anchor, state.rendezvous) if anchor else 0,
                )
            )
        return candidates

    def candidate(
        self,
        key: str,
        view: SharedView,
        now: float,
        wall: float,
        hashes: Sequence[bytes] = (),
        exact: ExactCache | None = None,
    ) -> Candidate:
        """``key`` as a policy would see it; an endpoint outside the pool (or unavailable) as a
        stranger: the prior speed, no load known."""
        if key in self.pool:
            for found in self.candidates(view, now, wall, hashes, exact):
                if found.key == key:
                    return found
        return Candidate(key=key, speed=PREFILL_PRIOR)

    def budget_of(self, rank: DecodeRank, now: float = 0.0) -> StallBudget:
        """``rank``'s stall budget (a full one from ``now`` on, the first time it is asked)."""
        budget = self._budgets.get(rank.url)
        if budget is None:
            budget = self._budgets[rank.url] = self.decider.budget(now, self._stale_after_s)
        return budget

    def observed_budget(self, rank: DecodeRank, now: float) -> StallBudget:
        """``rank``'s stall budget, its share set by the decodes' step time since the last
        scrape (the rank's latest one)."""
        budget = self.budget_of(rank, now)
        load = rank.load
        if load is not None and load.itl_sum_s is not None and load.itl_count is not None:
            budget.scraped(load.at, load.itl_sum_s, load.itl_count, now)
        return budget

    def describe_budget(self, rank: DecodeRank, now: float) -> dict[str, Any] | None:
        """``rank``'s stall budget for /debug/scheduler (None: no budget, a TPOT SLO of 0): the
        refill rate in force, the step time it follows (ms; None: not known, or stale), the
        credit left (s)."""
        if self.decider.tpot_slo_s <= 0:
            return None
        budget = self.observed_budget(rank, now)
        step_s = budget.step_at(now)
        return {
            "share": round(budget.rate(now), 4),
            "step_ms": None if step_s is None else round(step_s * 1000, 3),
            "credit_s": round(budget.credit(now), 4),
        }

    def decide(
        self,
        rank: DecodeRank,
        waiting: float | None,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        view: SharedView,
        now: float,
        wall: float,
        hashes: Sequence[bytes] = (),
        exact: ExactCache | None = None,
    ) -> Decision:
        """Where a request placed on ``rank`` prefills: the decider on the pool's candidates and
        the rank's local view (its local prefills not at their first byte yet, its scraped
        ``waiting`` queue, the observed local speed). ``hashes``: the prompt's prefix blocks
        (``PrefixHasher``), looked up in every endpoint's prefix index; ``exact``: what the
        endpoints' KV events say they hold, where they say it (the prefix index elsewhere).

        A request the decider sends remote goes instead to a candidate unmeasured for
        ``retest_s`` or more — no prefill from this sidecar, no new speed published by another —
        that lost on its speed estimate alone (reason ``retest``, ``_due_retest``): an endpoint
        the fleet stopped choosing for its speed gets a prefill per ``retest_s``, so its
        estimate learns whether it recovered.
        A re-test never turns a local decision into a remote one, nor takes a request whose
        chosen endpoint is predicted to hold part of its prompt."""
        candidates = self.candidates(view, now, wall, hashes, exact)
        budget = self.observed_budget(rank, now)
        # The request itself is claimed on the rank already: the others run there.
        running = max(0, rank.inflight - 1)
        speed = self.local_speed.value
        decision = self.decider.decide(
            candidates,
            LocalView(rank.ahead_tokens, waiting, speed, running, budget.credit(now)),
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
        )
        if decision.endpoint is None:
            if running > 0:
                budget.spend(speed.s_per_token * decision.uncached_tokens, now)
            return decision
        key = decision.endpoint
        # A re-test never takes a request that the chosen endpoint is predicted to hold part of:
        # it would recompute that prefix elsewhere (and, at a few prefills per sidecar per
        # re-test interval, most requests would be re-tests).
        due = (
            self._due_retest(candidates, key, prompt_tokens, now)
            if decision.remote_cached_tokens == 0
            else None
        )
        if due is not None:
            key = due.key
            predicted = self.decider.remote_seconds(due, prompt_tokens)
            decision = replace(
                decision,
                endpoint=key,
                reason="retest",
                predicted_s=predicted,
                remote_cached_tokens=due.cached_tokens,
            )
        # Counted in flight by whoever sends it (``sent``: the live scheduler), not here.
        self._chosen(self.pool[key], now)
        return decision

    def _due_retest(
        self, candidates: list[Candidate], chosen: str, prompt_tokens: int, now: float
    ) -> Candidate | None:
        """The candidate to re-test instead of ``chosen``, if any: of those measured at least
        ``retest_s`` ago (sent nothing by this sidecar, and no new speed published for them by
        the others; an endpoint seen for the first time counts from now), the one measured least
        recently that lost to ``chosen`` on its speed estimate alone — with ``chosen``'s speed it
        would be predicted as fast — and by a stall's margin: its own speed predicts the prompt
        at least ``RETEST_SLOWER`` times slower. One that lost on its queue, or on what
        ``chosen`` holds of the prompt, is not re-tested: its scrapes and its index say what a
        re-test would, and only its speed goes without evidence while it is not chosen."""
        due: list[tuple[float, Candidate]] = []
        winner: Candidate | None = None
        for candidate in candidates:
            state = self.pool[candidate.key]
            if state.last_sent is None:
                state.last_sent = now
            if candidate.key == chosen:
                winner = candidate
                continue
            # A speed another sidecar published anew is a measurement of the endpoint too:
            # the fleet re-tests an endpoint nobody measured, not one this sidecar did not.
            heard = state.last_sent
            if state.shared is not None and state.shared_since > heard:
                heard = state.shared_since
            if self._retest_s > 0 and now - heard >= self._retest_s:
                due.append((heard, candidate))
        if not due or winner is None:
            return None
        beaten = self.decider.remote_seconds(winner, prompt_tokens)
        for _, candidate in sorted(due, key=_first):
            as_fast = self.decider.remote_seconds(
                replace(candidate, speed=winner.speed), prompt_tokens
            )
            if (
                as_fast <= beaten
                and self.decider.remote_seconds(candidate, prompt_tokens) >= RETEST_SLOWER * as_fast
            ):
                return candidate
        return None

    def prefill_observed(
        self, reservation: Reservation, seconds: float, now: float
    ) -> Speed | None:
        """A prefill on ``reservation``'s endpoint answered after ``seconds`` (from the call),
        at ``now`` (monotonic): fit its speed on the tokens reserved ahead at send plus its own.
        Returns the new speed (to publish), None when the endpoint left the pool."""
        state = self.pool.get(reservation.endpoint)
        if state is None:
            return None
        speed = state.speed.observe(reservation.ahead_tokens + reservation.tokens, seconds, now)
        state.answered()
        return speed

    def local_observed(self, ahead_tokens: int, local_tokens: int, seconds: float) -> None:
        """A local prefill of ``local_tokens`` produced its first byte ``seconds`` after the
        request arrived, with ``ahead_tokens`` of other local prefills still before theirs."""
        self.local_speed.observe(ahead_tokens + local_tokens, seconds)

    def outlook(
        self,
        key: str,
        reservation: Reservation | None,
        uncached_tokens: int,
        elapsed_s: float,
        view: SharedView,
        now: float,
    ) -> PrefillOutlook:
        """How a prefill of ``uncached_tokens`` stands ``elapsed_s`` after it was sent to ``key``.

        Queued means: the engine's last fresh scrape showed waiting requests, and the work
        reserved ahead of this prefill when it was sent would not have drained yet. Without that
        evidence the prefill counts as computing — the error a stale scrape can cause is then to
        finish a prefill that was queued (compute spent), never to abort one that was done.
        """
        state = self.pool.get(key)
        speed = PREFILL_PRIOR
        waiting: float | None = None
        if state is not None:
            speed = self.speed(state, view.speeds.get(key), now)
            waiting = self.fresh(state.load, "waiting", now)
        queue_s = 0.0
        if waiting and reservation is not None:
            queue_s = speed.s_per_token * reservation.ahead_tokens
        # The tokens its speed was learned on (prefill_observed): the uncached ones.
        compute_s = speed.s_per_token * uncached_tokens
        return PrefillOutlook(
            queued=elapsed_s < queue_s,
            compute_s=compute_s,
            remaining_s=queue_s + speed.overhead_s + compute_s - elapsed_s,
        )

    def describe(self, view: SharedView, now: float, wall: float) -> list[dict[str, Any]]:
        """For /debug/scheduler: every endpoint of the pool, by key."""
        endpoints = []
        for key, state in sorted(self.pool.items()):
            load = view.loads.get(key)
            availability = state.health.refresh(now)
            shared_until = view.ejected_until.get(key, 0.0)
            best = state.speed.best
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
                    "speed": speed_dict(self.speed(state, view.speeds.get(key), now)),
                    "speed_samples": state.speed.samples,
                    "best_speed": None if best is None else speed_dict(best),
                    "stall_thawed_s_ago": None
                    if state.thawed_at is None
                    else round(now - state.thawed_at, 3),
                    "last_sent_s_ago": None
                    if state.last_sent is None
                    else round(now - state.last_sent, 3),
                }
            )
        return endpoints


def speed_dict(speed: Speed) -> dict[str, float]:
    return {"s_per_token": speed.s_per_token, "overhead_s": speed.overhead_s}
