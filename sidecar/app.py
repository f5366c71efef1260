"""``create_app(settings)``: the application — its parts built once from the settings, its routes,
its resources behind typed ``AppKey``s and their lifecycles (``cleanup_ctx``).

``sidecar.server.runner.start_sidecar`` serves it (as aiohttp keeps ``web_app`` and
``web_runner`` apart); ``sidecar.admin`` holds the probes and views beside the routes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from sidecar.admin import AdminViews
from sidecar.body import Bodies
from sidecar.config import Settings
from sidecar.connectors import Connector, ConnectorFactory
from sidecar.connectors.background import BackgroundWork
from sidecar.connectors.decode import DecodeOptions, DecodeSend
from sidecar.connectors.nixl import NixlConnector
from sidecar.connectors.nixl_push import NixlPushConnector
from sidecar.connectors.parts import Parts
from sidecar.connectors.prefill import Prefill, PrefillOptions
from sidecar.connectors.sglang import SglangConnector
from sidecar.connectors.shared_storage import SharedStorageConnector
from sidecar.discovery import Discovery, Resolver, system_resolver
from sidecar.drain import Drain
from sidecar.engines.monitor import EngineMonitor, MonitorOptions
from sidecar.engines.readiness import Readiness
from sidecar.engines.shared_scrapes import SHARED_SCRAPES_TIMEOUT_S, ScrapeShare
from sidecar.engines.upstream import Engines
from sidecar.errors import REQUEST_ID_HEADER
from sidecar.framing import identity_bodies
from sidecar.headers import GatewayHeaders, request_id_from
from sidecar.observability.debug import DebugViews
from sidecar.observability.debug_page import DebugPage
from sidecar.observability.metrics import ROUTES, Metrics
from sidecar.observability.tracing import Tracing
from sidecar.observability.tracking import Tracker
from sidecar.passthrough import Passthrough, PassthroughOptions
from sidecar.paths import canonical_paths
from sidecar.pipeline import Pipeline, PipelineOptions
from sidecar.scheduling.ranks import RankPorts
from sidecar.scheduling.scheduler import Scheduler, SchedulerOptions
from sidecar.scheduling.state import MemoryState, StateBackend
from sidecar.security.kube import KubeClient
from sidecar.security.poolwatch import InferencePoolWatch
from sidecar.security.tls import ClientTls, FileWatch, ServerTls
from sidecar.security.trust import PrefillGuard
from sidecar.tasks import stop_task

if TYPE_CHECKING:
    from sidecar.kvevents.fleet import KVFleet

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
BACKGROUND = web.AppKey("background", BackgroundWork)
ADMIN_APP = web.AppKey("admin_app", web.Application)
DRAIN = web.AppKey("drain", Drain)
SERVER_TLS = web.AppKey("server_tls", ServerTls)
TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
"""SIDECAR_TLS_MIN_VERSION's values."""
TLS_WATCHES = web.AppKey("tls_watches", list[FileWatch])
POOL_WATCH = web.AppKey("pool_watch", InferencePoolWatch)
KUBE = web.AppKey("kube", KubeClient)
TRACING = web.AppKey("tracing", Tracing)
RANK_PORTS = web.AppKey("rank_ports", RankPorts)
KV_FLEET: web.AppKey[KVFleet] = web.AppKey("kv_fleet")


