"""Disaggregate or prefill locally, and where: pure and synchronous.

A local prefill stalls every request running on the local engine while it computes: its cost
to them is ``stall_weight`` × running × its compute seconds (``SIDECAR_DISAGG_STALL_WEIGHT``),
counted only against a prefill server with room (nothing queued there: one with a queue is the
pool's bottleneck, and work sent to it to spare the decodes delays other prompts' prefills).
A prompt whose uncached tokens reach ``min_tokens`` is disaggregated while the best candidate's
predicted time to first token is at most ``ttft_ratio`` times that of a local prefill, plus that
stall; past it the pool counts as saturated. A shorter one (or one the local engine mostly holds)
prefills locally unless the stall it would impose outweighs what a remote prefill adds to its
time to first token (a busy decode batch, a prefill server holding the prompt's prefix); with
no weight it always prefills locally. The ratio is the price paid to keep long prefills out of
the local decode batch.

"Uncached" is relative to the local decode engine's prefix cache (``cached_tokens``); a prefill
engine does not hold that cache, so a remote prefill is predicted for the prompt less what the
prefill prefix index predicts that endpoint holds (its candidate's ``cached_tokens``).
The ratio trades goodput against prefill-queue length; docs/scheduling.md has the simulator's
numbers for 2, 3, 4 and 6.

The decodes' budget, a bound over all of the above: a local prefill of C compute seconds
(``s_per_token`` × uncached tokens) stalls each decode running on the engine by about C. A decode
whose engine steps every ``s`` seconds and that is stalled a share f of its time has a TPOT of
s ÷ (1 − f): it meets a TPOT SLO T while f ≤ 1 − s ÷ T. Each decode rank keeps a stall budget
(``StallBudget``, held by the planner), a token bucket that refills at the share the decodes can
spare, 1 − s ÷ (``TPOT_AIM`` × T) seconds per second (T: ``SIDECAR_DISAGG_TPOT_SLO_MS``; s: the
engine's step time, measured from its inter-token latency histogram between two scrapes, less the
share of that time this sidecar's local prefills took), up to ``stall_burst_s``
(``SIDECAR_DISAGG_STALL_BURST_S``: the longest single stall the decodes' tail gaps absorb); a
local prefill spends its C from it while decodes run there. Where the decode tier is the
bottleneck (s near T) the share is 0; where the decodes have slack, local prefills stay. While
decodes run (``running`` > 0), a prefill stays local only if C fits in the rank's budget
(``LocalView.stall_credit_s``).
Otherwise it goes to the policy's choice (reason ``decode_budget``), whatever the prefill pool's
queue: the anchors' choice where decodes are the bottleneck. With no decode running nothing is
stalled and nothing is spent; with no candidate the prefill stays local (``pool_empty``). A TPOT
SLO of 0 turns the budget off. The engine's scraped ``waiting`` is no sign of a decode
bottleneck: vLLM's ``vllm:num_requests_waiting`` also counts the requests pulling their KV from a
prefill server (``WAITING_FOR_REMOTE_KVS``), which most scrapes of a disaggregated engine find.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sidecar.defaults import STALL_BURST_S, STALL_WEIGHT, TPOT_AIM, TPOT_SLO_S
from sidecar.scheduling.model import Candidate, Decision, LocalView, Transfer
from sidecar.scheduling.policies import TOKENS_PER_WAITING, Policy, predicted_ttft


class Decider:
    def __init__(
        self,
        policy: Policy,
        *,
        min_tokens: int = 512,
        ttft_ratio: float = 2.0,
        transfer: Transfer = Transfer(),
        always: bool = False,
        stall_weight: float = STALL_WEIGHT,
        stall_burst_s: float = STALL_BURST_S,
        tpot_slo_s: float = TPOT_SLO_S,
    ) -> None:
        """``always`` disaggregates every request a candidate exists for (the simulator's
        "always disaggregate" baseline; also what a pure round-robin proxy does).
        ``stall_weight``: seconds of time to first token one second of stall on one running
        request is worth (0: the stall is not weighed). ``stall_burst_s``, ``tpot_slo_s``: the
        decode ranks' stall budgets (``budget``; a TPOT SLO of 0: none)."""
        self.policy = policy
        self.stall_burst_s = stall_burst_s
        self.tpot_slo_s = tpot_slo_s
        self._min_tokens = min_tokens
        self._ttft_ratio = ttft_ratio
        self._stall_weight = stall_weight
        self._transfer = transfer
        self._always = always

    def decide(
        self,
        candidates: Sequence[Candidate],
        local: LocalView,
        *,
        prompt_tokens: int,
        cached_tokens: int = 0,
    ) -> Decision:
        uncached = max(0, prompt_tokens - cached_tokens)
        local_s = predict_local(local, uncached)

        def stay(reason: str) -> Decision:
            return Decision(None, reason, prompt_tokens, uncached, local_s)

        if not candidates:
            return stay("pool_empty")
        # What a local prefill costs the decodes running on the engine: each stalls while it
        # computes (weighed per running request, in seconds of time to first token).
        compute_s = local.speed.s_per_token * uncached
        stall_s = self._stall_weight * local.running * compute_s
        # The decodes' budget: a hard bound, over anything the weighing below prefers.
        # A prompt with nothing to compute stalls nothing: never over, even on a budget in debt.
        over_budget = (
            self.tpot_slo_s > 0
            and local.running > 0
            and compute_s > 0
            and compute_s > local.stall_credit_s
        )
        short = uncached < self._min_tokens
        short_reason = "prefix_cached" if prompt_tokens >= self._min_tokens else "short_prompt"
        unweighed = short and stall_s <= 0  # short, and no stall weighed: local
        if not self._always and not over_budget and unweighed:
            return stay(short_reason)
        chosen = self.policy.choose(candidates, prompt_tokens)
        if chosen is None:
            return stay("pool_empty")
        remote_s = self.remote_seconds(chosen, prompt_tokens)

        def send(reason: str) -> Decision:
            return Decision(
                chosen.key, reason, prompt_tokens, uncached, remote_s, chosen.cached_tokens
            )

        if self._always:
            return send("scheduled")
        if chosen.queued_tokens(TOKENS_PER_WAITING) > 0:
            # The stall counts only against a prefill server with room: one with a queue is the
            # pool's bottleneck, and work sent there to spare the decodes delays others' prefills.
            stall_s = 0.0
        if unweighed or (short and remote_s > local_s + stall_s):
            # Short: local, unless the stall it would impose outweighs a remote prefill.
            local_reason = short_reason
        elif not short and remote_s > self._ttft_ratio * local_s + stall_s:
            local_reason = "pool_saturated"
        else:
            return send("scheduled")
        # Local by the steps above; the decodes' budget, a hard bound, may send it remote.
        return send("decode_budget") if over_budget else stay(local_reason)

    def remote_seconds(self, candidate: Candidate, prompt_tokens: int) -> float:
        """Predicted time to first token of a prefill on ``candidate``."""
        return predicted_ttft(candidate, prompt_tokens, self._transfer)

    def budget(self, now: float, stale_after_s: float = math.inf) -> StallBudget:
        """A full stall budget for a decode rank, with this decider's SLO and burst; its step time
        is forgotten ``stale_after_s`` after the scrape that measured it."""
        return StallBudget(self.tpot_slo_s, self.stall_burst_s, now, stale_after_s)


