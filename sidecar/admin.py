"""The probes and views beside the generation routes: ``/health`` (liveness), ``/ready``,
``/metrics`` and ``/debug/scheduler`` — what the kubelet, Prometheus and an operator read. With
``SIDECAR_ADMIN_PORT`` set, the last two are served there only (``elsewhere`` answers 404 on the
API port) and the probes on both ports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from sidecar.engines.readiness import Readiness
from sidecar.errors import EngineUnreachable, NotFound, error_response
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracking import Tracker
from sidecar.scheduling.scheduler import Scheduler
from sidecar.security.poolwatch import InferencePoolWatch


class AdminViews:
    def __init__(
        self,
        *,
        readiness: Readiness,
        scheduler: Scheduler,
        metrics: Metrics,
        tracker: Tracker,
        pool_watch: InferencePoolWatch | None,
        kv_events: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``kv_events``: the KV-event fleet's status (None: SIDECAR_KV_EVENTS=false)."""
        self._readiness = readiness
        self._scheduler = scheduler
        self._metrics = metrics
        self._tracker = tracker
        self._pool_watch = pool_watch
        self._kv_events = kv_events

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def ready(self, request: web.Request) -> web.Response:
        readiness = self._readiness
        if readiness.draining:
            return error_response(EngineUnreachable("the sidecar is shutting down"), None)
        pool = self._pool_watch
        if pool is not None and not pool.synced:
            return error_response(EngineUnreachable(pool.reason), None)
        if readiness.ready:
            return web.Response(body=b'{"status":"ready"}', content_type="application/json")
        return error_response(EngineUnreachable(readiness.reason), None)

    async def elsewhere(self, request: web.Request) -> web.Response:
        return error_response(NotFound("served on the admin port (SIDECAR_ADMIN_PORT)"), None)

    async def debug_scheduler(self, request: web.Request) -> web.Response:
        view = self._scheduler.snapshot()
        pool = self._pool_watch
        # The allowlist that follows an InferencePool: a section of its own, beside the
        # scheduler's.
        view["inference_pool"] = pool.snapshot() if pool is not None else None
        # What the engines' KV events say, per subscribed engine: which source each uses.
        view["kv_events"] = {"enabled": False} if self._kv_events is None else self._kv_events()
        return web.Response(body=orjson.dumps(view), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        metrics = self._metrics
        metrics.inflight.set(self._tracker.inflight_count())
        self._scheduler.publish_gauges()
        response = web.Response(body=metrics.render())
        response.headers["Content-Type"] = metrics.content_type
        return response
