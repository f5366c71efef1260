"""Prompt size and prefix identity from a request body, without a tokenizer.

Tokens are estimated as characters / 4, as llm-d's decider does (chat: the JSON of the messages).
The prefix index remembers chained hashes of fixed-size character blocks of prompts sent to the
local decode engine (one index per data-parallel rank), so a conversation continuing on this pod
is recognized as cached, on the rank that holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, overload

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


class LazyHashes(Sequence[K]):
    """A prompt's chained block hashes, each computed once and only when first read.

    A look-up (``leading_blocks``) stops at its first miss, so a decision hashes a prompt no
    further than its longest indexed prefix (one block for a prompt seen nowhere); the rest is
    computed when the placement is recorded (``all``), off the decision's latency. Block *i*'s
    hash chains blocks 0..i, so the blocks are computed in order, from the last one reached:
    the same values as hashing the whole prompt at once. ``len`` is the number of full blocks.
    """

    __slots__ = ("_done", "_total")

    def __init__(self, total: int) -> None:
        self._done: list[K] = []
        self._total = total

    def _extend(self, count: int) -> None:
        """Compute the hashes up to block ``count`` (excluded), after those done."""
        raise NotImplementedError

    def all(self) -> list[K]:
        """Every block's hash (the list this holds: not to be changed)."""
        if len(self._done) < self._total:
            self._extend(self._total)
        return self._done

    def __len__(self) -> int:
        return self._total

    @overload
    def __getitem__(self, index: int) -> K: ...
    @overload
    def __getitem__(self, index: slice) -> list[K]: ...
    def __getitem__(self, index: int | slice) -> K | list[K]:
        if isinstance(index, slice):
            return self.all()[index]
        if index < 0:
            index += self._total
        if not 0 <= index < self._total:
            raise IndexError(index)
        if index >= len(self._done):
            self._extend(index + 1)
        return self._done[index]

    def __iter__(self) -> Iterator[K]:
        if len(self._done) == self._total:
            return iter(self._done)
        return self._reading()

    def leading(self, blocks: Container[K]) -> int:
        """``leading_blocks`` of an LRU: hashed as far as the first miss (no iterator)."""
        done, total = self._done, self._total
        matched = 0
        for digest in done:
            if digest not in blocks:
                return matched
            matched += 1
        while matched < total:
            self._extend(matched + 1)
            if done[matched] not in blocks:
                return matched
            matched += 1
        return matched

    def _reading(self) -> Iterator[K]:
        done, total = self._done, self._total
        i = 0
        while i < total:
            if i == len(done):
                self._extend(i + 1)
            yield done[i]
            i += 1


class TextBlocks(LazyHashes[int]):
    """The local index's hashes of a text (``PrefixIndex.blocks``): Python's ``hash`` of each
    block's slice, chained to the previous block's through a tuple."""

    __slots__ = ("_chained", "_size", "_text")

    def __init__(self, text: str | bytes, size: int, total: int) -> None:
        super().__init__(total)
        self._text = text
        self._size = size
        self._chained = 0

    def _extend(self, count: int) -> None:
        done, text, size, chained = self._done, self._text, self._size, self._chained
        append = done.append
        for start in range(len(done) * size, count * size, size):
            chained = hash((chained, text[start : start + size]))
            append(chained)
        self._chained = chained


def leading_blocks(blocks: Mapping[K, None], hashes: Iterable[K]) -> int:
    """How many of ``hashes``, from the first, an LRU of chained block hashes holds: the blocks
    of the longest indexed prefix (a look-up only)."""
    if isinstance(hashes, LazyHashes):
        return hashes.leading(blocks)
    matched = 0
    for digest in hashes:
        if digest not in blocks:
            break
        matched += 1
    return matched


def touch_blocks(blocks: OrderedDict[K, None], hashes: Iterable[K], capacity: int) -> None:
    """Make ``hashes`` the most recent blocks of an LRU, then drop the oldest beyond
    ``capacity``."""
    if isinstance(hashes, LazyHashes):  # every block is read: computed in one loop
        hashes = hashes.all()
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
        return self.blocks(text).all()

    def blocks(self, text: str | bytes) -> TextBlocks:
        """``hashes`` of ``text``, computed as far as they are read (``LazyHashes``)."""
        size = self._block_chars
        return TextBlocks(text, size, min(len(text), MAX_HASHED_BLOCKS * size) // size)

    def cached_tokens(self, hashes: Sequence[Hashable]) -> int:
        """Tokens of the longest indexed prefix of a prompt with these ``hashes``; a look-up
        only (recency changes when the prompt is ``insert``ed where it goes)."""
        return leading_blocks(self._blocks, hashes) * self._block_tokens

    def insert(self, hashes: Sequence[Hashable]) -> None:
        """Remember a prompt sent to this engine: its blocks are the most recent ones."""
        touch_blocks(self._blocks, hashes, self._capacity)
