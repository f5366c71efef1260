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
(``s_per_token`` × uncached tokens) stalls each decode running on the engine by about C, and
each decode's TPOT and tail inter-token time can absorb only so much. Each decode rank keeps a
stall budget (``StallBudget``, held by the planner): it refills at ``stall_share`` seconds per
second (``SIDECAR_DISAGG_STALL_SHARE``: the share of their time the decodes may spend stalled)
up to ``stall_burst_s`` (``SIDECAR_DISAGG_STALL_BURST_S``: the longest stall their tail gaps
absorb), and a local prefill spends its C from it while decodes run there. While decodes run
(``running`` > 0), a prefill stays local only if

- the engine queues nothing (scraped ``waiting`` is 0 or unknown): requests waiting for a seat
  mean the decode tier is the bottleneck, and a local prefill takes its time from the decodes
  that bound the fleet; and
- C fits in the rank's budget (``LocalView.stall_credit_s``).

Otherwise it goes to the policy's choice (reason ``decode_budget``), whatever the prefill pool's
queue: the anchors' choice where decodes are the bottleneck. With no decode running nothing is
stalled and nothing is spent; with no candidate the prefill stays local (``pool_empty``).
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.defaults import STALL_BURST_S, STALL_SHARE, STALL_WEIGHT
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
        stall_share: float = STALL_SHARE,
        stall_burst_s: float = STALL_BURST_S,
    ) -> None:
        """``always`` disaggregates every request a candidate exists for (the simulator's
        "always disaggregate" baseline; also what a pure round-robin proxy does).
        ``stall_weight``: seconds of time to first token one second of stall on one running
        request is worth (0: the stall is not weighed). ``stall_share``, ``stall_burst_s``: the
        decode ranks' stall budgets (``budget``)."""
        self.policy = policy
        self.stall_share = stall_share
        self.stall_burst_s = stall_burst_s
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
        over_budget = local.running > 0 and (
            (local.waiting or 0.0) > 0 or compute_s > local.stall_credit_s
        )
        short = uncached < self._min_tokens
        if not self._always and not over_budget and short and stall_s <= 0:
            return stay("prefix_cached" if prompt_tokens >= self._min_tokens else "short_prompt")
        chosen = self.policy.choose(candidates, prompt_tokens)
        if chosen is None:
            return stay("pool_empty")
        remote_s = self.remote_seconds(chosen, prompt_tokens)
        if not self._always and over_budget:
            return Decision(
                chosen.key, "decode_budget", prompt_tokens, uncached, remote_s, chosen.cached_tokens
            )
        if chosen.queued_tokens(TOKENS_PER_WAITING) > 0:
            # The stall counts only against a prefill server with room: one with a queue is the
            # pool's bottleneck, and work sent there to spare the decodes delays others' prefills.
            stall_s = 0.0
        if not self._always and short and remote_s > local_s + stall_s:
            # Short: local, unless the stall it would impose outweighs a remote prefill.
            return stay("prefix_cached" if prompt_tokens >= self._min_tokens else "short_prompt")
        if not self._always and not short and remote_s > self._ttft_ratio * local_s + stall_s:
            return stay("pool_saturated")
        return Decision(
            chosen.key, "scheduled", prompt_tokens, uncached, remote_s, chosen.cached_tokens
        )

    def remote_seconds(self, candidate: Candidate, prompt_tokens: int) -> float:
        """Predicted time to first token of a prefill on ``candidate``."""
        return predicted_ttft(candidate, prompt_tokens, self._transfer)

    def budget(self, now: float) -> StallBudget:
        """A full stall budget for a decode rank, with this decider's share and burst."""
        return StallBudget(self.stall_share, self.stall_burst_s, now)


class StallBudget:
    """The stall a decode rank's running decodes can still absorb, in seconds: refills at
    ``share`` seconds per second up to ``burst_s``; a local prefill spends its compute seconds
    while decodes run there. Times are the caller's monotonic seconds."""

    __slots__ = ("_at", "_credit", "burst_s", "share")

    def __init__(self, share: float, burst_s: float, now: float) -> None:
        self.share = share
        self.burst_s = burst_s
        self._credit = burst_s
        self._at = now

    def credit(self, now: float) -> float:
        """The budget at ``now`` (refilled since the last look)."""
        if now > self._at:
            self._credit = min(self.burst_s, self._credit + self.share * (now - self._at))
            self._at = now
        return self._credit

    def spend(self, seconds: float, now: float) -> None:
        """A local prefill of ``seconds`` of compute stalls the running decodes. The budget may
        go below zero (a prefill that stays local without a candidate): it is paid back first."""
        self._credit = self.credit(now) - seconds


def predict_local(local: LocalView, uncached_tokens: int) -> float:
    """Local prefills ahead (this sidecar's, or the engine's waiting queue when larger) and this
    prompt, at the observed local speed."""
    ahead = max(float(local.ahead_tokens), (local.waiting or 0.0) * TOKENS_PER_WAITING)
    return local.speed.seconds(ahead + uncached_tokens)
