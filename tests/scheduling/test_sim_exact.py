"""The simulator's exact prefix source: prefill engines' caches publish KV events,
production's ``KVIndex`` applies them a lag behind, and an ``exact`` variant decides on it."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace

import pytest

from bench.sim.engines import Loop
from bench.sim.exact import EventedCache, ExactSource, prompt_ids
from bench.sim.kvshare import DECODE, measure, report
from bench.sim.run import simulate
from bench.sim.scenario import QOE, QOE_BLIND, QOE_EXACT
from bench.sim.scenarios import MOONCAKE_EVICT
from bench.sim.texts import Segment
from bench.simulate import parse_variant
from sidecar.kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from sidecar.kvevents.index import KVIndex, PromptKeys
from sidecar.scheduling.prefixes import PrefillPrefixes


def seg(key: int, tokens: int = 100) -> Segment:
    return Segment(key, tokens, tokens * 4)


def hit(index: KVIndex, segments: list[Segment]) -> int:
    return index.lookup(PromptKeys(prompt_ids(segments))).gpu


def subscribed(capacity: int, lag_s: float = 0.0) -> tuple[Loop, EventedCache, KVIndex]:
    loop = Loop()
    source = ExactSource(loop, lag_s)
    cache = EventedCache(capacity, 16)
    source.subscribe("e", cache)
    return loop, cache, source.indexes["e"]


def recorded(capacity: int) -> tuple[EventedCache, KVIndex, list[KVEvent]]:
    """A cache, its index (no lag), and every event it published, in order."""
    source = ExactSource(Loop(), 0.0)
    cache = EventedCache(capacity, 16)
    source.subscribe("e", cache)
    published: list[KVEvent] = []

    def observe(key: str, batch: EventBatch) -> None:
        published.extend(batch.events)

    source.observer = observe
    return cache, source.indexes["e"], published


def test_the_index_fed_by_a_cache_s_events_predicts_exactly_its_hits_through_evictions():
    """Unaligned segments (a block straddles two), shared prefixes, a cache a few prompts big:
    after every store, every prompt seen so far is looked up in both."""
    _, cache, index = subscribed(capacity=3000)
    rng = random.Random(7)
    systems = [seg(1000 + k, rng.randint(200, 900)) for k in range(4)]
    prompts: list[list[Segment]] = []
    for i in range(60):
        prompt = [rng.choice(systems), seg(i, rng.randint(5, 300))]
        if rng.random() < 0.3 and prompts:  # a conversation's next turn
            prompt = [*rng.choice(prompts), seg(10_000 + i, rng.randint(20, 400))]
        prompts.append(prompt)
        cache.store(prompt)
        for seen in prompts[-8:]:
            tokens = sum(s.tokens for s in seen)
            assert hit(index, seen) <= cache.cached_tokens(seen, tokens)
            # Equal, but for a prompt of whole blocks held whole: the cache's hit stops one
            # token short of the prompt, the index's a block short (vLLM's is the index's).
            assert cache.cached_tokens(seen, tokens) - hit(index, seen) < 16
    stats = index.stats()
    assert stats.removed > 0
    assert stats.unknown_parent == stats.misaligned == 0
    assert cache.used_tokens <= 3000


def test_events_reach_the_index_only_after_the_lag():
    loop, cache, index = subscribed(capacity=10_000, lag_s=0.5)
    prompt = [seg(1, 512), seg(2, 512), seg(3, 40)]
    cache.store(prompt)
    assert cache.cached_tokens(prompt, 1064) == 1056
    assert hit(index, prompt) == 0  # not yet
    loop.run()
    assert loop.now == 0.5
    assert hit(index, prompt) == 1056


def test_a_restart_clears_the_index_but_the_approximate_index_is_not_told():
    cache, index, published = recorded(capacity=10_000)
    prompt = [seg(1, 512), seg(2, 512)]
    cache.store(prompt)
    approximate = PrefillPrefixes(block_tokens=16, capacity_blocks=1000, max_blocks=1000)
    approximate.placed("e", [b"a", b"b"])
    cache.clear()
    assert [type(event) for event in published] == [BlockStored, BlockStored, AllBlocksCleared]
    assert cache.cached_tokens(prompt, 1024) == 0
    assert hit(index, prompt) == 0
    assert approximate.matched_blocks("e", [b"a", b"b"]) == 2  # still predicts the hit


def test_an_evicted_segment_s_blocks_are_removed_and_a_suffix_goes_before_its_prefix():
    cache, index, published = recorded(capacity=1024)
    cache.store([seg(1, 512), seg(2, 512)])
    cache.store([seg(1, 512), seg(3, 512)])  # evicts seg 2 (its prefix seg 1 was used again)
    removed = [event for event in published if isinstance(event, BlockRemoved)]
    assert [len(event.block_hashes) for event in removed] == [32]
    assert hit(index, [seg(1, 512), seg(3, 512), seg(4)]) == 1024
    assert hit(index, [seg(1, 512), seg(2, 512), seg(4)]) == 512


def test_an_exact_variant_parses_and_is_labelled():
    assert parse_variant("qoe:exact") == QOE_EXACT
    assert QOE_EXACT.label == "qoe exact"
    with pytest.raises(argparse.ArgumentTypeError):
        parse_variant("qoe:blind:exact")


def write_trace(path, conversations: int, turns: int) -> str:
    """Conversations of growing prompts (each turn the previous one's blocks and one more),
    interleaved, one request a second."""
    rows: list[dict[str, object]] = []
    for turn in range(turns):
        for c in range(conversations):
            ids = [c * 100 + i for i in range(turn + 2)]
            rows.append(
                {
                    "timestamp": len(rows) * 1000,
                    "input_length": 512 * len(ids) - 100,
                    "output_length": 20,
                    "hash_ids": ids,
                }
            )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_with_restarts_the_approximate_index_predicts_hits_the_exact_one_does_not(tmp_path):
    """Engines restarted every 20 s on average: the approximate index predicts what they held
    before; the exact one, its events instant, predicts within 10 % every time."""
    trace = write_trace(tmp_path / "trace.jsonl", conversations=8, turns=12)
    scenario = replace(MOONCAKE_EVICT, trace_path=trace, prefill_restart_s=20.0, kv_event_lag_s=0.0)
    runs = {
        variant: simulate(scenario, variant, 2.0, measured=70, warmup=20, seed=1)
        for variant in (QOE, QOE_EXACT)
    }
    assert runs[QOE].prefix_over_share > 0.05
    assert runs[QOE_EXACT].prefix_wrong_share == 0.0
    assert runs[QOE_EXACT].prefill_hit_share > 0.2  # it found hits, and placed them
    again = simulate(scenario, QOE_EXACT, 2.0, measured=70, warmup=20, seed=1)
    assert again.attainment == runs[QOE_EXACT].attainment
    assert again.prefill_hit_share == runs[QOE_EXACT].prefill_hit_share


def test_kvshare_counts_what_the_engines_publish_and_prices_both_designs(tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl", conversations=8, turns=6)
    published = measure(trace, rate=2.0, measured=30, warmup=10, seed=1)
    assert published.batches > 0
    assert published.events == published.stored + published.removed
    assert published.stored > 0
    assert published.payload_bytes > published.stored * 16  # the token ids dominate
    text = report(published, lag_s=0.05)
    subscribe = next(line for line in text.splitlines() if line.startswith("subscribe"))
    messages = published.batches / published.seconds * DECODE
    assert subscribe.split()[1] == f"{messages:,.0f}"


def test_the_re_test_interval_is_a_what_if_of_the_scenario(tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl", conversations=8, turns=12)
    # One prefill engine five times slower than the others: the policy keeps away from it for
    # its speed alone, which is what a re-test renews (at 0.5 req/s: the pool is not busy
    # enough for the policy to use it anyway). Prefix-blind: with the prompts' prefixes known,
    # the slow engine is the home of some of them and is measured as their home (placement.py's
    # affinity), so no re-test is due in this short scenario.
    speeds = (MOONCAKE_EVICT.prefill_tokens_per_s,) * (MOONCAKE_EVICT.prefill_engines - 1)
    scenario = replace(
        MOONCAKE_EVICT,
        trace_path=trace,
        prefill_restart_s=20.0,
        kv_event_lag_s=0.0,
        prefill_speeds=(*speeds, MOONCAKE_EVICT.prefill_tokens_per_s / 5),
    )
    default = simulate(scenario, QOE_BLIND, 0.5, measured=70, warmup=20, seed=1)
    never = simulate(
        replace(scenario, retest_s=0.0), QOE_BLIND, 0.5, measured=70, warmup=20, seed=1
    )
    assert default.reasons.get("retest", 0) > 0
    assert "retest" not in never.reasons
