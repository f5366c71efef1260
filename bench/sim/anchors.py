"""What users would run instead of our scheduler, as the simulator's anchor policies.

Each is a central router, as its project deploys it: one instance sees every request of the
fleet, chooses its decode engine and its prefill engine, and keeps its own state. Both are
written from the projects' documented behaviour and source as read (the facts and where they
come from are in the comments; no code is copied), with the defaults a user gets, not tuned per
workload. Each picks the decode engine its own way (the other variants, ours among them, sit
behind the simulator's gateway, which picks the decode engine with the fewest requests in
flight).

- ``sglang_cache_aware``: SGLang's router (sgl-project/sglang, ``sgl-model-gateway``; formerly
  ``sgl-router``), ``--pd-disaggregation`` with its default policy ``cache_aware`` for the
  prefill workers and for the decode workers: ``--decode-policy`` defaults to None, "if not
  specified, uses the main policy", and ``--policy`` defaults to ``cache_aware``
  (``sgl-model-gateway/bindings/python/src/sglang_router/router_args.py``, sgl-project/sglang
  commit 6614f984; an SGLang CI log of a PD launch, 2026-02-26, prints ``decode_policy: None``
  and ``policy: CacheAware``). Each worker pool has its own tree and load counts. PD mode
  disaggregates every request.
- ``llm-d_pd_scorer``: llm-d's endpoint picker with its shipped P/D configuration
  (llm-d/llm-d-inference-scheduler ``deploy/config/pd-epp-config.yaml``, v0.6.0-v0.8.0, HEAD
  520af478 and 0bb9fa83): its ``decode`` and ``prefill`` profiles alike score the pods by the
  approximate prefix-cache scorer (weight 2) plus the queue scorer (weight 1), the highest score
  wins; disaggregation by its ``prefix-based-pd-decider`` (``nonCachedTokens: 16``). One
  prefix-cache scorer serves both profiles (one index, keyed by pod).
- ``llm-d_precise``: ``llm-d_pd_scorer`` with its prefill profile scored as llm-d's precise
  prefix-cache configuration scores pods (``LlmdPrecise``): the exact index fed by the prefill
  engines' KV events. Our composition of llm-d's shipped pieces: no shipped P/D configuration
  uses the precise scorer.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from bench.sim.texts import Segment

ANCHORS = ("sglang_cache_aware", "llm-d_pd_scorer", "llm-d_precise")


# SGLang cache_aware.
#
# Defaults: what a user of the current gateway gets from its command line,
# sgl-model-gateway/bindings/python/src/sglang_router/router_args.py (commit 05e589ad):
# --cache-threshold 0.3, --balance-abs-threshold 64, --balance-rel-threshold 1.5,
# --eviction-interval-secs 60, --max-tree-size 2**26. The same three thresholds are the Rust CLI's
# (sgl-router/src/main.rs, commit 0129b029) and the older Python launcher's, and an SGLang CI log
# of a PD launch (2026-02-26) prints exactly them (eviction 60, tree 67108864). The library
# struct's Default (CacheAwareConfig::default() in sgl-model-gateway/src/policies/mod.rs,
# commit 01f6c92a: 0.5 / 32 / 1.1, eviction 30 s, tree 10,000) is what only code embedding the
# library gets; docs/scheduling.md reports it too (SGLANG_LIBRARY_DEFAULTS).


@dataclass(frozen=True, slots=True)
class SglangConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_size: int = 2**26
    """Characters per worker (the classic tree's ``tenant_char_count`` budget)."""


SGLANG_LIBRARY_DEFAULTS = SglangConfig(0.5, 32, 1.1, 30.0, 10_000)


@dataclass(slots=True, eq=False)
class _Node:
    chars: int
    parent: _Node | None
    element: tuple[int, int]
    children: dict[tuple[int, int], _Node] = field(default_factory=dict)
    tenants: dict[str, float] = field(default_factory=dict)
    """Worker -> last access (virtual seconds); insertion order is the match's pick order."""


class ApproximateTree:
    """The router's approximate radix tree of request text, workers as tenants.

    SGLang's tree (sgl-router/src/policies/tree.rs) holds characters; here a node holds one
    segment of the workload's text (``bench.sim.texts``), weighing its characters. The two agree
    because different segments never share leading characters; what differs is a segment
    matched in part (a prompt's partial last block against the same block in full), which this
    tree counts as no match (rare: the last block of a Mooncake prompt is mostly its own).
    """

    def __init__(self) -> None:
        self.root = _Node(0, None, (0, 0))
        self.chars: dict[str, int] = {}
        """Per worker: characters of the nodes it holds (``tenant_char_count``)."""

    def match(self, segments: Sequence[Segment], now: float) -> tuple[int, str | None]:
        """Matched characters from the root and the first worker at the deepest node reached;
        the walk refreshes that worker's timestamps up to the root."""
        node = self.root
        matched = 0
        for segment in segments:
            child = node.children.get((segment.key, segment.chars))
            if child is None:
                break
            node = child
            matched += child.chars
        if node is self.root or not node.tenants:
            return 0, None
        tenant = next(iter(node.tenants))
        walk: _Node | None = node
        while walk is not None and walk is not self.root:
            if tenant in walk.tenants:
                walk.tenants[tenant] = now
            walk = walk.parent
        return matched, tenant

    def insert(self, segments: Sequence[Segment], tenant: str, now: float) -> None:
        node = self.root
        added = 0
        for segment in segments:
            element = (segment.key, segment.chars)
            child = node.children.get(element)
            if child is None:
                child = node.children[element] = _Node(segment.chars, node, element)
            if tenant not in child.tenants:
                added += child.chars
            child.tenants[tenant] = now
            node = child
        self.chars[tenant] = self.chars.get(tenant, 0) + added

    def evict(self, budget: int) -> None:
        """Each worker over ``budget`` characters loses its least recently used leaves (nodes
        it holds with no child it holds) until it is within it; nodes nobody holds go."""
        for tenant, held in self.chars.items():
            if held <= budget:
                continue
            leaves: list[tuple[float, int, _Node]] = []
            stack = [self.root]
            while stack:
                node = stack.pop()
                for child in node.children.values():
                    if tenant in child.tenants:
                        stack.append(child)
                        if not any(tenant in c.tenants for c in child.children.values()):
                            leaves.append((child.tenants[tenant], id(child), child))
            heapq.heapify(leaves)
            while held > budget and leaves:
                _, _, node = heapq.heappop(leaves)
                del node.tenants[tenant]
                held -= node.chars
                parent = node.parent
                if not node.tenants and not node.children and parent is not None:
                    del parent.children[node.element]
                if (
                    parent is not None
                    and parent is not self.root
                    and tenant in parent.tenants
                    and not any(tenant in c.tenants for c in parent.children.values())
                ):
                    heapq.heappush(leaves, (parent.tenants[tenant], id(parent), parent))
            self.chars[tenant] = held


class SglangCacheAware:
    """``cache_aware`` on the prefill workers (sgl-model-gateway/src/policies/cache_aware.rs,
    commits b93974f1 and 053b63ff; the tree in sgl-router/src/policies/tree.rs):

    - load = the router's own count of its requests in flight per worker (``Worker::load()``),
      up when it dispatches, down when the request completes;
    - imbalanced when max − min load > ``balance_abs_threshold`` and max > min ×
      ``balance_rel_threshold``: the least loaded worker (ties: the first);
    - else the tree's match: its worker when matched characters / request characters >
      ``cache_threshold``, else the least loaded worker (the current gateway's "load-aware
      fallback", sglang PRs #14305/#14532, 2025-12; the older router took the worker with the
      smallest tree);
    - the request's text goes into the tree under the chosen worker either way; a background
      pass every ``eviction_interval_s`` trims each worker to ``max_tree_size`` characters.
    """

    def __init__(self, keys: Sequence[str], config: SglangConfig = SglangConfig()) -> None:
        self.keys = list(keys)
        self.config = config
        self.tree = ApproximateTree()
        self.load = dict.fromkeys(self.keys, 0)
        self._evicted_at = 0.0

    def choose(self, segments: Sequence[Segment], chars: int, now: float) -> str:
        config = self.config
        if config.eviction_interval_s > 0 and now - self._evicted_at >= config.eviction_interval_s:
            self._evicted_at = now
            self.tree.evict(config.max_tree_size)
        loads = self.load
        least = min(self.keys, key=loads.__getitem__)  # min() keeps the first of equals
        high, low = max(loads.values()), loads[least]
        imbalanced = (
            high - low > config.balance_abs_threshold and high > low * config.balance_rel_threshold
        )
        chosen = least
        if not imbalanced:
            matched, tenant = self.tree.match(segments, now)
            rate = matched / chars if chars else 0.0
            if rate > config.cache_threshold and tenant is not None:
                chosen = tenant
        self.tree.insert(segments, chosen, now)
        loads[chosen] += 1
        return chosen

    def finished(self, key: str) -> None:
        self.load[key] -= 1


# llm-d's default P/D profile.
#
# The approximate prefix cache (llm-d@520af478, pkg/epp/framework/plugins/requestcontrol/
# dataproducer/approximateprefix/): defaultConfig autoTune true, blockSizeTokens 16,
# maxPrefixBlocksToMatch 256, lruCapacityPerServer 31,250 (used only without autoTune), 4
# characters per token. With autoTune the block size and each pod's LRU capacity come from
# vLLM's vllm:cache_config_info (block_size, num_gpu_blocks): here every engine's block_size and
# prefix cache (``Scenario.block_size``, ``prefill_cache_tokens`` / block_size blocks).

LLMD_BLOCK_TOKENS = 16
LLMD_MAX_BLOCKS = 256
LLMD_CHARS_PER_TOKEN = 4
LLMD_PREFIX_WEIGHT = 2.0
LLMD_QUEUE_WEIGHT = 1.0
LLMD_NON_CACHED_TOKENS = 16
"""pd-epp-config.yaml's ``prefix-based-pd-decider`` parameter (the plugin's own default, 0,
never disaggregates)."""
LLMD_REFRESH_S = 0.05
"""The endpoint picker scrapes every engine every 50 ms (gateway-api-inference-extension's
``--refresh-metrics-interval`` default)."""


def llmd_hashes(text: str, block_chars: int, max_blocks: int) -> list[int]:
    """Chained hashes of the text's blocks of ``block_chars``, the first ``max_blocks`` of them,
    a trailing partial block included (llm-d HEAD; GIE v1.2.0 dropped it); a text shorter than
    a block has none. (llm-d chains xxhash64 seeded by the model name; any chained hash
    matches the same prefixes.)"""
    end = min(len(text), block_chars * max_blocks)
    if end < block_chars:
        return []
    hashes = []
    previous = hash("model")
    for start in range(0, end, block_chars):
        previous = hash((previous, text[start : start + block_chars]))
        hashes.append(previous)
    return hashes


class LlmdScorer:
    """Both profiles: every pod of the profile's pool scored 2 × prefix + 1 × queue, the
    maximum wins (``max-score-picker``: shuffled, then stably sorted, so ties go at random).

    - prefix score = the longest run of the request's leading blocks the pod's index holds /
      the request's blocks (``scheduling/scorer/prefix``); the index is one LRU of block hashes
      per pod (hashicorp golang-lru: adding a block makes it the most recent), fed after each
      decision with the request's blocks for its decode pod and its prefill pod;
    - queue score = (max − q) / (max − min) over the pods, all 1 when equal
      (``scheduling/scorer/queuedepth``), q = the pod's scraped ``vllm:num_requests_waiting``;
    - the decider (``prefix_based_pd_decider.go``): disaggregate when the prompt's estimated
      tokens (characters / 4) less those cached on the chosen decode pod (matched blocks × 16)
      reach ``nonCachedTokens``; the decode profile runs first.
    """

    def __init__(
        self,
        keys: Sequence[str],
        capacity_blocks: int,
        rng: random.Random,
        waiting: Callable[[str, float], float],
    ) -> None:
        """``keys``: the prefill pods; ``waiting(pod, at)``: any pod's waiting gauge as scraped
        at ``at``."""
        self.keys = list(keys)
        self._capacity = capacity_blocks
        self._rng = rng
        self._waiting = waiting
        self._index: dict[str, OrderedDict[int, None]] = {}
        self.block_chars = LLMD_BLOCK_TOKENS * LLMD_CHARS_PER_TOKEN

    def hashes(self, text: str) -> list[int]:
        return llmd_hashes(text, self.block_chars, LLMD_MAX_BLOCKS)

    def _matched(self, pod: str, hashes: Sequence[int]) -> int:
        index = self._index.get(pod)
        if index is None:
            return 0
        matched = 0
        for digest in hashes:
            if digest not in index:
                break
            matched += 1
        return matched

    def disaggregates(self, decode_pod: str, hashes: Sequence[int], chars: int) -> bool:
        tokens = chars // LLMD_CHARS_PER_TOKEN
        if tokens < LLMD_NON_CACHED_TOKENS:
            return False
        cached = self._matched(decode_pod, hashes) * LLMD_BLOCK_TOKENS
        return tokens - cached >= LLMD_NON_CACHED_TOKENS

    def choose(self, hashes: Sequence[int], now: float, pods: Sequence[str] = ()) -> str:
        """The best of ``pods`` (the decode profile's pool), or of the prefill pods."""
        pool = pods or self.keys
        scraped = now - now % LLMD_REFRESH_S
        queues = {key: self._waiting(key, scraped) for key in pool}
        high, low = max(queues.values()), min(queues.values())
        scores = []
        for key in pool:
            prefix = self._matched(key, hashes) / len(hashes) if hashes else 0.0
            queue = 1.0 if high == low else (high - queues[key]) / (high - low)
            scores.append((LLMD_PREFIX_WEIGHT * prefix + LLMD_QUEUE_WEIGHT * queue, key))
        best = max(score for score, _ in scores)
        return self._rng.choice([key for score, key in scores if score == best])

    def record(self, pod: str, hashes: Sequence[int]) -> None:
        index = self._index.setdefault(pod, OrderedDict())
        for digest in hashes:
            if digest in index:
                index.move_to_end(digest)
            else:
                index[digest] = None
        while len(index) > self._capacity:
            index.popitem(last=False)


# llm-d's precise prefix-cache scorer (facts from llm-d/llm-d-inference-scheduler HEAD 520af478,
# which pins llm-d/llm-d-kv-cache v0.8.0; the plugin in pkg/epp/framework/plugins/scheduling/
# scorer/preciseprefixcache/, the index and its scorer in llm-d-kv-cache pkg/kvcache/).

LLMD_PRECISE_BLOCK_TOKENS = 16
"""kv-cache ``defaultBlockSize`` (token_processor.go @ v0.8.0); a partial last block is dropped.
Every shipped configuration sets 64 to match its vLLM's ``--block-size``: the default is the
engines' block here (``Scenario.block_size``, 16)."""
LLMD_PRECISE_WEIGHT = 2.0
LLMD_KV_USAGE_WEIGHT = 1.0
"""``deploy/config/epp-precise-prefix-cache-config.yaml`` @ 520af478 (and llm-d/llm-d's
``precise-prefix-cache-aware`` guide @ 019a3f3f): precise 2.0, kv-cache-utilization 1.0,
queue 1.0 (``LLMD_QUEUE_WEIGHT``), ``max-score-picker``."""

Normalisation = Literal["absolute", "min-max"]


def precise_scores(
    leading: Mapping[str, int], total_blocks: int, normalisation: Normalisation = "absolute"
) -> dict[str, float]:
    """Each pod's precise prefix score from its run of the request's leading full blocks
    (``LongestPrefixScorer``, GPU blocks weighing 1.0: the raw score is the run's length).

    - ``absolute`` (scheduler HEAD 520af478, since e6f6b84f, utils.go ``absoluteScoredPods``):
      run / the request's full blocks, clipped to [0, 1]; a request of no full block scores 0;
    - ``min-max`` (scheduler v0.6.0 to v0.8.0, ``indexedScoresToNormalizedScoredPods``): over
      the pods holding block 0, (run − min) / (max − min), 1.0 when they tie; 0 for the others.
    """
    scores = dict.fromkeys(leading, 0.0)
    if normalisation == "absolute":
        if total_blocks > 0:
            for pod, run in leading.items():
                scores[pod] = min(1.0, run / total_blocks)
        return scores
    hits = {pod: run for pod, run in leading.items() if run > 0}
    if hits:
        high, low = max(hits.values()), min(hits.values())
        for pod, run in hits.items():
            scores[pod] = 1.0 if high == low else (run - low) / (high - low)
    return scores


class LlmdPrecise:
    """The prefill profile of ``llm-d_precise``: every prefill pod scored 2 × precise prefix +
    1 × kv-cache utilisation + 1 × queue, the maximum wins (ties at random).

    - precise prefix (``precise_scores``, ``absolute``: the normalisation of the scheduler's
      HEAD 520af478, which pins kv-cache v0.8.0; the latest tag, v0.8.0, still has ``min-max``):
      the pod's run of the request's leading full 16-token blocks in the index fed by its KV
      events (``bench.sim.exact.ExactSource``, the scenario's ``kv_event_lag_s`` behind), over
      the request's full blocks. Defaults as shipped: speculative indexing off (a block counts
      once its event arrived), the in-memory index (10⁸ keys, 10 pods a key: unbounded for the
      simulated fleets), no gap detection (no event is lost here), and ``AllBlocksCleared``
      ignored (a no-op in kv-cache v0.8.0 pool.go: a restarted engine's blocks stay indexed);
    - kv-cache utilisation = 1 − the pod's KV cache usage (``kv-cache-utilization-scorer``);
    - queue = (max − q) / (max − min) over the pods, as in ``LlmdScorer``.

    No shipped llm-d P/D configuration uses the precise scorer: it ships only in single-profile
    configurations (``deploy/config/epp-precise-prefix-cache-config.yaml`` @ 520af478; the
    guide ``guides/precise-prefix-cache-aware/`` in llm-d/llm-d @ 019a3f3f), every P/D one uses
    the approximate ``prefix-cache-scorer`` (``deploy/config/pd-epp-config.yaml``, v0.6.0 =
    7053654a to HEAD 520af478). This variant is our composition of those shipped pieces:
    pd-epp-config.yaml's decode profile and ``prefix-based-pd-decider`` (``nonCachedTokens``
    16; ``LlmdScorer``), this prefill profile with the precise configuration's weights.

    The decider quirk (scheduler v0.8.0 and HEAD, since 95c78cf8): the precise scorer's
    ``Score()`` overwrites the endpoint's ``PrefixCacheMatchInfo`` with a hit flag (0 or 1
    block of 1 token), and the decider reads it from the decode pod: with the precise scorer in
    the decode profile the decider sees at most a 1-token hit and disaggregates every request
    of 16 tokens or more. Not modelled, because it does not arise here: the precise scorer is in
    the prefill profile only, which runs after the decode profile and the decider, so the
    decider reads the decode profile's approximate match, as llm-d's code does for this
    composition. (The simulated decode engines publish no KV events either.)
    """

    def __init__(
        self,
        keys: Sequence[str],
        rng: random.Random,
        waiting: Callable[[str, float], float],
        usage: Callable[[str], float],
        normalisation: Normalisation = "absolute",
    ) -> None:
        """``waiting(pod, at)``: the pod's waiting gauge as scraped at ``at``; ``usage(pod)``:
        its KV cache usage, 0 to 1."""
        self.keys = list(keys)
        self._rng = rng
        self._waiting = waiting
        self._usage = usage
        self.normalisation: Normalisation = normalisation

    def scores(self, leading: Mapping[str, int], total_blocks: int, now: float) -> dict[str, float]:
        """Each prefill pod's weighted score; ``leading``: its run of leading full blocks."""
        scraped = now - now % LLMD_REFRESH_S
        queues = {key: self._waiting(key, scraped) for key in self.keys}
        high, low = max(queues.values()), min(queues.values())
        prefix = precise_scores(
            {key: leading.get(key, 0) for key in self.keys}, total_blocks, self.normalisation
        )
        scores = {}
        for key in self.keys:
            queue = 1.0 if high == low else (high - queues[key]) / (high - low)
            usage = 1.0 - min(1.0, max(0.0, self._usage(key)))
            scores[key] = (
                LLMD_PRECISE_WEIGHT * prefix[key]
                + LLMD_KV_USAGE_WEIGHT * usage
                + LLMD_QUEUE_WEIGHT * queue
            )
        return scores

    def choose(self, leading: Mapping[str, int], total_blocks: int, now: float) -> str:
        scores = self.scores(leading, total_blocks, now)
        best = max(scores.values())
        return self._rng.choice([key for key, score in scores.items() if score == best])
