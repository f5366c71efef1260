"""Prompts in, words out: prompt extraction, the token estimate, deterministic output text.

There is no tokenizer. A text prompt counts ``ceil(characters / 4)`` tokens (at least 1) and
token ``i`` is characters ``[4i, 4i + 4)``; with the ``words`` tokenizer it counts one token per
whitespace-separated word (at least 1) and token ``i`` is word ``i``, so its count differs from a
characters / 4 estimate as real text's does. A prompt given as token ids counts one token per id.
Token ``i``'s id (KV events) is the client's id, else :func:`token_id` of its text.
Output token ``i`` of choice ``k`` is a word picked by BLAKE2b of (prompt text, k, i), so the answer
depends on the prompt alone: identical whether prefilled here or remotely, streamed or not.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.emulator.config import Tokenizer

CHARS_PER_TOKEN = 4

_WORDS = """
the of and to in is that it for on with as was at by be this from or are an but not have all which
one had they were there been can has more will if no out so what up its about into than them only
other time new some could these two may first then do any like my now over such our man me even most
"""
# Fixed vocabulary of the emulated answers; every output token is one word with a leading space.
VOCABULARY: tuple[str, ...] = tuple(f" {word}" for word in _WORDS.split())


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as the emulator sees it: its text, its token count and its token units.

    ``token_ids`` is set when the client sent token ids; prefix-cache block contents then come
    from the ids rather than from the text.
    """

    text: str
    num_tokens: int
    token_ids: tuple[int, ...] | None = None
    words: bool = False
    """Counted by the ``words`` tokenizer: a token is a whitespace-separated word."""

    def full_blocks(self, block_size: int, limit_tokens: int | None = None) -> list[bytes]:
        """Contents of the leading full KV blocks (within the first ``limit_tokens`` tokens)."""
        tokens = self.num_tokens if limit_tokens is None else min(limit_tokens, self.num_tokens)
        count = tokens // block_size
        if self.token_ids is not None:
            ids = self.token_ids
            return [
                ",".join(map(str, ids[k * block_size : (k + 1) * block_size])).encode()
                for k in range(count)
            ]
        if self.words:
            words = self.text.split()
            return [
                " ".join(words[k * block_size : (k + 1) * block_size]).encode()
                for k in range(count)
            ]
        width = block_size * CHARS_PER_TOKEN
        return [self.text[k * width : (k + 1) * width].encode() for k in range(count)]

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """The ids of tokens ``[start, stop)`` (what KV events carry): the client's ids, else one
        id per token of this tokenization (4 characters, or a word), see :func:`token_id`."""
        if self.token_ids is not None:
            return list(self.token_ids[start:stop])
        if self.words:
            units = [word.encode() for word in self.text.split()[start:stop]]
        else:
            width = CHARS_PER_TOKEN
            units = [self.text[k * width : (k + 1) * width].encode() for k in range(start, stop)]
        return [token_id(unit) for unit in units]


def token_id(unit: bytes) -> int:
    """The emulator's id of one token's text: the low 31 bits of its BLAKE2b, so equal text has
    equal ids on every emulator and in every process (there is no vocabulary)."""
    digest = hashlib.blake2b(unit, digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def text_prompt(text: str, tokenizer: Tokenizer = "chars") -> Prompt:
    if tokenizer == "words":
        return Prompt(text, max(1, len(text.split())), words=True)
    return Prompt(text, estimate_tokens(text))


def _token_id_prompt(ids: Sequence[object]) -> Prompt:
    if not ids:
        raise ValueError("prompt must not be empty")
    token_ids: list[int] = []
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError("token id prompts must contain non-negative integers only")
        token_ids.append(i)
    return Prompt(" ".join(map(str, token_ids)), len(token_ids), tuple(token_ids))


def prompt_from_completion(value: object, tokenizer: Tokenizer = "chars") -> Prompt:
    """The ``prompt`` of /v1/completions: str, [str, ...], [int, ...] or [[int, ...], ...].

    For a batch only the first prompt is served. Raises ValueError with a client-facing message.
    """
    if isinstance(value, str):
        return text_prompt(value, tokenizer)
    if not isinstance(value, list) or not value:
        raise ValueError("prompt must be a string, a list of strings or a list of token ids")
    first = value[0]
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in value):
            raise ValueError("prompt list must contain only strings")
        return text_prompt(first, tokenizer)
    if isinstance(first, list):
        if not all(isinstance(p, list) for p in value):
            raise ValueError("prompt list must contain only token id lists")
        return _token_id_prompt(first)
    return _token_id_prompt(value)


def _content_text(content: object, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"messages[{index}].content parts must be objects with a type")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"messages[{index}].content text parts need a string text")
                texts.append(text)
        return "\n".join(texts)
    raise ValueError(f"messages[{index}].content must be a string or a list of parts")


def prompt_from_messages(value: object, tokenizer: Tokenizer = "chars") -> Prompt:
    """The ``messages`` of /v1/chat/completions rendered as lines ``role: content``."""
    if not isinstance(value, list) or not value:
        raise ValueError("messages must be a non-empty list")
    lines: list[str] = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{index}].role must be a string")
        lines.append(f"{role}: {_content_text(message.get('content'), index)}")
    return text_prompt("\n".join(lines), tokenizer)


class OutputText:
    """The deterministic answer to one prompt; words are computed on demand."""

    __slots__ = ("_seed",)

    def __init__(self, prompt_text: str) -> None:
        # Hash the (possibly long) prompt once; each word then hashes only 16 bytes + indices.
        self._seed = hashlib.blake2b(prompt_text.encode(), digest_size=16).digest()

    def word(self, choice: int, index: int) -> str:
        digest = hashlib.blake2b(self._seed + f":{choice}:{index}".encode(), digest_size=8).digest()
        return VOCABULARY[int.from_bytes(digest, "big") % len(VOCABULARY)]

    def text(self, choice: int, count: int) -> str:
        return "".join(self.word(choice, i) for i in range(count))
