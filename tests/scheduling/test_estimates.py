"""SpeedEstimate's fit and Health's ejection state machine."""

from __future__ import annotations

import random

import pytest

from sidecar.scheduling.estimates import Availability, Health, SpeedEstimate
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
