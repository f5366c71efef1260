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
from bench.sim.texts import Segment, chars_per_token

Kind = Literal["chat", "rag", "multi", "system", "trace"]


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
    segments: tuple[Segment, ...] = ()
    """The prompt's text as segments (``bench.sim.texts``) when it shares prefixes with other
    prompts (system prompts, a trace's hash ids); empty: text unique to this prompt."""


def shapes(scenario: Scenario, seed: int) -> Iterator[Shape]:
    """The scenario's request stream for ``seed``."""
    if scenario.workload == "system_prompts":
        return system_prompts(scenario, seed)
    if scenario.workload == "trace":
        if scenario.trace_path is None:
            raise ValueError(f"scenario {scenario.name} replays a trace: give its path")
        from bench.sim.traces import mooncake

        return iter(mooncake(scenario.trace_path, scenario, seed))
    return mixed(scenario, seed)


def mixed(scenario: Scenario, seed: int) -> Iterator[Shape]:
    """Chat, long RAG and multi-turn continuations (the first simulator's workload)."""
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


SYSTEM_KEYS = 1 << 40
"""Segment keys of system prompts start here; a user part's key is its request's index."""


def system_prompts(scenario: Scenario, seed: int) -> Iterator[Shape]:
    """The shared-system-prompt workload, its parameters fixed: ``system_prompts``
    (32) system prompts of ``system_tokens`` (2,000-8,000, uniform) true tokens, each request
    one of them chosen with Zipf popularity (``system_zipf_s``, 1.1: the k-th most popular
    drawn with weight k^-1.1) followed by a user part of its own (``system_user_tokens``,
    50-500) and answered with ``system_output_tokens`` (100-300); Poisson arrivals."""
    rng = random.Random(f"system-{seed}")
    median, sigma = scenario.chars_per_token_median, scenario.chars_per_token_sigma

    def segment(key: int, tokens: int) -> Segment:
        return Segment(
            key, tokens, max(1, round(tokens * chars_per_token(key, seed, median, sigma)))
        )

    prompts = [
        segment(SYSTEM_KEYS + k, rng.randint(*scenario.system_tokens))
        for k in range(scenario.system_prompts)
    ]
    weights = [(k + 1) ** -scenario.system_zipf_s for k in range(scenario.system_prompts)]
    index = 0
    while True:
        gap = rng.expovariate(1.0)
        system = rng.choices(prompts, weights)[0]
        user = segment(index, rng.randint(*scenario.system_user_tokens))
        output = rng.randint(*scenario.system_output_tokens)
        index += 1
        yield Shape(
            "system",
            system.tokens + user.tokens,
            0,
            output,
            None,
            gap,
            prompt_chars=system.chars + user.chars,
            segments=(system, user),
        )
