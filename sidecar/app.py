"""``create_app(settings)``: routes, resources and their lifecycles; ``start_sidecar`` serves it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from aiohttp import web

from sidecar.config import Settings
from sidecar.connectors import make_connector
from sidecar.debug import DebugViews
from sidecar.discovery import Discovery
from sidecar.errors import EngineUnreachable, error_response
from sidecar.metrics import ROUTES, Metrics
from sidecar.passthrough import Passthrough
from sidecar.pipeline import Pipeline
from sidecar.readiness import Readiness
from sidecar.scheduling.scheduler import Scheduler, SchedulerConfig
from sidecar.scheduling.state import MemoryState, StateBackend
from sidecar.scheduling.state.redis import RedisState
from sidecar.tracking import Tracker
from sidecar.upstream import Engines

SETTINGS = web.AppKey("settings", Settings)
ENGINES = web.AppKey("engines", Engines)
TRACKER = web.AppKey("tracker", Tracker)
METRICS = web.AppKey("metrics", Metrics)
READINESS = web.AppKey("readiness", Readiness)
SCHEDULER = web.AppKey("scheduler", Scheduler)


def create_app(settings: Settings) -> web.Application:
    """A fresh application: nothing is shared between two apps in one process."""
    # Bodies are read by the pipeline under its own limit; aiohttp's cap is never used.
    app = web.Application(client_max_size=settings.max_body_bytes)
    engines = Engines(connect_timeout_s=settings.connect_timeout_s)
    tracker = Tracker(settings.debug_history)
    metrics = Metrics()
    readiness = Readiness(
        engines=engines,
        decode_url=settings.decode_url,
        interval_s=settings.ready_interval_s,
        metrics=metrics,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            policy=settings.scheduler_policy,
            choices=settings.scheduler_choices,
            min_tokens=settings.disagg_min_tokens,
            ttft_ratio=settings.disagg_ttft_ratio,
            scrape_interval_s=settings.scrape_interval_s,
            discovery_interval_s=settings.discovery_interval_s,
            prefix_block_tokens=settings.prefix_block_tokens,
            prefix_cache_blocks=settings.prefix_cache_blocks,
            eject_after_failures=settings.eject_after_failures,
            eject_base_s=settings.eject_base_s,
            eject_max_s=settings.eject_max_s,
            seed=settings.scheduler_seed,
        ),
        discovery=Discovery(settings.prefill_endpoints, settings.prefill_dns),
        backend=_state_backend(settings, metrics),
        engines=engines,
        decode_url=settings.decode_url,
        metrics=metrics,
    )
    app[SETTINGS], app[ENGINES], app[TRACKER] = settings, engines, tracker
    app[METRICS], app[READINESS], app[SCHEDULER] = metrics, readiness, scheduler

    pipeline = Pipeline(
        decode_url=settings.decode_url,
        max_body_bytes=settings.max_body_bytes,
        connector=make_connector(
            settings.connector, rewrite_remote_host=settings.rewrite_remote_host
        ),
        engines=engines,
        scheduler=scheduler,
        tracker=tracker,
        metrics=metrics,
        log_requests=settings.log_requests,
    )
    passthrough = Passthrough(decode_url=settings.decode_url, engines=engines, metrics=metrics)
    debug = DebugViews(tracker)

    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/debug/scheduler", _debug_scheduler)
    app.router.add_get("/debug/requests", debug.requests)
    app.router.add_get("/debug/requests/{id}", debug.request)
    app.router.add_route("*", "/debug/{tail:.*}", debug.unknown)
    for path in ROUTES:
        app.router.add_post(path, pipeline.handle)
    # Last: everything else, any method (GET /v1/completions included), goes to the engine.
    app.router.add_route("*", "/{tail:.*}", passthrough.handle)

    app.cleanup_ctx.append(_engines_ctx)
    app.cleanup_ctx.append(_scheduler_ctx)
    app.cleanup_ctx.append(_readiness_ctx)
    return app


def _state_backend(settings: Settings, metrics: Metrics) -> StateBackend:
    if settings.state_backend == "redis":
        return RedisState(
            settings.redis_url.get_secret_value(),
            prefix=settings.redis_key_prefix,
            lease_s=settings.state_lease_s,
            timeout_s=settings.state_timeout_ms / 1000,
            on_error=lambda kind: metrics.state_backend_errors.labels(kind).inc(),
        )
    return MemoryState()


async def _scheduler_ctx(app: web.Application) -> AsyncIterator[None]:
    await app[SCHEDULER].start()
    yield
    await app[SCHEDULER].close()


async def _engines_ctx(app: web.Application) -> AsyncIterator[None]:
    await app[ENGINES].open()
    yield
    await app[ENGINES].close()


async def _readiness_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[READINESS].run(), name="readiness-poller")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def _ready(request: web.Request) -> web.Response:
    if request.app[READINESS].ready:
        return web.Response(body=b'{"status":"ready"}', content_type="application/json")
    return error_response(EngineUnreachable("the decode engine is not ready"), None)


async def _debug_scheduler(request: web.Request) -> web.Response:
    return web.Response(
        body=orjson.dumps(request.app[SCHEDULER].snapshot()), content_type="application/json"
    )


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    metrics.inflight.set(request.app[TRACKER].inflight_count())
    request.app[SCHEDULER].publish_gauges()
    response = web.Response(body=metrics.render())
    response.headers["Content-Type"] = metrics.content_type
    return response


@dataclass(slots=True)
class RunningSidecar:
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_sidecar(settings: Settings) -> RunningSidecar:
    """Serve ``create_app(settings)`` on its port (0 = a free one) until ``close()``."""
    runner = web.AppRunner(
        create_app(settings),
        handler_cancellation=True,  # a client that leaves cancels its request's work at once
        access_log=None,
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    address = runner.addresses[0]
    return RunningSidecar(runner=runner, host=address[0], port=address[1])
