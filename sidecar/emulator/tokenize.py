"""``POST /tokenize`` as vLLM serves it, and the token ids of the emulator's prompts.

The emulator has no tokenizer: a text prompt's tokens are its units (four characters, or words
with ``--tokenizer words``; ``text.py``). A unit's **token id** is the first four bytes of
BLAKE2b (digest size 4) of its UTF-8 bytes, big-endian, below 2³¹ (the top bit cleared); a
prompt sent as token ids keeps them. ``prompt_token_ids`` is the one rule: ``/tokenize`` answers
with it, and a KV-event publisher must give a block the ids of its units, so that a client
keying blocks by the ids ``/tokenize`` returned finds the blocks the events announced. A chat is
tokenized as the emulator renders it (``role: content`` lines); there are no special tokens, so
``add_special_tokens`` and ``add_generation_prompt`` change nothing.

Request and answer are vLLM's (``vllm/entrypoints/serve/tokenize/protocol.py``): a body with
``prompt`` (a string) or ``messages``, optional ``model`` and ``return_token_strs``; the answer
``{"count", "max_model_len", "tokens", "token_strs"}``; another model than the served one is a
404, as for generation.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from sidecar.emulator.config import EmulatorConfig
from sidecar.emulator.errors import EmulatorError
from sidecar.emulator.text import (
    CHARS_PER_TOKEN,
    Prompt,
    prompt_from_messages,
    text_prompt,
    token_id,
)


def unit_token_id(unit: str) -> int:
    """The token id of one unit of a text prompt (four characters, or a word): ``token_id``,
    the rule the KV-event publisher uses too."""
    return token_id(unit.encode())


def prompt_units(prompt: Prompt) -> list[str]:
    """A text prompt's tokens as text: words, or runs of four characters (the last shorter)."""
    if prompt.words:
        return prompt.text.split() or [""]
    text = prompt.text
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)] or [""]


def prompt_token_ids(prompt: Prompt) -> tuple[int, ...]:
    """The prompt's token ids: those it was sent as, else one per unit (``unit_token_id``)."""
    if prompt.token_ids is not None:
        return prompt.token_ids
    return tuple(unit_token_id(unit) for unit in prompt_units(prompt))


def tokenize(body: object, config: EmulatorConfig) -> dict[str, Any]:
    """The answer to a ``/tokenize`` body; raises ``EmulatorError`` (400) for a bad one."""
    if not isinstance(body, dict):
        raise EmulatorError(400, "the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != config.model:
        raise EmulatorError(404, f"The model `{model}` does not exist.")
    try:
        if "messages" in body:
            prompt = prompt_from_messages(body["messages"], config.tokenizer)
        elif isinstance(body.get("prompt"), str):
            prompt = text_prompt(body["prompt"], config.tokenizer)
        else:
            raise EmulatorError(400, "prompt must be a string, or messages a list")
    except ValueError as exc:
        raise EmulatorError(400, str(exc)) from exc
    ids = prompt_token_ids(prompt)
    strs = prompt_units(prompt) if body.get("return_token_strs") else None
    return {
        "count": len(ids),
        "max_model_len": config.max_model_len,
        "tokens": list(ids),
        "token_strs": strs,
    }


async def handle_tokenize(request: web.Request, config: EmulatorConfig) -> web.Response:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise EmulatorError(400, f"invalid JSON: {exc}") from exc
    return web.Response(body=orjson.dumps(tokenize(body, config)), content_type="application/json")
