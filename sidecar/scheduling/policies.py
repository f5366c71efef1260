"""Prefill-partner policies: pure, synchronous, free of I/O (the simulator runs them as they are).

Each gets the available candidates and the prompt's tokens (the decider passes the whole prompt:
a prefill engine does not hold the decode engine's prefix cache; a candidate's ``cached_tokens``
says what the prefill prefix index predicts it holds), and returns one candidate or None when
there is none. Randomness comes from an injected
``random.Random`` (seeded in tests and the simulator).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from sidecar.defaults import QOE_CHOICES
from sidecar.scheduling.model import Candidate, Transfer

TOKENS_PER_WAITING = 1000.0
"""Prompt tokens assumed per scraped waiting request when reservations say less."""


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], tokens: int) -> Candidate | None: ...


def predicted_ttft(
    candidate: Candidate,
    tokens: int,
    transfer: Transfer,
    tokens_per_waiting: float = TOKENS_PER_WAITING,
    *,
    credited: bool = True,
) -> float:
    """Queue ahead and the prompt's tokens the endpoint does not hold, at its observed speed, plus
    the KV transfer of the whole prompt (the decode engine pulls every block). ``credited``
    False: as if it held none of the prompt."""
    computed = max(0, tokens - candidate.cached_tokens) if credited else tokens
    work = candidate.queued_tokens(tokens_per_waiting) + computed
    return candidate.speed.seconds(work) + transfer.seconds(tokens)


class RoundRobin:
    """Each candidate in turn (vLLM's reference proxy, production-stack)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], tokens: int) -> Candidate | None:
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda c: c.key)
        choice = ordered[self._turn % len(ordered)]
        self._turn += 1
        return choice


class RandomChoice:
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate], tokens: int) -> Candidate | None:
        return self._rng.choice(candidates) if candidates else None


class LeastLoaded:
    """The global minimum of scraped load (waiting + running requests), ties at random.

    What the peers do; kept for comparison. With stale metrics every chooser sees the same
    minimum and herds onto it (NVIDIA Dynamo #12864). Endpoints not scraped yet count by this
    sidecar's reservations.
    """

    name = "least_loaded"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate], tokens: int) -> Candidate | None:
        return _lowest(candidates, _scraped_load, self._rng)


class PowerOfTwo:
    """The less loaded of two random candidates (Mitzenmacher), counting reservations."""

    name = "power_of_two"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, candidates: Sequence[Candidate], tokens: int) -> Candidate | None:
        sample = _sample(candidates, 2, self._rng)
        return _lowest(sample, _reserved_load, self._rng)