def create_app(
    settings: Settings,
    *,
    tracing: Tracing | None = None,
    connector: ConnectorFactory | None = None,
    resolver: Resolver = system_resolver,
    listener_tls: ServerTls | None = None,
) -> web.Application:
    """A fresh application: nothing is shared between two apps in one process.

    ``tracing``: the spans' provider, which the app then shuts down (tests pass one exporting
    where they read); None: what SIDECAR_TRACING says (``Tracing.when``: built from the
    ``OTEL_*`` variables, raising ``TracingUnavailable`` when it cannot be, or ``NO_TRACING``,
    whose methods do nothing). ``connector``: builds the connector from
    the settings and the shared parts (None: ``make_connector``, the one ``SIDECAR_CONNECTOR``
    names; a test plugs in its own). ``resolver``: what ``SIDECAR_PREFILL_DNS`` is looked up
    with (a test plays the DNS). ``listener_tls``: the listener's certificate when it is no
    files of the settings (``--secure-proxy``'s self-signed one, in memory); it wins over
    ``SIDECAR_TLS_CERT_FILE``.
    """
    if tracing is None:  # not given: what the settings say
        tracing = Tracing.when(settings.tracing)
    drain = Drain(settings.drain_timeout_s)
    # Bodies are read by the pipeline under its own limit; aiohttp's cap is never used.
    # A coded body is refused (sidecar.framing) before routing on the canonical path
    # (sidecar.paths), which comes before anything else sees the request.
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[identity_bodies, canonical_paths, drain.middleware],
    )
    app[DRAIN], app[TRACING] = drain, tracing
    tracker = Tracker(settings.debug_history)
    metrics = Metrics()
    # No engine over HTTPS (the settings then refuse every engine TLS file): no context to
    # build, and no CA store to load (0.1-0.3 s of CPU on the loop at start).
    client_tls = (
        ClientTls(
            ca_file=settings.tls_ca_file,
            cert_file=settings.tls_client_cert_file,
            key_file=settings.tls_client_key_file,
            insecure=settings.prefill_skip_verify or settings.decode_skip_verify,
        )
        if settings.prefill_tls or settings.decode_https
        else None
    )
    for stage, variable in settings.unverified_stages():
        logger.warning(
            "%s=true: the certificates of the %s are not verified; anyone on the network path "
            "can impersonate them",
            variable,
            stage,
        )
    engines = Engines(
        connect_timeout_s=settings.connect_timeout_s,
        keepalive_s=settings.engine_keepalive_s,
        tls=client_tls,
        prefill_tls=settings.prefill_tls,
        prefill_server_name=settings.prefill_tls_server_name,
        decode_urls=settings.decode_ranks,
        prefill_insecure=settings.prefill_skip_verify,
        decode_insecure=settings.decode_skip_verify,
    )
    app[TLS_WATCHES] = _tls_watches(app, settings, client_tls, metrics, listener_tls)
    discovery = Discovery(settings.prefill_endpoints, settings.prefill_dns, resolver=resolver)
    kv_fleet = _kv_fleet(app, settings, engines, metrics, discovery)
    scheduler = Scheduler(
        SchedulerOptions.from_settings(settings),
        discovery=discovery,
        backend=_state_backend(settings, metrics),
        metrics=metrics,
        kv_events=kv_fleet,
    )
    metrics.zero_ranks(len(scheduler.ranks))
    options = MonitorOptions.from_settings(settings)
    readiness = Readiness(ranks=scheduler.ranks, metrics=metrics, thresholds=options.thresholds)
    # The one poller of every engine: readiness, the scheduler and /debug/scheduler read what
    # it publishes.
    monitor = EngineMonitor(
        options,
        engines=engines,
        ranks=scheduler.ranks,
        readiness=readiness,
        pool=scheduler.pool,
        share=_scrape_share(settings, scheduler, metrics),
    )
    app[SETTINGS], app[ENGINES], app[TRACKER] = settings, engines, tracker
    app[METRICS], app[READINESS], app[SCHEDULER] = metrics, readiness, scheduler
    app[MONITOR] = monitor

    pool_watch = _pool_watch(app, settings, metrics)
    guard = PrefillGuard(
        cidrs=settings.prefill_allowed_cidrs,
        hosts=settings.prefill_allowed_hosts,
        pool=scheduler.pool.endpoints,
        pool_configured=bool(settings.prefill_endpoints or settings.prefill_dns),
        allowlist=pool_watch,
    )
    guard.warn_if_open()
    background = BackgroundWork(
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
            background=background,
            release_urls=decode.release_urls,
        ),
        decode=decode,
        background=background,
    )
    gateway = GatewayHeaders(
        settings.prefill_headers,
        sample=random.Random(settings.scheduler_seed) if settings.prefill_header_sampling else None,
    )
    bodies = Bodies(
        max_bytes=settings.max_body_bytes,
        max_elements=settings.max_body_elements,
        budget_bytes=settings.body_budget_bytes,
        timeout_s=settings.client_body_timeout_s,
        metrics=metrics,
    )
    rank_ports = RankPorts()  # filled by the runner (SIDECAR_RANK_PORTS)
    app[RANK_PORTS] = rank_ports
    pipeline = Pipeline(
        PipelineOptions.from_settings(settings),
        rank_ports=rank_ports,
        bodies=bodies,
        connector=(connector or make_connector)(settings, parts),
        scheduler=scheduler,
        guard=guard,
        gateway=gateway,
        tracker=tracker,
        metrics=metrics,
        tracing=tracing,
    )
    app[GUARD], app[BACKGROUND] = guard, background
    app[PIPELINE] = pipeline
    passthrough = Passthrough(
        PassthroughOptions.from_settings(settings),
        rank_ports=rank_ports,
        engines=engines,
        ranks=scheduler.ranks,
        gateway=gateway,
        metrics=metrics,
        bodies=bodies,
        tracing=tracing,
    )
    debug = DebugViews(tracker, DebugPage())

    views = AdminViews(
        readiness=readiness,
        scheduler=scheduler,
        metrics=metrics,
        tracker=tracker,
        pool_watch=pool_watch,
        kv_events=None if kv_fleet is None else kv_fleet.status,
    )
    admin = app
    if settings.admin_port is not None:
        admin = web.Application(middlewares=[canonical_paths])
        admin.router.add_get("/health", views.health)
        admin.router.add_get("/ready", views.ready)
        app.router.add_route("*", "/metrics", views.elsewhere)
        app.router.add_route("*", "/debug", views.elsewhere)
        app.router.add_route("*", "/debug/{tail:.*}", views.elsewhere)
        app[ADMIN_APP] = admin
        admin.on_response_prepare.append(_stamp_request_id)
    app.on_response_prepare.append(_stamp_request_id)
    app.router.add_get("/health", views.health)
    app.router.add_get("/ready", views.ready)
    admin.router.add_get("/metrics", views.metrics)
    admin.router.add_get("/debug/scheduler", views.debug_scheduler)
    admin.router.add_get("/debug/requests", debug.requests)
    admin.router.add_get("/debug/requests/{id}", debug.request)
    admin.router.add_get("/debug", debug.index)
    admin.router.add_get("/debug/ui", debug.ui)
    admin.router.add_get("/debug/ui/{name}", debug.ui_asset)
    admin.router.add_route("*", "/debug/{tail:.*}", debug.unknown)
    for path in ROUTES:
        app.router.add_post(path, pipeline.handle)
    # Last: everything else, any method (GET /v1/completions included), goes to the engine.
    app.router.add_route("*", "/{tail:.*}", passthrough.handle)

    app.cleanup_ctx.append(_tracing_ctx)  # closed last: the releases' spans end before it
    app.cleanup_ctx.append(_engines_ctx)
    # Before the scheduler: its first discovery subscribes to the pool's members.
    app.cleanup_ctx.append(_kv_events_ctx)
    app.cleanup_ctx.append(_scheduler_ctx)
    app.cleanup_ctx.append(_background_ctx)  # closed first: its work uses scheduler and engines
    # After the scheduler: its first scrape round polls the pool discovery found.
    app.cleanup_ctx.append(_monitor_ctx)
    app.cleanup_ctx.append(_tls_ctx)
    app.cleanup_ctx.append(_pool_watch_ctx)
    return app


