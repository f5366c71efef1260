"""A modelled prefill engine's prefix cache: what it computed lately, evicted in LRU order.

Kept per segment of the prompt (``bench.sim.texts``), chained (a segment counts only after the
same segments before it, as vLLM's block hashes chain), weighed in true tokens against the
capacity. A hit is the leading run of held segments, rounded down to whole engine blocks and
short of the whole prompt by at least one token (vLLM computes the last token at least). A
prompt is stored when its prefill ends, last segment first, so its first segments are the most
recently used: vLLM frees a request's blocks tail first, so a prefix goes after its suffixes.
Prompts without segments (the chat / RAG / multi-turn workload: unique text) are neither found
nor stored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from bench.sim.texts import Segment


def chain(segments: Sequence[Segment]) -> list[int]:
    """Each segment's identity with everything before it."""
    keys = []
    previous = 0
    for segment in segments:
        previous = hash((previous, segment.key, segment.tokens))
        keys.append(previous)
    return keys


class PrefixCache:
    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.block_tokens = block_tokens
        self.used_tokens = 0
        self._held: OrderedDict[int, int] = OrderedDict()

    def cached_tokens(self, segments: Sequence[Segment], prompt_tokens: int) -> int:
        held = self._held
        tokens = 0
        for key, segment in zip(chain(segments), segments, strict=True):
            if key not in held:
                break
            tokens += segment.tokens
        tokens -= tokens % self.block_tokens
        return max(0, min(tokens, prompt_tokens - 1))

    def store(self, segments: Sequence[Segment]) -> None:
        held = self._held
        for key, segment in zip(reversed(chain(segments)), reversed(segments), strict=True):
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = segment.tokens
                self.used_tokens += segment.tokens
        while self.used_tokens > self.capacity_tokens and held:
            self.used_tokens -= held.popitem(last=False)[1]
