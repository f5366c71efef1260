"""The exact prefix source in the simulator: each prefill engine publishes what its
prefix cache stores and evicts as vLLM's KV events, and the sidecars read the exact cached tokens
per candidate from production's ``KVIndex`` fed with them, a configurable lag behind.

- ``EventedCache``: a prefill engine's ``PrefixCache`` that publishes a ``BlockStored`` for the
  engine blocks of every segment it stores, a ``BlockRemoved`` for those of every segment it
  evicts and ``AllBlocksCleared`` when the engine restarts (``clear``). The cache is still kept
  per segment (``bench.sim.caches``); block *b* (tokens ``16b`` to ``16b + 15`` of the prompt) is
  held exactly when the segment holding its last token is, which is what the cache's hit
  (leading held segments, rounded down to whole blocks) counts: the index, applied with no lag,
  predicts exactly the engine's hit (``tests/scheduling/test_sim_exact.py``).
- Token ids: a segment's are derived from its key and its length (``segment_ids``), so two
  prompts share a block's ids exactly when they share the segments up to it, as the cache's
  chained keys do. (A partial last segment is not a prefix of the full one here, unlike its
  text: the cache does not count it as one either.)
- ``ExactSource``: one ``KVIndex`` per prefill engine; a published batch is applied ``lag_s``
  later. Every sidecar reads the same index: each subscribes to every engine itself and sees the
  same events after the same lag (docs/kv-events.md, "Several sidecars").
- ``ExactLookup``: what the planner's ``exact`` argument is in production
  (``placement.ExactCache``: an engine's key → the prompt's tokens its KV events say it holds):
  ``begin(prompt)`` before a decision names the prompt, and a call returns the engine's hit in
  the decision's token units (``prompt.scale``: estimated tokens per true token, so the exact
  variant differs from the approximate one by the index alone). The approximate index stays on
  beside it, as in production: it gives the prompt's prefix hashes (its affinity anchor), learns
  the placements and the answers, and answers for an engine whose events are not in sync.
"""

from __future__ import annotations

import functools
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.sim.caches import PrefixCache, chain
from bench.sim.texts import Segment
from sidecar.kvevents.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from sidecar.kvevents.index import MAX_BLOCKS_LIMIT, KVIndex, PromptKeys

if TYPE_CHECKING:
    from bench.sim.engines import Loop

_SEGMENT_SPAN = 8192
"""Token ids one segment may take (a segment is at most 8,000 tokens in every workload)."""
_SPANS = (1 << 32) // _SEGMENT_SPAN
_HASH_MASK = (1 << 64) - 1

Publish = Callable[[list[KVEvent]], None]


def segment_ids(segment: Segment) -> array[int]:
    """The token ids of a segment: a run of ``segment.tokens`` consecutive ids from a start its
    key and length pick among 2¹⁹ (two different segments rarely share one; when they do, only
    the blocks after the same parent would collide)."""
    return _ids(segment.key, segment.tokens)


@functools.lru_cache(maxsize=16384)
def _ids(key: int, tokens: int) -> array[int]:
    """Made once per segment (a trace's prompts repeat their conversations' segments); the
    callers only read it."""
    if tokens > _SEGMENT_SPAN:
        raise ValueError(f"a segment of {tokens} tokens (at most {_SEGMENT_SPAN})")
    start = (hash((key, tokens)) % _SPANS) * _SEGMENT_SPAN
    return array("I", range(start, start + tokens))


def prompt_ids(segments: Sequence[Segment]) -> array[int]:
    ids: array[int] = array("I")
    for segment in segments:
        ids.extend(segment_ids(segment))
    return ids


def _block_hash(owner: int, block: int) -> int:
    """The engine's hash of block ``block``, whose last token is in the segment of chained key
    ``owner`` (its contents are that segment's and those before it)."""
    return hash((owner, block)) & _HASH_MASK


