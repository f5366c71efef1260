"""Observed speed and endpoint health: small pure state machines fed by the sidecar's own calls."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from sidecar.scheduling.model import Speed


def decay_weight(age_s: float, half_life_s: float | None) -> float:
    """The weight evidence ``age_s`` seconds old keeps: ``0.5 ** (age_s / half_life_s)``.

    1.0 without a half-life (None or infinite) and for a non-positive age (a clock read before
    the evidence, e.g. by a caller that holds an older ``now``): evidence never gains weight."""
    if half_life_s is None or math.isinf(half_life_s) or age_s <= 0.0:
        return 1.0
    return float(0.5 ** (age_s / half_life_s))


def toward(fitted: Speed, prior: Speed, weight: float) -> Speed:
    """``fitted`` decayed toward ``prior``: each parameter ``prior + weight × (fitted − prior)``.

    For a speed known without its evidence (one another sidecar published). ``weight`` is
    ``decay_weight``'s: 1 keeps the speed, 0 is the prior, one half-life half-way."""
    if weight >= 1.0:
        return fitted
    return Speed(
        prior.s_per_token + weight * (fitted.s_per_token - prior.s_per_token),
        prior.overhead_s + weight * (fitted.overhead_s - prior.overhead_s),
    )


VIRTUAL_HIGH_TOKENS = 2000.0
"""Where a prior's second virtual point lies (the first is at 0 tokens): a long prompt's work;
fits are compared at it (``SpeedEstimate.best``)."""
BEST_FROM_EVIDENCE = 3.0
"""How many times the prior's weight the observations must weigh, both aged as they are, for
a fit to be an estimate's best (``SpeedEstimate.best``): seven observations in a row (the
prior's three virtual ones keep 0.9 of their weight at each, 1.4 after seven, against 5.2),
more after a long gap (the prior regains what the evidence loses). At the third the fit is
still about 45 % the prior's."""
BEST_KEPT_FOR = 20
"""Observations a best fit is kept for: ``SpeedEstimate.best`` is the fastest fit of the last
20 to 40 (an endpoint that became slower for good is not remembered as it was, and a stall of
fewer answers than that does not replace its best)."""


@dataclass(frozen=True, slots=True)
class Moments:
    """Weighted sums of 1, x, y, x², xy: what a least-squares line is fitted from."""

    w: float
    x: float
    y: float
    xx: float
    xy: float

    @classmethod
    def of(cls, speed: Speed, weight: float) -> Moments:
        """Two virtual points on ``speed``'s line, at 0 and ``VIRTUAL_HIGH_TOKENS``, weighing
        ``weight`` observations together: how a prior (or a target of ageing) enters a fit."""
        low, high = 0.0, VIRTUAL_HIGH_TOKENS
        return cls(
            weight,
            weight * (low + high) / 2,
            weight * (speed.seconds(low) + speed.seconds(high)) / 2,
            weight * (low * low + high * high) / 2,
            weight * (low * speed.seconds(low) + high * speed.seconds(high)) / 2,
        )

    def toward(self, prior: Moments, weight: float) -> Moments:
        """Every sum ``prior + weight × (self − prior)``: the evidence in ``self`` beyond the
        prior's keeps ``weight`` of its weight, and the prior regains what it had lost."""
        if weight >= 1.0:
            return self
        return Moments(
            prior.w + weight * (self.w - prior.w),
            prior.x + weight * (self.x - prior.x),
            prior.y + weight * (self.y - prior.y),
            prior.xx + weight * (self.xx - prior.xx),
            prior.xy + weight * (self.xy - prior.xy),
        )

    def without(self, prior: Moments, part: float) -> Moments:
        """The sums less ``part`` of ``prior``'s: the observations' own, in a fit that started
        from ``prior`` and kept ``part`` of it."""
        return Moments(
            self.w - part * prior.w,
            self.x - part * prior.x,
            self.y - part * prior.y,
            self.xx - part * prior.xx,
            self.xy - part * prior.xy,
        )

    def fit(self, fallback_slope: float) -> Speed:
        """The least-squares line, its slope kept positive and its intercept non-negative;
        ``fallback_slope`` when the x values have no spread (the level is fitted alone)."""
        if self.w <= 0.0:  # no evidence and a prior of no weight
            return Speed(fallback_slope, 0.0)
        mean_x, mean_y = self.x / self.w, self.y / self.w
        variance = self.xx / self.w - mean_x * mean_x
        if variance > 1e-9:
            slope = (self.xy / self.w - mean_x * mean_y) / variance
        else:  # all samples of one size: keep the prior's slope, fit the level
            slope = fallback_slope
        slope = max(slope, 1e-9)
        return Speed(slope, max(0.0, mean_y - slope * mean_x))


