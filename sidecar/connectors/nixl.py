"""vLLM NixlConnector (llm-d: ``nixlv2``): serial legs, the decode engine pulls KV over NIXL.

Wire facts from ../shared/reference/protocol.md §3 (sources: vLLM's NixlConnector and llm-d's
routing sidecar): the prefill leg asks the prefill engine to keep the KV for a remote decode and to
stop after one token; its answer's ``kv_transfer_params`` go to the decode leg verbatim.

The choreography::

    prefill attempts (retries) ──Prefilled──▶ decode send (client body + kv params) ──▶ taken
        │ Refused: to the client    │ attempts ran out: decode send (client body)
        └ client left: abort, or finish and release
    decode refused (4xx/5xx), timed out, broken or left before its first byte ──▶ release

The staged KV is the attempt's ``StagedKv``: its exit releases what the decode did not take.

NIXL has no "free" call: blocks staged on the prefill engine are freed when a decode pulls them
(or at the engine's expiry, 30–480 s). So a release is the cheapest pull — a one-token,
non-streamed decode carrying the KV params, its answer dropped. Whether a decode that failed had
pulled already (or vLLM freed the blocks itself, as 0.32 does for a request its decode engine
refused) is unknowable from outside. A second pull is then either refused or, on vLLM 0.32, reads
blocks that may hold another request's KV by now: the release's own ``cache_salt`` keeps what it
read from ever serving another request, and its answer is dropped.
"""

from __future__ import annotations

import secrets
from typing import Any

from sidecar.connectors.exchange import Answer, Exchange, Prefilled, Refused
from sidecar.connectors.parts import Parts
from sidecar.connectors.prefill import Release
from sidecar.connectors.refusals import in_client_terms
from sidecar.connectors.usage import CachedTokensPatch, cached_tokens, prompt_tokens
from sidecar.fleet.endpoints import Endpoint
from sidecar.sanitize import KV_TRANSFER_PARAMS, strip_client_fields

REMOTE_HOST = "remote_host"
CACHE_SALT = "cache_salt"
"""vLLM's per-request prefix-cache salt (at most 128 characters, no '@', '/', '\\')."""
RELEASE_ID_SUFFIX = "-release"
PROMPT_LOGPROBS = "prompt_logprobs"
"""The placement reason of a request served locally because it asks for prompt logprobs."""

PREFILL_REQUEST_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""Sent on every prefill leg, overwriting whatever the client sent."""

REQUIRED_DECODE_PARAMS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)
"""vLLM's decode side ignores (recomputes) params missing any of these."""

_PREFILL_DROPPED = (
    # Would make the prefill engine stream, or decode more than the one token it must.
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
    # What only the decode leg's answer reports (docs/protocol.md, "Prefill leg"): on the prefill
    # leg they change nothing of the KV and only grow its dropped answer — echo by the prompt,
    # prompt_logprobs by top-k per prompt token, return_token_ids by the prompt's token ids. Chat
    # refuses top_logprobs without logprobs: both go.
    "echo",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "return_token_ids",
)


def needs_prompt_logprobs(body: dict[str, Any]) -> bool:
    """Whether the answer reports the prompt's log-probabilities, which only an engine that
    computes the prompt itself has: vLLM's decode engine loads pulled KV and computes only the
    last prompt token (docs/protocol.md has the sources).

    vLLM sets prompt_logprobs from ``prompt_logprobs``, else, with ``echo``, from ``logprobs``
    (completions) or ``top_logprobs`` (chat, where it defaults to 0: echo alone asks for them).
    """
    if body.get("prompt_logprobs") is not None:
        return True
    if not body.get("echo"):
        return False
    if "messages" in body:  # chat
        return body.get("top_logprobs", 0) is not None
    return body.get("logprobs") is not None


def one_token_leg(body: dict[str, Any], route: str) -> dict[str, Any]:
    """The client's body made a prefill: not streamed, one token, one sample."""
    leg = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
    leg["stream"] = False
    leg["max_tokens"] = 1
    # An uncapped max_completion_tokens made the prefill decode N steps (llm-d #400). Chat
    # always gets it; on completions it is set only when the client used the field.
    if route == "chat_completions" or "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    if "n" in body:
        leg["n"] = 1
    return leg


