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
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.defaults import STALL_WEIGHT
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
        # What a local prefill costs the decodes running on the engine: each stalls while it
        # computes (weighed per running request, in seconds of time to first token).
        stall_s = self._stall_weight * local.running * local.speed.s_per_token * uncached
        short = uncached < self._min_tokens
        if not self._always and short and stall_s <= 0:
            return stay("prefix_cached" if prompt_tokens >= self._min_tokens else "short_prompt")
        chosen = self.policy.choose(candidates, prompt_tokens)
        if chosen is None:
            return stay("pool_empty")
        remote_s = self.remote_seconds(chosen, prompt_tokens)
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


def predict_local(local: LocalView, uncached_tokens: int) -> float:
    """Local prefills ahead (this sidecar's, or the engine's waiting queue when larger) and this
    prompt, at the observed local speed."""
    ahead = max(float(local.ahead_tokens), (local.waiting or 0.0) * TOKENS_PER_WAITING)
    return local.speed.seconds(ahead + uncached_tokens)
