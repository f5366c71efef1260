"""Decode-rank choice: pure functions of what is known of each rank and a seeded random source."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter

from sidecar.fleet.load import EngineLoad
from sidecar.fleet.snapshot import EngineHealth, EngineSnapshot
from sidecar.scheduling.ranks import (
    TOKENS_PER_REQUEST,
    DecodeRanks,
    RankView,
    choose_rank,
)

BLOCK_TOKENS = 16
HISTORY = "A conversation's earlier turns, long enough to fill several blocks. " * 60
_POLLS = itertools.count(1)


def polled(decode: DecodeRanks, index: int, health: EngineHealth | bool) -> None:
    """What the engine monitor publishes after a /health poll of rank ``index`` (True: it
    answered 200; False: it timed out)."""
    if isinstance(health, bool):
        health = EngineHealth.UP if health else EngineHealth.DOWN
    at = float(next(_POLLS))
    ready = health is EngineHealth.UP  # the rule of one poll (readiness judges several)
    decode.publish(decode[index], EngineSnapshot(health=health, health_at=at, at=at, ready=ready))


def ranks(count: int = 3, *, capacity_blocks: int = 65536, clock=lambda: 0.0) -> DecodeRanks:
    urls = [f"http://127.0.0.1:{8200 + i}" for i in range(count)]
    return DecodeRanks(
        urls,
        block_tokens=BLOCK_TOKENS,
        capacity_blocks=capacity_blocks,
        stale_after_s=3.0,
        rng=random.Random(5),
        clock=clock,
    )


def test_the_rank_holding_the_history_wins_at_equal_load() -> None:
    views = [RankView(0), RankView(1, cached_tokens=3000), RankView(2)]
    picks = {choose_rank(views, 3200, random.Random(seed)).index for seed in range(20)}
    assert picks == {1}


def test_load_outweighs_a_short_history() -> None:
    # 3000 cached tokens weigh less than four more requests (4 x 1000 tokens) on that rank.
    holder, idle = RankView(0, cached_tokens=3000, inflight=4), RankView(1)
    assert choose_rank([holder, idle], 3200, random.Random(1)).index == 1
    # ... but more than two.
    holder = RankView(0, cached_tokens=3000, inflight=2)
    assert choose_rank([holder, idle], 3200, random.Random(1)).index == 0
    assert holder.cost(3200) == 200 + 2 * TOKENS_PER_REQUEST


def test_without_a_cached_prefix_the_least_loaded_rank_wins() -> None:
    views = [RankView(0, inflight=2), RankView(1, inflight=1, waiting=2), RankView(2, inflight=1)]
    picks = {choose_rank(views, 500, random.Random(seed)).index for seed in range(20)}
    assert picks == {2}  # rank 1's scraped queue counts as load


def test_ties_are_broken_at_random() -> None:
    views = [RankView(0), RankView(1), RankView(2)]
    picks = Counter(choose_rank(views, 100, random.Random(seed)).index for seed in range(60))
    assert set(picks) == {0, 1, 2}


def test_a_continuation_goes_back_to_the_rank_that_holds_its_history() -> None:
    decode = ranks()
    first, cached = decode.claim(HISTORY, len(HISTORY) // 4)
    assert cached == 0
    first.end()
    for turn in range(5):
        follow_up = HISTORY + f" Question {turn}?"
        claim, cached = decode.claim(follow_up, len(follow_up) // 4)
        assert claim.index == first.index
        assert cached >= len(HISTORY) // 4 - BLOCK_TOKENS
        claim.end()
    # Another conversation is not cached anywhere: it goes where the load is lowest.
    decode[0].inflight = decode[1].inflight = 1
    other, cached = decode.claim("An unrelated question " * 40, 230)
    assert (other.index, cached) == (2, 0)


def test_unready_ranks_get_nothing_while_another_is_ready() -> None:
    decode = ranks()
    for index, ready in enumerate([False, True, False]):
        polled(decode, index, ready)
    assert decode.ready  # the pod is ready: one rank is
    history, _ = decode.claim(HISTORY, 1000)
    assert history.index == 1
    history.end()
    polled(decode, 0, True)
    polled(decode, 1, False)
    # Rank 1 holds the history, but an unready rank is never a candidate.
    claim, cached = decode.claim(HISTORY + " Next?", 1000)
    assert (claim.index, cached) == (0, 0)
    claim.end()
    for i in range(10):
        claim, _ = decode.claim(f"{i} {HISTORY}", 1000)
        assert claim.index == 0
        claim.end()
    passthrough = decode.claim_any()
    assert passthrough.index == 0
    passthrough.end()
    assert decode.least_loaded(exclude=[decode[0]]) is None  # nowhere else is ready
    # None ready: the pod is unready; a request that comes anyway may go to any rank.
    polled(decode, 0, False)
    assert not decode.ready
    placed = set()
    for i in range(30):
        claim, _ = decode.claim(f"{i} {HISTORY}", 1000)
        placed.add(claim.index)
        claim.end()
    assert placed == {0, 1, 2}


def test_a_claim_counts_until_it_ends_and_moves_with_its_request() -> None:
    decode = ranks(2)
    claim = decode.claim_any()
    rank = claim.rank
    other = decode[1 - rank.index]
    assert (rank.inflight, rank.placed) == (1, 1)
    claim.prefilling(700)
    assert rank.ahead_tokens == 700
    claim.move(other)  # its rank refused the connection: the request went to the other one
    assert (rank.inflight, rank.ahead_tokens) == (0, 0)
    assert (other.inflight, other.ahead_tokens, other.placed) == (1, 700, 1)
    claim.prefilled()
    assert other.ahead_tokens == 0
    claim.end()
    claim.end()  # idempotent
    assert (other.inflight, rank.inflight) == (0, 0)
    claim.move(rank)  # an ended claim holds nothing to move
    assert rank.inflight == 0


def test_a_request_passed_to_another_rank_leaves_its_history_there() -> None:
    decode = ranks(2)
    claim, _ = decode.claim(HISTORY, 1000)
    first, other = claim.rank, decode[1 - claim.index]
    claim.move(other)  # its rank refused the connection
    claim.end()
    follow_up = HISTORY + " And then?"
    hashes = other.prefix.hashes(follow_up)
    assert other.prefix.cached_tokens(hashes) == first.prefix.cached_tokens(hashes) > 0
    _, cached = decode.claim(follow_up, 1000)
    assert cached > 0


def test_a_rank_forgets_its_history_only_when_its_engine_lost_it() -> None:
    decode = ranks(2)
    for rank in decode:
        polled(decode, rank.index, True)
    claim, _ = decode.claim(HISTORY, 1000)
    claim.end()
    rank = claim.rank
    assert len(rank.prefix) > 0
    polled(decode, rank.index, True)  # still ready: kept
    assert len(rank.prefix) > 0
    polled(decode, rank.index, False)  # a poll timed out: unready, but a busy engine keeps its KV
    assert not rank.ready
    assert len(rank.prefix) > 0
    polled(decode, rank.index, EngineHealth.LOST)  # its health check failed, or nothing listens
    assert len(rank.prefix) == 0
    polled(decode, rank.index, True)
    _, cached = decode.claim(HISTORY + " Again?", 1000)
    assert cached == 0


def test_only_a_new_health_poll_forgets_a_ranks_history() -> None:
    """A snapshot keeps its last /health poll until the next one: a scrape published after a
    poll that found the engine lost says nothing new of its cache."""
    decode = ranks(1)
    polled(decode, 0, EngineHealth.LOST)
    decode.claim(HISTORY, 1000)[0].end()  # none ready: placed anyway, and remembered
    rank = decode[0]
    remembered = len(rank.prefix)
    assert remembered > 0
    load = EngineLoad(waiting=0, running=1, kv_usage=None, at=1.0)
    decode.publish(rank, dataclasses.replace(rank.engine, load=load))  # a scrape
    assert (rank.load, rank.engine.health) == (load, EngineHealth.LOST)
    assert len(rank.prefix) == remembered
    polled(decode, 0, EngineHealth.LOST)  # the next poll: still lost
    assert len(rank.prefix) == 0


def test_a_rank_refusing_connections_forgets_its_history() -> None:
    decode = ranks(2)
    claim, _ = decode.claim(HISTORY, 1000)
    first = claim.rank
    decode.lost(first)  # what the decode send does when the rank refuses the connection
    claim.move(decode[1 - first.index])
    claim.end()
    hashes = first.prefix.hashes(HISTORY)
    assert first.prefix.cached_tokens(hashes) == 0
    assert decode[1 - first.index].prefix.cached_tokens(hashes) > 0


def test_a_scraped_queue_counts_while_fresh() -> None:
    now = [100.0]
    decode = ranks(2, clock=lambda: now[0])
    load = EngineLoad(waiting=5, running=1, kv_usage=0.1, at=99.0)
    decode.publish(decode[0], EngineSnapshot(load=load, at=99.0))  # a scrape
    assert decode.waiting(decode[0]) == 5
    assert decode.claim_any().index == 1
    now[0] = 103.5  # older than three scrape intervals: unknown
    assert decode.waiting(decode[0]) is None
    assert decode.waiting(decode[1]) is None  # never scraped


def test_the_ranks_share_the_prefix_memory_bound() -> None:
    decode = ranks(4, capacity_blocks=40)
    blocks = 0
    for i in range(40):  # every prompt 10 blocks: far more than all the indexes hold
        prompt = f"{i:04d}" + "x" * (10 * BLOCK_TOKENS * 4)
        claim, _ = decode.claim(prompt, 160)
        claim.end()
        blocks = sum(len(rank.prefix) for rank in decode)
        assert blocks <= 40
        assert all(len(rank.prefix) <= 10 for rank in decode)
    assert blocks == 40  # each index is full, none beyond its share


def test_one_rank_holds_the_whole_index() -> None:
    decode = ranks(1, capacity_blocks=40)
    for i in range(8):
        decode.claim(f"{i:04d}" + "x" * (10 * BLOCK_TOKENS * 4), 160)[0].end()
    assert len(decode[0].prefix) == 40


def test_a_ranks_index_holds_no_more_than_its_engines_cache() -> None:
    decode = ranks(1, capacity_blocks=100)
    for i in range(10):
        decode.claim(f"{i:04d}" + "x" * (10 * BLOCK_TOKENS * 4), 160)[0].end()
    assert len(decode[0].prefix) == 100
    # The engine's scrape says its KV cache holds 40 blocks' worth: older prompts are gone there.
    load = EngineLoad(waiting=0, running=0, kv_usage=0.0, at=1.0, cache_tokens=40 * BLOCK_TOKENS)
    decode.publish(decode[0], EngineSnapshot(load=load, at=1.0))
    assert len(decode[0].prefix) == decode[0].prefix.capacity == 40
    recent = f"{9:04d}" + "x" * (10 * BLOCK_TOKENS * 4)
    assert decode[0].prefix.cached_tokens(decode[0].prefix.hashes(recent)) == 160
    oldest = f"{0:04d}" + "x" * (10 * BLOCK_TOKENS * 4)
    assert decode[0].prefix.cached_tokens(decode[0].prefix.hashes(oldest)) == 0
    # A larger cache never lifts the index above its configured share.
    load = dataclasses.replace(load, cache_tokens=10**6)
    decode.publish(decode[0], EngineSnapshot(load=load, at=2.0))
    assert decode[0].prefix.capacity == 100
