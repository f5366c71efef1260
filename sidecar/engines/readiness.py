"""Readiness follows the decode engine: ``/ready`` is 200 while at least one of its ranks is ready,
503 (saying why) before the first success and once every rank is unready.

A rank's readiness is judged from its consecutive ``/health`` polls (``judge``), as the kubelet
judges its own probes: a ready rank turns unready after ``SIDECAR_READY_FAILURE_THRESHOLD``
(3) failed polls in a row — no answer within the poll's timeout, an answer other than 200 — so
one slow answer under load does not take the pod out of its Service; a refused connection
(nothing listens: the engine is gone) turns it unready at once. An unready rank turns ready
after ``SIDECAR_READY_SUCCESS_THRESHOLD`` (1) successful polls in a row.

The polls are the engine monitor's (``sidecar.engines.monitor``: every rank, all at once, every
``SIDECAR_READY_INTERVAL_S``), which publishes the judged snapshot on the rank; the rank choice
and ``/debug/scheduler`` read the same one. ``Readiness`` then reports what changed: a log line
with the reason at each transition, a warning at once and then every ``REMIND_EVERY_S`` while
the engine stays unready (an engine that never comes up is not silent), and the
``pd_sidecar_decode_ready`` and ``pd_sidecar_decode_rank_ready`` gauges. A rank that is not
ready gets no requests while another is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.fleet.snapshot import EngineHealth, EngineSnapshot
from sidecar.observability.metrics import Metrics
from sidecar.scheduling.ranks import DecodeRank, DecodeRanks

logger = logging.getLogger("sidecar.engines.readiness")

REMIND_EVERY_S = 30.0
"""While the decode engine is not ready, its reason is logged again this often."""


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Consecutive polls that change a rank's readiness (the kubelet's ``failureThreshold`` and
    ``successThreshold``, and their defaults)."""

    failures: int = 3
    successes: int = 1


DEFAULT_THRESHOLDS = Thresholds()


@dataclass(frozen=True, slots=True)
class HealthPoll:
    """One ``/health`` poll of an engine, as the monitor found it."""

    health: EngineHealth
    at: float
    """Monotonic time of the poll."""
    engine: str
    """The engine polled, for people: ``decode engine at 127.0.0.1:8200``."""
    reason: str = ""
    """Why it failed, naming the engine; "" when it answered 200."""
    refused: bool = False
    """The connection was refused: nothing listens, the poll counts at once."""


def judge(engine: EngineSnapshot, poll: HealthPoll, thresholds: Thresholds) -> EngineSnapshot:
    """``engine`` after ``poll``: its health, its streak of alike polls, and whether it is ready
    now (pure)."""
    ok = poll.health is EngineHealth.UP
    alike = engine.streak > 0 and (engine.health is EngineHealth.UP) == ok
    streak = engine.streak + 1 if alike else 1
    if ok:
        ready = engine.ready or streak >= thresholds.successes
        reason = (
            ""
            if ready
            else f"{poll.engine}: {streak} of {thresholds.successes} /health polls in a row "
            "answered 200 so far"
        )
    else:
        ready = engine.ready and not poll.refused and streak < thresholds.failures
        reason = poll.reason
    return dataclasses.replace(
        engine,
        health=poll.health,
        health_at=poll.at,
        at=poll.at,
        ready=ready,
        streak=streak,
        reason=reason,
    )


class Readiness:
    def __init__(
        self,
        *,
        ranks: DecodeRanks,
        metrics: Metrics,
        thresholds: Thresholds | None = None,
        clock: Callable[[], float] = time.monotonic,
        remind_every_s: float = REMIND_EVERY_S,
    ) -> None:
        self._ranks = ranks
        self._metrics = metrics
        self._thresholds = thresholds or DEFAULT_THRESHOLDS
        self._clock = clock
        self._remind_every_s = remind_every_s
        self._unready_since = clock()
        self._remind_at: float | None = None  # None: the reason was not logged yet
        self._ready_before = False
        """Whether it was ready once: ready again after an outage says for how long it was not."""
        self.draining = False
        """Set at SIGTERM: not ready any more, whatever the engine says."""

    @property
    def ready(self) -> bool:
        return self._ranks.ready

    @property
    def reason(self) -> str:
        """Why the decode engine is not ready (each rank's reason, with ranks)."""
        ranks = list(self._ranks)
        if len(ranks) == 1:
            return _reason(ranks[0])
        return "no decode rank is ready: " + "; ".join(
            f"rank {rank.index}: {_reason(rank)}" for rank in ranks
        )

    def rank_polled(self, rank: DecodeRank, was: bool) -> None:
        """The monitor published a ``/health`` poll of ``rank``, which was ready or not (``was``)
        before it."""
        engine = rank.engine
        ok = engine.ready
        if ok and engine.health is not EngineHealth.UP:
            logger.info(
                "%s (%d of %d failed /health polls before it counts as not ready)",
                engine.reason,
                engine.streak,
                self._thresholds.failures,
            )
        elif ok != was and len(self._ranks) > 1:
            if ok:
                logger.info("decode rank %d (%s) ready", rank.index, rank.url)
            else:
                logger.warning(
                    "decode rank %d not ready: it gets no requests while another rank is ready: %s",
                    rank.index,
                    _reason(rank),
                )
        self._metrics.decode_rank_ready.labels(str(rank.index)).set(1 if ok else 0)

    def polled(self, was: bool) -> None:
        """The monitor polled every rank once; the engine was ready or not (``was``) before."""
        ok = self.ready
        now = self._clock()
        if ok:
            if not was and self._ready_before:
                logger.info(
                    "decode engine ready again (not ready for %.0f s)", now - self._unready_since
                )
            elif not was:
                logger.info("decode engine ready")
            self._ready_before = True
            self._remind_at = None
        elif was:
            self._unready_since = now
            logger.warning("decode engine not ready: %s", self.reason)
            self._remind_at = now + self._remind_every_s
        elif all(rank.engine.health is EngineHealth.UP for rank in self._ranks):
            pass  # its polls succeed, not enough of them yet: nothing to warn of
        elif self._remind_at is None:  # since start: no line said so yet
            logger.warning("decode engine not ready: %s", self.reason)
            self._remind_at = now + self._remind_every_s
        elif now >= self._remind_at:
            logger.warning(
                "decode engine still not ready after %.0f s: %s",
                now - self._unready_since,
                self.reason,
            )
            self._remind_at = now + self._remind_every_s
        self._metrics.decode_ready.set(1 if ok else 0)


def _reason(rank: DecodeRank) -> str:
    engine = rank.engine
    if engine.reason:
        return engine.reason
    name = rank.url.split("://", 1)[-1]
    if engine.health is EngineHealth.UNKNOWN:
        return f"decode engine at {name}: not polled yet"
    return f"decode engine at {name}: ready"
