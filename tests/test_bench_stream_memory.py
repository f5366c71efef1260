"""The stream-memory benchmark's pure part: RSS per additional stream, as a slope through the
steps. The benchmark itself runs real processes (``python -m bench stream_memory``)."""

from __future__ import annotations

import pytest

from bench.stream_memory import slope


def test_rss_per_stream_is_the_slope_through_the_steps_with_streams() -> None:
    mib = 1 << 20
    # 50 MiB of imports, then 30 KiB a stream; the first step (0 streams) is left out.
    readings = [(0, 50 * mib), (250, 50 * mib + 250 * 30 * 1024), (500, 50 * mib + 500 * 30 * 1024)]
    readings += [(1000, 50 * mib + 1000 * 30 * 1024)]
    assert slope(readings) == pytest.approx(30 * 1024)
    assert slope([(0, 50 * mib), (500, 50 * mib + 500 * 1024)]) == pytest.approx(1024)
