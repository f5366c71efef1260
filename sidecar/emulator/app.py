"""Assembling an emulator: the API app, the side-channel app, and their lifecycle.

Start order: KV store, push board, room board (sglang prefill) -> side-channel listener (its port
is advertised in kv_transfer_params; it is the sglang bootstrap server too) -> API app
(cleanup_ctx: KV-event publisher + pull session + engine, expiry sweeper) -> API listener.
Close order (:meth:`RunningEmulator.close`): cancel in-flight API and side-channel handlers (hung,
stalled and streaming requests, waiting push registrations and sglang claims end at once) -> stop
the API listener and run its cleanup_ctx in reverse (sweeper, then the pull session) -> stop the
side-channel listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from sidecar.emulator.config import EmulatorConfig
from sidecar.emulator.control import add_control_routes
from sidecar.emulator.engine import Engine
from sidecar.emulator.errors import EmulatorError, error_response
from sidecar.emulator.events import open_kv_events
from sidecar.emulator.faults import FaultBoard
from sidecar.emulator.generation import handle_generation
from sidecar.emulator.keys import (
    CONFIG,
    ENGINE,
    FAULTS,
    INFLIGHT,
    KV,
    METRICS,
    POLLS,
    PUSH,
    RAW_TARGET,
    REQUEST_ID,
    REQUEST_LOG,
    ROOMS,
    SIDE_CHANNEL_PORT,
    STARTED_AT,
)
from sidecar.emulator.kv import Clock, KvStore
from sidecar.emulator.metrics import CONTENT_TYPE, EmulatorMetrics
from sidecar.emulator.nixl import KvPuller, create_side_channel_app
from sidecar.emulator.parse import Endpoint
from sidecar.emulator.push import PushBoard, add_push_routes
from sidecar.emulator.reqlog import RequestLog
from sidecar.emulator.sglang import RoomBoard, add_bootstrap_routes
from sidecar.emulator.storage import SharedKvStore
from sidecar.emulator.tokenize import handle_tokenize
from sidecar.server.binding import CannotListen, bind, reachable

log = logging.getLogger("sidecar.emulator")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY_BYTES = 64 * 1024 * 1024
BACKLOG = 2048
"""The API port's listen backlog: uvicorn's default, so vLLM's."""
SHUTDOWN_TIMEOUT_S = 1.0  # in-flight handlers are already cancelled when aiohttp shuts down


GENERATION_PATHS = frozenset(
    {"/generate", "/inference/v1/generate", "/invocations", "/vertex_generate"}
)
"""Generation routes of vLLM and SGLang outside ``/v1/``: logged like ``/v1/*`` requests."""