class SpeedEstimate:
    """An exponentially weighted least-squares fit of ``seconds = overhead + s_per_token * work``.

    ``work`` is the tokens the engine had to get through: queued ahead at send time plus the
    prompt's. Starts from a prior worth ``prior_weight`` observations; the slope is kept positive
    and the intercept non-negative so one odd sample cannot make an endpoint look free.

    With ``half_life_s``, the evidence also ages with time: ``t`` seconds after the last
    observation every weighted sum is blended toward the prior's with ``decay_weight(t)``
    (``Moments.toward``: the observations weigh half as much after one half-life, and the prior's
    virtual points regain what they had lost). ``value_at(now)`` is the fit of that aged state
    and the next ``observe`` starts from it, so new samples are not outvoted by old ones. An
    endpoint that was slow once and is no longer used does not stay slow in the books forever.
    Only the sums age, never the clamped fit (re-seeding them from the clamped line would feed
    the clamp back into the state).
    """

    def __init__(
        self,
        prior: Speed,
        *,
        alpha: float = 0.1,
        prior_weight: float = 3.0,
        half_life_s: float | None = None,
    ) -> None:
        self._alpha = alpha
        self._half_life_s = half_life_s
        self.samples = 0
        self._prior_weight = prior_weight
        # Seeded with two virtual points on the prior line, at 0 and 2000 tokens.
        self._prior_moments = Moments.of(prior, prior_weight)
        self._m = self._prior_moments
        self._prior_part = 1.0
        """The part of the prior's sums in ``_m`` (the rest is the observations')."""
        self._prior = prior
        self.value = prior
        """The fit as of the last observation (``value_at`` ages it)."""
        self.observed_at: float | None = None
        """The ``now`` of the last observation that passed one (monotonic seconds)."""
        self._aged_at: float | None = None
        """The time the sums are aged to: the last observation's, or a later ``relax``'s."""
        self.best: Speed | None = None
        """Its measured speed at its best: the fastest (at ``VIRTUAL_HIGH_TOKENS``) of what it
        measured right after an observation, within the last ``BEST_KEPT_FOR`` to twice as many
        observations (two windows: this one's and the last one's). What it measured: the
        slower of the fit and the fit of the observations' own sums without the prior's, once
        they outweigh the prior ``BEST_FROM_EVIDENCE`` times — never a speed the prior pulled
        faster than the endpoint ever answered (an endpoint slower than the prior), nor one a
        few noisy observations extrapolate to (the fit's line holds the prior's two points
        apart). A stall of a few calls does not replace it; what the endpoint did before the
        stall is what its idle ageing returns to (``relax``)."""
        self._window: Speed | None = None
        """The fastest fit of this window of ``BEST_KEPT_FOR`` observations."""
        self._last_window: Speed | None = None
        self._in_window = 0

    def value_at(self, now: float) -> Speed:
        """The estimate at ``now``: the fit of the evidence aged to ``now``."""
        weight = self._weight(now)
        if weight >= 1.0:
            return self.value
        return self._m.toward(self._prior_moments, weight).fit(self._prior.s_per_token)

    def observe(self, work_tokens: float, seconds: float, now: float | None = None) -> Speed:
        """Learn one call; ``now`` (monotonic seconds) ages the evidence before it (None: no
        time passed, as for an estimate without a half-life)."""
        weight = self._weight(now)
        m = self._m.toward(self._prior_moments, weight)
        keep = 1.0 - self._alpha
        self._prior_part = keep * _toward_one(self._prior_part, weight)
        self._m = m = Moments(
            keep * m.w + 1.0,
            keep * m.x + work_tokens,
            keep * m.y + seconds,
            keep * m.xx + work_tokens * work_tokens,
            keep * m.xy + work_tokens * seconds,
        )
        self.samples += 1
        if now is not None:
            self.observed_at = self._aged_at = now
        self.value = fitted = m.fit(self._prior.s_per_token)
        prior = self._prior_moments
        own = m.without(prior, self._prior_part)
        if own.w >= BEST_FROM_EVIDENCE * self._prior_part * prior.w:
            measured = _slower(fitted, own.fit(fitted.s_per_token))
            if self._in_window == BEST_KEPT_FOR:
                self._last_window, self._window, self._in_window = self._window, None, 0
            self._in_window += 1
            self._window = _faster(self._window, measured)
            self.best = _faster(self._last_window, self._window)
        return fitted

    def relax(self, target: Speed, weight: float, since: float, at: float) -> Speed:
        """Replace part of the evidence as of ``since`` by ``target``'s line, for good: every
        weighted sum blended toward those of two virtual points on that line worth as much as
        the evidence, which keeps ``weight`` of its own (``decay_weight``'s); from ``since`` to
        ``at`` the result ages toward the prior as any evidence does, and the next ageing
        counts from ``at``. For evidence that something other than time says is stale: the
        endpoint's scrapes showed it idle after a stall, and its ``best`` says what it did
        before (``placement.EndpointState.idle_spell``). Returns the new fit."""
        if weight >= 1.0:
            return self.value
        since = self._since(since)
        aged = decay_weight(at - since, self._half_life_s)
        self._m = self._relaxed(target, weight, since).toward(self._prior_moments, aged)
        # The prior's part as of ``since``, of which the target's line takes its share too.
        kept = weight * _toward_one(self._prior_part, self._weight(since))
        self._prior_part = _toward_one(kept, aged)
        self._aged_at = max(since, at)
        self.value = self._m.fit(self._prior.s_per_token)
        return self.value

    def relaxed_at(self, target: Speed, weight: float, since: float, now: float) -> Speed:
        """The estimate at ``now`` had it been relaxed (``relax(target, weight, since, at)``,
        any ``at`` up to ``now``), without relaxing it: what a decision reads while an idle
        spell runs, the same as once the spell is applied for good."""
        if weight >= 1.0:
            return self.value_at(now)
        since = self._since(since)
        relaxed = self._relaxed(target, weight, since)
        aged = relaxed.toward(self._prior_moments, decay_weight(now - since, self._half_life_s))
        return aged.fit(self._prior.s_per_token)

    def _since(self, since: float) -> float:
        return since if self._aged_at is None else max(self._aged_at, since)

    def _relaxed(self, target: Speed, weight: float, since: float) -> Moments:
        aged = self._m.toward(self._prior_moments, self._weight(since))
        return aged.toward(Moments.of(target, aged.w), weight)

    def _weight(self, now: float | None) -> float:
        if now is None or self._aged_at is None:
            return 1.0
        return decay_weight(now - self._aged_at, self._half_life_s)


def _toward_one(part: float, weight: float) -> float:
    """The prior's part of a fit's sums after they are blended toward the prior's with
    ``weight`` (``Moments.toward``)."""
    return part if weight >= 1.0 else 1.0 + weight * (part - 1.0)


def _slower(one: Speed, other: Speed) -> Speed:
    """The slower of two fits at ``VIRTUAL_HIGH_TOKENS`` (``one`` on a tie)."""
    if other.seconds(VIRTUAL_HIGH_TOKENS) > one.seconds(VIRTUAL_HIGH_TOKENS):
        return other
    return one


def _faster(one: Speed | None, other: Speed) -> Speed:
    """The faster of two fits at ``VIRTUAL_HIGH_TOKENS`` (``other`` on a tie, or alone)."""
    if one is None or other.seconds(VIRTUAL_HIGH_TOKENS) <= one.seconds(VIRTUAL_HIGH_TOKENS):
        return other
    return one


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
