"""A modelled sidecar: the production decider, policy and estimates, fed from the model."""

from __future__ import annotations

import math
import random

from bench.sim.scenario import Scenario, Variant
from sidecar.scheduling.decider import Decider
from sidecar.scheduling.estimates import SpeedEstimate
from sidecar.scheduling.model import Speed
from sidecar.scheduling.policies import make_policy

REMOTE_PRIOR = Speed(1e-4, 0.02)
LOCAL_PRIOR = Speed(1e-4, 0.01)


class Reservations:
    """Prefills chosen and not finished, per endpoint: one instance shared by every sidecar
    (the Redis backend) or one per sidecar (the in-memory backend)."""

    def __init__(self, keys: list[str]) -> None:
        self.tokens = dict.fromkeys(keys, 0)
        self.requests = dict.fromkeys(keys, 0)

    def add(self, key: str, tokens: int) -> None:
        self.tokens[key] += tokens
        self.requests[key] += 1

    def release(self, key: str, tokens: int) -> None:
        self.tokens[key] -= tokens
        self.requests[key] -= 1


class Sidecar:
    def __init__(
        self,
        index: int,
        scenario: Scenario,
        variant: Variant,
        keys: list[str],
        reservations: Reservations,
        seed: int,
    ) -> None:
        rng = random.Random(f"sidecar-{seed}-{index}")
        self.index = index
        self.policy = make_policy(variant.policy, rng, transfer=scenario.transfer)
        always = variant.mode == "always"
        if scenario.ttft_ratio is None:
            self.decider = Decider(self.policy, transfer=scenario.transfer, always=always)
        else:
            self.decider = Decider(
                self.policy,
                ttft_ratio=scenario.ttft_ratio,
                transfer=scenario.transfer,
                always=always,
            )
        self.disaggregates = variant.mode != "never"
        self.reservations = reservations
        self.speeds = {key: SpeedEstimate(REMOTE_PRIOR) for key in keys}
        self.local_speed = SpeedEstimate(LOCAL_PRIOR)
        self.ahead_tokens = 0
        """Prompt tokens of this sidecar's local prefills that have not finished."""
        self._staleness = scenario.staleness_s
        self._scrape = scenario.stale_mode == "scrape"
        self._phase = rng.random() * scenario.staleness_s

    def view_time(self, now: float) -> float:
        """The moment the scraped gauges this sidecar holds at ``now`` describe."""
        if not self._scrape or self._staleness <= 0:
            return now - self._staleness
        scrapes = math.floor((now - self._phase) / self._staleness)
        return self._phase + scrapes * self._staleness
