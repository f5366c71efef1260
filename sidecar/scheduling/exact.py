"""What the scheduler asks of the engines' exact prefix indexes (``SIDECAR_KV_EVENTS``).

``sidecar.kvevents.fleet`` implements them (``KVFleet``, ``PromptLookup``); that package sits
above this one (it builds on placements) and imports ``msgpack``, so the scheduler names the
protocols only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from sidecar.scheduling.placement import Placement


class PromptLookup(Protocol):
    """One request's look-ups in the exact indexes, for its decision: called with a pool
    member's key (``placement.ExactCache``), ``rank`` for each candidate decode rank
    (``ranks.RankCache``)."""

    tokens: int | None
    """The prompt's token count (None: unknown)."""
    seconds: float | None
    """Spent getting the token ids (None: not asked of the engine)."""
    sources: dict[str, str]
    """Where each engine's cached tokens came from, as looked up."""

    def __call__(self, key: str) -> int | None: ...

    def rank(self, rank: int, approximate: int) -> int:
        """Decode rank ``rank``'s cached tokens: its exact index's, else ``approximate``."""
        ...

    def again(self) -> None:
        """The look-ups start over for another decision on the same prompt (a retry)."""
        ...


class ExactIndexes(Protocol):
    async def prompt(self, body: Mapping[str, Any], *, ask: bool) -> PromptLookup | None:
        """The look-ups of a request's decision, or None when no engine's index is in sync.
        ``ask``: the token ids may be asked of the decode engine (a choice is to be made)."""
        ...

    def decided(self, placement: Placement, lookup: PromptLookup) -> Placement:
        """The placement with what its look-ups add (``tokenize_s``, ``cached_source``)."""
        ...
