"""The simulator's prefix structure: prefill engines' prefix caches, the workloads that
share prefixes (a Mooncake-format trace, shared system prompts), the anchor policies."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

from bench.sim.anchors import ApproximateTree, LlmdScorer, SglangCacheAware, SglangConfig
from bench.sim.caches import PrefixCache
from bench.sim.run import simulate
from bench.sim.scenario import LEAST_LOADED, LLMD, QOE, QOE_BLIND, SGLANG
from bench.sim.scenarios import MOONCAKE, SHARED_PROMPTS
from bench.sim.texts import Segment, prompt_text
from bench.sim.traces import mooncake
from bench.sim.workload import shapes
from sidecar.scheduling.prefixes import PrefixHasher


def seg(key: int, tokens: int = 100) -> Segment:
    return Segment(key, tokens, tokens * 4)


def test_a_prefill_cache_finds_the_leading_segments_it_holds_in_whole_blocks():
    cache = PrefixCache(capacity_tokens=10_000, block_tokens=16)
    cache.store([seg(1), seg(2)])
    assert cache.cached_tokens([seg(1), seg(2), seg(3)], 300) == 192  # 200, whole blocks
    assert cache.cached_tokens([seg(2), seg(1)], 200) == 0  # a segment counts after its prefix
    assert cache.cached_tokens([seg(1), seg(2)], 200) == 192  # never the whole prompt
    assert cache.cached_tokens([seg(1), seg(9)], 200) == 96


def test_a_prefill_cache_evicts_suffixes_before_the_prefix_they_share():
    cache = PrefixCache(capacity_tokens=300, block_tokens=1)
    cache.store([seg(1), seg(2)])
    cache.store([seg(1), seg(3)])  # 300 tokens: full
    cache.store([seg(4)])  # evicts the least recent: seg 2 (seg 1 was used again)
    assert cache.used_tokens == 300
    assert cache.cached_tokens([seg(1), seg(3), seg(5)], 400) == 200
    assert cache.cached_tokens([seg(1), seg(2), seg(5)], 400) == 100


def write_trace(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_mooncake_trace_replays_with_its_sharing_in_the_text(tmp_path):
    trace = write_trace(
        tmp_path / "trace.jsonl",
        [
            {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 3]},
            {"timestamp": 2000, "input_length": 300, "output_length": 0, "hash_ids": [4]},
        ],
    )
    replayed = mooncake(trace, MOONCAKE, seed=1)
    assert [s.prompt_tokens for s in replayed] == [1200, 1100, 300]
    assert [s.output_tokens for s in replayed] == [10, 20, 1]
    assert [s.segments[-1].tokens for s in replayed] == [176, 76, 300]  # the partial last block
    # Gaps scaled to a mean rate of 1 request/s, the trace's shape kept.
    assert [round(s.gap, 3) for s in replayed] == [0.0, 0.5, 1.5]
    hasher = PrefixHasher(b"k" * 16, block_tokens=64)
    first, second, third = (hasher.hashes(prompt_text(s.segments)) for s in replayed)
    shared = sum(1 for a, b in zip(first, second, strict=False) if a == b)
    blocks_of_two_ids = sum(s.chars for s in replayed[0].segments[:2]) // 256
    assert shared == blocks_of_two_ids  # the sidecar's hashing sees the two shared ids, no more
    assert not set(third) & set(first)


def test_the_shared_system_prompt_workload_has_its_fixed_parameters():
    stream = shapes(SHARED_PROMPTS, seed=1)
    sample = [next(stream) for _ in range(4000)]
    systems = Counter(shape.segments[0] for shape in sample)
    assert len(systems) <= 32
    assert all(2000 <= system.tokens <= 8000 for system in systems)
    assert all(50 <= shape.segments[1].tokens <= 500 for shape in sample)
    assert all(100 <= shape.output_tokens <= 300 for shape in sample)
    assert len({shape.segments[1] for shape in sample}) == len(sample)  # user parts unique
    counts = sorted(systems.values(), reverse=True)
    # Zipf s = 1.1 over 32: the most popular 1 / sum(k^-1.1) of the requests, 2^1.1 x the second.
    top = 1 / sum(k**-1.1 for k in range(1, 33))
    assert abs(counts[0] / len(sample) - top) < 0.03
    assert 1.8 < counts[0] / counts[1] < 2.6


def test_sglang_tree_matches_the_deepest_prefix_and_evicts_the_least_recent_leaves():
    tree = ApproximateTree()
    tree.insert([seg(1), seg(2)], "a", now=1.0)
    tree.insert([seg(1), seg(3)], "b", now=2.0)
    assert tree.match([seg(1), seg(2), seg(9)], now=3.0) == (800, "a")
    assert tree.match([seg(1), seg(9)], now=3.0) == (400, "a")  # first tenant of the node
    assert tree.chars == {"a": 800, "b": 800}
    tree.insert([seg(1), seg(4)], "a", now=4.0)
    tree.evict(budget=800)  # a's least recent leaf (seg 2) goes; b's tree is within budget
    assert tree.chars == {"a": 800, "b": 800}
    assert tree.match([seg(1), seg(2)], now=5.0)[0] == 400
    assert tree.match([seg(1), seg(4)], now=5.0) == (800, "a")


def test_sglang_cache_aware_follows_the_cache_while_balanced_else_the_least_loaded():
    policy = SglangCacheAware(["p0", "p1"], SglangConfig(balance_abs_threshold=2))
    prompt = [seg(1, 1000), seg(2, 10)]
    assert policy.choose(prompt, 4040, now=0.0) == "p0"  # nothing cached: least loaded, first
    assert policy.choose([seg(1, 1000), seg(3, 10)], 4040, now=1.0) == "p0"  # match 99 %
    assert policy.choose([seg(5, 100)], 400, now=2.0) == "p1"  # no match: least loaded
    policy.choose([seg(1, 1000), seg(6, 10)], 4040, now=3.0)
    policy.choose([seg(1, 1000), seg(7, 10)], 4040, now=4.0)
    assert policy.load == {"p0": 4, "p1": 1}  # 4 - 1 > 2 and 4 > 1.5: imbalanced
    assert policy.choose([seg(1, 1000), seg(8, 10)], 4040, now=5.0) == "p1"
    policy.finished("p0")
    assert policy.load == {"p0": 3, "p1": 2}


def test_llmd_scores_prefix_twice_as_much_as_queue_and_disaggregates_on_uncached_tokens():
    waiting = {"p0": 5.0, "p1": 0.0}
    scorer = LlmdScorer(["p0", "p1"], 1000, random.Random(1), lambda key, at: waiting[key])
    text = "x" * 640  # 10 blocks of 64 characters
    hashes = scorer.hashes(text)
    assert len(hashes) == 10
    assert scorer.choose(hashes, now=0.0) == "p1"  # queue only: the empty one
    scorer.record("p0", hashes[:6])
    assert scorer.choose(hashes, now=0.0) == "p0"  # 2 x 0.6 > 1
    scorer.record("d0", hashes)
    assert not scorer.disaggregates("d0", hashes, len(text))  # all cached on the decode pod
    assert scorer.disaggregates("d1", hashes, len(text))
    assert scorer.hashes("short") == []


TINY = replace(SHARED_PROMPTS, name="tiny", prefill_engines=2, decode_engines=2)


def test_prefix_aware_placement_finds_the_shared_prompts_and_learns_from_the_answers():
    def run(variant):
        return simulate(TINY, variant, 5.0, measured=150, warmup=50, seed=2)

    aware, blind = run(QOE), run(QOE_BLIND)
    assert aware.prefill_hit_share > blind.prefill_hit_share > 0
    for variant in (SGLANG, LLMD, LEAST_LOADED):
        stats = run(variant)
        assert stats.unfinished == 0
        assert stats.prefill_hit_share > 0


def test_the_trace_scenario_runs_from_a_generated_trace(tmp_path):
    rng = random.Random(5)
    rows = []
    for i in range(300):
        conversation = rng.randrange(20)
        ids = [1000 * conversation + k for k in range(rng.randint(1, 6))] + [10**6 + i]
        rows.append(
            {
                "timestamp": 100 * i,
                "input_length": 512 * (len(ids) - 1) + 200,
                "output_length": 50,
                "hash_ids": ids,
            }
        )
    trace = write_trace(tmp_path / "generated.jsonl", rows)
    scenario = replace(MOONCAKE, trace_path=trace, prefill_engines=2, decode_engines=2)
    stats = simulate(scenario, QOE, 2.0, measured=200, warmup=50, seed=1)
    assert stats.requests == 200
    assert stats.unfinished == 0
    assert stats.prefill_hit_share > 0.2
