"""Replaying a trace in the Mooncake format (FAST'25; kvcache-ai/Mooncake, its
``FAST25-release/traces``).

One JSON object a line: ``timestamp`` (ms since the first request), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (one id per 512-token block of the prompt; two requests
that share leading ids share that prefix). Each id becomes a segment of text of its own
(``bench.sim.texts``): 512 true tokens, its characters drawn per id, the prompt's last block
partial (the tokens left of ``input_length``), so the sidecars' text hashing sees the trace's
sharing. The trace is never copied into the project: the benchmark takes its path.

Requests that share a timestamp are spread evenly up to the next distinct timestamp (the
trace's timestamps are coarse: Mooncake's conversation trace has 12,031 requests at 1,180
distinct timestamps about 3 s apart, up to 28 at one; replayed at once, each group would be a
burst at every rate); the last group over the trace's mean interval between timestamps. Gaps are
then scaled so that the trace's mean rate is 1 request/s: at rate ``r`` the replay runs ``r``
requests/s on average, keeping the trace's shape at the scale of its timestamps.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.sim.scenario import Scenario
from bench.sim.texts import Segment, chars_per_token
from bench.sim.workload import Shape

BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake traces."""


@functools.lru_cache(maxsize=2)
def _records(path: str) -> tuple[tuple[float, int, int, tuple[int, ...]], ...]:
    records = []
    with Path(path).open() as lines:
        for line in lines:
            if line.strip():
                item = json.loads(line)
                records.append(
                    (
                        float(item["timestamp"]) / 1000.0,
                        int(item["input_length"]),
                        int(item["output_length"]),
                        tuple(int(i) for i in item["hash_ids"]),
                    )
                )
    if len(records) < 2:
        raise ValueError(f"{path}: a trace needs at least two requests")
    return tuple(records)


def mooncake(path: str, scenario: Scenario, seed: int) -> list[Shape]:
    """The trace's requests as shapes, in order. The seed draws the characters per token of
    each block's text; with ``Scenario.trace_windows`` it also picks where in the trace the
    replay starts (it wraps round to the beginning, one mean gap after the end) and the phase of
    each timestamp's spread (below); otherwise every seed replays the same requests at the same
    times."""
    return _shapes(
        path,
        seed,
        scenario.chars_per_token_median,
        scenario.chars_per_token_sigma,
        scenario.trace_windows,
    )


def spread(times: Sequence[float], phases: Sequence[float] = ()) -> list[float]:
    """Arrival times with the requests of one timestamp spread evenly up to the next one (the
    last group over the mean interval between distinct timestamps); ``times`` is sorted.
    ``phases``: per distinct timestamp, a fraction of the spacing the whole group is shifted by
    (the spacing stays even, the requests distinct); none: 0."""
    distinct = sorted(set(times))
    if len(distinct) < 2:
        return list(times)
    last_interval = (distinct[-1] - distinct[0]) / (len(distinct) - 1)
    following = dict(zip(distinct, [*distinct[1:], distinct[-1] + last_interval], strict=True))
    arrivals: list[float] = []
    start = 0
    group = 0
    while start < len(times):
        at = times[start]
        end = start
        while end < len(times) and times[end] == at:
            end += 1
        step = (following[at] - at) / (end - start)
        phase = phases[group] if phases else 0.0
        arrivals.extend(at + (i + phase) * step for i in range(end - start))
        start = end
        group += 1
    return arrivals


@functools.lru_cache(maxsize=2)
def _shapes(path: str, seed: int, median: float, sigma: float, windows: bool) -> list[Shape]:
    """Built once per process and seed: a goodput search replays them at every rate."""
    records = _records(path)
    times = [record[0] for record in records]
    rng = random.Random(f"trace-window-{seed}")
    phases = [rng.random() for _ in range(len(set(times)))] if windows else []
    arrivals = spread(times, phases)
    span = arrivals[-1] - arrivals[0]
    scale = (len(records) - 1) / span if span > 0 else 1.0
    shapes = []
    previous = arrivals[0] - 1 / scale  # the first request's gap: the mean (when wrapped to)
    ratios: dict[int, float] = {}  # a block's characters per token, drawn once per id
    for at, (_, tokens, output, ids) in zip(arrivals, records, strict=True):
        segments = []
        left = tokens
        for i, key in enumerate(ids):
            block = BLOCK_TOKENS if i < len(ids) - 1 else max(1, left)
            left -= block
            ratio = ratios.get(key)
            if ratio is None:
                ratio = ratios[key] = chars_per_token(key, seed, median, sigma)
            # A partial block is a prefix of the full block's text (same key, fewer characters).
            segments.append(Segment(key, block, max(1, round(block * ratio))))
        true_tokens = sum(segment.tokens for segment in segments)
        shapes.append(
            Shape(
                "trace",
                true_tokens,
                0,
                max(1, output),
                None,
                (at - previous) * scale,
                prompt_chars=sum(segment.chars for segment in segments),
                segments=tuple(segments),
            )
        )
        previous = at
    start = rng.randrange(len(shapes)) if windows else 0
    shapes = shapes[start:] + shapes[:start]
    shapes[0] = replace(shapes[0], gap=0.0)
    return shapes
