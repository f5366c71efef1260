"""What the scheduler knows at decision time: plain immutable values, no I/O.

Production fills them from reservations, scraped engine metrics and its own observations; the
simulator (bench/simulate.py) fills them from its modelled cluster. Both then run the same decider
and policy code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Speed:
    """Predicted prefill time = ``overhead_s + s_per_token * tokens`` (queued tokens included)."""

    s_per_token: float
    overhead_s: float

    def seconds(self, tokens: float) -> float:
        return self.overhead_s + self.s_per_token * tokens


@dataclass(frozen=True, slots=True)
class Transfer:
    """KV transfer time estimate: ``fixed_s + s_per_token * tokens``."""

    fixed_s: float = 0.002
    s_per_token: float = 1e-7

    def seconds(self, tokens: float) -> float:
        return self.fixed_s + self.s_per_token * tokens


@dataclass(slots=True)
class Candidate:
    """One prefill endpoint as a policy sees it. Only available endpoints are ever candidates
    (ejected, probing and draining ones are filtered out before a policy runs). Built anew for
    every endpoint on every decision, and never changed once built; not ``frozen``, as a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``, several times the
    instructions of a plain one (measured with callgrind: docs/benchmarks.md).

    ``reserved_*`` are reservations of prefills chosen and not yet finished (every sidecar's with a
    shared backend, this sidecar's own otherwise): fresh. ``waiting``/``running`` are the engine's
    scraped gauges: possibly stale, None when unknown.
    """

    key: str
    reserved_tokens: int = 0
    reserved_requests: int = 0
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    speed: Speed = Speed(1e-4, 0.02)
    cached_tokens: int = 0
    """Tokens of this prompt the endpoint is predicted to hold in its prefix cache (the prefill
    prefix index's match, weighed by how much a predicted hit is trusted): it computes the rest."""
    affinity: int = 0
    """The endpoint's rendezvous weight for the prompt's prefix (``placement.affinity``): the
    same in every sidecar that shares the prefix hash key, so that among endpoints equally placed
    to serve a prefix every sidecar prefers the same one. 0 for all: no prefix known."""

    def scraped_requests(self) -> float | None:
        if self.waiting is None and self.running is None:
            return None
        return (self.waiting or 0.0) + (self.running or 0.0)

    def queued_tokens(self, tokens_per_waiting: float) -> float:
        """Work ahead of a new prefill. Reservations and scraped waiting requests often describe
        the same work (ours, seen twice): take the larger, not the sum."""
        scraped = (self.waiting or 0.0) * tokens_per_waiting
        return max(float(self.reserved_tokens), scraped)


@dataclass(frozen=True, slots=True)
class LocalView:
    """The local decode engine, for "prefill locally" predictions.

    ``ahead_tokens``: prompt tokens of this sidecar's local requests that have not produced their
    first byte yet. ``waiting``: the engine's scraped ``vllm:num_requests_waiting``.
    ``speed``: observed local time to first token per prompt token. ``running``: other requests
    of this sidecar on the engine (placed, not finished): the decodes a local prefill stalls.
    ``stall_credit_s``: the stall those decodes can still absorb (the rank's ``StallBudget``;
    infinite: no budget kept).
    """

    ahead_tokens: int = 0
    waiting: float | None = None
    speed: Speed = Speed(1e-4, 0.01)
    running: int = 0
    stall_credit_s: float = math.inf


@dataclass(frozen=True, slots=True)
class Decision:
    """Where to prefill. ``endpoint`` None means on the local decode engine.

    ``reason`` (recorded with the request, a metric label): ``header``, ``pool_empty``,
    ``short_prompt``, ``prefix_cached``, ``pool_saturated``, ``scheduled``, ``decode_budget`` (a
    local prefill would overrun the running decodes' stall budget), ``retest`` (sent to
    an endpoint unmeasured for ``SIDECAR_SCHEDULER_RETEST_S``), ``round_robin``.
    """

    endpoint: str | None
    reason: str
    prompt_tokens: int = 0
    uncached_tokens: int = 0
    predicted_s: float | None = None
    """Predicted time to first token where the prefill was placed (remote or local)."""
    remote_cached_tokens: int = 0
    """Tokens the chosen prefill endpoint was predicted to hold (its candidate's
    ``cached_tokens``); 0 for a local prefill, or without the prefill prefix index."""