@web.middleware
async def _decode_before_routing(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Route as vLLM's and SGLang's server does: uvicorn decodes every percent-escape of the path
    (``%2F`` included) before Starlette routes it, so ``/v1%2Fcompletions`` is
    ``/v1/completions``. aiohttp routes on the path with ``%2F`` kept: a request whose decoded
    path differs is dispatched again on the decoded one, its target remembered for the log."""
    if RAW_TARGET in request:
        return await handler(request)
    target = request.raw_path
    path, _, query = target.partition("?")
    if not path.startswith("/"):  # absolute-form: its path
        path = request.rel_url.raw_path
    if "%" not in path:
        request[RAW_TARGET] = target
        return await handler(request)
    again = request.clone(rel_url=URL.build(path=urllib.parse.unquote(path), query_string=query))
    again[RAW_TARGET] = target
    return await request.app._handle(again)


@web.middleware
async def _redirect_slashes(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Starlette's ``redirect_slashes``: a path no route matches, but which one does with its
    trailing slash toggled, answers 307 to that spelling, at the host the request named (what
    a proxy that does not forward ``Host`` shows its client is the engine's own address)."""
    path = request.path
    if request.match_info.http_exception is None or path == "/":
        return await handler(request)
    other = path[:-1] if path.endswith("/") else path + "/"
    match = await request.app.router.resolve(request.clone(rel_url=URL.build(path=other)))
    if match.http_exception is not None and match.http_exception.status == 404:
        return await handler(request)
    location = str(request.url.with_path(other).with_query(request.rel_url.query))
    return web.Response(status=307, headers={"Location": location})


@web.middleware
async def _track_and_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Register the handler task for close(), and log generation requests (``/v1/*`` and
    ``GENERATION_PATHS``) before they are served."""
    if request.path.startswith("/v1/") or request.path in GENERATION_PATHS:
        raw = await request.read()  # aiohttp caches the body, so the handler can read it again
        request.app[REQUEST_LOG].record(
            request.method,
            request.path,
            list(request.headers.items()),
            raw,
            target=request.get(RAW_TARGET),
        )
    task = asyncio.current_task()
    inflight = request.app[INFLIGHT]
    if task is not None:
        inflight.add(task)
    try:
        return await handler(request)
    finally:
        if task is not None:
            inflight.discard(task)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render every error, ours or aiohttp's, in vLLM's error shape."""
    try:
        return await handler(request)
    except EmulatorError as exc:
        return error_response(exc.status, exc.message)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "Internal server error")


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["x-request-id"] = request_id


async def _completions(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, Endpoint.COMPLETIONS)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await handle_generation(request, Endpoint.CHAT)


async def _tokenize(request: web.Request) -> web.Response:
    return await handle_tokenize(request, request.app[CONFIG])


async def _models(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    card = {
        "id": config.model,
        "object": "model",
        "created": request.app[STARTED_AT],
        "owned_by": "vllm",
        "root": config.model,
        "parent": None,
        "max_model_len": config.max_model_len,
        "permission": [],
    }
    return web.json_response({"object": "list", "data": [card]}, dumps=_dumps)


async def _health(request: web.Request) -> web.Response:
    request.app[POLLS]["health"] += 1
    if request.app[FAULTS].health_down:
        return error_response(503, "Injected fault: engine unhealthy")
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    request.app[POLLS]["metrics"] += 1
    engine = request.app[ENGINE]
    engine.refresh_metrics()
    return web.Response(body=engine.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    """The engine, its KV-event publisher (when enabled) and the client session it pulls KV
    with (closed last)."""
    config = app[CONFIG]
    events = open_kv_events(config.kv_events(), config.kv_events_encoding)
    session = aiohttp.ClientSession()
    app[ENGINE] = Engine(
        config,
        kv=app[KV],
        metrics=app[METRICS],
        puller=KvPuller(session, config.kv_pull_timeout_s),
        side_channel_port=app[SIDE_CHANNEL_PORT],
        rooms=app.get(ROOMS),
        store=SharedKvStore(config.kv_store, config.kv_store_max_blocks)
        if config.kv_store
        else None,
        events=events,
    )
    yield
    await events.close()
    await session.close()


async def _sweeper_ctx(app: web.Application) -> AsyncIterator[None]:
    """Expire unpulled KV in the background too, so metrics move without anyone reading state."""
    kv = app[KV]
    interval = min(1.0, max(0.05, app[CONFIG].kv_expiry_s / 4))

    async def sweep_forever() -> None:
        while True:
            await asyncio.sleep(interval)
            kv.sweep()

    task = asyncio.create_task(sweep_forever(), name="emulator-kv-sweeper")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def create_api_app(
    config: EmulatorConfig,
    *,
    kv: KvStore,
    side_channel_port: int,
    push: PushBoard,
    rooms: RoomBoard | None = None,
) -> web.Application:
    # Long prompts are the point of P/D disaggregation: allow bodies far beyond aiohttp's 1 MiB.
    app = web.Application(
        middlewares=[_decode_before_routing, _errors, _redirect_slashes, _track_and_log],
        client_max_size=MAX_BODY_BYTES,
    )
    app[CONFIG] = config
    app[KV] = kv
    app[METRICS] = EmulatorMetrics(
        config.model, block_size=config.block_size, num_gpu_blocks=config.num_gpu_blocks
    )
    app[FAULTS] = FaultBoard(config.faults)
    app[REQUEST_LOG] = RequestLog(config.request_log_size)
    app[POLLS] = {"metrics": 0, "health": 0}
    app[SIDE_CHANNEL_PORT] = side_channel_port
    app[PUSH] = push
    if rooms is not None:
        app[ROOMS] = rooms
    app[STARTED_AT] = int(time.time())
    app[INFLIGHT] = set()
    app.cleanup_ctx.append(_engine_ctx)
    app.cleanup_ctx.append(_sweeper_ctx)
    app.on_response_prepare.append(_echo_request_id)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    add_control_routes(app)
    return app


def _tls(config: EmulatorConfig) -> ssl.SSLContext | None:
    """The API's TLS context, when it serves HTTPS; with a client CA, a client certificate
    signed by it is required."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    if config.tls_client_ca_file is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=config.tls_client_ca_file)
    return context


def listen_hosts(text: str) -> list[str]:
    """``--host``: one address, or a comma list (``0.0.0.0,::``: both families, as the sidecar's
    SIDECAR_HOST); IPv6 addresses with or without brackets."""
    hosts = [item.strip().removeprefix("[").removesuffix("]") for item in text.split(",")]
    return [host for host in hosts if host] or ["127.0.0.1"]


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class RunningEmulator:
    """A started emulator; :meth:`close` stops it (idempotent)."""

    def __init__(
        self,
        config: EmulatorConfig,
        app: web.Application,
        api_runner: web.AppRunner,
        side_runner: web.AppRunner,
        host: str | None = None,
    ) -> None:
        """``host``: what ``endpoint`` and ``url`` name (None: ``config.host``)."""
        host = config.host if host is None else host
        self.config = config
        self.app = app
        self._api_runner = api_runner
        self._side_runner = side_runner
        self.port: int = api_runner.addresses[0][1]

        # The NIXL side channel; for an sglang prefill server, its bootstrap server.
        self.side_channel_port: int = side_runner.addresses[0][1]
        self.bootstrap_port: int = self.side_channel_port
        self.endpoint = f"{_host_for_url(host)}:{self.port}"
        scheme = "https" if config.tls_cert_file else "http"
        self.url = f"{scheme}://{self.endpoint}"
        self._closed = False

    @property
    def engine_id(self) -> str:
        return self.app[KV].engine_id

    @property
    def kv(self) -> KvStore:
        return self.app[KV]

    @property
    def kv_events_port(self) -> int | None:
        """The KV events' PUB port (None: events off)."""
        return self.app[ENGINE].events.port

    @property
    def kv_events_replay_port(self) -> int | None:
        """The KV events' replay (ROUTER) port (None: events off or no replay endpoint)."""
        return self.app[ENGINE].events.replay_port

    @property
    def faults(self) -> FaultBoard:
        return self.app[FAULTS]

    @property
    def inflight_requests(self) -> int:
        """API requests being handled right now (hung and stalled ones included)."""
        return len(self.app[INFLIGHT])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        inflight = [*self.app[INFLIGHT], *self._side_runner.app[INFLIGHT]]
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
        try:
            await self._api_runner.cleanup()
        finally:
            await self._side_runner.cleanup()

    async def __aenter__(self) -> RunningEmulator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def start_emulator(
    config: EmulatorConfig | None = None, *, clock: Clock | None = None
) -> RunningEmulator:
    """Start both listeners; ``clock`` (monotonic seconds) drives KV expiry, for tests."""
    config = config or EmulatorConfig()
    kv_clock = clock or time.monotonic
    kv = KvStore(
        engine_id=str(uuid.uuid4()),
        block_size=config.block_size,
        expiry_s=config.kv_expiry_s,
        clock=kv_clock,
    )
    push = PushBoard(kv)
    rooms = RoomBoard(kv_clock) if config.disaggregation_mode == "prefill" else None
    side_app = create_side_channel_app(kv)
    side_app.middlewares.append(_track_and_log)  # waiting registrations and claims end on close()
    side_app[INFLIGHT] = set()
    add_push_routes(side_app, push if config.kv_protocol == "nixl-push" else None, kv.engine_id)
    add_bootstrap_routes(side_app, rooms)
    side_runner = web.AppRunner(
        side_app,
        access_log=None,
        handler_cancellation=True,  # a decode that leaves drops its registration or claim
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    await side_runner.setup()
    try:
        side_site = web.TCPSite(side_runner, config.side_channel_host, config.side_channel_port)
        try:
            await side_site.start()
        except OSError as exc:  # in use, not permitted: one line (``python -m sidecar.emulator``)
            where = f"{config.side_channel_host}:{config.side_channel_port}"
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise CannotListen(f"cannot listen on {where} (--side-channel-port): {reason}") from exc
        side_channel_port: int = side_runner.addresses[0][1]
        app = create_api_app(
            config, kv=kv, side_channel_port=side_channel_port, push=push, rooms=rooms
        )
        api_runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,  # a client that goes away aborts its request, as in vLLM
            keepalive_timeout=config.keepalive_timeout_s,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        await api_runner.setup()
        try:
            # Every address of --host, on one port (sidecar.server.binding: "::" skipped where
            # the kernel has no IPv6, as long as another address is bound), with uvicorn's (so
            # vLLM's) listen backlog: a burst of new connections from a proxy opening hundreds
            # of streams at once is queued, not dropped and retried after 1 s.
            context = _tls(config)
            hosts = listen_hosts(config.host)
            sockets = await bind(hosts, config.port, "--port")
            for sock in sockets:
                site = web.SockSite(api_runner, sock, ssl_context=context, backlog=BACKLOG)
                await site.start()
            # Several addresses (0.0.0.0,::): named by one a local client reaches, as the
            # sidecar does; one: as written.
            host = hosts[0] if len(hosts) == 1 else reachable(sockets)[0]
        except BaseException:
            await api_runner.cleanup()
            raise
    except BaseException:
        await side_runner.cleanup()
        raise
    return RunningEmulator(config, app, api_runner, side_runner, host)
