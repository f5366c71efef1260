"""A request's token ids, for the exact index: asked of the local decode engine's ``/tokenize``.

Why the engine and not a tokenizer in the sidecar: docs/scheduling.md, "Exact prefix state from KV
events" (the two were measured against each other: docs/benchmarks.md). The engine tokenizes with
its own tokenizer and chat template and the request's own chat options, so the ids are those its
KV events will carry, by construction; the sidecar needs no model files and no tokenizer library,
and spends one loopback round trip.

``TokenSource.token_ids(body)`` returns the ids, or None when it cannot tell — the caller then uses
the approximate index for that request. None when:

- the body is one the engine would key differently from its tokens alone: images, audio or other
  non-text parts (multimodal identifiers are hashed into vLLM's blocks), ``prompt_embeds``, a
  batch of several prompts, ``documents`` (rendered by the chat template, but not accepted by
  ``/tokenize``);
- the engine did not answer within ``timeout_s`` (the whole exchange), refused, answered an
  error, or an answer that is not ``{"tokens": [ints]}`` within ``max_tokens``;
- ``max_inflight`` calls are already out (the source never queues: a slow engine costs each
  request at most its timeout, and nothing piles up).

A prompt sent as token ids needs no call. The request sent to ``/tokenize`` is vLLM's
(``vllm/entrypoints/serve/tokenize/protocol.py``): for a chat, ``messages`` with the request's
``add_generation_prompt`` (default true), ``continue_final_message``, ``add_special_tokens``
(default false), ``chat_template``, ``chat_template_kwargs`` and ``tools``; for a completion,
``prompt`` with ``add_special_tokens`` (default true, as ``/v1/completions``).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from sidecar.engines.upstream import HttpClient
from sidecar.errors import EngineAnswerTooLarge, EngineError, EngineRefused, EngineTimeout

MAX_TOKEN_ID = (1 << 32) - 1
TOKEN_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)
"""``array``'s type code of a token id packed as a 4-byte unsigned int."""
_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)
_HEADERS = {"content-type": "application/json"}
_BYTES_PER_TOKEN = 12
"""An answer's bytes per token at most (an id of up to 10 digits, a comma, a space)."""


@dataclass(slots=True)
class TokenSourceStats:
    """Counts since the source was made: answers, and why the others were None."""

    answered: int = 0
    given: int = 0
    """Prompts sent as token ids: no call."""
    unsupported: int = 0
    busy: int = 0
    timeout: int = 0
    refused: int = 0
    failed: int = 0
    """Other transport errors and error statuses."""
    invalid: int = 0
    """Answers that were not token ids within the bound."""


def tokenize_request(body: Mapping[str, Any]) -> dict[str, Any] | TokenIds | None:
    """What to ask ``/tokenize`` for a generation ``body``: vLLM's tokenize request, the ids
    themselves when the prompt is token ids, or None when ids cannot stand for the prompt."""
    model = body.get("model")
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or "documents" in body or not _text_only(messages):
            return None
        request: dict[str, Any] = {"messages": messages}
        for field in _CHAT_FIELDS:
            if field in body:
                request[field] = body[field]
    else:
        prompt = body.get("prompt")
        if "prompt_embeds" in body or prompt is None:
            return None
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            return checked_ids(prompt)
        if not isinstance(prompt, str):
            return None
        request = {"prompt": prompt}
        if "add_special_tokens" in body:
            request["add_special_tokens"] = body["add_special_tokens"]
    if model is not None:
        request["model"] = model
    return request


def _text_only(messages: list[Any]) -> bool:
    for message in messages:
        if not isinstance(message, dict):
            return False
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    return False
    return True


class TokenIds(list[int]):
    """A prompt's token ids, checked, with ``packed``: each a 4-byte unsigned int in native order,
    what the exact indexes key (``index.PromptKeys``), made once here with the check."""

    __slots__ = ("packed",)

    def __init__(self, ids: list[int], packed: bytes) -> None:
        super().__init__(ids)
        self.packed = packed


def checked_ids(value: object, *, bools: bool = True) -> TokenIds | None:
    """``value`` as token ids: a non-empty list of ints in [0, 2**32), not bools; else None.
    Checked at C speed: the packing rejects other types and ranges (a Python loop over a
    2,000-token prompt cost ten times as much), and the set of the items' types the bools (which
    the packing takes as 0 and 1). ``bools``: whether ``value`` may hold bools at all (False for
    ids parsed from a JSON text without ``true`` or ``false``: the set is then not needed)."""
    if not isinstance(value, list) or not value:
        return None
    try:
        packed = array(TOKEN_TYPECODE, value)
    except (TypeError, OverflowError):
        return None
    if bools and bool in set(map(type, value)):
        return None
    return TokenIds(value, packed.tobytes())


class TokenSource:
    """The local decode engine's ``/tokenize``, bounded; see the module's docstring.

    ``client``: an open ``HttpClient`` (the engines' pool); ``url``: the engine's base URL;
    ``timeout_s``: the whole exchange; ``max_tokens``: the longest answer read (beyond it, None);
    ``max_inflight``: calls out at once (beyond it, None at once).
    """

    def __init__(
        self,
        client: HttpClient,
        url: str,
        *,
        timeout_s: float,
        max_tokens: int = 131_072,
        max_inflight: int = 64,
    ) -> None:
        self._client = client
        self._url = url.rstrip("/") + "/tokenize"
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens
        self._max_inflight = max_inflight
        self._inflight = 0
        self.stats = TokenSourceStats()

    async def token_ids(self, body: Mapping[str, Any]) -> TokenIds | None:
        """The ids the engine will prefill for ``body`` (a generation request), or None."""
        request = tokenize_request(body)
        if request is None:
            self.stats.unsupported += 1
            return None
        if isinstance(request, list):
            if len(request) > self.max_tokens:
                self.stats.unsupported += 1
                return None
            self.stats.given += 1
            return request
        if self._inflight >= self._max_inflight:
            self.stats.busy += 1
            return None
        self._inflight += 1
        try:
            return await self._ask(request)
        finally:
            self._inflight -= 1

    async def _ask(self, request: dict[str, Any]) -> TokenIds | None:
        limit = self.max_tokens * _BYTES_PER_TOKEN + 1024
        try:
            # One deadline for the whole call: the client's bounds the exchange, this one also
            # the JSON encoding's and the pool's waits.
            async with asyncio.timeout(self.timeout_s):
                answer = await self._client.send(
                    "POST",
                    self._url,
                    headers=_HEADERS,
                    data=orjson.dumps(request),
                    total_s=self.timeout_s,
                    role="the decode engine's /tokenize",
                )
                raw = await answer.read(limit)
        except (EngineTimeout, TimeoutError):
            self.stats.timeout += 1
            return None
        except EngineRefused:
            self.stats.refused += 1
            return None
        except EngineAnswerTooLarge:
            self.stats.invalid += 1
            return None
        except EngineError:
            self.stats.failed += 1
            return None
        if answer.status != 200:
            self.stats.failed += 1
            return None
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self.stats.invalid += 1
            return None
        tokens = parsed.get("tokens") if isinstance(parsed, dict) else None
        # orjson makes a bool only of a literal ``true`` or ``false``: without one in the text,
        # the ids need no look at their types.
        ids = checked_ids(tokens, bools=b"true" in raw or b"false" in raw)
        if ids is None or len(ids) > self.max_tokens:
            self.stats.invalid += 1
            return None
        self.stats.answered += 1
        return ids
