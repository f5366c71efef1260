"""The simulator's llm-d precise prefix-cache anchor: its scores on an index fed by KV events,
and the variant end to end."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from bench.sim.anchors import LLMD_PRECISE_BLOCK_TOKENS, LlmdPrecise, precise_scores
from bench.sim.engines import Loop
from bench.sim.exact import EventedCache, ExactSource, prompt_ids
from bench.sim.run import simulate
from bench.sim.scenario import LLMD, LLMD_PRECISE
from bench.sim.scenarios import SHARED_PROMPTS
from bench.sim.texts import Segment
from bench.simulate import parse_variant
from sidecar.kvevents.index import PromptKeys


def seg(key: int, tokens: int) -> Segment:
    return Segment(key, tokens, tokens * 4)


def test_precise_scores_absolute_and_min_max():
    leading = {"p0": 6, "p1": 3, "p2": 0}
    assert precise_scores(leading, 10) == {"p0": 0.6, "p1": 0.3, "p2": 0.0}
    assert precise_scores(leading, 0) == {"p0": 0.0, "p1": 0.0, "p2": 0.0}
    assert precise_scores({"p0": 12}, 10) == {"p0": 1.0}
    # v0.6.0-v0.8.0: min-max over the pods holding block 0; the weakest hitter scores 0.
    assert precise_scores(leading, 10, "min-max") == {"p0": 1.0, "p1": 0.0, "p2": 0.0}
    assert precise_scores({"p0": 1, "p1": 0}, 10, "min-max") == {"p0": 1.0, "p1": 0.0}
    assert precise_scores({"p0": 0, "p1": 0}, 10, "min-max") == {"p0": 0.0, "p1": 0.0}


def fleet(*, clears: bool) -> tuple[ExactSource, dict[str, EventedCache]]:
    source = ExactSource(Loop(), 0.0, clears=clears)
    caches = {key: EventedCache(10_000, 16) for key in ("p0", "p1")}
    for key, cache in caches.items():
        source.subscribe(key, cache)
    return source, caches


def test_llmd_precise_weighs_the_evented_prefix_twice_and_ignores_clears():
    source, caches = fleet(clears=False)
    prompt = [seg(1, 100), seg(2, 70)]  # 170 tokens: 10 full blocks, the partial one dropped
    keys = PromptKeys(prompt_ids(prompt))
    caches["p0"].store([seg(1, 100)])  # blocks 0-5 (block 6 ends in segment 2)
    leading = {key: source.leading_blocks(key, keys, LLMD_PRECISE_BLOCK_TOKENS) for key in caches}
    assert leading == {"p0": 6, "p1": 0}
    waiting = {"p0": 5.0, "p1": 0.0}
    usage = {"p0": 0.0, "p1": 0.0}
    scorer = LlmdPrecise(
        ["p0", "p1"], random.Random(1), lambda k, at: waiting[k], usage.__getitem__
    )
    scores = scorer.scores(leading, 170 // LLMD_PRECISE_BLOCK_TOKENS, now=0.0)
    assert scores["p0"] == pytest.approx(2 * 0.6 + 1 + 0)
    assert scores["p1"] == pytest.approx(0 + 1 + 1)
    assert scorer.choose(leading, 10, now=0.0) == "p0"
    usage["p0"] = 0.5  # kv-cache utilisation: 1 - usage, weight 1
    assert scorer.choose(leading, 10, now=0.0) == "p1"
    scorer.normalisation = "min-max"  # the only hitter scores 1.0
    assert scorer.scores(leading, 10, now=0.0)["p0"] == pytest.approx(2 + 0.5 + 0)
    caches["p0"].clear()  # llm-d-kv-cache v0.8.0 only logs AllBlocksCleared
    assert source.leading_blocks("p0", keys, LLMD_PRECISE_BLOCK_TOKENS) == 6
    production, cleared = fleet(clears=True)
    cleared["p0"].store([seg(1, 100)])
    cleared["p0"].clear()
    assert production.leading_blocks("p0", keys, LLMD_PRECISE_BLOCK_TOKENS) == 0


def test_llmd_precise_parses_and_runs_in_simulate():
    assert parse_variant("llm-d_precise") == LLMD_PRECISE
    assert LLMD_PRECISE.exact
    assert LLMD_PRECISE.label == "llm-d_precise"
    tiny = replace(SHARED_PROMPTS, name="tiny", prefill_engines=2, decode_engines=2)
    runs = {
        variant: simulate(tiny, variant, 5.0, measured=150, warmup=50, seed=2)
        for variant in (LLMD_PRECISE, LLMD)
    }
    precise = runs[LLMD_PRECISE]
    assert precise.unfinished == 0
    assert precise.remote_share > 0.5
    assert precise.prefill_hit_share > 0
    # The prefill pick is its own: not the approximate anchor's run replayed.
    assert precise.prefill_hit_share != runs[LLMD].prefill_hit_share
