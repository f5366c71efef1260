"""SpeedEstimate's fit and Health's ejection state machine."""

from __future__ import annotations

import math
import random

import pytest

from sidecar.scheduling.estimates import (
    BEST_KEPT_FOR,
    Availability,
    Health,
    Moments,
    SpeedEstimate,
    decay_weight,
    toward,
)
from sidecar.scheduling.model import Speed

PRIOR = Speed(s_per_token=1e-4, overhead_s=0.02)


def test_the_estimate_starts_at_the_prior():
    estimate = SpeedEstimate(PRIOR)
    assert estimate.value == PRIOR
    assert estimate.samples == 0


def test_the_estimate_converges_to_the_observed_line():
    estimate = SpeedEstimate(PRIOR)
    rng = random.Random(1)
    for _ in range(200):
        work = rng.uniform(100, 20_000)
        estimate.observe(work, 0.05 + 2e-4 * work)
    assert estimate.value.s_per_token == pytest.approx(2e-4, rel=1e-3)
    assert estimate.value.overhead_s == pytest.approx(0.05, abs=1e-3)
    assert estimate.samples == 200


def test_the_estimate_follows_a_change_of_speed():
    estimate = SpeedEstimate(PRIOR)
    rng = random.Random(2)
    for slope in (1e-4, 3e-4):
        for _ in range(100):
            work = rng.uniform(1000, 10_000)
            estimate.observe(work, 0.01 + slope * work)
    assert estimate.value.s_per_token == pytest.approx(3e-4, rel=0.01)


def test_one_odd_sample_cannot_make_an_endpoint_free():
    estimate = SpeedEstimate(PRIOR)
    value = estimate.observe(20_000, 0.0)
    assert value.s_per_token > 0
    assert value.overhead_s >= 0


def test_samples_of_one_size_keep_the_prior_slope():
    estimate = SpeedEstimate(PRIOR, prior_weight=0.0)
    for _ in range(5):
        value = estimate.observe(1000, 0.5)
    assert value.s_per_token == PRIOR.s_per_token
    assert value.seconds(1000) == pytest.approx(0.5)


def test_health_ejects_after_consecutive_failures():
    health = Health(eject_after=3, base_s=1.0)
    health.failure(0.0)
    health.failure(0.1)
    assert health.available(0.2)
    health.failure(0.2)
    assert not health.available(0.3)
    assert health.refresh(0.3) == Availability.EJECTED


def test_a_success_between_failures_resets_the_count():
    health = Health(eject_after=2)
    health.failure(0.0)
    health.success()
    health.failure(0.1)
    assert health.available(0.2)


def test_the_ejection_runs_out_into_a_probe():
    health = Health(eject_after=1, base_s=1.0)
    health.failure(10.0)
    assert health.refresh(10.9) == Availability.EJECTED
    assert health.refresh(11.0) == Availability.PROBING
    assert not health.available(11.0)  # only the probe may use it
    health.success()
    assert health.available(11.1)


def test_a_failed_probe_doubles_the_ejection_up_to_the_maximum():
    health = Health(eject_after=1, base_s=1.0, max_s=3.0)
    health.failure(0.0)
    assert health.ejected_until == 1.0
    health.failure(1.0)  # probing: ejected for 2 s
    assert health.ejected_until == 3.0
    health.failure(3.0)  # 4 s, capped at 3
    assert health.ejected_until == 6.0
    health.success()
    health.failure(7.0)
    assert health.ejected_until == 8.0


# --- ageing: an endpoint slow once must not stay slow in the books for good -------------------


def test_the_decay_weight_halves_every_half_life():
    assert decay_weight(0.0, 10.0) == 1.0
    assert decay_weight(10.0, 10.0) == pytest.approx(0.5)
    assert decay_weight(30.0, 10.0) == pytest.approx(0.125)
    # No half-life, or a clock that reads earlier than the evidence: nothing decays.
    assert decay_weight(1e9, None) == 1.0
    assert decay_weight(1e9, math.inf) == 1.0
    assert decay_weight(-5.0, 10.0) == 1.0