class Qoe:
    """Lowest predicted time to first token among ``choices`` random candidates (all of them
    when there are no more).

    Predicted TTFT = (tokens queued ahead + the prompt's tokens it is not predicted to hold) x
    the endpoint's observed seconds per token + its overhead + the KV transfer estimate. A small
    ``choices`` (2) trades the best pick for less herding when sidecars decide on one stale
    view; so does ``among`` (2: the pick is drawn at random among the two lowest predicted
    TTFTs of the sample, unless the prefix's home wins).

    Affinity: the prompt's prefix has one home, ``affinity_target``: the candidate predicted to
    hold most of it, the highest rendezvous weight among equal holders, or, when none holds any
    of it, the highest weight of all. The home is always compared, wins ties, and is the only
    candidate credited with what it holds: another is predicted to compute the whole prompt,
    even when the index says it holds the prefix too. A home that holds nothing yet is credited
    with the whole prompt all the same (it will hold it), computed at the sample's fastest speed.
    So a prefix leaves its home only when waiting there costs more than computing the prompt
    elsewhere, and once the queue drains it
    comes back: a copy made by that spill is left to age out of the other cache instead of
    splitting the prefix's requests between two servers whose caches then evict each other;
    and a prefix evicted everywhere comes back to the same home.
    """

    name = "qoe"

    def __init__(
        self,
        rng: random.Random,
        *,
        choices: int = QOE_CHOICES,
        transfer: Transfer = Transfer(),
        tokens_per_waiting: float = TOKENS_PER_WAITING,
        among: int = 1,
    ) -> None:
        if among < 1:
            raise ValueError("among is at least 1")
        self._rng = rng
        self._among = among
        self._choices = choices
        self._transfer = transfer
        self._tokens_per_waiting = tokens_per_waiting

    def choose(self, candidates: Sequence[Candidate], tokens: int) -> Candidate | None:
        sample = _sample(candidates, self._choices, self._rng)
        home = affinity_target(candidates)
        if home is not None and home not in sample:
            # A sample without the prefix's home would recompute what the pool holds.
            sample = [*sample, home]
        transfer, per_waiting = self._transfer, self._tokens_per_waiting

        def cost(candidate: Candidate) -> float:
            credited = candidate is home
            return predicted_ttft(candidate, tokens, transfer, per_waiting, credited=credited)

        if home is None:
            if self._among > 1:
                return _among_lowest([(cost(c), c) for c in sample], self._among, self._rng)
            return _lowest(sample, cost, self._rng)
        scored = [(cost(c), c) for c in sample]
        best = min(score for score, _ in scored)
        home_cost = next(score for score, c in scored if c is home)
        if home.cached_tokens == 0:
            # Nobody holds the prefix: its home is credited with what computing it elsewhere
            # costs (later requests of the prefix find it at home), at the sample's fastest
            # speed: a slow home is not credited with its own slowness.
            home_cost -= min(c.speed.s_per_token for c in sample) * tokens
        if home_cost <= best:
            return home
        # The home lost: the lowest predicted time to first token of the others, the credit
        # playing no part among them.
        if self._among > 1:
            return _among_lowest(scored, self._among, self._rng)
        return self._rng.choice([c for score, c in scored if score <= best])


def affinity_target(candidates: Sequence[Candidate]) -> Candidate | None:
    """The prompt's prefix's home among ``candidates`` (``Qoe``): the one predicted to hold most
    of the prompt, the highest ``affinity`` among equal holders; when none holds any of it, the
    highest ``affinity``; None without either (no prefix known)."""
    if not candidates:
        return None
    home = max(candidates, key=_held_then_affinity)
    if home.cached_tokens == 0 and home.affinity == 0:
        return None
    return home


def _held_then_affinity(candidate: Candidate) -> tuple[int, int]:
    return candidate.cached_tokens, candidate.affinity


POLICIES = ("qoe", "power_of_two", "least_loaded", "round_robin", "random")


def make_policy(
    name: str,
    rng: random.Random,
    *,
    choices: int = QOE_CHOICES,
    transfer: Transfer = Transfer(),
    among: int = 1,
) -> Policy:
    if name == "qoe":
        return Qoe(rng, choices=choices, transfer=transfer, among=among)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "least_loaded":
        return LeastLoaded(rng)
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(rng)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")


def _scraped_load(candidate: Candidate) -> float:
    scraped = candidate.scraped_requests()
    return float(candidate.reserved_requests) if scraped is None else scraped


def _reserved_load(candidate: Candidate) -> float:
    # Reservations are fresh, the scrape may see work from elsewhere: the larger of the two.
    return max(float(candidate.reserved_requests), candidate.scraped_requests() or 0.0)


def _sample(candidates: Sequence[Candidate], k: int, rng: random.Random) -> Sequence[Candidate]:
    return candidates if len(candidates) <= k else rng.sample(list(candidates), k)


def _lowest(
    candidates: Sequence[Candidate], cost: Callable[[Candidate], float], rng: random.Random
) -> Candidate | None:
    if not candidates:
        return None
    scored = [(cost(c), c) for c in candidates]
    best = min(score for score, _ in scored)
    return rng.choice([c for score, c in scored if score <= best])


def _among_lowest(
    scored: Sequence[tuple[float, Candidate]], among: int, rng: random.Random
) -> Candidate | None:
    """One of the ``among`` lowest-scored candidates, drawn at random (ties in the order given)."""
    if not scored:
        return None
    ranked = sorted(scored, key=lambda pair: pair[0])
    return rng.choice([candidate for _, candidate in ranked[:among]])
