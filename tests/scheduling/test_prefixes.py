"""The prefill prefix index: keyed stable hashes, per-endpoint LRUs within bounds, feedback."""

from __future__ import annotations

import random
import subprocess
import sys
import tracemalloc

import pytest

from sidecar.scheduling.model import Candidate, Transfer
from sidecar.scheduling.policies import Qoe, predicted_ttft
from sidecar.scheduling.prefixes import (
    BYTES_PER_BLOCK,
    MAX_PROMPT_BLOCKS,
    MIN_BLOCKS,
    PrefillPrefixes,
    PrefixGuess,
    PrefixHasher,
    blocks_within,
)

KEY = b"0123456789abcdef0123456789abcdef"
A, B = "127.0.0.11:8000", "127.0.0.12:8000"


def text(seed: str, blocks: int) -> str:
    """``blocks`` blocks of 256 distinct characters (64 tokens each at 4 characters a token)."""
    return "".join(f"{seed}-{i:06d}-".ljust(256, "x") for i in range(blocks))


def index(**overrides: int | float) -> PrefillPrefixes:
    values: dict[str, int | float] = {
        "block_tokens": 64,
        "capacity_blocks": 1000,
        "max_blocks": 100_000,
    }
    values.update(overrides)
    return PrefillPrefixes(**values)  # type: ignore[arg-type]