def test_toward_the_prior_moves_each_parameter_by_the_weight():
    fitted = Speed(s_per_token=3e-4, overhead_s=2.06)
    assert toward(fitted, PRIOR, 1.0) == fitted
    assert toward(fitted, PRIOR, 0.0) == PRIOR
    half = toward(fitted, PRIOR, 0.5)
    assert half.s_per_token == pytest.approx(2e-4)
    assert half.overhead_s == pytest.approx(1.04)


def stalled(half_life_s: float | None) -> SpeedEstimate:
    """An estimate whose last observations, at t = 0..9 s, came from a 2 s stall."""
    estimate = SpeedEstimate(PRIOR, half_life_s=half_life_s)
    for t in range(10):
        estimate.observe(1000 + 100 * t, 2.0 + 1e-4 * (1000 + 100 * t), now=float(t))
    return estimate


def test_an_estimate_without_new_observations_decays_toward_the_prior():
    estimate = stalled(half_life_s=30.0)
    fitted = estimate.value
    assert fitted.overhead_s > 0.5
    assert estimate.value_at(9.0) == fitted  # no time since the last observation
    overheads = [estimate.value_at(9.0 + 30.0 * k).overhead_s for k in range(8)]
    assert overheads == sorted(overheads, reverse=True)  # every half-life closer to the prior
    assert overheads[1] < fitted.overhead_s
    late = estimate.value_at(9.0 + 30.0 * 40)
    assert late.overhead_s == pytest.approx(PRIOR.overhead_s, abs=1e-6)
    assert late.s_per_token == pytest.approx(PRIOR.s_per_token, rel=1e-6)
    # Without a half-life it never does (today's estimate).
    assert stalled(half_life_s=None).value_at(1e6) == stalled(half_life_s=None).value


def test_the_evidence_weighs_half_as_much_after_one_half_life():
    """The aged state is the prior's sums plus half the evidence beyond them."""
    prior = Moments(3.0, 3000.0, 0.36, 6e6, 440.0)
    evidence = Moments(10.0, 15000.0, 21.0, 3e7, 3.2e4)
    half = evidence.toward(prior, decay_weight(60.0, 60.0))
    assert half.w == pytest.approx(6.5)
    assert half.y == pytest.approx(0.36 + 0.5 * (21.0 - 0.36))
    assert evidence.toward(prior, 1.0) is evidence
    assert evidence.toward(prior, 0.0) == pytest.approx(prior)


def test_after_a_gap_new_observations_are_not_outvoted_by_aged_ones():
    aged, ageless = stalled(half_life_s=10.0), stalled(half_life_s=None)
    # The endpoint recovered: 100 s later, three calls at its true speed (the prior's line).
    for estimate in (aged, ageless):
        for i in range(3):
            work = 1500.0 + 500 * i
            estimate.observe(work, PRIOR.seconds(work), now=109.0 + i)
    assert aged.value.overhead_s == pytest.approx(PRIOR.overhead_s, abs=0.01)
    assert ageless.value.overhead_s > 1.0  # the stall still dominates the ageless fit


def test_a_long_half_life_learns_like_no_half_life():
    """Ageing slowly never drifts: an endpoint answering every call of one size in 1 ms (far
    faster than the prior) is fitted alike with a one-hour half-life and without one."""
    aged, ageless = SpeedEstimate(PRIOR, half_life_s=3600.0), SpeedEstimate(PRIOR)
    for i in range(300):
        aged.observe(600, 0.001, now=0.01 * i)
        ageless.observe(600, 0.001)
    assert aged.value.seconds(600) == pytest.approx(ageless.value.seconds(600), rel=0.01)


def test_an_estimate_without_a_half_life_learns_as_before():
    with_clock, without = SpeedEstimate(PRIOR, half_life_s=None), SpeedEstimate(PRIOR)
    rng = random.Random(3)
    for t in range(50):
        work = rng.uniform(100, 20_000)
        assert with_clock.observe(work, 0.05 + 2e-4 * work, now=1000.0 * t) == without.observe(
            work, 0.05 + 2e-4 * work
        )


