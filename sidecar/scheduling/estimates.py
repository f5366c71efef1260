"""Observed speed and endpoint health: small pure state machines fed by the sidecar's own calls."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sidecar.scheduling.model import Speed


class SpeedEstimate:
    """An exponentially weighted least-squares fit of ``seconds = overhead + s_per_token * work``.

    ``work`` is the tokens the engine had to get through: queued ahead at send time plus the
    prompt's. Starts from a prior worth ``prior_weight`` observations; the slope is kept positive
    and the intercept non-negative so one odd sample cannot make an endpoint look free.
    """

    def __init__(self, prior: Speed, *, alpha: float = 0.1, prior_weight: float = 3.0) -> None:
        self._alpha = alpha
        self.samples = 0
        # Weighted sums of 1, x, y, xx, xy, seeded with two virtual points on the prior line.
        low, high = 0.0, 2000.0
        self._w = prior_weight
        self._x = prior_weight * (low + high) / 2
        self._y = prior_weight * (prior.seconds(low) + prior.seconds(high)) / 2
        self._xx = prior_weight * (low * low + high * high) / 2
        self._xy = prior_weight * (low * prior.seconds(low) + high * prior.seconds(high)) / 2
        self._prior = prior
        self.value = prior

    def observe(self, work_tokens: float, seconds: float) -> Speed:
        keep = 1.0 - self._alpha
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + work_tokens
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + work_tokens * work_tokens
        self._xy = keep * self._xy + work_tokens * seconds
        self.samples += 1
        mean_x, mean_y = self._x / self._w, self._y / self._w
        variance = self._xx / self._w - mean_x * mean_x
        if variance > 1e-9:
            slope = (self._xy / self._w - mean_x * mean_y) / variance
        else:  # all samples of one size: keep the prior's slope, fit the level
            slope = self._prior.s_per_token
        slope = max(slope, 1e-9)
        overhead = max(0.0, mean_y - slope * mean_x)
        self.value = Speed(slope, overhead)
        return self.value


class Availability(StrEnum):
    HEALTHY = "healthy"
    EJECTED = "ejected"
    PROBING = "probing"
    """The ejection ran out: a successful probe re-admits the endpoint, a failed one ejects it
    again for twice as long."""


@dataclass(slots=True)
class Health:
    """Consecutive failures eject an endpoint for a growing backoff.

    ``eject_after`` failures in a row eject it for ``base_s``; each ejection that follows a
    failed probe doubles the time, up to ``max_s``. A success (call or probe) resets both.
    """

    eject_after: int = 3
    base_s: float = 1.0
    max_s: float = 60.0
    failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    state: Availability = Availability.HEALTHY

    def available(self, now: float) -> bool:
        return self.refresh(now) == Availability.HEALTHY

    def refresh(self, now: float) -> Availability:
        if self.state == Availability.EJECTED and now >= self.ejected_until:
            self.state = Availability.PROBING
        return self.state

    def success(self) -> None:
        self.failures = 0
        self.ejections = 0
        self.state = Availability.HEALTHY

    def failure(self, now: float) -> None:
        self.failures += 1
        probing = self.refresh(now) == Availability.PROBING
        if probing or (self.state == Availability.HEALTHY and self.failures >= self.eject_after):
            self.eject(now)

    def eject(self, now: float, until: float | None = None) -> None:
        backoff = min(self.max_s, self.base_s * (2**self.ejections))
        self.ejections += 1
        self.ejected_until = max(until or 0.0, now + backoff)
        self.state = Availability.EJECTED