class EventedCache(PrefixCache):
    """A prefill engine's prefix cache that publishes its changes as KV events (``publish``:
    None until something subscribes)."""

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        super().__init__(capacity_tokens, block_tokens)
        self.publish: Publish | None = None
        self._blocks: dict[int, range] = {}
        """A held segment's chained key → the engine blocks whose last token is in it."""

    def store(self, segments: Sequence[Segment]) -> None:
        publish = self.publish
        if publish is None:
            super().store(segments)
            return
        held = self._held
        keys = chain(segments)
        new = [i for i, key in enumerate(keys) if key not in held]
        super().store(segments)
        events: list[KVEvent] = []
        if new:
            events.extend(self._stored(segments, keys, new))
        gone = [key for key in self._blocks if key not in held]
        if gone:
            removed: list[int] = []
            for key in gone:
                removed.extend(_block_hash(key, b) for b in self._blocks.pop(key))
            if removed:
                events.append(BlockRemoved(tuple(removed), MEDIUM_GPU))
        if events:
            publish(events)

    def _stored(
        self, segments: Sequence[Segment], keys: list[int], new: list[int]
    ) -> list[BlockStored]:
        """One ``BlockStored`` per new segment that owns a whole block, in prompt order, chained
        after the block before it."""
        size = self.block_tokens
        ends: list[int] = []
        end = 0
        for segment in segments:
            end += segment.tokens
            ends.append(end)
        owners: list[int] = []  # block -> its owner segment's index
        start = 0
        for i, end in enumerate(ends):
            owners.extend([i] * (end // size - start // size))
            start = end
        ids: array[int] | None = None
        stored: list[BlockStored] = []
        for i in new:
            begin = (ends[i] - segments[i].tokens) // size
            blocks = range(begin, ends[i] // size)
            # Recorded even if evicted at once (a prompt over capacity): removed below.
            self._blocks[keys[i]] = blocks
            if not blocks:
                continue
            if ids is None:
                ids = prompt_ids(segments)
            parent = None if begin == 0 else _block_hash(keys[owners[begin - 1]], begin - 1)
            stored.append(
                BlockStored(
                    tuple(_block_hash(keys[i], b) for b in blocks),
                    parent,
                    tuple(ids[begin * size : blocks.stop * size]),
                    size,
                    MEDIUM_GPU,
                )
            )
        return stored

    def clear(self) -> None:
        """The engine restarted: its prefix cache is empty (vLLM publishes ``AllBlocksCleared``
        on a reset of its prefix cache; a restarted publisher's subscribers reset too)."""
        self._held.clear()
        self.used_tokens = 0
        self._blocks.clear()
        if self.publish is not None:
            self.publish([AllBlocksCleared()])


class ExactSource:
    """Every prefill engine's exact index, fed by its events ``lag_s`` after they happen."""

    def __init__(self, loop: Loop, lag_s: float, *, clears: bool = True) -> None:
        """``clears``: an ``AllBlocksCleared`` empties the engine's index (production's
        ``KVIndex``); False: it is ignored, as llm-d-kv-cache v0.8.0 does (only logged)."""
        self.loop = loop
        self.lag_s = lag_s
        self.clears = clears
        self.indexes: dict[str, KVIndex] = {}
        self.batches = 0
        """Batches published (one per store, eviction or restart)."""
        self.events = 0
        """Blocks stored or removed (one event each), and clears."""
        self.stored_tokens = 0
        """Token ids carried by the stores (what the wire carries most of)."""
        self.observer: Callable[[str, EventBatch], None] | None = None
        """Called with every batch as it is published (``bench.sim.kvshare`` measures them)."""
        self._seq: dict[str, int] = {}
        self.in_flight: dict[str, Counter[int]] = {}
        """What-if (``Scenario.kv_in_flight``): per engine, the chained segment keys of the
        prompts placed there whose events have not arrived yet."""

    def placed(self, key: str, chained: Sequence[int]) -> None:
        """A prompt (its segments' chained keys) was sent to engine ``key``."""
        self.in_flight.setdefault(key, Counter()).update(chained)

    def arrived(self, key: str, chained: Sequence[int]) -> None:
        """Its prefill's events have reached the indexes: the index answers for it now."""
        flight = self.in_flight[key]
        flight.subtract(chained)
        for chained_key in chained:
            if flight[chained_key] <= 0:
                del flight[chained_key]

    def in_flight_tokens(self, key: str, chained: Sequence[int], tokens: Sequence[int]) -> int:
        """The prompt's leading segments in flight to engine ``key``, in true tokens."""
        flight = self.in_flight.get(key)
        held = 0
        if flight:
            for chained_key, count in zip(chained, tokens, strict=True):
                if chained_key not in flight:
                    break
                held += count
        return held

    def subscribe(self, key: str, cache: EventedCache) -> None:
        self.indexes[key] = KVIndex(max_blocks=MAX_BLOCKS_LIMIT)
        self._seq[key] = 0
        cache.publish = lambda events: self._publish(key, events)

    def _publish(self, key: str, events: list[KVEvent]) -> None:
        self._seq[key] += 1
        self.batches += 1
        for event in events:
            if isinstance(event, BlockStored):
                self.events += len(event.block_hashes)
                self.stored_tokens += len(event.token_ids)
            elif isinstance(event, BlockRemoved):
                self.events += len(event.block_hashes)
            else:
                self.events += 1
        kept = events if self.clears else [e for e in events if not isinstance(e, AllBlocksCleared)]
        batch = EventBatch(self._seq[key], self.loop.now, tuple(kept))
        if self.observer is not None:
            self.observer(key, batch)
        index = self.indexes[key]
        if self.lag_s <= 0:
            index.apply(batch)
        else:
            self.loop.at(self.loop.now + self.lag_s, index.apply, batch)

    def leading_blocks(self, key: str, keys: PromptKeys, block_tokens: int) -> int:
        """Engine ``key``'s run of the prompt's leading full blocks of ``block_tokens`` that its
        index holds on GPU (what an event-fed router such as llm-d's precise scorer reads)."""
        index = self.indexes.get(key)
        if index is None:
            return 0
        return index.lookup(keys).gpu // block_tokens


@dataclass(slots=True)
class ExactPrompt:
    """A request as the exact indexes see it: its keys (computed once, shared by every
    engine's look-up) and the decision's tokens per true token."""

    keys: PromptKeys
    scale: float
    chained: Sequence[int] = ()
    """Its segments' chained keys and their tokens (``Scenario.kv_in_flight``)."""
    tokens: Sequence[int] = ()


class ExactLookup:
    """Each prefill engine's cached tokens of the prompt being decided, from its exact index
    (production's ``PromptLookup`` as ``Planner.decide``'s ``exact``): in the decision's tokens.
    The simulated subscriptions never drop, so every engine's index is in sync."""

    def __init__(self, source: ExactSource) -> None:
        self.source = source
        self.prompt: ExactPrompt | None = None

    def begin(self, prompt: ExactPrompt) -> None:
        """The next decision is for ``prompt`` (the simulator decides one request at a time)."""
        self.prompt = prompt

    def __call__(self, key: str) -> int | None:
        index = self.source.indexes.get(key)
        prompt = self.prompt
        if index is None or prompt is None:
            return None
        held = index.lookup(prompt.keys).gpu
        if prompt.chained:
            # What-if: the prompts placed on the engine and not reported yet count as held.
            flight = self.source.in_flight_tokens(key, prompt.chained, prompt.tokens)
            held = max(held, flight - flight % 16)
        return int(held * prompt.scale)
