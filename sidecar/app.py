"""``create_app(settings)``: routes, resources and their lifecycles; ``start_sidecar`` serves it."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from sidecar.aftercare import Aftercare
from sidecar.body import Bodies
from sidecar.config import Settings
from sidecar.connectors import Connector, ConnectorFactory
from sidecar.connectors.nixl import NixlConnector
from sidecar.connectors.nixl_push import NixlPushConnector
from sidecar.connectors.parts import Parts
from sidecar.connectors.sglang import SglangConnector
from sidecar.connectors.shared_storage import SharedStorageConnector
from sidecar.debug import DebugViews
from sidecar.debug_page import DebugPage
from sidecar.decode import DecodeOptions, DecodeSend
from sidecar.discovery import Discovery
from sidecar.drain import CUT_GRACE_S, Drain
from sidecar.engines.monitor import EngineMonitor, MonitorOptions
from sidecar.errors import REQUEST_ID_HEADER, EngineUnreachable, NotFound, error_response
from sidecar.headers import GatewayHeaders, request_id_from
from sidecar.kube import KubeClient
from sidecar.listener import (
    ADMIN_MAX_CONNECTIONS,
    ConnectionLimits,
    Connections,
    ListenerRunner,
    connection_budget,
)
from sidecar.metrics import ROUTES, Metrics
from sidecar.passthrough import Passthrough, PassthroughOptions
from sidecar.paths import canonical_paths
from sidecar.pipeline import Pipeline, PipelineOptions
from sidecar.poolwatch import InferencePoolWatch
from sidecar.prefill import Prefill, PrefillOptions
from sidecar.readiness import Readiness
from sidecar.scheduling.scheduler import Scheduler, SchedulerOptions
from sidecar.scheduling.state import MemoryState, StateBackend
from sidecar.serverlog import ServerLog
from sidecar.tasks import stop_task
from sidecar.tls import ClientTls, FileWatch, ServerTls
from sidecar.tracing import Tracing
from sidecar.tracking import Tracker
from sidecar.trust import PrefillGuard
from sidecar.upstream import Engines

logger = logging.getLogger("sidecar.app")

SETTINGS = web.AppKey("settings", Settings)
ENGINES = web.AppKey("engines", Engines)
TRACKER = web.AppKey("tracker", Tracker)
METRICS = web.AppKey("metrics", Metrics)
READINESS = web.AppKey("readiness", Readiness)
MONITOR = web.AppKey("monitor", EngineMonitor)
SCHEDULER = web.AppKey("scheduler", Scheduler)
PIPELINE = web.AppKey("pipeline", Pipeline)
GUARD = web.AppKey("guard", PrefillGuard)
AFTERCARE = web.AppKey("aftercare", Aftercare)
ADMIN_APP = web.AppKey("admin_app", web.Application)
DRAIN = web.AppKey("drain", Drain)
SERVER_TLS = web.AppKey("server_tls", ServerTls)
TLS_WATCHES = web.AppKey("tls_watches", list[FileWatch])
POOL_WATCH = web.AppKey("pool_watch", InferencePoolWatch)
KUBE = web.AppKey("kube", KubeClient)
TRACING = web.AppKey("tracing", Tracing)

LISTEN_BACKLOG = 2048
"""Connections the kernel queues before accept (aiohttp's default, 128, drops SYNs when a
thousand clients connect at once; vLLM's API server uses 2048 too)."""


def create_app(
    settings: Settings,
    *,
    tracing: Tracing | None = None,
    connector: ConnectorFactory | None = None,
) -> web.Application:
    """A fresh application: nothing is shared between two apps in one process.

    ``tracing``: the spans' provider, which the app then shuts down (tests pass one exporting
    where they read); None builds it from the ``OTEL_*`` variables when SIDECAR_TRACING=true
    (raises ``TracingUnavailable`` when it cannot be). ``connector``: builds the connector from
    the settings and the shared parts (None: ``make_connector``, the one ``SIDECAR_CONNECTOR``
    names; a test plugs in its own).
    """
    if tracing is None and settings.tracing:
        tracing = Tracing.from_environment()
    drain = Drain(settings.drain_timeout_s)
    # Bodies are read by the pipeline under its own limit; aiohttp's cap is never used.
    # Routed on the canonical path (sidecar.paths) before anything else sees the request.
    app = web.Application(
        client_max_size=settings.max_body_bytes, middlewares=[canonical_paths, drain.middleware]
    )
    app[DRAIN] = drain
    if tracing is not None:
        app[TRACING] = tracing
    tracker = Tracker(settings.debug_history)
    metrics = Metrics()
    client_tls = ClientTls(
        ca_file=settings.tls_ca_file,
        cert_file=settings.tls_client_cert_file,
        key_file=settings.tls_client_key_file,
        insecure=settings.tls_insecure_skip_verify,
    )
    if client_tls.insecure:
        logger.warning(
            "SIDECAR_TLS_INSECURE_SKIP_VERIFY=true: the certificates of https:// engines are "
            "not verified; anyone on the network path can impersonate them"
        )
    engines = Engines(
        connect_timeout_s=settings.connect_timeout_s,
        keepalive_s=settings.engine_keepalive_s,
        tls=client_tls,
        prefill_tls=settings.prefill_tls,
        prefill_server_name=settings.prefill_tls_server_name,
    )
    app[TLS_WATCHES] = _tls_watches(app, settings, client_tls, metrics)
    scheduler = Scheduler(
        SchedulerOptions.from_settings(settings),
        discovery=Discovery(settings.prefill_endpoints, settings.prefill_dns),
        backend=_state_backend(settings, metrics),
        metrics=metrics,
    )
    metrics.zero_ranks(len(scheduler.ranks))
    readiness = Readiness(ranks=scheduler.ranks, metrics=metrics)
    # The one poller of every engine: readiness, the scheduler and /debug/scheduler read what
    # it publishes.
    monitor = EngineMonitor(
        MonitorOptions.from_settings(settings),
        engines=engines,
        ranks=scheduler.ranks,
        readiness=readiness,
        pool=scheduler,
    )
    app[SETTINGS], app[ENGINES], app[TRACKER] = settings, engines, tracker
    app[METRICS], app[READINESS], app[SCHEDULER] = metrics, readiness, scheduler
    app[MONITOR] = monitor

    pool_watch = _pool_watch(app, settings, metrics)
    guard = PrefillGuard(
        cidrs=settings.prefill_allowed_cidrs,
        hosts=settings.prefill_allowed_hosts,
        pool=scheduler.pool_endpoints,
        pool_configured=bool(settings.prefill_endpoints or settings.prefill_dns),
        allowlist=pool_watch,
    )
    guard.warn_if_open()
    aftercare = Aftercare(
        engines=engines,
        metrics=metrics,
        enabled=settings.release_on_disconnect,
        timeout_s=settings.decode_first_byte_timeout_s,
    )
    decode = DecodeSend(
        DecodeOptions.from_settings(settings),
        engines=engines,
        ranks=scheduler.ranks,
        metrics=metrics,
    )
    parts = Parts(
        prefill=Prefill(
            PrefillOptions.from_settings(settings),
            engines=engines,
            scheduler=scheduler,
            metrics=metrics,
            aftercare=aftercare,
            release_urls=decode.release_urls,
        ),
        decode=decode,
        aftercare=aftercare,
    )
    gateway = GatewayHeaders(settings.prefill_headers)
    bodies = Bodies(
        max_bytes=settings.max_body_bytes,
        max_elements=settings.max_body_elements,
        budget_bytes=settings.body_budget_bytes,
        timeout_s=settings.client_body_timeout_s,
        metrics=metrics,
    )
    pipeline = Pipeline(
        PipelineOptions.from_settings(settings),
        bodies=bodies,
        connector=(connector or make_connector)(settings, parts),
        scheduler=scheduler,
        guard=guard,
        gateway=gateway,
        tracker=tracker,
        metrics=metrics,
        tracing=tracing,
    )
    app[GUARD], app[AFTERCARE] = guard, aftercare
    app[PIPELINE] = pipeline
    passthrough = Passthrough(
        PassthroughOptions.from_settings(settings),
        engines=engines,
        ranks=scheduler.ranks,
        gateway=gateway,
        metrics=metrics,
        bodies=bodies,
        tracing=tracing,
    )
    debug = DebugViews(tracker, DebugPage())

    admin = app
    if settings.admin_port is not None:
        admin = web.Application(middlewares=[canonical_paths])
        admin[TRACKER], admin[METRICS], admin[SCHEDULER] = tracker, metrics, scheduler
        admin[READINESS] = readiness
        if pool_watch is not None:
            admin[POOL_WATCH] = pool_watch
        admin.router.add_get("/health", _health)
        admin.router.add_get("/ready", _ready)
        app.router.add_route("*", "/metrics", _admin_elsewhere)
        app.router.add_route("*", "/debug/{tail:.*}", _admin_elsewhere)
        app[ADMIN_APP] = admin
        admin.on_response_prepare.append(_stamp_request_id)
    app.on_response_prepare.append(_stamp_request_id)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    admin.router.add_get("/metrics", _metrics)
    admin.router.add_get("/debug/scheduler", _debug_scheduler)
    admin.router.add_get("/debug/requests", debug.requests)
    admin.router.add_get("/debug/requests/{id}", debug.request)
    admin.router.add_get("/debug/ui", debug.ui)
    admin.router.add_get("/debug/ui/{name}", debug.ui_asset)
    admin.router.add_route("*", "/debug/{tail:.*}", debug.unknown)
    for path in ROUTES:
        app.router.add_post(path, pipeline.handle)
    # Last: everything else, any method (GET /v1/completions included), goes to the engine.
    app.router.add_route("*", "/{tail:.*}", passthrough.handle)

    app.cleanup_ctx.append(_tracing_ctx)  # closed last: the releases' spans end before it
    app.cleanup_ctx.append(_engines_ctx)
    app.cleanup_ctx.append(_scheduler_ctx)
    app.cleanup_ctx.append(_aftercare_ctx)  # closed first: its work uses scheduler and engines
    # After the scheduler: its first scrape round polls the pool discovery found.
    app.cleanup_ctx.append(_monitor_ctx)
    app.cleanup_ctx.append(_tls_ctx)
    app.cleanup_ctx.append(_pool_watch_ctx)
    return app


def _tls_watches(
    app: web.Application, settings: Settings, client_tls: ClientTls, metrics: Metrics
) -> list[FileWatch]:
    """The listener's context (when it serves HTTPS) and what watches the files of both."""
    watches = []

    def counter(files: str) -> Callable[[bool], None]:
        return lambda ok: metrics.tls_reloads.labels(files, "reloaded" if ok else "failed").inc()

    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        server_tls = ServerTls(settings.tls_cert_file, settings.tls_key_file)
        app[SERVER_TLS] = server_tls
        watches.append(
            FileWatch(
                "the listener's certificate",
                server_tls.files,
                server_tls.reload,
                interval_s=settings.tls_reload_interval_s,
                on_result=counter("listener"),
            )
        )
    if client_tls.files:
        watches.append(
            FileWatch(
                "the engines' TLS files",
                client_tls.files,
                client_tls.reload,
                interval_s=settings.tls_reload_interval_s,
                on_result=counter("engines"),
            )
        )
    return watches


def _pool_watch(
    app: web.Application, settings: Settings, metrics: Metrics
) -> InferencePoolWatch | None:
    if settings.inference_pool is None:
        return None
    client = None
    if settings.kube_api_url is not None:
        client = KubeClient(
            settings.kube_api_url,
            token_file=settings.kube_token_file,
            ca_file=settings.kube_ca_file,
            connect_timeout_s=settings.connect_timeout_s,
        )
        app[KUBE] = client
    watch = InferencePoolWatch(
        client,
        settings.inference_pool,
        retry_base_s=settings.kube_retry_base_s,
        retry_max_s=settings.kube_retry_max_s,
        on_error=lambda kind: metrics.inference_pool_errors.labels(kind).inc(),
        on_change=metrics.inference_pool_addresses.set,
    )
    app[POOL_WATCH] = watch
    return watch


def make_connector(settings: Settings, parts: Parts) -> Connector:
    """The connector ``SIDECAR_CONNECTOR`` names (``create_app``'s default factory)."""
    name = settings.connector
    if name == NixlConnector.name:
        return NixlConnector(parts, rewrite_remote_host=settings.rewrite_remote_host)
    if name == NixlPushConnector.name:
        return NixlPushConnector(parts, rewrite_remote_host=settings.rewrite_remote_host)
    if name == SglangConnector.name:
        return SglangConnector(parts, bootstrap_port=settings.sglang_bootstrap_port)
    if name == SharedStorageConnector.name:
        return SharedStorageConnector(parts)
    raise ValueError(f"unknown connector {name!r}")


def _state_backend(settings: Settings, metrics: Metrics) -> StateBackend:
    if settings.state_backend == "redis":
        # Imported only when used: redis-py (and the cryptography package it loads) is ~6 MiB
        # of every sidecar's resident memory, and a fifth of a second of its start-up.
        from sidecar.scheduling.state.redis import RedisState

        return RedisState(
            settings.redis_url.get_secret_value(),
            prefix=settings.redis_key_prefix,
            cluster=settings.redis_cluster,
            lease_s=settings.state_lease_s,
            timeout_s=settings.state_timeout_ms / 1000,
            max_ejection_s=settings.eject_max_s,
            on_error=lambda kind: metrics.state_backend_errors.labels(kind).inc(),
            on_skipped=lambda kind, count: metrics.state_entries_skipped.labels(kind).inc(count),
        )
    return MemoryState()


async def _scheduler_ctx(app: web.Application) -> AsyncIterator[None]:
    await app[SCHEDULER].start()
    yield
    await app[SCHEDULER].close()


async def _aftercare_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[AFTERCARE].close(app[DRAIN].background_s())


async def _tracing_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    if TRACING in app:
        await app[TRACING].close(app[DRAIN].background_s())


async def _engines_ctx(app: web.Application) -> AsyncIterator[None]:
    await app[ENGINES].open()
    yield
    await app[ENGINES].close()


async def _monitor_ctx(app: web.Application) -> AsyncIterator[None]:
    app[MONITOR].start()
    yield
    await app[MONITOR].close()


async def _tls_ctx(app: web.Application) -> AsyncIterator[None]:
    for watch in app[TLS_WATCHES]:
        await watch.start()
    tasks = [asyncio.create_task(w.run(), name="tls-file-watch") for w in app[TLS_WATCHES]]
    yield
    for task in tasks:
        await stop_task(task)


async def _pool_watch_ctx(app: web.Application) -> AsyncIterator[None]:
    if POOL_WATCH not in app:
        yield
        return
    if KUBE in app:
        await app[KUBE].open()
    task = asyncio.create_task(app[POOL_WATCH].run(), name="inference-pool-follower")
    yield
    await stop_task(task)
    if KUBE in app:
        await app[KUBE].close()


async def _stamp_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer carries an ``x-request-id``: the one its handler set, else the client's,
    else a new one (aiohttp's own 404s and 405s included)."""
    if REQUEST_ID_HEADER not in response.headers:
        response.headers[REQUEST_ID_HEADER] = request_id_from(request.headers)


async def _health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def _ready(request: web.Request) -> web.Response:
    readiness = request.app[READINESS]
    if readiness.draining:
        return error_response(EngineUnreachable("the sidecar is shutting down"), None)
    pool = request.app.get(POOL_WATCH)
    if pool is not None and not pool.synced:
        return error_response(EngineUnreachable(pool.reason), None)
    if readiness.ready:
        return web.Response(body=b'{"status":"ready"}', content_type="application/json")
    return error_response(EngineUnreachable("the decode engine is not ready"), None)


async def _admin_elsewhere(request: web.Request) -> web.Response:
    return error_response(NotFound("served on the admin port (SIDECAR_ADMIN_PORT)"), None)


async def _debug_scheduler(request: web.Request) -> web.Response:
    view = request.app[SCHEDULER].snapshot()
    pool = request.app.get(POOL_WATCH)
    # The allowlist that follows an InferencePool: a section of its own, beside the scheduler's.
    view["inference_pool"] = pool.snapshot() if pool is not None else None
    return web.Response(body=orjson.dumps(view), content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    metrics.inflight.set(request.app[TRACKER].inflight_count())
    request.app[SCHEDULER].publish_gauges()
    response = web.Response(body=metrics.render())
    response.headers["Content-Type"] = metrics.content_type
    return response


@dataclass(slots=True)
class RunningSidecar:
    app: web.Application
    runners: list[web.AppRunner]
    host: str
    port: int
    admin_port: int | None
    tls: bool = False
    """SIDECAR_PORT serves HTTPS."""
    admin_tls: bool = False

    @property
    def url(self) -> str:
        return _url(self.host, self.port, self.tls)

    @property
    def admin_url(self) -> str:
        if self.admin_port is None:
            return self.url
        return _url(self.host, self.admin_port, self.admin_tls)

    def begin_drain(self) -> None:
        """SIGTERM's first step: /ready turns 503 at once, and the drain's clock starts."""
        self.app[READINESS].draining = True
        self.app[DRAIN].begin()

    async def close(self) -> int:
        """The shutdown sequence of ``sidecar.drain``, within the drain timeout + 1 s: stop
        listening, let requests in flight finish until the deadline, cancel the rest, and close
        every resource; the admin listener goes last. Returns how many requests were cut."""
        self.begin_drain()
        main = self.runners[0]
        for site in list(main.sites):
            await site.stop()
        if main.server is not None:
            main.server.pre_shutdown()  # keep-alive connections close after their answer
        cut = await self.app[DRAIN].wait_then_cut()
        for runner in self.runners:
            await runner.cleanup()
        return cut


class CannotListen(Exception):
    """A port the sidecar cannot bind (in use, not permitted); its message is one log line."""


async def start_sidecar(
    settings: Settings,
    *,
    tracing: Tracing | None = None,
    connector: ConnectorFactory | None = None,
) -> RunningSidecar:
    """Serve ``create_app(settings, tracing=tracing, connector=connector)`` on its port (0 = a
    free one) until ``close()``.

    Raises ``CannotListen`` when a port cannot be bound, with every resource closed again.
    """
    app = create_app(settings, tracing=tracing, connector=connector)
    context = app[SERVER_TLS].context if SERVER_TLS in app else None
    admin_context = context if settings.admin_tls else None
    runner = ListenerRunner(
        app,
        _connections(settings, app[METRICS], "api", connection_budget(settings.max_connections)),
        handler_cancellation=True,  # a client that leaves cancels its request's work at once
        shutdown_timeout=CUT_GRACE_S,  # by then the drain has already cut what was in flight
        logger=ServerLog(),  # a malformed request: one rate-limited line, not a traceback
    )
    runners: list[web.AppRunner] = [runner]
    await runner.setup()
    try:
        await _listen(runner, settings.host, settings.port, "SIDECAR_PORT", context)
        host, port = runner.addresses[0][:2]
        app[GUARD].listening(port, **await _own_identity(settings.host))
        admin_port = None
        if ADMIN_APP in app:
            admin_runner = ListenerRunner(
                app[ADMIN_APP],
                _connections(settings, app[METRICS], "admin", ADMIN_MAX_CONNECTIONS),
                shutdown_timeout=CUT_GRACE_S,
                logger=ServerLog(),
            )
            runners.append(admin_runner)
            await admin_runner.setup()
            await _listen(
                admin_runner,
                settings.host,
                settings.admin_port,
                "SIDECAR_ADMIN_PORT",
                admin_context,
            )
            admin_port = admin_runner.addresses[0][1]
    except BaseException:
        for started in reversed(runners):
            await started.cleanup()
        raise
    return RunningSidecar(
        app, runners, host, port, admin_port, context is not None, admin_context is not None
    )


def _connections(settings: Settings, metrics: Metrics, listener: str, cap: int) -> Connections:
    """One listener's connection book, counted under ``listener`` in the metrics."""
    book = Connections(
        ConnectionLimits(
            head_timeout_s=settings.client_header_timeout_s,
            keepalive_s=settings.client_keepalive_s,
            max_connections=cap,
        ),
        on_refused=lambda how: metrics.client_connections_refused.labels(listener, how).inc(),
        on_closed=lambda why: metrics.client_connections_closed.labels(listener, why).inc(),
    )
    metrics.client_connections.labels(listener).set_function(lambda: book.open)
    return book


async def _listen(
    runner: web.AppRunner,
    host: str,
    port: int | None,
    variable: str,
    context: ssl.SSLContext | None,
) -> None:
    try:
        site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG, ssl_context=context)
        await site.start()
    except OSError as exc:
        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        address = _url(host, port or 0).removeprefix("http://")
        raise CannotListen(f"cannot listen on {address} ({variable}): {reason}") from exc


async def _own_identity(listen_host: str) -> dict[str, list[str]]:
    """This pod's host name and addresses, so a prefill target naming the sidecar itself is
    recognised (the listen address, and what the host name resolves to: the pod IP in
    Kubernetes)."""
    name = socket.gethostname()
    addresses = [listen_host]
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None)
    except OSError:
        infos = []
    addresses += [str(info[4][0]) for info in infos]
    return {"names": [name, listen_host], "addresses": addresses}


def _url(host: str, port: int, tls: bool = False) -> str:
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
