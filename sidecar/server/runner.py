"""Serving the application (``sidecar.app.create_app``) on its ports until ``close()``: the API
listener and, with ``SIDECAR_ADMIN_PORT``, the admin one, each on ``ListenerRunner`` (the
connection bounds of ``sidecar.server.listener``) and on every address of ``SIDECAR_HOST``
(``sidecar.server.binding``); the shutdown sequence of ``sidecar.drain``.
``python -m sidecar`` runs it (``sidecar.__main__``)."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiohttp import web
from yarl import URL

from sidecar.app import (
    ADMIN_APP,
    DRAIN,
    GUARD,
    METRICS,
    RANK_PORTS,
    READINESS,
    SERVER_TLS,
    create_app,
)
from sidecar.config import Settings, in_this_pod
from sidecar.connectors import ConnectorFactory
from sidecar.discovery import Resolver, system_resolver
from sidecar.drain import CUT_GRACE_S
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import Tracing
from sidecar.security.tls import ServerTls
from sidecar.server.binding import CannotListen as CannotListen
from sidecar.server.binding import SocketFactory, bind, display, reachable
from sidecar.server.listener import (
    ADMIN_MAX_CONNECTIONS,
    ConnectionLimits,
    Connections,
    ListenerRunner,
    connection_budget,
)
from sidecar.server.serverlog import ServerLog

logger = logging.getLogger("sidecar.server.runner")

LISTEN_BACKLOG = 2048
"""Connections the kernel queues before accept (aiohttp's default, 128, drops SYNs when a
thousand clients connect at once; vLLM's API server uses 2048 too)."""


@dataclass(slots=True)
class RunningSidecar:
    app: web.Application
    runners: list[web.AppRunner]
    host: str
    """An address of the API listener a client on this host can connect to (loopback when it
    listens on every address): what ``url`` names."""
    port: int
    admin_port: int | None
    tls: bool = False
    """SIDECAR_PORT serves HTTPS."""
    admin_tls: bool = False
    listening: list[str] = field(default_factory=list)
    """Every ``host:port`` the API listener is bound to."""
    rank_ports: list[int] = field(default_factory=list)
    """SIDECAR_RANK_PORTS: the API's port for decode rank 1, 2, ... (rank 0's is ``port``)."""

    def rank_url(self, rank: int) -> str:
        """The API's URL for decode rank ``rank`` (SIDECAR_RANK_PORTS; 0: ``url``)."""
        return self.url if rank == 0 else _url(self.host, self.rank_ports[rank - 1], self.tls)

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


async def start_sidecar(
    settings: Settings,
    *,
    tracing: Tracing | None = None,
    connector: ConnectorFactory | None = None,
    make_socket: SocketFactory = socket.socket,
    resolver: Resolver = system_resolver,
    listener_tls: ServerTls | None = None,
) -> RunningSidecar:
    """Serve ``create_app(settings, tracing=tracing, connector=connector, resolver=resolver,
    listener_tls=listener_tls)`` on its port (0 = a free one) until ``close()``. ``make_socket``
    makes the listening sockets (a test gives one that fails for IPv6); ``resolver`` plays the
    DNS behind ``SIDECAR_PREFILL_DNS`` (a test gives its own).

    Raises ``CannotListen`` when a port cannot be bound, with every resource closed again.
    """
    app = create_app(
        settings,
        tracing=tracing,
        connector=connector,
        resolver=resolver,
        listener_tls=listener_tls,
    )
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
        try:
            sockets = await _listen(
                runner, settings.host, settings.port, "SIDECAR_PORT", context, make_socket
            )
        except CannotListen as exc:
            raise CannotListen(f"{exc}{await _engine_on_port(settings, exc)}") from exc.__cause__
        host, port = reachable(sockets)
        listening = [display(*sock.getsockname()[:2]) for sock in sockets]
        rank_ports = await _listen_per_rank(settings, app, runner, port, context, make_socket)
        app[GUARD].listening(port, *rank_ports, **await _own_identity(settings.host))
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
            admin_sockets = await _listen(
                admin_runner,
                settings.host,
                settings.admin_port,
                "SIDECAR_ADMIN_PORT",
                admin_context,
                make_socket,
            )
            admin_port = reachable(admin_sockets)[1]
    except BaseException:
        for started in reversed(runners):
            await started.cleanup()
        raise
    logger.info("SIDECAR_PORT: listening on %s", ", ".join(listening))
    for rank, rank_port in enumerate(rank_ports, 1):
        logger.info("SIDECAR_RANK_PORTS: decode rank %d on port %d", rank, rank_port)
    return RunningSidecar(
        app,
        runners,
        host,
        port,
        admin_port,
        context is not None,
        admin_context is not None,
        listening,
        rank_ports,
    )


async def _listen_per_rank(
    settings: Settings,
    app: web.Application,
    runner: web.AppRunner,
    port: int,
    context: ssl.SSLContext | None,
    make_socket: SocketFactory,
) -> list[int]:
    """SIDECAR_RANK_PORTS: the API on SIDECAR_PORT + r for each decode rank r above 0 too (the
    same addresses, runner, connection book and TLS; with SIDECAR_PORT=0, a free port each),
    and each port pinned to its rank. The ports of ranks 1, 2, ..."""
    ranks = len(settings.decode_ranks)
    if not settings.rank_ports or ranks < 2:
        return []
    app[RANK_PORTS].serve(port, 0)
    ports = []
    for rank in range(1, ranks):
        wanted = settings.port + rank if settings.port else 0
        variable = f"SIDECAR_PORT + {rank} (SIDECAR_RANK_PORTS)"
        sockets = await _listen(runner, settings.host, wanted, variable, context, make_socket)
        ports.append(reachable(sockets)[1])
        app[RANK_PORTS].serve(ports[-1], rank)
    return ports


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
    hosts: Sequence[str],
    port: int | None,
    variable: str,
    context: ssl.SSLContext | None,
    make_socket: SocketFactory,
) -> list[socket.socket]:
    """Serve ``runner`` on every address of ``hosts``, one site per socket: the runner's
    connection book (its cap, its timeouts) and TLS hold across them. The sockets, listening."""
    sockets = await bind(hosts, port or 0, variable, make_socket=make_socket)
    started = 0
    try:
        for sock in sockets:
            site = web.SockSite(runner, sock, backlog=LISTEN_BACKLOG, ssl_context=context)
            await site.start()  # from here the site's server owns (and closes) the socket
            started += 1
    except BaseException as exc:
        address = display(*sockets[started].getsockname()[:2])
        for sock in sockets[started:]:
            sock.close()
        if isinstance(exc, OSError):  # listen() refused
            raise CannotListen(f"cannot listen on {address} ({variable}): {exc}") from exc
        raise
    return sockets


