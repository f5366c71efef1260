"""The decodes' stall budget: a local prefill may not stall the decodes running on its engine
past what their TPOT and tail inter-token time absorb."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from sidecar.fleet.endpoints import Endpoint
from sidecar.fleet.load import EngineLoad
from sidecar.scheduling.decider import Decider, StallBudget
from sidecar.scheduling.estimates import Health
from sidecar.scheduling.model import Candidate, LocalView, Speed
from sidecar.scheduling.placement import Planner
from sidecar.scheduling.policies import make_policy
from sidecar.scheduling.ranks import DecodeRank, DecodeRanks
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


def test_the_budget_is_the_reason_only_for_a_prefill_it_sends_remote():
    # An idle pool takes a long prompt anyway: the budget changed nothing, the reason says so
    # (the reasons are counted in /debug/scheduler and the records).
    idle = Candidate("p0", speed=SPEED)
    over = LocalView(speed=SPEED, running=10, waiting=2, stall_credit_s=0.0)
    decision = decider().decide([idle], over, prompt_tokens=3000)
    assert (decision.endpoint, decision.reason) == ("p0", "scheduled")
    decision = decider().decide([BUSY], over, prompt_tokens=3000)
    assert (decision.endpoint, decision.reason) == ("p0", "decode_budget")


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


def test_requests_waiting_on_the_decode_engine_do_not_send_prefills_remote():
    # vLLM's waiting gauge also counts the requests pulling their KV from a prefill server: on a
    # disaggregated engine it is rarely 0, and it says nothing about the decodes' slack. Within
    # the budget, a short prompt and a long one the saturated pool would delay both stay local.
    pulling = LocalView(speed=SPEED, running=64, waiting=3, stall_credit_s=1.0)
    short = decider(stall_weight=0.0).decide([BUSY], pulling, prompt_tokens=20)
    assert (short.endpoint, short.reason) == (None, "short_prompt")
    long = decider(stall_weight=0.0).decide([BUSY], pulling, prompt_tokens=3000)
    assert (long.endpoint, long.reason) == (None, "pool_saturated")
    # Past the budget, the budget alone sends it remote.
    spent = dataclasses.replace(pulling, stall_credit_s=0.01)
    decision = decider(stall_weight=0.0).decide([BUSY], spent, prompt_tokens=3000)
    assert (decision.endpoint, decision.reason) == ("p0", "decode_budget")


def test_a_prompt_with_nothing_to_compute_stays_local_whatever_the_budget_owes():
    # All 3,000 tokens cached locally: a local prefill computes nothing and stalls nothing, so
    # even a budget in debt does not send it to a server that would compute the whole prompt.
    in_debt = LocalView(speed=SPEED, running=4, stall_credit_s=-0.5)
    decision = decider().decide([BUSY], in_debt, prompt_tokens=3000, cached_tokens=3000)
    assert (decision.endpoint, decision.reason) == (None, "prefix_cached")


def test_a_budget_owes_at_most_one_burst():
    # Ten minutes without a prefill pool, every prefill local: the debt stops at one burst, so
    # the pool's return sends prefills remote for about a burst's refill, not for ten minutes.
    budget = StallBudget(0.05, 3.0, now=0.0)
    budget.share = 0.125
    for second in range(600):
        budget.spend(0.3, now=float(second))
    assert budget.credit(600.0) == pytest.approx(-3.0 + 0.125)
    assert budget.credit(600.0 + 3.0 / 0.125) == pytest.approx(0.0, abs=0.2)


def test_always_is_unchanged_by_the_budget():
    over = LocalView(speed=SPEED, running=10, stall_credit_s=0.0)
    decision = decider(always=True).decide([BUSY], over, prompt_tokens=3000)
    assert (decision.endpoint, decision.reason) == ("p0", "scheduled")


def test_the_budget_refills_at_its_share_up_to_its_burst():
    budget = StallBudget(0.05, 1.0, now=100.0)
    budget.share = 0.05
    assert budget.credit(100.0) == 1.0
    budget.spend(0.8, now=100.0)
    assert budget.credit(102.0) == pytest.approx(0.3)  # 0.2 + 2 s x 0.05
    budget.spend(0.5, now=102.0)  # a prefill with nowhere else to go: paid back first
    assert budget.credit(104.0) == pytest.approx(-0.1)
    assert budget.credit(1000.0) == 1.0


def test_the_share_follows_the_decodes_slack_against_their_tpot_slo():
    # A 50 ms SLO, aimed at 0.8 x 50 = 40 ms: a step of s leaves 1 - s / 40 ms of the time.
    budget = StallBudget(0.050, 1.0, now=0.0)
    assert (budget.share, budget.step_s) == (1.0, None)  # no step time known: the burst alone
    budget.scraped(0.0, itl_sum_s=10.0, itl_count=1000, now=0.0)
    assert budget.share == 1.0  # one scrape: no interval yet
    # 400 tokens in 10 s at 20 ms each (8 s of them), nothing spent: slack for half the time.
    budget.scraped(10.0, itl_sum_s=18.0, itl_count=1400, now=10.0)
    assert budget.step_s == pytest.approx(0.020)
    assert budget.share == pytest.approx(0.5)
    # This sidecar's local prefills took 2 s of the next 10: the engine's tokens came every
    # 30 ms, of which a fifth was their stall; the step is 24 ms, and 40 % of the time is left.
    budget.spend(2.0, now=15.0)
    budget.scraped(20.0, itl_sum_s=30.0, itl_count=1800, now=20.0)
    assert budget.step_s == pytest.approx(0.024)
    assert budget.share == pytest.approx(0.4)
    # A step at or past the aim (the decode tier is the bottleneck): nothing is left.
    budget.scraped(30.0, itl_sum_s=50.0, itl_count=2200, now=30.0)
    assert budget.step_s == pytest.approx(0.050)
    assert budget.share == 0.0
    credit = budget.credit(30.0)
    assert budget.credit(90.0) == credit  # no refill at a share of 0
    # The same scrape again, an interval without tokens, counters that went back (a restart):
    # the share stands.
    budget.scraped(30.0, itl_sum_s=99.0, itl_count=9999, now=31.0)
    budget.scraped(40.0, itl_sum_s=50.0, itl_count=2200, now=40.0)
    budget.scraped(50.0, itl_sum_s=1.0, itl_count=100, now=50.0)
    assert budget.share == 0.0
    # Counters from the restarted engine on: its decodes have slack again.
    budget.scraped(60.0, itl_sum_s=9.0, itl_count=500, now=60.0)
    assert budget.step_s == pytest.approx(0.020)
    assert budget.share == pytest.approx(0.5)


def test_a_tpot_slo_of_zero_turns_the_budget_off():
    queueing = LocalView(speed=SPEED, running=64, waiting=3, stall_credit_s=0.0)
    assert decider(tpot_slo_s=0.0).decide([BUSY], queueing, prompt_tokens=3000).endpoint is None


def place_on(plan: Planner, rank: DecodeRank, now: float, tokens: int = 400) -> str | None:
    decision = plan.decide(
        rank,
        None,
        prompt_tokens=tokens,  # 400, short: 0.04 s of local compute at the local prior
        cached_tokens=0,
        view=SharedView({}, {}, {}),
        now=now,
        wall=now,
    )
    return decision.endpoint


def planner(**options: Any) -> tuple[Planner, DecodeRanks]:
    plan = Planner(decider(stall_weight=0.0, **options), stale_after_s=3.0)
    plan.join(Endpoint("127.0.0.1", 1), Health())
    ranks = DecodeRanks(
        ["http://d0", "http://d1"],
        block_tokens=16,
        capacity_blocks=64,
        stale_after_s=3,
        rng=random.Random(1),
    )
    return plan, ranks


def scrape(ranks: DecodeRanks, rank: DecodeRank, at: float, itl_sum: float, tokens: int) -> None:
    load = EngineLoad(0.0, 4.0, None, at, itl_sum_s=itl_sum, itl_count=float(tokens))
    ranks.publish(rank, dataclasses.replace(rank.engine, load=load))


def test_the_planner_spends_each_ranks_budget_on_its_local_prefills():
    plan, ranks = planner(stall_burst_s=0.1)
    busy, quiet = ranks[0], ranks[1]
    busy.inflight = quiet.inflight = 1  # this request alone
    scrape(ranks, busy, 0.0, 0.0, 0)
    assert place_on(plan, busy, 0.0) is None  # nothing running: nothing spent
    busy.inflight = 5  # this request and 4 running decodes
    # The engine's decodes step every 39.6 ms: 1 % of the time to spare under 0.8 x 50 ms.
    scrape(ranks, busy, 1.0, 3.96, 100)
    # 0.1 s of budget: two local prefills of 0.04 s, then the third would overrun it.
    assert [place_on(plan, busy, 1.0) for _ in range(3)] == [None, None, "127.0.0.1:1"]
    # The other rank's budget is its own; with nothing running there it is never spent.
    assert [place_on(plan, quiet, 1.0) for _ in range(5)] == [None] * 5
    # Two seconds at 1 %: 0.02 s more, 0.04 s in all, enough for one more.
    assert [place_on(plan, busy, 3.0) for _ in range(2)] == [None, "127.0.0.1:1"]


def test_decodes_with_slack_keep_their_local_prefills_and_a_bottleneck_loses_them():
    plan, ranks = planner(stall_burst_s=0.1)
    rank = ranks[0]
    rank.inflight = 5
    scrape(ranks, rank, 0.0, 0.0, 0)
    assert place_on(plan, rank, 0.0) is None
    # 20 ms steps: half the time to spare, 0.5 s of budget a second, more than the 0.04 s of
    # each of ten local prefills a second.
    scrape(ranks, rank, 1.0, 2.0, 100)
    for tick in range(1, 40):
        now = 1.0 + tick / 10
        assert place_on(plan, rank, now) is None
    # Tokens every 65.4 ms over the next 5 s, of which this sidecar's prefills took 1.56 s: the
    # decodes step every 45 ms, and none of the time is theirs to give. The burst refilled at
    # the share the decodes had till now holds two more prefills, and then none fits.
    scrape(ranks, rank, 6.0, 2.0 + 100 * 0.045 / (1 - 39 * 0.04 / 5), 200)
    assert [place_on(plan, rank, 6.0) for _ in range(3)] == [None, None, "127.0.0.1:1"]
    assert [place_on(plan, rank, 6.0 + tick / 2) for tick in range(1, 6)] == ["127.0.0.1:1"] * 5


def test_a_step_time_older_than_the_staleness_bound_no_longer_sets_the_refill():
    # The engine's decodes step every 45 ms (past 0.8 x 50 ms): nothing refills. Then its
    # scrapes fail (an overloaded engine whose /metrics times out): three scrape intervals after
    # the measurement the step is unknown again, and the burst alone bounds.
    plan, ranks = planner(stall_burst_s=0.1)
    rank = ranks[0]
    rank.inflight = 5
    scrape(ranks, rank, 0.0, 0.0, 0)
    assert place_on(plan, rank, 0.0) is None
    scrape(ranks, rank, 1.0, 4.5, 100)
    assert [place_on(plan, rank, 1.0) for _ in range(3)] == [None, None, "127.0.0.1:1"]
    ranks.publish(rank, dataclasses.replace(rank.engine, load=None))
    budget = plan.budget_of(rank)
    assert place_on(plan, rank, 3.9) == "127.0.0.1:1"
    assert budget.rate(3.9) == 0.0
    # Past 1.0 + 3 s: refilled at 1 s per second from 4.0 on, 0.1 s by 4.1.
    assert budget.rate(4.1) == 1.0
    assert place_on(plan, rank, 4.1) is None
    assert budget.credit(4.1) == pytest.approx(0.1 - 0.04, abs=0.01)
