"""Summary statistics of measured or simulated samples."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``q`` % of the values at or
    below it (``q`` in 0..100; 0 gives the minimum, 100 the maximum); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in 0..100")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
