"""Readiness follows the decode engine: ``/ready`` is 200 only while its last ``/health`` poll
succeeded (503 before the first success and after any failure)."""

from __future__ import annotations

import asyncio
import logging

from sidecar.errors import EngineError
from sidecar.metrics import Metrics
from sidecar.upstream import Engines

logger = logging.getLogger("sidecar.readiness")


class Readiness:
    def __init__(
        self, *, engines: Engines, decode_url: str, interval_s: float, metrics: Metrics
    ) -> None:
        self._engines = engines
        self._url = decode_url + "/health"
        self._interval_s = interval_s
        # A poll may take at most one interval (and never less than a second) before it fails.
        self._timeout_s = max(1.0, interval_s)
        self._metrics = metrics
        self.ready = False
        self.draining = False
        """Set at SIGTERM: not ready any more, whatever the engine says."""

    async def poll(self) -> bool:
        try:
            response = await self._engines.send(
                "GET", self._url, headers={}, total_s=self._timeout_s, poll=True
            )
            await response.read()
            ok = response.status == 200
        except EngineError:
            ok = False
        if ok != self.ready:
            logger.info("decode engine %s", "ready" if ok else "not ready")
        self.ready = ok
        self._metrics.decode_ready.set(1 if ok else 0)
        return ok

    async def run(self) -> None:
        """Poll forever; cancelled at shutdown."""
        while True:
            await self.poll()
            await asyncio.sleep(self._interval_s)