def test_relaxing_replaces_the_evidence_by_the_target_then_ages_it():
    """``relax``: the evidence as of ``since`` keeps ``weight`` of its own, the rest on the
    target's line; then, from ``since`` on, it ages toward the prior as any evidence does."""
    target = Speed(2e-5, 0.005)
    estimate = stalled(half_life_s=30.0)
    assert estimate.relax(target, 1.0, 39.0, 39.0) == estimate.value  # weight 1: nothing
    relaxed = estimate.relax(target, decay_weight(120.0, 10.0), 39.0, 39.0)  # 1/4096 left
    assert relaxed.seconds(2000) == pytest.approx(target.seconds(2000), rel=0.03)
    assert estimate.value_at(39.0) == relaxed
    # Aged toward the prior again from then on, not from the last observation: worth as much
    # as the evidence it replaced (ten observations), it keeps most of the target's line.
    later = estimate.value_at(69.0).seconds(2000)
    assert target.seconds(2000) < later < (target.seconds(2000) + PRIOR.seconds(2000)) / 2
    assert estimate.samples == 10  # relaxing is not an observation
    # Relaxed as of 39 s and aged to 69 s: the same as relaxed at 39 s, read at 69 s.
    twin = stalled(half_life_s=30.0)
    assert twin.relax(target, decay_weight(120.0, 10.0), 39.0, 69.0) == estimate.value_at(69.0)


def test_reading_a_relaxation_ahead_changes_nothing_and_reads_what_relaxing_gives():
    """``relaxed_at``: what ``relax`` would leave, read at any later time, without relaxing."""
    target = Speed(2e-5, 0.005)
    estimate, twin = stalled(half_life_s=30.0), stalled(half_life_s=30.0)
    weight = decay_weight(40.0, 5.0)
    ahead = [estimate.relaxed_at(target, weight, 39.0, now) for now in (39.0, 50.0, 99.0)]
    assert estimate.value_at(99.0) == twin.value_at(99.0)  # unchanged
    twin.relax(target, weight, 39.0, 39.0)
    assert ahead == [twin.value_at(now) for now in (39.0, 50.0, 99.0)]
    assert estimate.relaxed_at(target, 1.0, 39.0, 50.0) == estimate.value_at(50.0)


def test_the_best_fit_survives_a_stall_and_gives_way_to_a_lasting_slowdown():
    estimate = SpeedEstimate(PRIOR, half_life_s=60.0)
    assert estimate.best is None
    for i in range(2):
        estimate.observe(1000 + 500 * i, PRIOR.seconds(1000 + 500 * i), now=float(i))
    assert estimate.best is None  # two observations: mostly the prior's
    for i in range(2, 10):
        estimate.observe(1000 + 500 * (i % 3), PRIOR.seconds(1000 + 500 * (i % 3)), now=float(i))
    before = estimate.best
    assert before is not None
    assert before.seconds(2000) == pytest.approx(PRIOR.seconds(2000), rel=0.01)
    for i in range(5):  # a stall: five calls 5 s late
        estimate.observe(1000 + 500 * i, 5.0, now=10.0)
    assert estimate.best == before
    slower = Speed(5 * PRIOR.s_per_token, PRIOR.overhead_s)
    for i in range(40):  # slower for good: after 20 more without a better fit, the current one
        estimate.observe(1000 + 500 * (i % 3), slower.seconds(1000 + 500 * (i % 3)), now=11.0 + i)
    assert estimate.best is not None
    assert estimate.best.seconds(2000) > 3 * PRIOR.seconds(2000)


def test_a_stall_at_the_end_of_its_best_fits_window_does_not_become_its_best():
    """An endpoint slower than the prior fits slower with each answer (the prior's weight
    goes), so its best is an early fit, kept for ``BEST_KEPT_FOR`` observations; a stall whose
    answers fall when that runs out is still not its best: the best is the fastest of the last
    20 to 40 fits."""
    slower = Speed(2e-4, 0.02)
    estimate = SpeedEstimate(PRIOR, half_life_s=60.0)
    observed, in_window = 0, 0
    while in_window < BEST_KEPT_FOR - 2:  # the window's first is the first with a best
        work = 600 * (1 + observed % 4)
        estimate.observe(work, slower.seconds(work), now=float(observed))
        observed += 1
        in_window += estimate.best is not None
    for ahead in range(3):  # the stall: 5 s answers
        estimate.observe(600 * (1 + ahead), 5.0, now=30.0)
    assert estimate.best is not None
    assert estimate.best.seconds(2000) < 1.5 * slower.seconds(2000)
