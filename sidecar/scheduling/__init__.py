"""Choosing the prefill partner when the gateway named none.

The static pool, picked round robin, stands here until the shared-state scheduler (decider,
policies, state backends) replaces it behind the same call: ``choose()`` is plain, synchronous and
free of I/O, so a simulator can run the production code in virtual time.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.endpoints import Endpoint


@dataclass(frozen=True, slots=True)
class Choice:
    """Where to prefill: ``endpoint`` None means on the local decode engine. ``reason`` is a short
    word recorded with the request (documented in docs/observability.md)."""

    endpoint: Endpoint | None
    reason: str


class RoundRobin:
    """Every pool member in turn."""

    def __init__(self, pool: tuple[Endpoint, ...]) -> None:
        self._pool = pool
        self._next = 0

    def choose(self) -> Choice:
        if not self._pool:
            return Choice(None, "pool_empty")
        endpoint = self._pool[self._next % len(self._pool)]
        self._next += 1
        return Choice(endpoint, "round_robin")
