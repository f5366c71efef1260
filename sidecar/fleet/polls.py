"""A prefill endpoint's poll, as the pool asks the engine monitor for it."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.fleet.endpoints import Endpoint


@dataclass(frozen=True, slots=True)
class PrefillPoll:
    """One prefill endpoint's poll in a scrape round, as the pool asks for it."""

    key: str
    """The endpoint's key in the pool (``host:port``)."""
    endpoint: Endpoint
    probe: bool
    """True: its ``/health`` (it is probed after an ejection); False: its ``/metrics``."""
