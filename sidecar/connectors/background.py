"""Work that outlives its request: KV releases, and prefill calls whose client left.

Both run in the background, off the request path, each kind in a bounded set of its own that
shutdown waits for (each piece is bounded by its own timeout), so that one kind cannot take the
other's place: prefills adopted for clients who left — which a client's own load can make many,
e.g. abandoned requests to a prefill that drips its answer — never crowd out another client's
KV release.

- Adopted prefills: at most ``MAX_ADOPTED``; beyond it a prefill is aborted rather than finished.
- Releases: at most ``RELEASES_AT_ONCE`` sent at once; more wait for a place, in order (each
  wait counted in ``pd_sidecar_kv_release_waits_total``), up to ``MAX_RELEASES`` sent or
  waiting; beyond that a release is refused (the engine's own expiry frees that KV later; its
  sender, ``sidecar.connectors.prefill.Attempt.send_release``, counts it ``skipped``).
- Aborted tasks held until they end (``abort``): not bounded here — each is already cancelled
  and ends at its next step, and each belongs to a request that ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.body import Wire
from sidecar.engines.upstream import EngineAnswer, Engines
from sidecar.errors import EngineConnectTimeout, EngineNotConnected, EngineTimeout, SidecarError
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import NO_TRACE, Leg, RequestTrace
from sidecar.observability.tracking import task_name

logger = logging.getLogger("sidecar.connectors.background")

MAX_ADOPTED = 1024
"""Prefill calls finishing for clients who left at once; beyond it a prefill is aborted."""
RELEASES_AT_ONCE = 256
"""KV releases sent at once (each a one-token decode on the decode engine); more wait."""
MAX_RELEASES = 1024
"""KV releases sent or waiting; beyond it the engine's own expiry has to do. A release holds
its body (the client's prompt) while it waits: this bounds that memory as before."""


class BackgroundWork:
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
        self._adopted: set[asyncio.Future[Any]] = set()
        self._releases: set[asyncio.Future[Any]] = set()
        self._watched: set[asyncio.Future[Any]] = set()
        self._sending = asyncio.Semaphore(RELEASES_AT_ONCE)
        """A release's place to be sent; FIFO among the waiting ones."""

    @property
    def releasing(self) -> bool:
        """Whether staged KV is released (``SIDECAR_RELEASE_ON_DISCONNECT``)."""
        return self._enabled

    def adopt(self, task: asyncio.Future[Any]) -> bool:
        """Keep ``task`` running after its request ended; False when ``MAX_ADOPTED`` are."""
        if len(self._adopted) >= MAX_ADOPTED:
            return False
        _hold(self._adopted, task)
        return True

    def abort(self, task: asyncio.Future[Any]) -> None:
        """Cancel ``task`` (a leg its request gave up on), held until it ends."""
        task.cancel()
        _hold(self._watched, task)

    def release(
        self,
        request_id: str,
        urls: Sequence[str],
        headers: Mapping[str, str],
        data: Wire,
        trace: RequestTrace = NO_TRACE,
    ) -> bool:
        """Send ``data`` to ``urls[0]`` in the background to free request ``request_id``'s
        staged KV, its answer dropped; to the next URL when one cannot be connected to (any
        decode rank can pull the KV). Its end is counted (``sent`` or ``failed``). False, and
        nothing sent, when ``MAX_RELEASES`` are sent or waiting already.
        """
        if len(self._releases) >= MAX_RELEASES:
            return False
        leg = trace.leg("kv_release", urls[0])
        headers = leg.headers(headers)
        name = task_name(request_id, "release")
        _hold(self._releases, asyncio.create_task(self._send(urls, headers, data, leg), name=name))
        return True

    async def _send(
        self, urls: Sequence[str], headers: Mapping[str, str], data: Wire, leg: Leg
    ) -> None:
        if self._sending.locked():
            self._metrics.kv_release_waits.inc()
        async with self._sending:
            await self._send_now(urls, headers, data, leg)

    async def _send_now(
        self, urls: Sequence[str], headers: Mapping[str, str], data: Wire, leg: Leg
    ) -> None:
        try:
            answer = await self._post(urls, headers, data)
            await answer.read()
        except BaseException as exc:
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
            error = f"{answer.engine} answered {answer.status}"
            leg.end("failed", status=answer.status, error=error)
            self._metrics.kv_releases.labels("failed").inc()
            logger.warning(
                "releasing staged KV failed: %s answered %d", answer.engine, answer.status
            )
            return
        leg.end("sent", status=answer.status)
        self._metrics.kv_releases.labels("sent").inc()

    async def _post(
        self, urls: Sequence[str], headers: Mapping[str, str], data: Wire
    ) -> EngineAnswer:
        """The release sent to the first URL that can be connected to; the last one, when its
        connection timed out, once more (nothing was sent). All of it, the answer read
        included, within ``timeout_s``."""
        by = asyncio.get_running_loop().time() + self._timeout_s
        for url in urls[:-1]:
            try:
                return await self._send_one(url, headers, data, by)
            except EngineNotConnected as exc:
                logger.info("KV release: %s; trying another decode rank", exc.message)
        try:
            return await self._send_one(urls[-1], headers, data, by)
        except EngineConnectTimeout as exc:  # nothing was sent: as a decode leg, once more
            logger.info("KV release: %s; trying it once more", exc.message)
            return await self._send_one(urls[-1], headers, data, by)

    async def _send_one(
        self, url: str, headers: Mapping[str, str], data: Wire, by: float
    ) -> EngineAnswer:
        left = by - asyncio.get_running_loop().time()
        if left <= 0:
            raise EngineTimeout(f"the KV release took over {self._timeout_s:g} s")
        return await self._engines.requests.send(
            "POST",
            url,
            headers=headers,
            data=data,
            total_s=left,
            role="the engine taking a KV release",
        )

    async def close(self, timeout_s: float) -> None:
        """Let the work under way finish for up to ``timeout_s``, then cancel what is left (a
        finishing prefill cancelled then may keep its KV until the engine's expiry)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while (tasks := self._tasks()) and loop.time() < until:
            await asyncio.wait(tasks, timeout=until - loop.time())
        left = self._tasks()
        for task in left:
            task.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)
            logger.warning("shutdown: %d KV release(s) or finishing prefill(s) cut", len(left))

    def _tasks(self) -> list[asyncio.Future[Any]]:
        return [*self._adopted, *self._releases, *self._watched]


def _hold(tasks: set[asyncio.Future[Any]], task: asyncio.Future[Any]) -> None:
    """Keep ``task`` in ``tasks`` until it ends."""
    if not task.done():
        tasks.add(task)
        task.add_done_callback(tasks.discard)
