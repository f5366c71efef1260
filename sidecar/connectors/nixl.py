"""vLLM NixlConnector (llm-d: ``nixlv2``): serial legs, the decode engine pulls KV over NIXL.

Wire facts from ../shared/reference/protocol.md §3 (sources: vLLM's NixlConnector and llm-d's
routing sidecar): the prefill leg asks the prefill engine to keep the KV for a remote decode and to
stop after one token; its answer's ``kv_transfer_params`` go to the decode leg verbatim.
"""

from __future__ import annotations

from typing import Any

from sidecar.endpoints import Endpoint

KV_TRANSFER_PARAMS = "kv_transfer_params"
REMOTE_HOST = "remote_host"

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

# Fields that would make the prefill engine stream, or decode more than the one token it must.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


class NixlConnector:
    name = "nixl"
    concurrent_legs = False

    def __init__(self, *, rewrite_remote_host: bool = False) -> None:
        self.rewrite_remote_host = rewrite_remote_host

    def unsupported(self, body: dict[str, Any]) -> str | None:
        # A batch of prompts gets the KV params of its first prompt only (observed on vLLM
        # 0.32): forwarding them would decode every prompt on the first one's KV.
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            return "batched_prompt"
        return None

    def sanitize(self, body: dict[str, Any]) -> bool:
        # A client must not direct the decode engine to pull KV from a host of its choosing.
        if KV_TRANSFER_PARAMS not in body:
            return False
        del body[KV_TRANSFER_PARAMS]
        return True

    def prefill_body(self, body: dict[str, Any], route: str) -> dict[str, Any]:
        leg = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
        leg[KV_TRANSFER_PARAMS] = dict(PREFILL_REQUEST_PARAMS)
        leg["stream"] = False
        leg["max_tokens"] = 1
        # An uncapped max_completion_tokens made the prefill decode N steps (llm-d #400). Chat
        # always gets it; on completions it is set only when the client used the field.
        if route == "chat_completions" or "max_completion_tokens" in body:
            leg["max_completion_tokens"] = 1
        if "n" in body:
            leg["n"] = 1
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
        # NIXL has no "free" call on the prefill side: the blocks are freed once a decode pulls
        # them. The cheapest pull is a one-token, non-streamed decode whose answer is dropped.
        leg = self.prefill_body(body, route)
        leg[KV_TRANSFER_PARAMS] = kv_params
        return leg
