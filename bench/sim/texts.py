"""Prompt text with prefix structure: a prompt is a run of segments, each a block of text that is
the same wherever the same segment appears (a shared system prompt, a Mooncake hash id's block).

A segment is its ``key`` (what identifies its content), its true tokens (what an engine computes)
and its characters (what a sidecar sees). Its text is derived from the key alone: a marker naming
the key, then characters of a fixed pseudo-random pool from an offset the key picks; a shorter
segment with the same key (a prompt's partial last block) is a prefix of the longer one's text.
So the sidecar's own text hashing (``sidecar.scheduling.prefixes.PrefixHasher``) sees exactly the
sharing the workload has, and no other: two different keys never share their first characters.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

_POOL_CHARS = 1 << 20
_POOL = "".join(
    random.Random("bench-sim-text").choices("abcdefghijklmnopqrstuvwxyz     ", k=_POOL_CHARS)
)
_STRIDE = 2_654_435_761  # Knuth's multiplicative hash: keys spread over the pool


@dataclass(frozen=True, slots=True)
class Segment:
    key: int
    tokens: int
    """True tokens."""
    chars: int
    """Characters of its text (at least the marker's)."""


def segment_text(segment: Segment) -> str:
    marker = f"<{segment.key:x}>"
    body = segment.chars - len(marker)
    if body <= 0:
        return marker[: segment.chars]
    start = (segment.key * _STRIDE) % (_POOL_CHARS // 2)
    parts = [marker]
    while body > 0:
        piece = _POOL[start : start + body]
        parts.append(piece)
        body -= len(piece)
        start = 0
    return "".join(parts)


def prompt_text(segments: Sequence[Segment]) -> str:
    return "".join(segment_text(segment) for segment in segments)


def chars_per_token(key: int, seed: int, median: float, sigma: float) -> float:
    """Characters per true token of one segment's text: log-normal (docs/scheduling.md), at
    least 2, the same for the key wherever it appears (an integer seed: seeding from a string
    hashes it with SHA-512, too slow for a trace's 180,000 blocks)."""
    draw = random.Random(key * 1_000_003 + seed).lognormvariate(math.log(median), sigma)
    return max(2.0, draw)
