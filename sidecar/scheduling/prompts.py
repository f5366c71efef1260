"""Prompt size and prefix identity from a request body, without a tokenizer.

Tokens are estimated as characters / 4, as llm-d's decider does (chat: the JSON of the messages).
The prefix index remembers chained hashes of fixed-size character blocks of prompts sent to the
local decode engine (one index per data-parallel rank), so a conversation continuing on this pod
is recognized as cached, on the rank that holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import orjson

CHARS_PER_TOKEN = 4
INDEX_BYTES_PER_BLOCK = 350
"""Resident memory one block of the local prefix index costs, as ``bench/soak.py`` measured it
(docs/configuration.md): what it takes of ``SIDECAR_PREFIX_INDEX_MEMORY_MIB``."""
MAX_HASHED_BLOCKS = 8192
"""Prefix blocks hashed per prompt (131,072 tokens at 16 per block): bounds the work a huge
prompt costs on the event loop; a longer prompt counts as uncached beyond it."""


def prompt_text(body: dict[str, Any]) -> str | bytes:
    """The part of a generation request that the engine prefills, as text or canonical bytes."""
    messages = body.get("messages")
    if messages is not None:
        return _exact(orjson.dumps(messages))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return str(prompt[0])
    return _exact(orjson.dumps(prompt)) if prompt is not None else ""


def _exact(dumped: bytes) -> bytes:
    """``dumped`` in a buffer of its own size. orjson hands back its whole growth buffer (4 KiB
    for a 267-byte chat prompt, 64 KiB for an 8 KB one), and the text is held as long as its
    stream (``RankClaim``): a copy saves ~2 KiB per stream at 64-token prompts and ~7 KiB at
    2,000 tokens (bench/stream_memory.py, docs/benchmarks.md)."""
    return bytes(memoryview(dumped))


def estimate_tokens(body: dict[str, Any], text: str | bytes | None = None) -> int:
    """Prompt tokens: counted exactly for token-id prompts, else characters / 4 (at least 1).
    ``text``: ``prompt_text(body)``, when the caller has it already."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return len(prompt[0])
    return tokens_of_text(len(prompt_text(body) if text is None else text))


def tokens_of_text(characters: int) -> int:
    """The estimate for a text of ``characters``: characters / 4, at least 1."""
    return max(1, characters // CHARS_PER_TOKEN)


K = TypeVar("K", bound=Hashable)
"""A block hash: Python's ``int`` in the local index, a keyed digest in the prefill index."""


def leading_blocks(blocks: Mapping[K, None], hashes: Iterable[K]) -> int:
    """How many of ``hashes``, from the first, an LRU of chained block hashes holds: the blocks
    of the longest indexed prefix (a look-up only)."""
    matched = 0
    for digest in hashes:
        if digest not in blocks:
            break
        matched += 1
    return matched


def touch_blocks(blocks: OrderedDict[K, None], hashes: Iterable[K], capacity: int) -> None:
    """Make ``hashes`` the most recent blocks of an LRU, then drop the oldest beyond
    ``capacity``."""
    move = blocks.move_to_end
    for digest in hashes:
        if digest in blocks:
            move(digest)
        else:
            blocks[digest] = None
    # One count, not a length check per evicted block.
    excess = min(len(blocks), len(blocks) - capacity)
    if excess > 0:
        pop = blocks.popitem
        for _ in range(excess):
            pop(False)


class PrefixIndex:
    """A bounded LRU of block hashes: an estimate of what one engine (rank) has cached.

    A block is ``block_tokens * 4`` characters (bytes, for a chat's JSON); block *i*'s hash
    covers blocks 0..i, so a match is always a prefix. Only full blocks count, like an engine's
    prefix cache.

    The hashes never leave the process (the shared state backends carry reservations, speeds
    and ejections only), so they are Python's own 64-bit ``hash``: a block's is SipHash of its
    text under the process's random key, chained to the previous one through a tuple's hash —
    no byte string built per block, ~10× cheaper than the BLAKE2b chain it replaced. Two
    prefixes share a chained hash with a chance of ~2⁻⁶⁴; with the index full (65,536 blocks),
    a look-up matches a block it should not about once in 10¹⁴, and a wrong match only misjudges
    what an engine has cached (a placement, never an answer). Keys are anything hashable (the
    simulator's stand-ins are bytes).
    """

    def __init__(self, *, block_tokens: int, capacity_blocks: int) -> None:
        self._block_chars = block_tokens * CHARS_PER_TOKEN
        self._block_tokens = block_tokens
        self._configured = capacity_blocks
        self._capacity = capacity_blocks
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def block_tokens(self) -> int:
        return self._block_tokens

    def engine_holds(self, tokens: int) -> None:
        """The engine's KV cache holds ``tokens`` (its scrape): the index keeps no more blocks
        than that, nor than it was configured with."""
        self._capacity = min(self._configured, tokens // self._block_tokens)
        touch_blocks(self._blocks, (), self._capacity)

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()

    def hashes(self, text: str | bytes) -> list[int]:
        """The chained hashes of ``text``'s full blocks (computed once per request, then looked
        up in every rank's index)."""
        size = self._block_chars
        end = min(len(text), MAX_HASHED_BLOCKS * size)
        hashes: list[int] = []
        append = hashes.append
        chained = 0
        for start in range(0, end - size + 1, size):
            chained = hash((chained, text[start : start + size]))
            append(chained)
        return hashes

    def cached_tokens(self, hashes: Sequence[Hashable]) -> int:
        """Tokens of the longest indexed prefix of a prompt with these ``hashes``; a look-up
        only (recency changes when the prompt is ``insert``ed where it goes)."""
        return leading_blocks(self._blocks, hashes) * self._block_tokens

    def insert(self, hashes: Sequence[Hashable]) -> None:
        """Remember a prompt sent to this engine: its blocks are the most recent ones."""
        touch_blocks(self._blocks, hashes, self._capacity)
