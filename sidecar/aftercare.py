"""Work that outlives its request: KV releases, and prefill calls whose client left.

Both run in the background, off the request path, in one bounded set that shutdown waits for
(each piece is bounded by its own timeout). A full set makes a release be skipped (the engine's
own expiry frees that KV later; counted as ``skipped``) and a prefill be aborted rather than
finished.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.errors import EngineNotConnected, SidecarError
from sidecar.metrics import Metrics
from sidecar.tracing import Leg, RequestTrace
from sidecar.tracking import task_name
from sidecar.upstream import EngineAnswer, Engines

logger = logging.getLogger("sidecar.aftercare")

MAX_PENDING = 1024
"""Releases and finishing prefills at once; beyond it the engine's own expiry has to do."""


class Aftercare:
    def __init__(
        self,
        *,
        engines: Engines,
        metrics: Metrics,
        enabled: bool,
        timeout_s: float,
    ) -> None:
        self._engines = engines
        self._metrics = metrics
        self._enabled = enabled
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Future[Any]] = set()

    def adopt(self, task: asyncio.Future[Any]) -> bool:
        """Keep ``task`` running after its request ended; False when the set is full."""
        if len(self._tasks) >= MAX_PENDING:
            return False
        self.watch(task)
        return True

    def watch(self, task: asyncio.Future[Any]) -> None:
        """Hold a reference to ``task`` (already cancelled, say) until it ends."""
        if not task.done():
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def release(
        self,
        request_id: str,
        urls: Sequence[str],
        headers: Mapping[str, str],
        data: bytes,
        trace: RequestTrace | None = None,
    ) -> None:
        """Send ``data`` to ``urls[0]`` in the background to free request ``request_id``'s
        staged KV, its answer dropped; to the next URL when one cannot be connected to (any
        decode rank can pull the KV).

        Does nothing when releases are off (``SIDECAR_RELEASE_ON_DISCONNECT=false``).
        """
        if not self._enabled:
            return
        if len(self._tasks) >= MAX_PENDING:
            self._metrics.kv_releases.labels("skipped").inc()
            return
        leg = trace.leg("kv_release", urls[0]) if trace is not None else None
        if leg is not None:
            headers = leg.headers(headers)
        name = task_name(request_id, "release")
        self.watch(asyncio.create_task(self._send(urls, headers, data, leg), name=name))

    async def _send(
        self, urls: Sequence[str], headers: Mapping[str, str], data: bytes, leg: Leg | None
    ) -> None:
        try:
            answer = await self._post(urls, headers, data)
            await answer.read()
        except BaseException as exc:
            if leg is not None:
                leg.ended_by(exc)
            if isinstance(exc, SidecarError):
                self._metrics.kv_releases.labels("failed").inc()
                logger.warning("releasing staged KV failed: %s", exc.message)
                return
            if isinstance(exc, Exception):
                self._metrics.kv_releases.labels("failed").inc()
                logger.exception("releasing staged KV failed")
                return
            raise
        if answer.status >= 400:
            if leg is not None:
                error = f"{answer.engine} answered {answer.status}"
                leg.end("failed", status=answer.status, error=error)
            self._metrics.kv_releases.labels("failed").inc()
            logger.warning(
                "releasing staged KV failed: %s answered %d", answer.engine, answer.status
            )
            return
        if leg is not None:
            leg.end("sent", status=answer.status)
        self._metrics.kv_releases.labels("sent").inc()

    async def _post(
        self, urls: Sequence[str], headers: Mapping[str, str], data: bytes
    ) -> EngineAnswer:
        for url in urls[:-1]:
            try:
                return await self._send_one(url, headers, data)
            except EngineNotConnected as exc:
                logger.info("KV release: %s; trying another decode rank", exc.message)
        return await self._send_one(urls[-1], headers, data)

    async def _send_one(self, url: str, headers: Mapping[str, str], data: bytes) -> EngineAnswer:
        return await self._engines.send(
            "POST",
            url,
            headers=headers,
            data=data,
            total_s=self._timeout_s,
            role="the engine taking a KV release",
        )

    async def close(self, timeout_s: float) -> None:
        """Let the work under way finish for up to ``timeout_s``, then cancel what is left (a
        finishing prefill cancelled then may keep its KV until the engine's expiry)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while self._tasks and loop.time() < until:
            await asyncio.wait(list(self._tasks), timeout=until - loop.time())
        left = list(self._tasks)
        for task in left:
            task.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)
            logger.warning("shutdown: %d KV release(s) or finishing prefill(s) cut", len(left))
