"""Shared-storage connectors (vLLM ExampleConnector, formerly SharedStorageConnector; LMCache-style
stores): serial legs, and the decode engine finds the KV by prompt prefix in the shared store.

Wire facts from ../shared/reference/protocol.md §5: the prefill leg computes the prompt and stops
after one token (``max_tokens``/``max_completion_tokens`` 1, ``stream`` false) without
``kv_transfer_params``; its store write is its side effect. The decode leg gets the client's body
unchanged. Nothing is staged for one request alone — the store keeps (and evicts) blocks by its own
policy — so there is nothing to release, and a prefill that failed only means the decode
recomputes the prompt: ``SIDECAR_PREFILL_FALLBACK`` applies as usual.
"""

from __future__ import annotations

from typing import Any

from sidecar.connectors.exchange import Answer, Exchange, Prefilled, Refused
from sidecar.connectors.nixl import PROMPT_LOGPROBS, needs_prompt_logprobs, one_token_leg
from sidecar.connectors.parts import Parts
from sidecar.connectors.refusals import in_client_terms
from sidecar.connectors.usage import CachedTokensPatch, cached_tokens, prompt_tokens
from sidecar.fleet.endpoints import Endpoint
from sidecar.sanitize import strip_client_fields


class SharedStorageConnector:
    name = "shared-storage"

    def __init__(self, parts: Parts) -> None:
        self._parts = parts

    async def run(self, ex: Exchange) -> Answer | Refused:
        patch = None
        async for attempt in self._parts.prefill.attempts(ex):
            with attempt.staged(release=None) as kv:  # the store keeps blocks by its own policy
                outcome = await kv.prefill(ex.encode(one_token_leg(ex.body, ex.route)), _accept)
            if isinstance(outcome, Refused):
                return in_client_terms(outcome, ex)  # it refused the one-token leg
            if isinstance(outcome, Prefilled):
                if outcome.cached_tokens is not None:
                    patch = CachedTokensPatch(outcome.cached_tokens)
                break
        # Prefilled or not, the decode gets the client's body: it finds what the store holds.
        data = ex.raw if ex.raw is not None else ex.encode(ex.body)
        return await self._parts.decode.send(ex, data, patch)

    def unsupported(self, body: dict[str, Any]) -> str | None:
        # The store is keyed by prompt: every prompt of a batch is found. But a decode engine
        # that loads the prompt from the store does not compute its logprobs (vLLM's
        # ExampleConnector loads whatever prefix it holds, prompt_logprobs or not): such a
        # request is not prefilled first.
        return PROMPT_LOGPROBS if needs_prompt_logprobs(body) else None

    def sanitize(self, body: dict[str, Any]) -> bool:
        # Meaningless to these engines, and a NIXL engine would act on them.
        return strip_client_fields(body)


def _accept(answer: object, endpoint: Endpoint) -> Prefilled:
    """Any 2xx JSON answer: the prompt's KV is in the store."""
    return Prefilled(endpoint, {}, cached_tokens(answer), prompt_tokens(answer))