def test_hashes_are_chained_keyed_and_stable_across_processes() -> None:
    hasher = PrefixHasher(KEY, block_tokens=64)
    shared = text("system", 4)
    one = hasher.hashes(shared + text("alice", 2))
    two = hasher.hashes(shared + text("bob", 2))
    assert len(one) == len(two) == 6
    assert one[:4] == two[:4]
    assert one[4] != two[4]  # a different block: a different chain from there on
    # A change in block 0 changes every hash after it: a match is always a prefix.
    moved = hasher.hashes("y" + shared[1:] + text("alice", 2))
    assert not set(moved) & set(one)
    # Another key, other digests: whoever reads Redis cannot recompute them.
    assert not set(PrefixHasher(b"another key, 16 bytes+", block_tokens=64).hashes(shared)) & set(
        one
    )
    # The same key in another process (another hash seed): the same digests.
    code = (
        "from sidecar.scheduling.prefixes import PrefixHasher;"
        f"print(PrefixHasher({KEY!r}, block_tokens=64).hashes({shared!r})[-1].hex())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    )
    assert other.stdout.strip() == one[3].hex()
    # Without a key each hasher draws its own.
    assert PrefixHasher(None, block_tokens=64).hashes(shared) != PrefixHasher(
        None, block_tokens=64
    ).hashes(shared)


def test_only_full_blocks_count_and_a_huge_prompt_is_bounded() -> None:
    hasher = PrefixHasher(KEY, block_tokens=64)
    assert hasher.hashes("x" * 255) == ()
    assert len(hasher.hashes("x" * 513)) == 2
    assert len(hasher.hashes(b"x" * 256 * (MAX_PROMPT_BLOCKS + 10))) == MAX_PROMPT_BLOCKS


def test_a_match_is_the_longest_indexed_prefix_per_endpoint() -> None:
    hasher = PrefixHasher(KEY, block_tokens=64)
    prefixes = index()
    system = text("system", 10)
    prefixes.placed(A, hasher.hashes(system + text("first", 3)))
    asked = hasher.hashes(system + text("second", 3))
    assert prefixes.matched_blocks(A, asked) == 10
    assert prefixes.matched_blocks(B, asked) == 0
    assert prefixes.predicted_tokens(10) == 640
    assert index(trust=0.5).predicted_tokens(10) == 320


def test_lru_ageing_against_the_capacity_and_the_memory_bound() -> None:
    hasher = PrefixHasher(KEY, block_tokens=64)
    prefixes = index(capacity_blocks=30)
    old, new = hasher.hashes(text("old", 20)), hasher.hashes(text("new", 20))
    prefixes.placed(A, old)
    prefixes.placed(A, new)
    assert len(prefixes) == 30
    assert prefixes.matched_blocks(A, new) == 20
    assert prefixes.matched_blocks(A, old) == 0  # its first blocks were the oldest
    # A scrape says the endpoint holds less: the index keeps less.
    prefixes.set_capacity(A, 20 * 64)
    assert len(prefixes) == 20
    # All endpoints together stay within max_blocks: each gets an equal share.
    bounded = index(max_blocks=40)
    for key, seed in ((A, "a"), (B, "b"), ("127.0.0.13:8000", "c")):
        bounded.placed(key, hasher.hashes(text(seed, 20)))
    assert len(bounded) <= 40 + MIN_BLOCKS


def test_memory_per_block_within_the_documented_figure() -> None:
    hasher = PrefixHasher(KEY, block_tokens=64)
    prompts = [text(f"p{n}", 100) for n in range(50)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        prefixes = index(capacity_blocks=10_000)
        for prompt in prompts:
            prefixes.placed(A, hasher.hashes(prompt))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(prefixes) == 5000
    assert used / len(prefixes) <= BYTES_PER_BLOCK
    assert blocks_within(48 * 2**20) == 48 * 2**20 // BYTES_PER_BLOCK
    # With the local index's default 65,536 blocks at 350 bytes: 26.1 MiB left, 155,648 blocks.
    assert blocks_within(48 * 2**20, 65536) == (48 * 2**20 - 65536 * 350) // BYTES_PER_BLOCK


def test_feedback_shrinks_an_endpoint_that_held_less_and_lets_it_grow_back() -> None:
    hasher = PrefixHasher(KEY, block_tokens=64)
    prefixes = index(capacity_blocks=1000)
    for n in range(10):
        prefixes.placed(A, hasher.hashes(text(f"doc{n}", 50)))
    assert len(prefixes) == 500
    prompt = text("doc9", 50)
    guess = PrefixGuess(hasher.hashes(prompt), len(prompt), matched_blocks=50)
    # A shortfall of more than a block but to no less than half the prediction: the text's
    # characters per token, not an eviction (the engine counts 3,000 tokens, we 3,200).
    assert prefixes.answered(A, guess, 3000, 2000) == pytest.approx(1000)
    assert len(prefixes) == 500
    # It found 1,000 of the 3,000 predicted cached: it evicted what the index kept.
    assert prefixes.answered(A, guess, 3000, 1000) == pytest.approx(2000)
    assert len(prefixes) == 450  # 90 % of what it held
    described = prefixes.describe()["endpoints"][A]
    assert described["held_less_than_predicted"] == 1
    assert described["limit_blocks"] == 450
    # An answer that held what was predicted lets it grow back by that prompt's blocks.
    assert prefixes.answered(A, guess, 3000, 3000) == pytest.approx(0)
    assert prefixes.describe()["endpoints"][A]["limit_blocks"] == 500
    assert prefixes.feedback() == "closed"


def test_answers_without_details_leave_the_index_open_loop() -> None:
    hasher = PrefixHasher(KEY, block_tokens=64)
    prefixes = index()
    assert prefixes.feedback() == "none"
    prompt = text("doc", 5)
    prefixes.placed(A, hasher.hashes(prompt))
    guess = PrefixGuess(hasher.hashes(prompt), len(prompt), 5)
    assert prefixes.answered(A, guess, 320, None) is None
    assert prefixes.feedback() == "open"
    assert prefixes.describe()["endpoints"][A]["answers_without"] == 1
    assert len(prefixes) == 5  # nothing learnt, nothing lost


def test_the_decision_counts_only_what_a_candidate_would_compute() -> None:
    transfer = Transfer()
    cold = Candidate(A, reserved_tokens=0)
    warm = Candidate(B, reserved_tokens=2000, cached_tokens=6000)
    # 8,000 tokens: the warm endpoint computes 2,000 behind 2,000 queued; the cold one 8,000.
    assert predicted_ttft(warm, 8000, transfer) < predicted_ttft(cold, 8000, transfer)
    # The transfer counts the whole prompt either way.
    assert predicted_ttft(Candidate(A, cached_tokens=8000), 8000, transfer) == pytest.approx(
        Candidate(A).speed.seconds(0) + transfer.seconds(8000)
    )
    # Sampling two of many never leaves out the endpoint predicted to hold the prompt.
    pool = [Candidate(f"127.0.0.{n}:8000") for n in range(20, 40)]
    pool.append(Candidate("127.0.0.50:8000", cached_tokens=6000))
    qoe = Qoe(random.Random(1), choices=2)
    assert all(qoe.choose(pool, 8000).key == "127.0.0.50:8000" for _ in range(50))  # type: ignore[union-attr]


def test_a_retest_never_takes_a_request_its_chosen_endpoint_holds_part_of() -> None:
    from sidecar.fleet.endpoints import Endpoint
    from sidecar.scheduling.decider import Decider
    from sidecar.scheduling.estimates import Health
    from sidecar.scheduling.placement import Planner
    from sidecar.scheduling.policies import make_policy
    from sidecar.scheduling.ranks import DecodeRanks
    from sidecar.scheduling.state import Reservation, SharedView

    hasher = PrefixHasher(KEY, block_tokens=64)
    prefixes = index()
    planner = Planner(
        Decider(make_policy("qoe", random.Random(1)), ttft_ratio=1000),
        stale_after_s=3.0,
        retest_s=15.0,
        prefixes=prefixes,
    )
    for host in ("127.0.0.11", "127.0.0.12"):
        planner.join(Endpoint(host, 8000), Health())
    rank = DecodeRanks(
        ["http://127.0.0.1:8200"],
        block_tokens=16,
        capacity_blocks=100,
        stale_after_s=3.0,
        rng=random.Random(1),
    )[0]
    # B answered once in 5 s (a stall): the policy picks A, and only B's speed keeps it away,
    # which is what a re-test renews.
    planner.prefill_observed(Reservation(B, 1000, 0), 5.0, now=0.0)
    view = SharedView({}, {}, {})
    system = text("system", 40)
    prefixes.placed(A, hasher.hashes(system + text("first", 4)))

    def decide(prompt: str, now: float):
        return planner.decide(
            rank,
            None,
            prompt_tokens=len(prompt) // 4,
            cached_tokens=0,
            view=view,
            now=now,
            wall=now,
            hashes=hasher.hashes(prompt),
        )

    assert decide(text("first look", 44), 0.0).endpoint == A  # both seen: re-test clocks start
    assert decide(system + text("u0", 4), 10.0).endpoint == A
    # 20 s later B is due a re-test; the prompt's prefix is on A: it stays there.
    held = decide(system + text("u1", 4), 20.0)
    assert (held.endpoint, held.reason) == (A, "scheduled")
    # A prompt neither holds: B is re-tested with it.
    other = decide(text("unrelated", 44), 21.0)
    assert (other.endpoint, other.reason) == (B, "retest")