def _tls_watches(
    app: web.Application,
    settings: Settings,
    client_tls: ClientTls | None,
    metrics: Metrics,
    server_tls: ServerTls | None,
) -> list[FileWatch]:
    """The listener's context (when it serves HTTPS) and what watches the files of both (a
    pair in memory has none)."""
    watches = []

    def counter(files: str) -> Callable[[bool], None]:
        return lambda ok: metrics.tls_reloads.labels(files, "reloaded" if ok else "failed").inc()

    cert_file, key_file = settings.tls_cert_file, settings.tls_key_file
    if server_tls is None and cert_file is not None and key_file is not None:
        server_tls = ServerTls(cert_file, key_file, TLS_VERSIONS[settings.tls_min_version])
    if server_tls is not None:
        app[SERVER_TLS] = server_tls
    if server_tls is not None and server_tls.files:
        watches.append(
            FileWatch(
                "the listener's certificate",
                server_tls.files,
                server_tls.reload,
                interval_s=settings.tls_reload_interval_s,
                on_result=counter("listener"),
            )
        )
    if client_tls is not None and client_tls.files:
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
        group=settings.inference_pool_group or None,
    )
    app[POOL_WATCH] = watch
    return watch


def _kv_fleet(
    app: web.Application,
    settings: Settings,
    engines: Engines,
    metrics: Metrics,
    discovery: Discovery,
) -> KVFleet | None:
    """The KV-event subscribers and exact indexes (SIDECAR_KV_EVENTS), following discovery."""
    if not settings.kv_events:
        return None
    # Imported only when used: msgpack is the kvevents extra's.
    from sidecar.kvevents.fleet import FleetOptions, KVFleet
    from sidecar.kvevents.tokens import TokenSource
    from sidecar.observability.kv_metrics import KVEventsCollector

    tokens = TokenSource(
        engines.requests,
        settings.decode_ranks[0],
        timeout_s=settings.kv_events_tokenize_timeout_ms / 1000,
    )
    fleet = KVFleet(FleetOptions.from_settings(settings), tokens=tokens)
    discovery.listen(fleet.follow)
    metrics.registry.register(KVEventsCollector(fleet.report))
    app[KV_FLEET] = fleet
    return fleet


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

        kind = RedisState
        if settings.state_reservations == "counters":
            from sidecar.scheduling.state.counter_state import CounterState

            kind = CounterState
        return kind(
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


def _scrape_share(settings: Settings, scheduler: Scheduler, metrics: Metrics) -> ScrapeShare | None:
    if not settings.shared_scrapes:
        return None
    from sidecar.scheduling.state.redis import RedisState

    backend = scheduler.backend
    assert isinstance(backend, RedisState)  # the settings refuse shared scrapes without Redis
    share = ScrapeShare(
        backend,
        per_endpoint=settings.scrapes_per_endpoint,
        interval_s=settings.scrape_interval_s,
        members_every_s=max(settings.state_lease_s, settings.scrape_interval_s),
        timeout_s=SHARED_SCRAPES_TIMEOUT_S,
        on_skipped=lambda kind, count: metrics.state_entries_skipped.labels(kind).inc(count),
        on_error=metrics.state_backend_errors.labels("scrapes").inc,
    )
    backend.describe_scrapes = share.describe
    return share


async def _scheduler_ctx(app: web.Application) -> AsyncIterator[None]:
    await app[SCHEDULER].start()
    yield
    await app[SCHEDULER].close()


async def _kv_events_ctx(app: web.Application) -> AsyncIterator[None]:
    if KV_FLEET not in app:
        yield
        return
    await app[KV_FLEET].start()
    yield
    await app[KV_FLEET].close()


async def _background_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[BACKGROUND].close(app[DRAIN].background_s())


async def _tracing_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
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