class NixlConnector:
    name = "nixl"

    def __init__(self, parts: Parts, *, rewrite_remote_host: bool = False) -> None:
        self._parts = parts
        self.rewrite_remote_host = rewrite_remote_host

    async def run(self, ex: Exchange) -> Answer | Refused:
        release = Release(
            lambda prefilled: self.release_body(ex.body, prefilled.kv_params, ex.route),
            self.release_id(ex),
        )
        async for attempt in self._parts.prefill.attempts(ex):
            with attempt.staged(release) as kv:
                data = ex.encode(self.prefill_body(ex.body, ex.route))
                outcome = await kv.prefill(data, self._accept)
                if isinstance(outcome, Refused):
                    return in_client_terms(outcome, ex)  # it refused the one-token leg
                if isinstance(outcome, Prefilled):
                    answer = await self._decode_pulling(ex, outcome)
                    if answer.upstream.status < 400:
                        kv.taken()
                    # else refused (e.g. max_tokens over its context): the exit releases it,
                    # as it does when the decode timed out, broke, closed without an answer
                    # (perhaps after reading the request), or the client left, before the
                    # first byte. A decode engine that was merely unreachable fails the
                    # release fast too; it is counted, not guessed.
                    return answer
        local = ex.raw if ex.raw is not None else ex.encode(ex.body)
        return await self._parts.decode.send(ex, local)

    async def _decode_pulling(self, ex: Exchange, prefilled: Prefilled) -> Answer:
        data = ex.encode(self.decode_body(ex.body, prefilled.kv_params))
        patch = None
        if prefilled.cached_tokens is not None:
            patch = CachedTokensPatch(prefilled.cached_tokens)
        return await self._parts.decode.send(ex, data, patch)

    def _accept(self, answer: object, endpoint: Endpoint) -> Prefilled | None:
        params = self.kv_params(answer, endpoint)
        if params is None:
            return None
        return Prefilled(endpoint, params, cached_tokens(answer), prompt_tokens(answer))

    def release_id(self, ex: Exchange) -> str:
        """The ``x-request-id`` of a release: its own, from the engine id (the decode leg it
        stands in for may still be known to the engine)."""
        return f"{ex.engine_id}{RELEASE_ID_SUFFIX}"

    # --- the wire ------------------------------------------------------------------------

    def unsupported(self, body: dict[str, Any]) -> str | None:
        # A batch of prompts gets the KV params of its first prompt only (observed on vLLM
        # 0.32): forwarding them would decode every prompt on the first one's KV.
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            return "batched_prompt"
        if needs_prompt_logprobs(body):
            return PROMPT_LOGPROBS
        return None

    def sanitize(self, body: dict[str, Any]) -> bool:
        # A client must not direct the decode engine to pull KV from a host of its choosing,
        # whether at the top level or in vllm_xargs (vLLM reads it from both).
        return strip_client_fields(body)

    def prefill_body(self, body: dict[str, Any], route: str) -> dict[str, Any]:
        leg = one_token_leg(body, route)
        leg[KV_TRANSFER_PARAMS] = dict(PREFILL_REQUEST_PARAMS)
        return leg

    def kv_params(self, prefill_answer: Any, endpoint: Endpoint) -> dict[str, Any] | None:
        if not isinstance(prefill_answer, dict):
            return None
        params = prefill_answer.get(KV_TRANSFER_PARAMS)
        if not isinstance(params, dict) or any(
            params.get(key) is None for key in REQUIRED_DECODE_PARAMS
        ):
            return None
        if self.rewrite_remote_host:
            return {**params, REMOTE_HOST: endpoint.host}
        return params

    def decode_body(self, body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
        return {**body, KV_TRANSFER_PARAMS: kv_params}

    def release_body(
        self, body: dict[str, Any], kv_params: dict[str, Any], route: str
    ) -> dict[str, Any]:
        leg = self.prefill_body(body, route)
        leg[KV_TRANSFER_PARAMS] = kv_params
        # The engine may have freed (and reused) these blocks already; vLLM 0.32 reads them all
        # the same and caches what it read under the prompt's hashes. A salt of its own keeps
        # that from ever being a prefix-cache hit for another request.
        leg[CACHE_SALT] = f"pd-sidecar-release-{secrets.token_hex(16)}"
        return leg
