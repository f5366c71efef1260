"""The decider: local or remote prefill, and where, from plain values."""

from __future__ import annotations

import random

import pytest

from sidecar.scheduling.decider import Decider, predict_local
from sidecar.scheduling.model import Candidate, LocalView, Speed, Transfer
from sidecar.scheduling.policies import TOKENS_PER_WAITING, make_policy, predicted_ttft

SPEED = Speed(s_per_token=1e-4, overhead_s=0.01)
TRANSFER = Transfer()


def decider(**options) -> Decider:
    return Decider(make_policy("qoe", random.Random(1), choices=4), **options)


def idle(key: str = "p0", **fields) -> Candidate:
    return Candidate(key, speed=SPEED, **fields)


def test_no_candidates_prefill_locally():
    decision = decider().decide([], LocalView(), prompt_tokens=5000)
    assert (decision.endpoint, decision.reason) == (None, "pool_empty")
    assert decision.uncached_tokens == 5000
    assert decision.predicted_s == pytest.approx(predict_local(LocalView(), 5000))


def test_short_prompts_stay_local():
    decision = decider(min_tokens=512).decide([idle()], LocalView(), prompt_tokens=511)
    assert (decision.endpoint, decision.reason) == (None, "short_prompt")


def test_long_prompts_mostly_cached_locally_stay_local():
    decision = decider().decide([idle()], LocalView(), prompt_tokens=4100, cached_tokens=4000)
    assert (decision.endpoint, decision.reason) == (None, "prefix_cached")
    assert decision.uncached_tokens == 100


def test_a_long_prompt_goes_to_the_best_endpoint():
    candidates = [idle("p0", reserved_tokens=8000), idle("p1"), idle("p2", reserved_tokens=2000)]
    decision = decider().decide(candidates, LocalView(speed=SPEED), prompt_tokens=3000)
    assert (decision.endpoint, decision.reason) == ("p1", "scheduled")
    assert decision.predicted_s == pytest.approx(predicted_ttft(candidates[1], 3000, TRANSFER))


def test_a_remote_prefill_is_predicted_for_the_whole_prompt():
    # The prefill engine does not hold the decode engine's cache.
    decision = decider().decide(
        [idle()], LocalView(speed=SPEED), prompt_tokens=3000, cached_tokens=1000
    )
    assert decision.endpoint == "p0"
    assert decision.uncached_tokens == 2000
    assert decision.predicted_s == pytest.approx(predicted_ttft(idle(), 3000, TRANSFER))


def test_a_saturated_pool_sends_the_prefill_home():
    busy = idle(reserved_tokens=60_000)  # ~6 s of queue against ~0.3 s locally
    decision = decider(ttft_ratio=2.0).decide([busy], LocalView(speed=SPEED), prompt_tokens=3000)
    assert (decision.endpoint, decision.reason) == (None, "pool_saturated")
    assert decision.predicted_s == pytest.approx(predict_local(LocalView(speed=SPEED), 3000))


def test_the_ratio_sets_how_much_queue_is_acceptable():
    queued = idle(reserved_tokens=6000)  # remote 0.9 s, local 0.31 s: ratio 2.9
    local = LocalView(speed=SPEED)
    assert decider(ttft_ratio=2.0).decide([queued], local, prompt_tokens=3000).endpoint is None
    assert decider(ttft_ratio=4.0).decide([queued], local, prompt_tokens=3000).endpoint == "p0"


def test_a_busy_local_engine_makes_remote_worth_more_queue():
    queued = idle(reserved_tokens=6000)
    busy_home = LocalView(ahead_tokens=5000, speed=SPEED)
    decision = decider(ttft_ratio=2.0).decide([queued], busy_home, prompt_tokens=3000)
    assert decision.endpoint == "p0"


def test_always_disaggregates_short_and_saturated_prompts():
    always = decider(always=True)
    assert always.decide([idle()], LocalView(), prompt_tokens=10).endpoint == "p0"
    busy = idle(reserved_tokens=10**6)
    assert always.decide([busy], LocalView(), prompt_tokens=3000).reason == "scheduled"
    assert always.decide([], LocalView(), prompt_tokens=3000).reason == "pool_empty"


def test_predict_local_takes_the_larger_of_own_work_and_scraped_waiting():
    scraped_more = LocalView(ahead_tokens=500, waiting=2, speed=SPEED)
    own_more = LocalView(ahead_tokens=5000, waiting=2, speed=SPEED)
    assert predict_local(scraped_more, 100) == pytest.approx(
        0.01 + 1e-4 * (2 * TOKENS_PER_WAITING + 100)
    )
    assert predict_local(own_more, 100) == pytest.approx(0.01 + 1e-4 * 5100)
