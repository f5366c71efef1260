"""Prefill-partner policies: pure functions of the candidates and a seeded random source."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from sidecar.config import Settings
from sidecar.defaults import QOE_CHOICES
from sidecar.scheduling.model import Candidate, Speed, Transfer
from sidecar.scheduling.policies import (
    POLICIES,
    TOKENS_PER_WAITING,
    Qoe,
    make_policy,
    predicted_ttft,
)


def rng() -> random.Random:
    return random.Random(7)


def key(choice: Candidate | None) -> str:
    assert choice is not None
    return choice.key


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_returns_none_without_candidates(name):
    assert make_policy(name, rng()).choose([], 1000) is None


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_names_itself_and_picks_a_candidate(name):
    policy = make_policy(name, rng())
    candidates = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert policy.name == name
    assert policy.choose(candidates, 100) in candidates


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        make_policy("fastest", rng())


def test_round_robin_cycles_in_key_order_whatever_the_input_order():
    policy = make_policy("round_robin", rng())
    picks = [key(policy.choose([Candidate("b"), Candidate("a")], 1)) for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_least_loaded_takes_the_global_minimum_of_scraped_load():
    candidates = [
        Candidate("busy", waiting=3, running=1),
        Candidate("idle", waiting=0, running=1, reserved_requests=9),  # reservations ignored
        Candidate("mid", waiting=1, running=1),
    ]
    policy = make_policy("least_loaded", rng())
    assert {key(policy.choose(candidates, 10)) for _ in range(20)} == {"idle"}


def test_least_loaded_counts_reservations_for_endpoints_not_scraped_yet():
    candidates = [Candidate("new", reserved_requests=2), Candidate("seen", waiting=1, running=0)]
    assert key(make_policy("least_loaded", rng()).choose(candidates, 10)) == "seen"


def test_least_loaded_breaks_ties_at_random():
    candidates = [Candidate("a", waiting=0), Candidate("b", waiting=0)]
    policy = make_policy("least_loaded", rng())
    picks = Counter(key(policy.choose(candidates, 1)) for _ in range(200))
    assert set(picks) == {"a", "b"}


def test_power_of_two_prefers_the_larger_of_reservations_and_scrape():
    # "b" has fewer reservations but its scrape shows more work from other sidecars.
    candidates = [
        Candidate("a", reserved_requests=2),
        Candidate("b", reserved_requests=0, waiting=5),
    ]
    assert key(make_policy("power_of_two", rng()).choose(candidates, 1)) == "a"


def test_predicted_ttft_counts_the_larger_of_reserved_and_scraped_queue():
    speed = Speed(s_per_token=1e-4, overhead_s=0.02)
    transfer = Transfer(fixed_s=0.002, s_per_token=1e-7)
    reserved = Candidate("a", reserved_tokens=5000, waiting=1, speed=speed)
    scraped = Candidate("b", reserved_tokens=0, waiting=3, speed=speed)
    assert predicted_ttft(reserved, 1000, transfer) == pytest.approx(
        0.02 + 1e-4 * 6000 + 0.002 + 1e-7 * 1000
    )
    assert predicted_ttft(scraped, 1000, transfer) == pytest.approx(
        0.02 + 1e-4 * (3 * TOKENS_PER_WAITING + 1000) + 0.002 + 1e-7 * 1000
    )


def test_qoe_weighs_queue_by_the_endpoint_speed():
    slow = Candidate("slow", reserved_tokens=1000, speed=Speed(4e-4, 0.02))
    fast = Candidate("fast", reserved_tokens=4000, speed=Speed(1e-4, 0.02))
    policy = Qoe(rng(), choices=2)
    assert key(policy.choose([slow, fast], 1000)) == "fast"
    # 2000 tokens at 0.4 ms (0.8 s) against 5000 at 0.1 ms (0.5 s).


def test_qoe_with_two_choices_never_picks_the_worst_endpoint():
    candidates = [Candidate(str(i), reserved_tokens=1000 * i) for i in range(5)]
    policy = make_policy("qoe", rng(), choices=2)
    picks = Counter(key(policy.choose(candidates, 500)) for _ in range(500))
    assert "4" not in picks
    assert picks["0"] > picks["1"] > picks["2"] > picks["3"] > 0


def test_qoe_with_all_choices_takes_the_best():
    candidates = [Candidate(str(i), reserved_tokens=1000 * (3 - i)) for i in range(4)]
    policy = make_policy("qoe", rng(), choices=4)
    assert {key(policy.choose(candidates, 1)) for _ in range(20)} == {"3"}


def test_qoe_by_default_compares_every_endpoint_of_a_pool_of_eight():
    """The default (SIDECAR_SCHEDULER_CHOICES too): the best of all 8, every time."""
    candidates = [Candidate(str(i), reserved_tokens=1000 * (7 - i)) for i in range(8)]
    policy = make_policy("qoe", rng())
    assert {key(policy.choose(candidates, 1)) for _ in range(50)} == {"7"}
    assert Settings(decode_url="http://127.0.0.1:1").scheduler_choices == QOE_CHOICES == 8


def test_policies_are_reproducible_with_the_same_seed():
    candidates = [Candidate(str(i)) for i in range(6)]
    first = [make_policy("random", random.Random(3)).choose(candidates, 1) for _ in range(5)]
    again = [make_policy("random", random.Random(3)).choose(candidates, 1) for _ in range(5)]
    assert first == again


# --- prefix affinity ------------------------------------------------------------------------

PROMPT = 8000
"""A long prompt whose prefix two endpoints hold (after a spill, say)."""


def holders(queue_a: int, queue_b: int) -> list[Candidate]:
    """Two equal endpoints both predicted to hold 7,000 tokens of the prompt; ``a`` ranks
    first for its prefix."""
    return [
        Candidate("a", reserved_tokens=queue_a, cached_tokens=7000, affinity=20),
        Candidate("b", reserved_tokens=queue_b, cached_tokens=7000, affinity=10),
    ]


def test_qoe_keeps_a_prefix_that_two_endpoints_hold_on_its_home():
    """A queue difference smaller than computing the prompt does not split the prefix: every
    request goes to the home, whose queue is longer by 5,000 tokens here (it would be the other
    one's by predicted time alone, each credited with what it holds)."""
    policy = Qoe(rng())
    assert {key(policy.choose(holders(6000, 1000), PROMPT)) for _ in range(50)} == {"a"}
    credited_each = [predicted_ttft(c, PROMPT, Transfer()) for c in holders(6000, 1000)]
    assert credited_each[1] < credited_each[0]  # what the rule changes


def test_qoe_spills_a_prefix_when_waiting_at_home_costs_more_than_computing_elsewhere():
    policy = Qoe(rng())
    # 9,000 tokens queued at home, against the whole prompt (8,000) on an idle endpoint.
    assert key(policy.choose(holders(9000 + 1000, 0), PROMPT)) == "b"


def test_qoe_gives_a_prefix_nobody_holds_its_home_when_the_endpoints_tie():
    policy = Qoe(rng())
    cold = [Candidate(k, affinity=w) for k, w in (("a", 5), ("b", 9), ("c", 7))]
    assert {key(policy.choose(cold, 3000)) for _ in range(30)} == {"b"}
    # With no prefix known (no affinities), a tie is broken at random, as before.
    blind = [Candidate(k) for k in ("a", "b", "c")]
    assert len({key(policy.choose(blind, 3000)) for _ in range(60)}) == 3


def test_qoe_sends_a_prefix_nobody_holds_home_unless_waiting_there_costs_more_than_it():
    """A home that holds nothing yet is credited with the prompt it will hold: a cold prompt of
    3,000 tokens waits behind 2,000 queued at home, not behind 4,000."""
    policy = Qoe(rng())

    def cold(home_queue: int) -> list[Candidate]:
        return [Candidate("a", reserved_tokens=home_queue, affinity=9), Candidate("b", affinity=5)]

    assert key(policy.choose(cold(2000), 3000)) == "a"
    assert key(policy.choose(cold(4000), 3000)) == "b"


def test_qoe_compares_the_home_whatever_the_sample():
    candidates = [Candidate(str(i), affinity=i + 1) for i in range(8)]
    policy = Qoe(rng(), choices=2)
    assert {key(policy.choose(candidates, 3000)) for _ in range(40)} == {"7"}


def test_qoe_without_its_home_takes_the_best_of_the_others_not_any_within_the_credit():
    """A cold prompt whose home is busy goes to the fastest of the others: the home's credit
    decides whether the home wins, not which of the others does."""
    policy = Qoe(rng())
    cold = [
        Candidate("home", reserved_tokens=5000, affinity=9),
        Candidate("a", affinity=5),
        Candidate("b", reserved_tokens=900, affinity=3),
    ]
    assert {key(policy.choose(cold, 1000)) for _ in range(50)} == {"a"}
