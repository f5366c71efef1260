"""The decodes' stall budget: a local prefill may not stall the decodes running on its engine
past what their TPOT and tail inter-token time absorb."""

from __future__ import annotations

import random
from typing import Any

import pytest

from sidecar.fleet.endpoints import Endpoint
from sidecar.scheduling.decider import Decider, StallBudget
from sidecar.scheduling.estimates import Health
from sidecar.scheduling.model import Candidate, LocalView, Speed
from sidecar.scheduling.placement import Planner
from sidecar.scheduling.policies import make_policy
from sidecar.scheduling.ranks import DecodeRanks
from sidecar.scheduling.state import SharedView

SPEED = Speed(s_per_token=1e-4, overhead_s=0.01)
# 40,000 tokens queued: 4.5 s predicted for 3,000 tokens, past 2 x the local 0.31 s.
BUSY = Candidate("p0", reserved_tokens=40_000, speed=SPEED)


def decider(**options: Any) -> Decider:
    return Decider(make_policy("qoe", random.Random(1)), **options)


def test_a_saturated_pool_keeps_a_prefill_local_only_within_the_decodes_budget():
    # 3,000 uncached tokens: 0.3 s of local compute, a 0.3 s stall for each running decode.
    within = LocalView(speed=SPEED, running=10, stall_credit_s=0.5)
    assert decider().decide([BUSY], within, prompt_tokens=3000).reason == "pool_saturated"
    over = LocalView(speed=SPEED, running=10, stall_credit_s=0.2)
    decision = decider().decide([BUSY], over, prompt_tokens=3000)
    assert (decision.endpoint, decision.reason) == ("p0", "decode_budget")
    assert decision.predicted_s == pytest.approx(decider().remote_seconds(BUSY, 3000))
    # Nothing running: nothing is stalled, whatever the budget.
    idle = LocalView(speed=SPEED, running=0, stall_credit_s=0.0)
    assert decider().decide([BUSY], idle, prompt_tokens=3000).reason == "pool_saturated"
    # No candidate: the prefill has nowhere else to go.
    assert decider().decide([], over, prompt_tokens=3000).reason == "pool_empty"


def test_short_and_locally_cached_prompts_respect_the_budget_without_a_stall_weight():
    unweighed = decider(stall_weight=0.0)
    over = LocalView(speed=SPEED, running=4, stall_credit_s=0.01)
    # 400 tokens: 0.04 s, more than the 0.01 s left.
    decision = unweighed.decide([BUSY], over, prompt_tokens=400)
    assert (decision.endpoint, decision.reason) == ("p0", "decode_budget")
    decision = unweighed.decide([BUSY], over, prompt_tokens=4400, cached_tokens=4000)
    assert (decision.endpoint, decision.reason) == ("p0", "decode_budget")
    within = LocalView(speed=SPEED, running=4, stall_credit_s=0.05)
    assert unweighed.decide([BUSY], within, prompt_tokens=400).reason == "short_prompt"


def test_a_queueing_decode_engine_sends_every_prefill_remote():
    # Requests wait for a seat: the decode tier is the bottleneck, a local prefill would take its
    # time from the decodes that bound the fleet, however much budget is left.
    queueing = LocalView(speed=SPEED, running=64, waiting=3, stall_credit_s=1.0)
    for tokens in (100, 3000):
        decision = decider(stall_weight=0.0).decide([BUSY], queueing, prompt_tokens=tokens)
        assert (decision.endpoint, decision.reason) == ("p0", "decode_budget")
    # Queued but nothing running (the engine's own prefills): nothing to protect.
    alone = LocalView(speed=SPEED, running=0, waiting=3, stall_credit_s=1.0)
    assert decider().decide([BUSY], alone, prompt_tokens=3000).endpoint is None


def test_always_is_unchanged_by_the_budget():
    over = LocalView(speed=SPEED, running=10, stall_credit_s=0.0)
    decision = decider(always=True).decide([BUSY], over, prompt_tokens=3000)
    assert (decision.endpoint, decision.reason) == ("p0", "scheduled")


def test_the_budget_refills_at_its_share_up_to_its_burst():
    budget = StallBudget(0.05, 1.0, now=100.0)
    assert budget.credit(100.0) == 1.0
    budget.spend(0.8, now=100.0)
    assert budget.credit(102.0) == pytest.approx(0.3)  # 0.2 + 2 s x 0.05
    budget.spend(0.5, now=102.0)  # a prefill with nowhere else to go: paid back first
    assert budget.credit(104.0) == pytest.approx(-0.1)
    assert budget.credit(1000.0) == 1.0


def test_the_planner_spends_each_ranks_budget_on_its_local_prefills():
    plan = Planner(
        decider(stall_weight=0.0, stall_share=0.01, stall_burst_s=0.1), stale_after_s=3.0
    )
    plan.join(Endpoint("127.0.0.1", 1), Health())
    ranks = DecodeRanks(
        ["http://d0", "http://d1"],
        block_tokens=16,
        capacity_blocks=64,
        stale_after_s=3,
        rng=random.Random(1),
    )
    busy, quiet = ranks[0], ranks[1]
    busy.inflight = 5  # this request and 4 running decodes
    quiet.inflight = 1  # this request alone

    def place(rank_index: int, now: float) -> str | None:
        decision = plan.decide(
            ranks[rank_index],
            None,
            prompt_tokens=400,  # short: 0.04 s of local compute at the local prior
            cached_tokens=0,
            view=SharedView({}, {}, {}),
            now=now,
            wall=now,
        )
        return decision.endpoint

    # 0.1 s of budget: two local prefills of 0.04 s, then the third would overrun it.
    assert [place(0, 0.0) for _ in range(3)] == [None, None, "127.0.0.1:1"]
    # The other rank's budget is its own; with nothing running there it is never spent.
    assert [place(1, 0.0) for _ in range(5)] == [None] * 5
    # Two seconds at 1 %: 0.02 s more, 0.04 s in all, enough for one more.
    assert [place(0, 2.0) for _ in range(2)] == [None, "127.0.0.1:1"]
