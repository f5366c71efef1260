"""Response bodies shaped like vLLM 0.32's OpenAI server (JSON and SSE chunks)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sidecar.emulator.parse import Endpoint, GenerationRequest

SSE_DONE = b"data: [DONE]\n\n"
FINISH_REASON = "length"  # the emulator always generates exactly the requested length


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting; ``cached_tokens`` is None when prompt_tokens_details is disabled."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None

    def to_json(self) -> dict[str, Any]:
        details = None if self.cached_tokens is None else {"cached_tokens": self.cached_tokens}
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": details,
        }


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every body and chunk of one response repeats."""

    request: GenerationRequest
    model: str
    created: int

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.request.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
        }

    @property
    def is_chat(self) -> bool:
        return self.request.endpoint is Endpoint.CHAT

    def full_body(
        self, texts: list[str], usage: Usage, kv_transfer_params: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """The non-streaming answer; ``texts[k]`` is choice k."""
        choices: list[dict[str, Any]]
        if self.is_chat:
            choices = [
                {
                    "index": k,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": FINISH_REASON,
                    "stop_reason": None,
                }
                for k, text in enumerate(texts)
            ]
            body = self._head("chat.completion")
        else:
            choices = [
                {
                    "index": k,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": FINISH_REASON,
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
                for k, text in enumerate(texts)
            ]
            body = self._head("text_completion")
        body["choices"] = choices
        body["usage"] = usage.to_json()
        body["kv_transfer_params"] = (
            dict(kv_transfer_params) if kv_transfer_params is not None else None
        )
        return body

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat only: the first chunk of a choice announces the assistant role."""
        return self._chunk(index, {"delta": {"role": "assistant", "content": ""}}, None)

    def token_chunk(self, index: int, word: str, last: bool) -> dict[str, Any]:
        payload = {"delta": {"content": word}} if self.is_chat else {"text": word}
        return self._chunk(index, payload, FINISH_REASON if last else None)

    def _chunk(self, index: int, payload: dict[str, Any], finish: str | None) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        choice = {"index": index, **payload, "logprobs": None, "finish_reason": finish}
        choice["stop_reason"] = None
        body["choices"] = [choice]
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage.to_json()
        return body


def sse(event: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"
