"""Request streams: the same seeded sequence of request shapes at every rate (common random
numbers), so attainment falls smoothly as the rate rises and policies see identical traffic.

Every prompt has a true token count (what the engines compute) and a length in characters
(what a sidecar estimates from: characters / 4). Characters per true token are drawn per prompt
(per conversation for a multi-turn one) from a log-normal distribution; docs/scheduling.md has
the model and where its parameters come from.
"""

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
    """True tokens: what an engine computes."""
    cached_tokens: int
    """True tokens already in the home decode engine's prefix cache (a conversation's history)."""
    output_tokens: int
    home: int | None
    """The decode engine holding the history (multi-turn), or the one a trace assigns; else
    None: the gateway picks."""
    gap: float
    """Inter-arrival time at rate 1 request/s (divide by the rate)."""
    prompt_chars: int = 0
    """Characters of the prompt's text: what the sidecar's estimate (characters / 4) sees."""
    indexed_chars: int = 0
    """Characters of this prompt's prefix that the home sidecar's prefix index holds: the
    previous turn's prompt (its answer is cached on the engine but was never hashed)."""
    conversation: int = -1


def shapes(scenario: Scenario, seed: int) -> Iterator[Shape]:
    rng = random.Random(f"workload-{seed}")
    text = random.Random(f"text-{seed}")
    gamma_shape = 1.0 / (scenario.burst_cv**2)
    mu = math.log(scenario.chat_median_tokens)
    ratio_mu = math.log(scenario.chars_per_token_median)
    conversation = 0

    def chars(tokens: int, ratio: float) -> int:
        return max(1, round(tokens * ratio))

    while True:
        if scenario.bursty:
            gap = rng.gammavariate(gamma_shape, 1.0 / gamma_shape)
        else:
            gap = rng.expovariate(1.0)
        draw = rng.random()
        # At least 2 (a one-letter word and a space): bench/calibrate.py writes such text.
        ratio = max(2.0, text.lognormvariate(ratio_mu, scenario.chars_per_token_sigma))
        if draw < scenario.chat_share:
            tokens = round(rng.lognormvariate(mu, scenario.chat_sigma))
            tokens = max(1, min(scenario.chat_max_tokens, tokens))
            yield Shape(
                "chat",
                tokens,
                0,
                scenario.chat_output_tokens,
                None,
                gap,
                prompt_chars=chars(tokens, ratio),
            )
        elif draw < scenario.chat_share + scenario.rag_share:
            tokens = rng.randint(*scenario.rag_tokens)
            yield Shape(
                "rag",
                tokens,
                0,
                scenario.rag_output_tokens,
                None,
                gap,
                prompt_chars=chars(tokens, ratio),
            )
        else:
            history = rng.randint(*scenario.multi_history_tokens)
            home = rng.randrange(scenario.decode_engines)
            tokens = history + scenario.multi_new_tokens
            # The history ends with the previous answer (as long as this turn's): cached on the
            # engine, which keeps generated tokens' KV, but not in the sidecar's prefix index.
            previous_prompt = max(0, history - scenario.multi_output_tokens)
            conversation += 1
            yield Shape(
                "multi",
                tokens,
                history,
                scenario.multi_output_tokens,
                home,
                gap,
                prompt_chars=chars(tokens, ratio),
                indexed_chars=chars(previous_prompt, ratio) if previous_prompt else 0,
                conversation=conversation,
            )