async def _engine_on_port(settings: Settings, exc: CannotListen) -> str:
    """The likely cause when the serving port is in use, the decode engine is in the pod and
    nothing listens where SIDECAR_DECODE_URL says it does: the engine still listens on the
    serving port (a manifest gave the sidecar that port and left the engine's ``--port`` as it
    was). "" for any other failure."""
    cause = exc.__cause__
    if not isinstance(cause, OSError) or cause.errno != errno.EADDRINUSE:
        return ""
    for url in settings.decode_ranks:
        engine = URL(url)
        if not in_this_pod(engine.host) or engine.port is None:
            continue
        try:
            async with asyncio.timeout(1):
                _, writer = await asyncio.open_connection(engine.host, engine.port)
        except (OSError, TimeoutError):
            return (
                f"; nothing listens at SIDECAR_DECODE_URL ({url}): if the decode engine is on "
                f"port {settings.port}, move it to {engine.port} (vLLM --port {engine.port}), "
                "the sidecar takes the pod's serving port (docs/deploy.md)"
            )
        writer.close()
        await writer.wait_closed()
    return ""


async def _own_identity(listen_hosts: Sequence[str]) -> dict[str, list[str]]:
    """This pod's host name and addresses, so a prefill target naming the sidecar itself is
    recognised (the listen addresses, and what the host name resolves to: the pod IP in
    Kubernetes)."""
    name = socket.gethostname()
    addresses = list(listen_hosts)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None)
    except OSError:
        infos = []
    addresses += [str(info[4][0]) for info in infos]
    return {"names": [name, *listen_hosts], "addresses": addresses}


def _url(host: str, port: int, tls: bool = False) -> str:
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
