"""What the engine monitor last found of one engine, as an immutable value.

Pure: no I/O, no clock. The monitor (``sidecar.engines.monitor``) is the only one that makes
snapshots; a new poll makes a new snapshot, never changes one. Readiness, the scheduler and
``/debug/scheduler`` read the same value, so what one of them says of an engine is what the
others say (a rank's ``/debug/scheduler`` entry, for instance, shows the ``ready`` and the scrape
of one snapshot).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sidecar.fleet.load import EngineLoad


class EngineHealth(enum.Enum):
    """What an engine's last ``/health`` poll said."""

    UNKNOWN = "unknown"
    """Not polled yet."""
    UP = "up"
    """It answered 200."""
    DOWN = "down"
    """No usable answer in time (a timeout, a broken answer): not ready, but a busy engine keeps
    its KV cache."""
    LOST = "lost"
    """Its health check failed (an answer other than 200: a vLLM whose engine core died comes
    back empty) or nothing listens: whatever it cached is gone."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """One engine as the monitor's polls last found it.

    A decode rank's snapshot carries both kinds of poll, each kept until its next poll: the
    ``/health`` poll's ``health`` (every ``SIDECAR_READY_INTERVAL_S``) and the ``/metrics``
    scrape's ``load`` and ``unreachable`` (every ``SIDECAR_SCRAPE_INTERVAL_S``). A prefill
    endpoint's is the one poll of a scrape round (its scrape, or its probe while it is probed
    after an ejection), handed to the prefill pool, which keeps what it needs.
    """

    health: EngineHealth = EngineHealth.UNKNOWN
    health_at: float | None = None
    """Monotonic time of the ``/health`` poll that said ``health``; None: never polled."""
    ready: bool = False
    """What readiness makes of the ``/health`` polls so far (``sidecar.engines.readiness``:
    a decode rank turns unready after consecutive failed polls, not one; a prefill probe's is
    its one poll)."""
    streak: int = 0
    """Consecutive ``/health`` polls, the last one included, that succeeded (``health`` UP) or
    failed alike; 0: never polled."""
    reason: str = ""
    """Why the engine is not ready, or why its last poll failed while it still counts as ready,
    naming it (``decode engine at 127.0.0.1:8200: connection refused``); "" otherwise."""
    load: EngineLoad | None = None
    """The last scrape's gauges; None before the first, or when that scrape found none (an
    engine without metrics is scheduled by reservations alone)."""
    unreachable: bool = False
    """The last scrape could not reach the engine (refused or reset; a timeout or an answer
    other than 200 is not): for a prefill endpoint, a failure."""
    at: float | None = None
    """Monotonic time of the poll, of either kind, that made this snapshot; None: never
    polled."""


NOT_POLLED = EngineSnapshot()
"""An engine before its first poll: not ready, no load."""
