"""Disaggregate or prefill locally, and where: pure and synchronous.

Disaggregate iff the prompt's uncached tokens reach ``min_tokens`` and the best candidate's
predicted time to first token is at most ``ttft_ratio`` times that of a local prefill, plus the
stall a local prefill would impose: every request running on the local engine waits while it
computes (``stall_weight`` × running × its compute seconds). The ratio is the price paid to keep
long prefills out of the local decode batch; past it the pool counts as saturated.

"Uncached" is relative to the local decode engine's prefix cache (``cached_tokens``); a prefill
engine does not hold that cache, so a remote prefill is predicted for the prompt less what the
prefill prefix index predicts that endpoint holds (its candidate's ``cached_tokens``).
The ratio trades goodput against prefill-queue length; docs/scheduling.md has the simulator's
numbers for 2, 3, 4 and 6.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.scheduling.model import Candidate, Decision, LocalView, Transfer
from sidecar.scheduling.policies import TOKENS_PER_WAITING, Policy, predicted_ttft

STALL_WEIGHT = 0.0


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
    ) -> None:
        """``always`` disaggregates every request a candidate exists for (the simulator's
        "always disaggregate" baseline; also what a pure round-robin proxy does).
        ``stall_weight``: seconds of time to first token one second of stall on one running
        request is worth (0: the stall is not weighed)."""
        self.policy = policy
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
        if not self._always and uncached < self._min_tokens:
            return stay("prefix_cached" if prompt_tokens >= self._min_tokens else "short_prompt")
        chosen = self.policy.choose(candidates, prompt_tokens)
        if chosen is None:
            return stay("pool_empty")
        remote_s = self.remote_seconds(chosen, prompt_tokens)
        stall_s = self._stall_weight * local.running * local.speed.s_per_token * uncached
        if not self._always and remote_s > self._ttft_ratio * local_s + stall_s:
            return stay("pool_saturated")
        return Decision(
            chosen.key, "scheduled", prompt_tokens, uncached, remote_s, chosen.cached_tokens
        )

    def remote_seconds(self, candidate: Candidate, prompt_tokens: int) -> float:
        """Predicted time to first token of a prefill on ``candidate``."""
        return predicted_ttft(candidate, prompt_tokens, self._transfer)


def predict_local(local: LocalView, uncached_tokens: int) -> float:
    """Local prefills ahead (this sidecar's, or the engine's waiting queue when larger) and this
    prompt, at the observed local speed."""
    ahead = max(float(local.ahead_tokens), (local.waiting or 0.0) * TOKENS_PER_WAITING)
    return local.speed.seconds(ahead + uncached_tokens)
