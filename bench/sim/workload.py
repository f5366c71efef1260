"""Request streams: the same seeded sequence of request shapes at every rate (common random
numbers), so attainment falls smoothly as the rate rises and policies see identical traffic."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from bench.sim.scenario import Scenario

Kind = Literal["chat", "rag", "multi"]


@dataclass(frozen=True, slots=True)
class Shape:
    kind: Kind
    prompt_tokens: int
    cached_tokens: int
    """Tokens already in the home decode engine's prefix cache (a conversation's history)."""
    output_tokens: int
    home: int | None
    """The decode engine holding the history (multi-turn), else None: the gateway picks."""
    gap: float
    """Inter-arrival time at rate 1 request/s (divide by the rate)."""


def shapes(scenario: Scenario, seed: int) -> Iterator[Shape]:
    rng = random.Random(f"workload-{seed}")
    gamma_shape = 1.0 / (scenario.burst_cv**2)
    mu = math.log(scenario.chat_median_tokens)
    while True:
        if scenario.bursty:
            gap = rng.gammavariate(gamma_shape, 1.0 / gamma_shape)
        else:
            gap = rng.expovariate(1.0)
        draw = rng.random()
        if draw < scenario.chat_share:
            tokens = round(rng.lognormvariate(mu, scenario.chat_sigma))
            tokens = max(1, min(scenario.chat_max_tokens, tokens))
            yield Shape("chat", tokens, 0, scenario.chat_output_tokens, None, gap)
        elif draw < scenario.chat_share + scenario.rag_share:
            tokens = rng.randint(*scenario.rag_tokens)
            yield Shape("rag", tokens, 0, scenario.rag_output_tokens, None, gap)
        else:
            history = rng.randint(*scenario.multi_history_tokens)
            home = rng.randrange(scenario.decode_engines)
            yield Shape(
                "multi",
                history + scenario.multi_new_tokens,
                history,
                scenario.multi_output_tokens,
                home,
                gap,
            )
