"""Requirement checks, attached to the scenario they judge (``Scenario.checks``).

A check names the variants it needs and judges one seed's outcome. When one of them did not run
(``--policies`` left it out), the check cannot be evaluated and that is a failure, with a message
saying which — never a silent skip. A check whose bound is None is a report: it prints its
value and never fails (nor does it fail when it cannot run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from bench.sim.scenario import Variant


@dataclass(frozen=True, slots=True)
class Outcome:
    """One scenario and seed: goodput per variant, and the prefill queues' max/mean at the
    common reference rate."""

    goodput: dict[Variant, float]
    queue_max_over_mean: dict[Variant, float]


@dataclass(frozen=True, slots=True)
class Verdict:
    text: str
    ok: bool | None
    """None: a report, not a requirement."""

    @property
    def failed(self) -> bool:
        return self.ok is False

    @property
    def tag(self) -> str:
        return {True: "PASS", False: "FAIL", None: "INFO"}[self.ok]


class Check(Protocol):
    def needs(self) -> tuple[Variant, ...]: ...

    def judge(self, outcome: Outcome) -> Verdict: ...


def _missing(check: Check, present: dict[Variant, float], text: str, report: bool) -> Verdict:
    labels = ", ".join(v.label for v in check.needs() if v not in present)
    return Verdict(f"{text}: cannot run, not run: {labels}", None if report else False)


@dataclass(frozen=True, slots=True)
class GoodputRatio:
    """``variant``'s goodput ≥ ``factor`` × ``base``'s (strictly greater for a factor of 1);
    ``factor`` None reports the ratio."""

    variant: Variant
    base: Variant
    factor: float | None
    note: str = ""

    def needs(self) -> tuple[Variant, ...]:
        return (self.variant, self.base)

    def judge(self, outcome: Outcome) -> Verdict:
        name = f"{self.base.label}{self.note}"
        if self.factor is None:
            text = f"{self.variant.label} goodput vs {name} (reported)"
        elif self.factor == 1:
            text = f"{self.variant.label} goodput > {name}"
        else:
            text = f"{self.variant.label} goodput >= {self.factor:g}x {name}"
        rates = outcome.goodput
        if self.variant not in rates or self.base not in rates:
            return _missing(self, rates, text, self.factor is None)
        value, base = rates[self.variant], rates[self.base]
        ratio = value / base if base else math.inf
        shown = f"{text} ({ratio:.2f}x: {value:.2f} vs {base:.2f} req/s)"
        if self.factor is None:
            return Verdict(shown, None)
        ok = value > base if self.factor == 1 else value >= self.factor * base
        return Verdict(shown, ok)


@dataclass(frozen=True, slots=True)
class QueueBalance:
    """``variant``'s prefill queue max/mean at the reference rate ≤ ``at_most``; None reports
    it."""

    variant: Variant
    at_most: float | None

    def needs(self) -> tuple[Variant, ...]:
        return (self.variant,)

    def judge(self, outcome: Outcome) -> Verdict:
        label = self.variant.label
        text = (
            f"{label} prefill queue max/mean (reported)"
            if self.at_most is None
            else f"{label} prefill queue max/mean <= {self.at_most:g}"
        )
        ratios = outcome.queue_max_over_mean
        if self.variant not in ratios:
            return _missing(self, ratios, text, self.at_most is None)
        value = ratios[self.variant]
        if math.isnan(value):
            return Verdict(f"{text}: cannot run, no prefill queue at the reference rate", False)
        shown = f"{text} ({value:.2f})"
        return Verdict(shown, None if self.at_most is None else value <= self.at_most)
