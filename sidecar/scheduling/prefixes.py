"""What each prefill endpoint holds in its prefix cache, approximately: the prompts this fleet sent
there, aged out in LRU order against the endpoint's capacity, corrected by what it reports.

A prompt is cut into blocks of ``block_tokens × 4`` bytes of its text (UTF-8; the chat's messages
as JSON), the sidecar's token estimate (``prompts.CHARS_PER_TOKEN``). Block *i*'s hash is the
keyed BLAKE2b digest of bytes 0..end of block *i* (the running state of one hash over the
prompt), so equal hashes mean equal prefixes, and it is the same in every process that holds the
same key: sidecars share these hashes through the state backend. The key is a secret
(``SIDECAR_PREFIX_HASH_KEY``, from a Kubernetes Secret): whoever reads Redis sees digests they
cannot recompute, so cannot confirm a guessed prompt. Without a key each process draws its own
(the index then stays private to the sidecar).

``PrefillPrefixes`` keeps, per endpoint, an LRU of the block hashes placed there (by this sidecar,
or learnt from the others'), bounded by the endpoint's capacity in blocks (scraped from vLLM's
``vllm:cache_config_info``, else a setting) and, all endpoints together, by ``max_blocks``
(the memory bound). A look-up is the longest indexed prefix; ``trust`` weighs it in the decision.

Feedback: a prefill answer that reports ``usage.prompt_tokens_details.cached_tokens`` (vLLM with
``--enable-prompt-tokens-details``) is compared with the prediction, both as fractions of the
prompt (tokens are estimated from text here, the engine counts real ones), and the error kept.
When the endpoint held clearly less than predicted (below half, and short by more than a
block), its cache evicted what the index thought it kept:
the endpoint's capacity as the index runs it shrinks (to 90 % of the blocks it holds, never below
``MIN_BLOCKS``) and its oldest blocks go; every answer that held what was predicted lets it grow
back by that prompt's blocks, up to the endpoint's capacity. An endpoint whose answers carry no
details leaves the index open-loop for it (``describe`` says so).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.scheduling.prompts import (
    CHARS_PER_TOKEN,
    INDEX_BYTES_PER_BLOCK,
    LazyHashes,
    leading_blocks,
    touch_blocks,
)

DIGEST_BYTES = 8
"""Bytes of a block hash: two prefixes share one with a chance of ~2⁻⁶⁴."""
BYTES_PER_BLOCK = 176
"""Memory one indexed block costs (its digest and its place in an ordered dict): 116 bytes
allocated (``tracemalloc``, which ``tests/scheduling/test_prefixes.py`` checks), 167 bytes of
resident memory filling 100,000 blocks: what ``max_blocks`` is derived from."""
MAX_PROMPT_BLOCKS = 4096
"""Blocks hashed per prompt (262,144 estimated tokens at 64 per block): bounds a huge prompt's
cost on the event loop and what one placement publishes; beyond it a prompt counts as uncached."""
HELD_LESS = 0.5
"""An answer whose cached tokens are below this share of the prediction (and short of it by more
than a block) counts as the endpoint having evicted what the index kept. In the simulator,
with any shortfall beyond a block counting, a system prompt denser in characters than its user
part made every answer look like an eviction and the indexes kept shrinking; at half, the
misses fell to about what no shrinking at all gives (docs/benchmarks.md)."""
MIN_BLOCKS = 16
"""The least capacity feedback can shrink an endpoint to."""
SHRINK = 0.9


def blocks_within(memory_bytes: int, local_blocks: int = 0) -> int:
    """How many blocks the prefill indexes may hold together so that they and the local prefix
    index of ``local_blocks`` (``SIDECAR_PREFIX_CACHE_BLOCKS``) stay within ``memory_bytes``."""
    left = memory_bytes - local_blocks * INDEX_BYTES_PER_BLOCK
    return max(MIN_BLOCKS, left // BYTES_PER_BLOCK)


class PrefixHasher:
    """Keyed, stable, chained block hashes of prompts (computed once per request, then looked up
    in every endpoint's index)."""

    def __init__(self, key: bytes | None, *, block_tokens: int) -> None:
        self._base = hashlib.blake2b(
            key=key if key else secrets.token_bytes(32), digest_size=DIGEST_BYTES
        )
        self.block_bytes = block_tokens * CHARS_PER_TOKEN
        self.block_tokens = block_tokens

    def hashes(self, text: str | bytes) -> tuple[bytes, ...]:
        return tuple(self.blocks(text).all())

    def blocks(self, text: str | bytes) -> DigestBlocks:
        """``hashes`` of ``text``, computed as far as they are read (``LazyHashes``)."""
        data = text.encode() if isinstance(text, str) else text
        size = self.block_bytes
        return DigestBlocks(
            self._base, data, size, min(len(data), MAX_PROMPT_BLOCKS * size) // size
        )


class DigestBlocks(LazyHashes[bytes]):
    """The prefill index's hashes of a prompt's bytes (``PrefixHasher.blocks``): the digests of
    one running keyed BLAKE2b, taken at the end of each block."""

    __slots__ = ("_data", "_running", "_size")

    def __init__(self, base: Any, data: bytes, size: int, total: int) -> None:
        super().__init__(total)
        self._data = data
        self._size = size
        self._running = base.copy()

    def _extend(self, count: int) -> None:
        done, data, size = self._done, self._data, self._size
        # ``digest()`` leaves the running state as it was (hashlib finalizes a copy): the next
        # block goes on from there, so no copy of the state per block.
        update, digest, append = self._running.update, self._running.digest, done.append
        for start in range(len(done) * size, count * size, size):
            update(data[start : start + size])
            append(digest())
        if len(done) == self._total:
            # Complete: the prompt's bytes (a copy, for a text prompt) and the hash state are
            # not kept as long as the placement that holds these digests.
            self._data, self._running = b"", None


@dataclass(frozen=True, slots=True)
class PrefixGuess:
    """What the index predicted for one prompt on the endpoint it was placed on: kept with the
    placement, to compare with what the endpoint reports."""

    hashes: Sequence[bytes]
    """The prompt's block hashes (``PrefixHasher.blocks``: complete once the placement is
    recorded)."""
    prompt_bytes: int
    """The prompt's length in the hasher's bytes (the base of the predicted fraction)."""
    matched_blocks: int


@dataclass(slots=True)
class _Server:
    capacity: int
    """Blocks the endpoint holds when full (scraped or configured)."""
    limit: int
    """Blocks this index keeps for it: the capacity, less what feedback took off."""
    blocks: OrderedDict[bytes, None]
    answers: int = 0
    """Prefill answers that said how many tokens were cached (feedback)."""
    blind: int = 0
    """Prefill answers without ``prompt_tokens_details``."""
    misses: int = 0
    """Answers that held less than predicted."""
    error_sum: float = 0.0
    abs_error_sum: float = 0.0


class PrefillPrefixes:
    def __init__(
        self,
        *,
        block_tokens: int,
        capacity_blocks: int,
        max_blocks: int,
        trust: float = 1.0,
    ) -> None:
        """``capacity_blocks``: an endpoint's capacity until a scrape says otherwise.
        ``max_blocks``: all endpoints' blocks together (``blocks_within`` the memory bound).
        ``trust``: the share of a predicted hit the decision counts."""
        self.block_tokens = block_tokens
        self.trust = trust
        self._default_capacity = max(MIN_BLOCKS, capacity_blocks)
        self.max_blocks = max_blocks
        self._servers: dict[str, _Server] = {}

    def __len__(self) -> int:
        return sum(len(server.blocks) for server in self._servers.values())

    def _server(self, key: str) -> _Server:
        server = self._servers.get(key)
        if server is None:
            capacity = self._default_capacity
            server = self._servers[key] = _Server(capacity, capacity, OrderedDict())
        return server

    def _share(self) -> int:
        """Blocks one endpoint may keep so that all of them stay within ``max_blocks``."""
        return max(MIN_BLOCKS, self.max_blocks // max(1, len(self._servers)))

    def matched_blocks(self, key: str, hashes: Sequence[bytes]) -> int:
        """Blocks of the longest indexed prefix of a prompt on ``key``: a look-up only."""
        server = self._servers.get(key)
        return 0 if server is None else leading_blocks(server.blocks, hashes)

    def predicted_tokens(self, matched_blocks: int) -> int:
        """Estimated tokens a match of ``matched_blocks`` counts for in the decision."""
        return int(self.trust * matched_blocks * self.block_tokens)

    def placed(self, key: str, hashes: Iterable[bytes]) -> None:
        """A prompt with these ``hashes`` was sent to ``key`` (by this sidecar or, learnt through
        the state backend, by another): the endpoint now holds them, most recent."""
        server = self._server(key)
        touch_blocks(server.blocks, hashes, min(server.limit, self._share()))

    def _trim(self, server: _Server) -> None:
        touch_blocks(server.blocks, (), min(server.limit, self._share()))

    def set_capacity(self, key: str, tokens: int) -> None:
        """The endpoint's cache holds ``tokens`` (its scrape): in this index's blocks."""
        server = self._server(key)
        capacity = max(MIN_BLOCKS, tokens // self.block_tokens)
        if capacity != server.capacity:
            shrunk = server.limit < server.capacity  # by feedback: kept, within the new capacity
            server.capacity = capacity
            server.limit = min(server.limit, capacity) if shrunk else capacity
            self._trim(server)

    def forget(self, key: str) -> None:
        """``key`` left the pool."""
        self._servers.pop(key, None)

    def answered(
        self, key: str, guess: PrefixGuess, prompt_tokens: int | None, cached_tokens: int | None
    ) -> float | None:
        """The prefill of ``guess``'s prompt on ``key`` answered: the engine counted
        ``prompt_tokens`` and found ``cached_tokens`` of them cached (None: it did not say).
        Returns the prediction's error in the engine's tokens (predicted − reported), None
        without feedback; shrinks the endpoint when it held less than predicted."""
        server = self._servers.get(key)
        if server is None:
            return None
        if cached_tokens is None or not prompt_tokens or guess.prompt_bytes <= 0:
            server.blind += 1
            return None
        block_bytes = self.block_tokens * CHARS_PER_TOKEN
        share = min(1.0, guess.matched_blocks * block_bytes / guess.prompt_bytes)
        predicted = share * prompt_tokens
        error = predicted - cached_tokens
        server.answers += 1
        server.error_sum += error
        server.abs_error_sum += abs(error)
        # One of this index's blocks, in the engine's tokens: the granularity of a prediction.
        block = prompt_tokens * block_bytes / guess.prompt_bytes
        # Held clearly less: not a prediction off by the text's characters per token (a
        # system prompt and a user part rarely have the same), but blocks the engine evicted.
        if error > block and cached_tokens < HELD_LESS * predicted:
            server.misses += 1
            server.limit = max(MIN_BLOCKS, math.floor(len(server.blocks) * SHRINK))
            self._trim(server)
        elif server.limit < server.capacity:
            server.limit = min(server.capacity, server.limit + len(guess.hashes))
        return error

    def feedback(self) -> str:
        """``closed`` (every endpoint that answered said what it had cached), ``open`` (none
        did: the index runs open-loop), ``partial``, or ``none`` (no answer yet)."""
        told = sum(1 for s in self._servers.values() if s.answers)
        blind = sum(1 for s in self._servers.values() if s.blind and not s.answers)
        if not told and not blind:
            return "none"
        if not blind:
            return "closed"
        return "open" if not told else "partial"

    def describe(self) -> dict[str, Any]:
        """For /debug/scheduler."""
        servers = {}
        for key, server in sorted(self._servers.items()):
            servers[key] = {
                "blocks": len(server.blocks),
                "capacity_blocks": server.capacity,
                "limit_blocks": min(server.limit, self._share()),
                "answers_with_cached_tokens": server.answers,
                "answers_without": server.blind,
                "held_less_than_predicted": server.misses,
                "mean_error_tokens": round(server.error_sum / server.answers, 1)
                if server.answers
                else None,
                "mean_abs_error_tokens": round(server.abs_error_sum / server.answers, 1)
                if server.answers
                else None,
            }
        return {
            "block_tokens": self.block_tokens,
            "trust": self.trust,
            "blocks": len(self),
            "max_blocks": self.max_blocks,
            "feedback": self.feedback(),
            "endpoints": servers,
        }
