"""The pure placement logic (sidecar.scheduling.placement), shared with the simulator."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from sidecar.fleet.endpoints import Endpoint
from sidecar.fleet.load import EngineLoad
from sidecar.scheduling.decider import Decider
from sidecar.scheduling.estimates import BEST_KEPT_FOR, Health
from sidecar.scheduling.model import Decision, Speed
from sidecar.scheduling.placement import (
    PREFILL_PRIOR,
    STALL_KEPT_S,
    EndpointState,
    Planner,
    reserved_tokens,
)
from sidecar.scheduling.policies import make_policy
from sidecar.scheduling.prefixes import PrefixHasher
from sidecar.scheduling.prompts import PrefixIndex, tokens_of_text
from sidecar.scheduling.ranks import DecodeRanks
from sidecar.scheduling.state import Load, Reservation, SharedView

EMPTY = SharedView({}, {}, {})


def planner(*ports: int, policy: str = "qoe") -> Planner:
    plan = Planner(
        Decider(make_policy(policy, random.Random(1)), ttft_ratio=1000), stale_after_s=3.0
    )
    for port in ports:
        state = EndpointState(Endpoint("127.0.0.1", port), Health())
        plan.pool[state.key] = state
    return plan


def test_candidates_are_the_available_endpoints_with_their_reservations_and_fresh_scrapes():
    plan = planner(1, 2, 3, 4)
    plan.pool["127.0.0.1:2"].draining = True
    plan.pool["127.0.0.1:3"].health.eject(now=100.0)
    plan.pool["127.0.0.1:1"].load = EngineLoad(waiting=2, running=1, kv_usage=0.5, at=98.0)
    plan.pool["127.0.0.1:4"].load = EngineLoad(waiting=7, running=1, kv_usage=None, at=96.0)
    view = SharedView({"127.0.0.1:1": Load(900, 2)}, {}, {})
    [one, four] = plan.candidates(view, now=100.0, wall=5000.0)
    assert (one.key, one.reserved_tokens, one.reserved_requests) == ("127.0.0.1:1", 900, 2)
    assert (one.waiting, one.running, one.kv_usage) == (2, 1, 0.5)
    assert (four.key, four.waiting, four.running) == ("127.0.0.1:4", None, None)  # 4 s old
    # Ejected by another sidecar until a wall time still ahead: not a candidate either.
    ejected = SharedView({}, {}, {"127.0.0.1:4": 5001.0})
    assert [c.key for c in plan.candidates(ejected, now=100.0, wall=5000.0)] == ["127.0.0.1:1"]


def test_a_published_speed_counts_until_this_sidecar_has_its_own_samples():
    plan = planner(1)
    shared = Speed(5e-5, 0.01)
    view = SharedView({}, {"127.0.0.1:1": shared}, {})
    assert plan.candidates(view, 0.0, 0.0)[0].speed == shared
    for _ in range(3):
        plan.prefill_observed(Reservation("127.0.0.1:1", 1000, 0), 0.5, now=0.0)
    assert plan.candidates(view, 0.0, 0.0)[0].speed == plan.pool["127.0.0.1:1"].speed.value
    assert plan.candidates(view, 0.0, 0.0)[0].speed != shared


def test_a_stranger_is_predicted_with_the_prior():
    plan = planner(1)
    assert plan.candidate("127.0.0.9:80", EMPTY, 0.0, 0.0).speed == PREFILL_PRIOR
    assert plan.candidate("127.0.0.1:1", EMPTY, 0.0, 0.0).key == "127.0.0.1:1"


def test_a_placement_reserves_the_uncached_tokens():
    assert reserved_tokens(Decision("x", "scheduled", 5000, 1200)) == 1200


def test_the_decision_weighs_the_rank_it_is_made_for():
    plan = planner(1)
    ranks = DecodeRanks(
        ["http://d"], block_tokens=16, capacity_blocks=64, stale_after_s=3, rng=random.Random(1)
    )
    rank = ranks[0]
    # Plenty of local work ahead: the remote endpoint wins.
    rank.ahead_tokens = 50_000
    decision = plan.decide(
        rank, None, prompt_tokens=4000, cached_tokens=0, view=EMPTY, now=0.0, wall=0.0
    )
    assert (decision.endpoint, decision.reason) == ("127.0.0.1:1", "scheduled")
    # The same prompt cached on the rank: local, whatever the pool.
    decision = plan.decide(
        rank, None, prompt_tokens=4000, cached_tokens=3900, view=EMPTY, now=0.0, wall=0.0
    )
    assert (decision.endpoint, decision.reason) == (None, "prefix_cached")


def test_what_is_learnt_from_outcomes():
    plan = planner(1)
    before = plan.pool["127.0.0.1:1"].speed.samples
    speed = plan.prefill_observed(Reservation("127.0.0.1:1", 1000, 3000), 0.4, now=0.0)
    assert speed == plan.pool["127.0.0.1:1"].speed.value
    assert plan.pool["127.0.0.1:1"].speed.samples == before + 1
    assert plan.prefill_observed(Reservation("127.0.0.1:9", 1000, 0), 0.4, now=0.0) is None  # gone
    plan.local_observed(2000, 1000, 0.3)
    assert plan.local_speed.samples == 1


@pytest.mark.parametrize(("waiting", "queued"), [(3.0, True), (None, False), (0.0, False)])
def test_the_outlook_counts_a_queue_only_when_the_scrape_shows_one(waiting, queued):
    plan = planner(1)
    plan.pool["127.0.0.1:1"].load = EngineLoad(waiting, 1, None, at=0.0)
    reservation = Reservation("127.0.0.1:1", 1000, ahead_tokens=10_000)
    outlook = plan.outlook("127.0.0.1:1", reservation, 1000, 0.2, EMPTY, now=0.5)
    assert outlook.queued is queued
    assert outlook.compute_s == pytest.approx(PREFILL_PRIOR.s_per_token * 1000)


def test_claiming_by_block_hashes_is_claiming_by_text():
    text = "x" * 64 * 10
    by_text = DecodeRanks(
        ["http://d"], block_tokens=16, capacity_blocks=64, stale_after_s=3, rng=random.Random(1)
    )
    by_blocks = DecodeRanks(
        ["http://d"], block_tokens=16, capacity_blocks=64, stale_after_s=3, rng=random.Random(1)
    )
    hashes = PrefixIndex(block_tokens=16, capacity_blocks=1).hashes(text)
    for _ in range(2):
        claim_t, cached_t = by_text.claim(text, tokens_of_text(len(text)))
        claim_b, cached_b = by_blocks.claim_blocks(hashes, tokens_of_text(len(text)))
        assert cached_t == cached_b
        assert claim_t.index == claim_b.index
    assert cached_t == 160
    assert tokens_of_text(3) == 1
    assert tokens_of_text(4001) == 1000


# --- re-tests and ageing -----------------------------------------------------------------------


def ageing_planner(*ports: int, half_life_s: float | None, retest_s: float) -> Planner:
    plan = Planner(
        Decider(make_policy("qoe", random.Random(1)), ttft_ratio=1000),
        stale_after_s=3.0,
        half_life_s=half_life_s,
        retest_s=retest_s,
    )
    for port in ports:
        plan.join(Endpoint("127.0.0.1", port), Health())
    return plan


def decide_at(plan: Planner, now: float, view: SharedView = EMPTY) -> Decision:
    ranks = DecodeRanks(
        ["http://d"], block_tokens=16, capacity_blocks=64, stale_after_s=3, rng=random.Random(1)
    )
    ranks[0].ahead_tokens = 50_000  # remote wins whenever the pool is usable
    return plan.decide(
        ranks[0], None, prompt_tokens=4000, cached_tokens=0, view=view, now=now, wall=now
    )


def test_an_endpoint_the_policy_stopped_choosing_is_retested_once_per_interval():
    plan = ageing_planner(1, 2, half_life_s=None, retest_s=10.0)
    slow = "127.0.0.1:1"
    plan.prefill_observed(Reservation(slow, 1000, 0), 5.0, now=0.0)  # one stall: 2 s+ overhead
    chosen = [decide_at(plan, 0.5 * t) for t in range(60)]  # a remote prefill every 0.5 s
    retests = [(0.5 * t, d.reason) for t, d in enumerate(chosen) if d.endpoint == slow]
    # First considered at 0 s, then re-tested every 10 s; the policy itself never picks it.
    assert retests == [(10.0, "retest"), (20.0, "retest")]
    predicted = chosen[20].predicted_s
    assert predicted is not None
    assert predicted > 1.0  # predicted at its stalled speed: a re-test, not a policy's choice


def test_an_endpoint_the_other_sidecars_measure_is_not_retested_until_they_stop():
    plan = ageing_planner(1, 2, half_life_s=None, retest_s=10.0)
    slow = "127.0.0.1:1"
    plan.prefill_observed(Reservation(slow, 1000, 0), 5.0, now=0.0)  # stalled: 2 s+ overhead

    def published(now: float, renewed_until: float) -> SharedView:
        # Another sidecar's estimate of the stalled endpoint, published anew every 4 s (each of
        # its prefills there), until ``renewed_until``: as stalled as this sidecar's own.
        step = int(min(now, renewed_until) // 4)
        return SharedView({}, {slow: Speed(3e-4, 2.0 + step * 1e-3)}, {})

    # Measured by the fleet every 4 s: this sidecar never re-tests it, though it sent it nothing.
    measured = [decide_at(plan, 0.5 * t, published(0.5 * t, 1e9)) for t in range(60)]
    assert {d.endpoint for d in measured} == {"127.0.0.1:2"}
    # The others stop at 30 s (their last new speed seen at 28 s): re-tested 10 s later.
    chosen = [(0.5 * t, decide_at(plan, 0.5 * t, published(0.5 * t, 30.0))) for t in range(60, 90)]
    retests = [(now, d.reason) for now, d in chosen if d.endpoint == slow]
    assert retests == [(38.0, "retest")]


def test_only_an_endpoint_kept_away_by_its_speed_is_retested():
    """A re-test renews the one thing an endpoint the policy avoids stops being told: its speed.
    One avoided for its queue (scraped and reserved: known) or for what the chosen one holds is
    not re-tested, and does not stand in the way of one avoided for its speed."""
    plan = ageing_planner(1, 2, 3, 4, half_life_s=None, retest_s=10.0)
    busy, slow, fast, a_bit_slower = (f"127.0.0.1:{port}" for port in (1, 2, 3, 4))
    plan.prefill_observed(Reservation(slow, 1000, 0), 5.0, now=0.0)  # a stall: 2 s+ overhead
    # A healthy engine's fit a little off the prior: not what a re-test is for.
    plan.prefill_observed(
        Reservation(a_bit_slower, 4000, 0), 1.3 * PREFILL_PRIOR.seconds(4000), now=0.0
    )
    queued = SharedView({busy: Load(200_000, 20)}, {}, {})  # 20 s of prefill queued
    chosen = [decide_at(plan, 0.5 * t, queued) for t in range(60)]
    retests = [(0.5 * t, d.endpoint) for t, d in enumerate(chosen) if d.reason == "retest"]
    # All were first seen at 0 s (the busy one first, so it is "older" at every turn): only
    # the stalled one is re-tested, every 10 s; the busy one never, as fast as the chosen one,
    # nor the one a little slower by its estimate.
    assert retests == [(10.0, slow), (20.0, slow)]
    assert {d.endpoint for d in chosen if d.reason == "scheduled"} == {fast}


def test_no_retest_when_disabled_or_when_the_decision_is_local():
    plan = ageing_planner(1, 2, half_life_s=None, retest_s=0.0)
    plan.prefill_observed(Reservation("127.0.0.1:1", 1000, 0), 5.0, now=0.0)
    assert {decide_at(plan, float(t)).endpoint for t in range(100)} == {"127.0.0.1:2"}
    # A re-test only changes where a remote prefill goes, never local into remote.
    plan = ageing_planner(1, 2, half_life_s=None, retest_s=1.0)
    decide_at(plan, 0.0)
    ranks = DecodeRanks(
        ["http://d"], block_tokens=16, capacity_blocks=64, stale_after_s=3, rng=random.Random(1)
    )
    short = plan.decide(
        ranks[0], None, prompt_tokens=100, cached_tokens=0, view=EMPTY, now=50.0, wall=50.0
    )
    assert (short.endpoint, short.reason) == (None, "short_prompt")


def test_a_stalled_endpoint_is_chosen_again_once_its_estimate_has_aged():
    plan = ageing_planner(1, 2, half_life_s=5.0, retest_s=0.0)
    slow, fast = "127.0.0.1:1", "127.0.0.1:2"
    plan.prefill_observed(Reservation(fast, 4000, 0), PREFILL_PRIOR.seconds(4000), now=0.0)
    plan.prefill_observed(Reservation(slow, 1000, 0), 5.0, now=0.0)
    # The fast one has a queue (0.2 s of work): still far better than a 5 s stall.
    busy = SharedView({fast: Load(2000, 2)}, {}, {})
    assert decide_at(plan, 1.0, busy).endpoint == fast
    # Four half-lives later the stall weighs 1/16: 0.33 s, less than the fast one's queue.
    assert (decide_at(plan, 20.0, busy).endpoint, decide_at(plan, 20.0, busy).reason) == (
        slow,
        "scheduled",
    )
    # Without ageing it would not be chosen again, however long it had been.
    ageless = ageing_planner(1, 2, half_life_s=None, retest_s=0.0)
    ageless.prefill_observed(Reservation(fast, 4000, 0), PREFILL_PRIOR.seconds(4000), now=0.0)
    ageless.prefill_observed(Reservation(slow, 1000, 0), 5.0, now=0.0)
    assert decide_at(ageless, 1e6, busy).endpoint == fast


def test_a_published_speed_ages_from_when_it_was_seen_to_change():
    plan = ageing_planner(1, half_life_s=10.0, retest_s=0.0)
    stalled = Speed(3e-4, 2.0)
    view = SharedView({}, {"127.0.0.1:1": stalled}, {})
    assert plan.candidates(view, 100.0, 100.0)[0].speed == stalled
    half = plan.candidates(view, 110.0, 110.0)[0].speed
    assert half.overhead_s == pytest.approx((2.0 + PREFILL_PRIOR.overhead_s) / 2)
    # Published anew (another sidecar's new observation): fresh again.
    renewed = SharedView({}, {"127.0.0.1:1": Speed(3e-4, 1.0)}, {})
    assert plan.candidates(renewed, 120.0, 120.0)[0].speed == Speed(3e-4, 1.0)


def test_every_sidecar_gives_a_prefix_the_same_home_and_prefixes_spread_over_homes():
    """Two planners (two sidecars) sharing a hash key rank the endpoints alike for a prompt's
    prefix; prompts that share their first 256 bytes share it; 64 prefixes over four endpoints
    land on each of them."""
    hasher = PrefixHasher(b"k" * 32, block_tokens=16)
    first, second = planner(1, 2, 3, 4), planner(4, 3, 2, 1)

    def home(plan: Planner, prompt: str) -> str:
        found = plan.candidates(EMPTY, 0.0, 0.0, hasher.hashes(prompt))
        return max(found, key=lambda c: c.affinity).key

    shared_start = "s" * 256
    assert home(first, shared_start + "one") == home(second, shared_start + "two")
    homes = Counter(home(first, f"prefix {i} " * 40) for i in range(64))
    assert set(homes) == {f"127.0.0.1:{port}" for port in (1, 2, 3, 4)}
    assert all(c.affinity == 0 for c in first.candidates(EMPTY, 0.0, 0.0))  # no prompt known


# --- idle ageing toward the best measured speed ------------------------------------------------

HEALTHY = Speed(2e-5, 0.005)  # 50,000 tokens/s: five times the prior
PROMPT = 600


def thawed_pool(idle_half_life_s: float | None) -> tuple[Planner, str, str]:
    """Two equal endpoints, both measured at ``HEALTHY``; then one froze for 5 s under load:
    its scrapes went unanswered, three of its prefills answered 5 s late, at 100 s."""
    plan = Planner(
        Decider(make_policy("qoe", random.Random(1)), ttft_ratio=1000),
        stale_after_s=3.0,
        half_life_s=60.0,
        idle_half_life_s=idle_half_life_s,
        retest_s=0.0,  # the ageing alone
    )
    thawed, other = "127.0.0.1:1", "127.0.0.1:2"
    for port in (1, 2):
        measured(plan, port, HEALTHY)
    froze(plan, thawed)
    return plan, thawed, other


def measured(plan: Planner, port: int, speed: Speed) -> str:
    """A new endpoint on ``port``, measured 20 times at ``speed`` at 90 s."""
    key = str(plan.join(Endpoint("127.0.0.1", port), Health()).endpoint)
    for i in range(20):
        work = PROMPT * (1 + i % 4)
        plan.prefill_observed(Reservation(key, PROMPT, work - PROMPT), speed.seconds(work), 90.0)
    return key


def froze(plan: Planner, key: str) -> None:
    """``key`` froze for 5 s: a scrape went unanswered, three prefills answered 5 s late."""
    plan.pool[key].load = None
    for ahead in range(3):
        plan.prefill_observed(Reservation(key, PROMPT, ahead * PROMPT), 5.0, now=100.0)


def scraped_idle(plan: Planner, key: str, start: float, end: float) -> None:
    """Scrapes of ``key`` every second from ``start`` to ``end``: nothing waiting or running."""
    for second in range(int(start), int(end) + 1):
        plan.pool[key].load = EngineLoad(waiting=0, running=0, kv_usage=0.0, at=float(second))


def predicted(plan: Planner, key: str, now: float, view: SharedView = EMPTY) -> float:
    [candidate] = [c for c in plan.candidates(view, now, now) if c.key == key]
    return candidate.speed.seconds(PROMPT)


def test_an_idle_thawed_endpoint_ages_toward_its_best_speed_and_is_chosen_again():
    plan, thawed, other = thawed_pool(idle_half_life_s=5.0)
    assert predicted(plan, thawed, 100.0) > 1.0  # the freeze, in its fit
    for key in (thawed, other):
        scraped_idle(plan, key, 101.0, 160.0)
    # 60 s of idle scrapes, twelve idle half-lives: predicted as the endpoint that did not
    # freeze (both aged toward the prior for a minute), not seconds slower.
    assert predicted(plan, thawed, 160.0) == pytest.approx(predicted(plan, other, 160.0), rel=0.2)
    assert predicted(plan, thawed, 160.0) < PREFILL_PRIOR.seconds(PROMPT) / 2
    # With another prompt queued on the other endpoint, the thawed one is chosen.
    queued = SharedView({other: Load(PROMPT, 1)}, {}, {})
    assert decide_at(plan, 160.0, queued).endpoint == thawed
    assert decide_at(plan, 160.0, queued).reason == "scheduled"


def test_a_slower_endpoint_that_froze_stays_as_slow_as_it_measured():
    """Toward its own best, not the pool's: an endpoint slower by its hardware was never
    faster."""
    plan, thawed, other = thawed_pool(idle_half_life_s=5.0)
    slower = Speed(2e-4, 0.02)  # ten times slower than the others, twice the prior
    slow, frozen = measured(plan, 3, slower), measured(plan, 4, slower)
    froze(plan, frozen)
    for key in (thawed, other, slow, frozen):
        scraped_idle(plan, key, 101.0, 160.0)
    assert predicted(plan, frozen, 160.0) == pytest.approx(predicted(plan, slow, 160.0), rel=0.2)
    assert predicted(plan, frozen, 160.0) > 3 * predicted(plan, thawed, 160.0)


def test_without_idle_ageing_the_freeze_keeps_it_away():
    plan, thawed, other = thawed_pool(idle_half_life_s=None)
    for key in (thawed, other):
        scraped_idle(plan, key, 101.0, 160.0)
    # One half-life toward the prior: still seconds slower than the other with three queued.
    assert predicted(plan, thawed, 160.0) > 10 * predicted(plan, other, 160.0)
    queued = SharedView({other: Load(3 * PROMPT, 3)}, {}, {})
    assert decide_at(plan, 160.0, queued).endpoint == other


@pytest.mark.parametrize(
    "scrapes",
    [
        "busy",  # something running there: its own work explains nothing about the freeze
        "unanswered",  # frozen again: no scrape answers
        "in flight",  # a prefill of this sidecar's in flight, which the scrapes may not show
    ],
)
def test_only_idle_scrapes_age_it(scrapes: str) -> None:
    plan, thawed, _ = thawed_pool(idle_half_life_s=5.0)
    before = predicted(plan, thawed, 100.0)
    state = plan.pool[thawed]
    if scrapes == "busy":
        for second in range(101, 161):
            state.load = EngineLoad(waiting=0, running=1, kv_usage=0.1, at=float(second))
    elif scrapes == "unanswered":
        for _ in range(101, 161):
            state.load = None
    else:
        plan.sent(thawed, 100.5)  # in flight from then on
        scraped_idle(plan, thawed, 101.0, 160.0)
    # Aged toward the prior only (one half-life at most): still about as slow.
    assert predicted(plan, thawed, 160.0) > 0.4 * before


def test_the_idle_ageing_is_kept_once_the_endpoint_is_sent_a_prefill():
    plan, thawed, other = thawed_pool(idle_half_life_s=5.0)
    for key in (thawed, other):
        scraped_idle(plan, key, 101.0, 160.0)
    aged = predicted(plan, thawed, 160.0)
    plan.sent(thawed, 160.0)
    assert predicted(plan, thawed, 160.0) == aged  # applied for good, as it was read
    plan.pool[thawed].load = EngineLoad(waiting=0, running=1, kv_usage=0.1, at=161.0)
    assert predicted(plan, thawed, 161.0) == pytest.approx(aged, rel=0.05)
    # Its answer, at its healthy speed, is learnt from the aged state: it stays fast.
    plan.ended(thawed)
    plan.prefill_observed(Reservation(thawed, PROMPT, 0), HEALTHY.seconds(PROMPT), now=161.1)
    assert predicted(plan, thawed, 161.1) < 2 * predicted(plan, other, 161.1)


@pytest.mark.parametrize("every_s", [None, 5.0, 1.0, 0.1, "irregular"])
def test_the_idle_ageing_does_not_depend_on_how_often_decisions_read_it(every_s) -> None:
    """A function of the idle spell as a whole: one decision at the end of 60 s of idle
    scrapes, one every 5 s, one a second, 600 (every 0.1 s) or at random times read the same
    estimate at the end, and the same as each other at every scrape."""
    reference, thawed, _ = thawed_pool(idle_half_life_s=5.0)
    scraped_idle(reference, thawed, 101.0, 160.0)
    expected = predicted(reference, thawed, 160.0)
    plan, _, _ = thawed_pool(idle_half_life_s=5.0)
    if every_s is None:
        moments: list[float] = []
    elif every_s == "irregular":
        moments = sorted(random.Random(7).uniform(101.0, 160.0) for _ in range(300))
    else:
        moments = [101.0 + every_s * i for i in range(int(59.0 / every_s))]
    readings = iter(moments)
    moment = next(readings, None)
    for second in range(101, 161):
        plan.pool[thawed].load = EngineLoad(0, 0, 0.0, at=float(second))
        while moment is not None and moment < second + 1:
            predicted(plan, thawed, moment)
            moment = next(readings, None)
    assert predicted(plan, thawed, 160.0) == expected
    assert expected < 1.2 * predicted(reference, "127.0.0.1:2", 160.0)  # not held at 1.5 x


def test_a_fit_within_a_stalls_margin_of_its_best_is_not_aged_toward_it():
    """Only a stall's margin (1.5 x its best, at the idle spell's start) is aged away: the
    spread of an endpoint's fits under traffic is not, or every idle endpoint would look as
    fast as its luckiest fit."""
    aged, ageless = thawed_pool(idle_half_life_s=5.0), thawed_pool(idle_half_life_s=None)
    for plan, _, other in (aged, ageless):
        plan.pool[other].load = None  # a scrape went unanswered
        # A little slower than its best (1.3 x at 2,000 tokens): noise, not a stall.
        for _ in range(3):
            plan.prefill_observed(Reservation(other, 2000, 0), 1.3 * HEALTHY.seconds(2000), 95.0)
        scraped_idle(plan, other, 96.0, 101.0)  # five seconds: one idle half-life
    [(plan, _, other), (reference, _, _)] = aged, ageless
    assert predicted(plan, other, 101.0) == predicted(reference, other, 101.0)


def slowed(plan: Planner, key: str, now: float, answers: int = 3) -> None:
    """``answers`` prefills of ``key`` twenty times slower than it measured, at ``now``, its
    scrapes answered and busy meanwhile: prompts predicted 95 % cached and computed whole (a
    stall's margin slower, but no stall)."""
    for _ in range(answers):
        plan.pool[key].load = EngineLoad(waiting=0, running=1, kv_usage=0.1, at=now)
        plan.prefill_observed(Reservation(key, PROMPT, 0), 20 * HEALTHY.seconds(PROMPT), now)


def unaged(plan: Planner, key: str, now: float) -> float:
    """What ``key``'s estimate, aged toward the prior alone, predicts at ``now``."""
    return plan.pool[key].speed.value_at(now).seconds(PROMPT)


def not_idle_aged(plan: Planner, key: str, now: float) -> bool:
    """Whether ``key`` is predicted as its estimate's ageing toward the prior alone would."""
    return predicted(plan, key, now) == unaged(plan, key, now)


@pytest.mark.parametrize("answered", [True, False])
def test_the_stall_is_over_once_an_answer_is_back_near_its_best(answered: bool) -> None:
    """An endpoint that missed a scrape, then answered at its best again: the stall is over.
    Slowed soon after for another reason (mispredicted cache hits) and idle, it ages toward the
    prior alone, as an endpoint that never missed a scrape; without that answer, toward its
    best."""
    plan, _, other = thawed_pool(idle_half_life_s=5.0)
    plan.pool[other].load = None  # missed a scrape at 100
    plan.pool[other].load = EngineLoad(waiting=0, running=1, kv_usage=0.1, at=101.0)
    if answered:
        plan.sent(other, 101.0)
        plan.ended(other)
        plan.prefill_observed(Reservation(other, PROMPT, 0), HEALTHY.seconds(PROMPT), now=102.0)
    slowed(plan, other, 110.0)
    scraped_idle(plan, other, 111.0, 171.0)
    assert not_idle_aged(plan, other, 171.0) is answered
    assert (predicted(plan, other, 171.0) < 0.5 * unaged(plan, other, 171.0)) is not answered


def test_a_prefill_the_stall_held_does_not_end_it_however_fast_it_looks():
    """Sent just before the thaw with a queue reserved ahead of it, a held prefill answers
    soon after and in less than its best predicts for that work: it was sent before the stall
    ended, and says nothing of how the endpoint does now."""
    plan, thawed, other = thawed_pool(idle_half_life_s=5.0)
    plan.pool[thawed].load = EngineLoad(waiting=0, running=1, kv_usage=0.1, at=101.0)  # thawed
    held = Reservation(thawed, PROMPT, 5 * PROMPT)
    plan.prefill_observed(held, 0.9 * HEALTHY.seconds(6 * PROMPT), now=101.05)
    assert plan.pool[thawed].thawed_at == 101.0
    for key in (thawed, other):
        scraped_idle(plan, key, 102.0, 161.0)
    assert predicted(plan, thawed, 161.0) == pytest.approx(predicted(plan, other, 161.0), rel=0.2)


def test_a_fresh_answer_at_its_best_does_not_end_a_stall_its_fit_still_holds():
    """Thawed, the endpoint answers the prefills the stall held, seconds late, then a prefill
    sent after the thaw at its best: the stall's evidence is still in its fit, so the stall is
    remembered, and its idle spell ages that evidence away."""
    plan, thawed, other = thawed_pool(idle_half_life_s=5.0)
    state = plan.pool[thawed]
    state.load = EngineLoad(waiting=1, running=1, kv_usage=0.1, at=100.5)  # thawed
    plan.sent(thawed, 100.6)
    plan.ended(thawed)
    plan.prefill_observed(Reservation(thawed, PROMPT, 0), HEALTHY.seconds(PROMPT), now=100.7)
    assert state.thawed_at == 100.5
    for key in (thawed, other):
        scraped_idle(plan, key, 101.0, 160.0)
    assert predicted(plan, thawed, 160.0) == pytest.approx(predicted(plan, other, 160.0), rel=0.2)


def test_a_thawed_endpoint_is_stalled_until_its_answers_bring_its_fit_back():
    """After its idle spell, the thawed endpoint's fit has drifted toward the prior as the
    other's has; a few answers at its best bring it within a stall's margin of its best: the
    stall is over. A new stall is remembered again, and aged away again."""
    plan, thawed, _ = thawed_pool(idle_half_life_s=5.0)
    scraped_idle(plan, thawed, 101.0, 160.0)
    assert plan.pool[thawed].thawed_at == 101.0  # aged, not answered yet
    answers = 0
    while plan.pool[thawed].thawed_at is not None and answers < 10:
        work = PROMPT * (1 + answers % 3)
        plan.sent(thawed, 160.5 + answers)
        plan.ended(thawed)
        plan.prefill_observed(Reservation(thawed, work, 0), HEALTHY.seconds(work), 160.6 + answers)
        answers += 1
    assert plan.pool[thawed].thawed_at is None
    assert answers <= 6
    plan.pool[thawed].load = None  # a new stall
    slowed(plan, thawed, 180.0)
    scraped_idle(plan, thawed, 181.0, 240.0)
    assert predicted(plan, thawed, 240.0) < 0.5 * unaged(plan, thawed, 240.0)


@pytest.mark.parametrize(("later_s", "aged"), [(-30.0, True), (1.0, False)])
def test_a_stall_is_remembered_for_a_minute(later_s: float, aged: bool) -> None:
    """A thawed endpoint busy with the work of others, then idle: its idle spell ages it
    toward its best if it begins within ``STALL_KEPT_S`` (60 s) of the stall's end (its first
    answered scrape), and toward the prior alone if it begins later."""
    plan, thawed, _ = thawed_pool(idle_half_life_s=5.0)
    start = 101.0 + STALL_KEPT_S + later_s
    for second in range(101, int(start)):
        plan.pool[thawed].load = EngineLoad(waiting=1, running=1, kv_usage=0.2, at=float(second))
    scraped_idle(plan, thawed, start, start + 60.0)
    assert not_idle_aged(plan, thawed, start + 60.0) is not aged
    assert (
        predicted(plan, thawed, start + 60.0) < 0.2 * unaged(plan, thawed, start + 60.0)
    ) is aged


def test_a_stall_is_over_within_its_best_fits_lifetime_of_answers():
    """Answers alone end a stall within twice ``BEST_KEPT_FOR`` of them (a best is the fastest
    of the last 20 to 40 fits, as its windows fall): by then its best is renewed from them, and
    its fit is within a stall's margin of it, however slow it is."""
    plan, thawed, _ = thawed_pool(idle_half_life_s=5.0)
    plan.pool[thawed].load = EngineLoad(0, 1, 0.1, at=101.0)  # thawed, busy
    slowed(plan, thawed, 102.0, answers=1)
    assert plan.pool[thawed].thawed_at == 101.0  # still a stall's margin slower than its best
    for i in range(1, 2 * BEST_KEPT_FOR):
        slowed(plan, thawed, 102.0 + i, answers=1)
    assert plan.pool[thawed].thawed_at is None


FIVE_TIMES_SLOWER = Speed(5e-4, 0.02)  # 1.02 s per 2,000 tokens, the prior 0.22 s


@pytest.mark.parametrize("stall", ["missed a scrape", "froze"])
@pytest.mark.parametrize("half_life_s", [None, 60.0])
def test_an_endpoint_slower_than_the_prior_is_never_aged_faster_than_it_answered(
    stall: str, half_life_s: float | None
) -> None:
    """Five times slower than the prior, measured 30 times a second apart, then a scrape went
    unanswered (and, frozen, three prefills answered 5 s late), then 30 s of idle scrapes: its
    idle ageing returns it to what it answered, not to a fit its first observations shared with
    the prior (0.61 s for 2,000 tokens, against 1.02 s). Without ageing toward the prior, as slow
    as it truly is; with it, as slow as a twin that neither missed a scrape nor froze."""
    plan = Planner(
        Decider(make_policy("qoe", random.Random(1)), ttft_ratio=1000),
        stale_after_s=3.0,
        half_life_s=half_life_s,
        idle_half_life_s=5.0,
        retest_s=0.0,
    )
    slow, twin = (str(plan.join(Endpoint("127.0.0.1", port), Health()).endpoint) for port in (1, 2))
    for key in (slow, twin):
        for second in range(30):
            work = PROMPT * (1 + second % 4)
            reservation = Reservation(key, PROMPT, work - PROMPT)
            plan.prefill_observed(reservation, FIVE_TIMES_SLOWER.seconds(work), float(second))
    plan.pool[slow].load = None
    if stall == "froze":
        for ahead in range(3):
            plan.prefill_observed(Reservation(slow, PROMPT, ahead * PROMPT), 5.0, now=30.0)
    for key in (slow, twin):
        scraped_idle(plan, key, 31.0, 60.0)
    speeds = {c.key: c.speed for c in plan.candidates(EMPTY, 60.0, 60.0)}
    truth = FIVE_TIMES_SLOWER if half_life_s is None else speeds[twin]
    assert speeds[slow].seconds(2000) >= 0.95 * truth.seconds(2000)


@pytest.mark.parametrize("name", ["half_life_s", "idle_half_life_s"])
@pytest.mark.parametrize("value", [0.0, -5.0, float("nan")])
def test_a_half_life_is_positive_or_none(name: str, value: float) -> None:
    """Checked where the planner is made, not on the request path (a division by zero when an
    estimate is read)."""
    decider = Decider(make_policy("qoe", random.Random(1)), ttft_ratio=1000)

    def made(half_life: float | None) -> Planner:
        if name == "half_life_s":
            return Planner(decider, stale_after_s=3.0, half_life_s=half_life)
        return Planner(decider, stale_after_s=3.0, idle_half_life_s=half_life)

    with pytest.raises(ValueError, match=name):
        made(value)
    made(None)


def described(plan: Planner, key: str, now: float) -> dict:
    [entry] = [e for e in plan.describe(EMPTY, now, now) if e["endpoint"] == key]
    return entry


def test_the_debug_view_shows_the_best_speed_and_the_stall_it_remembers() -> None:
    plan, thawed, other = thawed_pool(idle_half_life_s=5.0)
    plan.pool[thawed].load = EngineLoad(waiting=0, running=1, kv_usage=0.1, at=101.0)  # thawed
    entry = described(plan, thawed, 102.0)
    assert entry["stall_thawed_s_ago"] == 1.0
    best = Speed(**entry["best_speed"])
    assert best.seconds(PROMPT) == pytest.approx(HEALTHY.seconds(PROMPT), rel=0.2)
    assert described(plan, other, 102.0)["stall_thawed_s_ago"] is None
    fresh = plan.join(Endpoint("127.0.0.1", 9), Health())
    assert described(plan, fresh.key, 102.0)["best_speed"] is None  # nothing measured yet


def test_a_stall_is_forgotten_once_no_idle_spell_can_use_it() -> None:
    """Busy for a minute after the thaw: forgotten at the first scrape past ``STALL_KEPT_S``.
    Idle from the thaw on: remembered while that spell runs, past the minute, then forgotten
    when it ends, its ageing kept."""
    busy, thawed, _ = thawed_pool(idle_half_life_s=5.0)
    for second in range(101, 163):
        busy.pool[thawed].load = EngineLoad(0, 1, 0.1, at=float(second))
        assert (busy.pool[thawed].thawed_at is None) is (second - 101.0 > STALL_KEPT_S)
    idle, thawed, _ = thawed_pool(idle_half_life_s=5.0)
    scraped_idle(idle, thawed, 101.0, 200.0)
    assert described(idle, thawed, 200.0)["stall_thawed_s_ago"] == 99.0
    aged = predicted(idle, thawed, 200.0)
    assert aged < 0.2 * unaged(idle, thawed, 200.0)
    idle.pool[thawed].load = EngineLoad(0, 1, 0.1, at=201.0)  # the spell ends
    assert described(idle, thawed, 201.0)["stall_thawed_s_ago"] is None
    assert predicted(idle, thawed, 201.0) == pytest.approx(aged, rel=0.05)
