"""Readiness follows the decode engine: ``/ready`` is 200 only while the last ``/health`` poll of
at least one of its ranks succeeded (503 before the first success and once every rank failed).

Each rank (``SIDECAR_DECODE_URLS``; the one ``SIDECAR_DECODE_URL`` without ranks) is polled every
interval, all at once; a rank whose last poll failed gets no requests while another is ready.
"""

from __future__ import annotations

import asyncio
import logging

from sidecar.errors import EngineError, EngineNotConnected
from sidecar.metrics import Metrics
from sidecar.scheduling.ranks import DecodeRank, DecodeRanks
from sidecar.upstream import Engines

logger = logging.getLogger("sidecar.readiness")


class Readiness:
    def __init__(
        self, *, engines: Engines, ranks: DecodeRanks, interval_s: float, metrics: Metrics
    ) -> None:
        self._engines = engines
        self._ranks = ranks
        self._interval_s = interval_s
        # A poll may take at most one interval (and never less than a second) before it fails.
        self._timeout_s = max(1.0, interval_s)
        self._metrics = metrics
        self.draining = False
        """Set at SIGTERM: not ready any more, whatever the engine says."""

    @property
    def ready(self) -> bool:
        return self._ranks.ready

    async def poll(self) -> bool:
        """Poll every rank once; whether the engine (at least one rank) is ready."""
        was = self.ready
        await asyncio.gather(*(self._poll(rank) for rank in self._ranks))
        ok = self.ready
        if ok != was:
            logger.info("decode engine %s", "ready" if ok else "not ready")
        self._metrics.decode_ready.set(1 if ok else 0)
        return ok

    async def _poll(self, rank: DecodeRank) -> None:
        lost = False  # evidence that the engine's cache is gone, not just a slow answer
        try:
            response = await self._engines.send(
                "GET", rank.url + "/health", headers={}, total_s=self._timeout_s, poll=True
            )
            await response.read()
            ok = response.status == 200
            lost = not ok
        except EngineNotConnected:
            ok, lost = False, True
        except EngineError:  # a timeout, a broken answer: unready, its cache presumably kept
            ok = False
        if ok != rank.ready and len(self._ranks) > 1:
            logger.info("decode rank %d (%s) %s", rank.index, rank.url, _word(ok))
        self._ranks.mark(rank, ok, lost=lost)
        self._metrics.decode_rank_ready.labels(str(rank.index)).set(1 if ok else 0)

    async def run(self) -> None:
        """Poll forever; cancelled at shutdown."""
        while True:
            await self.poll()
            await asyncio.sleep(self._interval_s)


def _word(ready: bool) -> str:
    return "ready" if ready else "not ready: it gets no requests while another rank is ready"