class StallBudget:
    """The stall a decode rank's running decodes can still absorb, in seconds: refills at
    ``share`` seconds per second up to ``burst_s``; a local prefill spends its compute seconds
    while decodes run there. ``share`` follows the decodes' slack against the TPOT SLO,
    1 − step ÷ (``TPOT_AIM`` × ``slo_s``), from the engine's step time as ``scraped`` measures
    it; 1 (the burst alone bounds) until a step time is known, and again once the last one was
    measured more than ``stale_after_s`` ago (the engine's scrapes failed or found nothing
    new). Times are the caller's monotonic seconds."""

    __slots__ = (
        "_at",
        "_credit",
        "_seen",
        "_spent",
        "burst_s",
        "measured_at",
        "share",
        "slo_s",
        "stale_after_s",
        "step_s",
    )

    def __init__(
        self, slo_s: float, burst_s: float, now: float, stale_after_s: float = math.inf
    ) -> None:
        self.slo_s = slo_s
        self.burst_s = burst_s
        self.stale_after_s = stale_after_s
        self.share = 1.0
        """The share as last measured (``rate``: the one in force)."""
        self.step_s: float | None = None
        """The engine's step time without this sidecar's local prefills (None: not known)."""
        self.measured_at = -math.inf
        """The scrape that measured ``step_s`` and ``share``."""
        self._credit = burst_s
        self._at = now
        self._spent = 0.0
        """Seconds spent since the budget began (for the share of a scrape interval)."""
        self._seen: tuple[float, float, float, float] | None = None
        """The last scrape: its time, inter-token seconds and tokens, and ``_spent`` then."""

    def rate(self, now: float) -> float:
        """The refill rate in force at ``now``, seconds per second: the measured share, or 1 once
        it is more than ``stale_after_s`` old."""
        return self.share if now <= self._fresh_until(now) else 1.0

    def step_at(self, now: float) -> float | None:
        """``step_s`` while it sets the rate (None: not known, or more than ``stale_after_s``
        old)."""
        return self.step_s if now <= self._fresh_until(now) else None

    def _fresh_until(self, now: float) -> float:
        if self.stale_after_s == math.inf:
            return now
        return self.measured_at + self.stale_after_s

    def credit(self, now: float) -> float:
        """The budget at ``now`` (refilled since the last look: at the measured share until it
        went stale, at 1 after)."""
        if now > self._at:
            fresh = max(0.0, min(now, self._fresh_until(now)) - self._at)
            refill = self.share * fresh + (now - self._at - fresh)
            self._credit = min(self.burst_s, self._credit + refill)
            self._at = now
        return self._credit

    def spend(self, seconds: float, now: float) -> None:
        """A local prefill of ``seconds`` of compute stalls the running decodes. The budget may
        go below zero (a prefill that stays local without a candidate), down to ``-burst_s``: it
        is paid back first, and a long spell without a prefill pool leaves at most one burst of
        debt (more would send every later prefill remote for as long again)."""
        self._credit = max(-self.burst_s, self.credit(now) - seconds)
        self._spent += seconds

    def scraped(self, at: float, itl_sum_s: float, itl_count: float, now: float) -> None:
        """The engine's inter-token latency histogram (its running sum of seconds and count of
        tokens) as a scrape at ``at`` found it. Between two scrapes the decodes took
        ``observed`` = Δsum ÷ Δcount per token, stalled for a share ``stalled`` of the interval
        by what this sidecar spent; their step is ``observed`` × (1 − ``stalled``), and the
        share refills from ``now`` on. An interval without tokens (nothing decoded), or with
        counters that went back (the engine restarted), leaves the share as it was, until it is
        ``stale_after_s`` old. Without a TPOT SLO (0) there is no budget to keep."""
        previous = self._seen
        if self.slo_s <= 0:
            return
        if previous is not None and at <= previous[0]:
            return
        self._seen = (at, itl_sum_s, itl_count, self._spent)
        if previous is None:
            return
        then, sum_then, count_then, spent_then = previous
        tokens = itl_count - count_then
        seconds = itl_sum_s - sum_then
        if tokens <= 0 or seconds < 0:
            return
        stalled = min(MAX_STALLED, (self._spent - spent_then) / (at - then))
        self.credit(now)
        self.step_s = seconds / tokens * (1.0 - stalled)
        self.share = max(0.0, 1.0 - self.step_s / (TPOT_AIM * self.slo_s))
        self.measured_at = at


MAX_STALLED = 0.9
"""The share of an interval a sidecar's spending is taken to have stalled its decodes at most
(a budget overdrawn by a prefill without a candidate can spend more than the interval)."""


def predict_local(local: LocalView, uncached_tokens: int) -> float:
    """Local prefills ahead (this sidecar's, or the engine's waiting queue when larger) and this
    prompt, at the observed local speed."""
    ahead = max(float(local.ahead_tokens), (local.waiting or 0.0) * TOKENS_PER_WAITING)
    return local.speed.seconds(ahead + uncached_tokens)
