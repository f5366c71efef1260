"""Readiness follows the decode engine: ``/ready`` is 200 only while the last ``/health`` poll of
at least one of its ranks succeeded (503 before the first success and once every rank failed).

The polls are the engine monitor's (``sidecar.engines.monitor``: every rank, all at once, every
``SIDECAR_READY_INTERVAL_S``); readiness reads the snapshots it publishes on the ranks, the same
ones the rank choice and ``/debug/scheduler`` read, and reports what changed: a log line and the
``pd_sidecar_decode_ready`` and ``pd_sidecar_decode_rank_ready`` gauges. A rank whose last poll
failed gets no requests while another is ready.
"""

from __future__ import annotations

import logging

from sidecar.observability.metrics import Metrics
from sidecar.scheduling.ranks import DecodeRank, DecodeRanks

logger = logging.getLogger("sidecar.engines.readiness")


class Readiness:
    def __init__(self, *, ranks: DecodeRanks, metrics: Metrics) -> None:
        self._ranks = ranks
        self._metrics = metrics
        self.draining = False
        """Set at SIGTERM: not ready any more, whatever the engine says."""

    @property
    def ready(self) -> bool:
        return self._ranks.ready

    def rank_polled(self, rank: DecodeRank, was: bool) -> None:
        """The monitor published a ``/health`` poll of ``rank``, which was ready or not (``was``)
        before it."""
        ok = rank.ready
        if ok != was and len(self._ranks) > 1:
            logger.info("decode rank %d (%s) %s", rank.index, rank.url, _word(ok))
        self._metrics.decode_rank_ready.labels(str(rank.index)).set(1 if ok else 0)

    def polled(self, was: bool) -> None:
        """The monitor polled every rank once; the engine was ready or not (``was``) before."""
        ok = self.ready
        if ok != was:
            logger.info("decode engine %s", "ready" if ok else "not ready")
        self._metrics.decode_ready.set(1 if ok else 0)


def _word(ready: bool) -> str:
    return "ready" if ready else "not ready: it gets no requests while another rank is ready"
