"""Client connections: a deadline for every request head, an idle keep-alive timeout, a cap.

aiohttp's server bounds how long a keep-alive connection may sit idle between requests, but not
how long a client may take to send a request's head: a client dripping one header byte every few
seconds, or one that connects and never sends, held its connection (a task, a file descriptor,
~6 KiB) for the whole keep-alive time. This module adds both bounds to aiohttp's own
per-connection protocol (``ConnectionHandler``, made by ``ConnectionServer``, installed by
``ListenerRunner``): a waiting connection costs a dict entry or two (``Deadlines``,
``Connections``), with one timer per listener and no task of the sidecar's own.

A connection is either **waiting** for a request head or **busy** with a request:

- waiting, new: its first head must be complete within ``head_timeout_s`` of the accept;
- waiting, keep-alive (after an answer): idle until the next request's first byte, for at most
  ``keepalive_s`` (aiohttp's own timer); from that byte the head must be complete within
  ``head_timeout_s`` (from the answer, for a next request whose first bytes came before it);
- busy, from a complete head until the answer is sent: no timeout of this module (the body, the
  engines and a long stream have their own), so a long stream is never cut here.

The cap (``Connections``): at most ``max_connections`` connections in full service. A connection
beyond it first takes the place of the oldest waiting one (never-served connections before idle
keep-alive ones, which are the gateway's pool), which is closed. When every one is busy, it gets
one of ``overflow`` probe-only places: its head must come within ``PROBE_HEAD_TIMEOUT_S``, a
probe path (the kubelet's ``/health`` and ``/ready``, one new connection per probe) is answered,
anything else gets 503, and the connection is closed after the answer. Past those places too
(after taking the place of the oldest probe-only connection still waiting for its head), a
connection is closed at once, before aiohttp starts anything for it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from sidecar.errors import TooManyConnections, error_response

logger = logging.getLogger("sidecar.server.listener")

PROBE_PATHS = frozenset({"/health", "/ready"})
"""Paths answered on a probe-only connection: the kubelet's liveness and readiness probes."""
PROBE_HEAD_TIMEOUT_S = 2.0
"""A probe-only connection's head deadline (or ``head_timeout_s`` when shorter): a probe sends
its head at once, and the kubelet gives up after the probe's ``timeoutSeconds`` (2 in the
manifests)."""
OVERFLOW_CONNECTIONS = 64
"""Probe-only places over the cap. Each is held for at most PROBE_HEAD_TIMEOUT_S before its head
and a new connection takes the oldest one's place, so a probe is lost only to more than this
many new connections within the few milliseconds its head takes."""
ADMIN_MAX_CONNECTIONS = 64
"""The admin port's cap: a Prometheus scraper keeps one connection, an operator a few."""
FD_RESERVE = 128
"""File descriptors kept for everything but client connections beyond one engine connection
each: listening sockets, the engines' pools for background work, Redis, files, the event loop."""

Handler = Callable[[BaseRequest], Awaitable[web.StreamResponse]]
RequestFactory = Callable[
    [RawRequestMessage, StreamReader, RequestHandler, Any, "asyncio.Task[None]"], BaseRequest
]


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    head_timeout_s: float
    """A request head must be complete this long after the accept, or after its first byte on
    a keep-alive connection."""
    keepalive_s: float
    """A connection idle between requests is closed after this long."""
    max_connections: int
    """Connections in full service; over it, see the module's docstring."""
    overflow: int = OVERFLOW_CONNECTIONS


class Deadlines:
    """Connections whose request head is due, in the order it is due, under one timer.

    Every connection here has the same timeout, so the order they came in is the order of
    their deadlines: a connection costs a dict entry (no timer of its own), and the timer is
    set for the first deadline only, and moved on when it fires.
    """

    __slots__ = ("_due", "_late", "_timeout_s", "_timer")

    def __init__(self, timeout_s: float, late: Callable[[ConnectionHandler], None]) -> None:
        self._timeout_s = timeout_s
        self._late = late
        self._due: dict[ConnectionHandler, float] = {}
        self._timer: asyncio.TimerHandle | None = None

    def start(self, handler: ConnectionHandler) -> None:
        """From now; ``handler`` must not be here already."""
        loop = asyncio.get_running_loop()
        due = self._due[handler] = loop.time() + self._timeout_s
        if self._timer is None:
            self._timer = loop.call_at(due, self._expire)

    def stop(self, handler: ConnectionHandler) -> None:
        self._due.pop(handler, None)  # the timer stays: it finds nothing due and moves on

    def _expire(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = self._due
        while due:
            handler = next(iter(due))
            when = due[handler]
            if when > now:
                self._timer = loop.call_at(when, self._expire)
                return
            del due[handler]
            self._late(handler)


class Slot(enum.Enum):
    FULL = "full"
    PROBE = "probe"


class Connections:
    """The open connections of one listener and their places: counts, and the waiting ones in
    the order they started to wait (dicts keep insertion order: the first is the oldest)."""

    def __init__(
        self,
        limits: ConnectionLimits,
        *,
        on_refused: Callable[[str], None] = lambda how: None,
        on_closed: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.limits = limits
        self._on_refused = on_refused
        self._on_closed = on_closed
        self._full = 0
        self._probe = 0
        self._fresh: dict[ConnectionHandler, None] = {}  # full, no request yet
        self._idle: dict[ConnectionHandler, None] = {}  # full, keep-alive between requests
        self._probing: dict[ConnectionHandler, None] = {}  # probe-only, no request yet
        self.heads = Deadlines(limits.head_timeout_s, self._head_late)
        self.probe_heads = Deadlines(
            min(limits.head_timeout_s, PROBE_HEAD_TIMEOUT_S), self._head_late
        )

    @property
    def open(self) -> int:
        return self._full + self._probe

    def admit(self, handler: ConnectionHandler) -> Slot | None:
        """The new connection's place, or None: close it at once (counted)."""
        if self._full < self.limits.max_connections or self._evict(self._fresh, self._idle):
            self._full += 1
            return Slot.FULL
        if self._probe < self.limits.overflow or self._evict(self._probing):
            self._probe += 1
            return Slot.PROBE
        self._on_refused("closed")
        return None

    def waiting(self, handler: ConnectionHandler) -> None:
        if handler.slot is Slot.PROBE:
            tier = self._probing
        elif handler.served:
            tier = self._idle
        else:
            tier = self._fresh
        tier[handler] = None
        handler.tier = tier

    def busy(self, handler: ConnectionHandler) -> None:
        if handler.tier is not None:
            handler.tier.pop(handler, None)
            handler.tier = None

    def release(self, handler: ConnectionHandler) -> None:
        """The connection no longer counts (closed, or closing); idempotent."""
        if not handler.booked:
            return
        handler.booked = False
        self.busy(handler)
        if handler.slot is Slot.PROBE:
            self._probe -= 1
        else:
            self._full -= 1

    def refused(self) -> None:
        """A request on a probe-only connection was answered 503."""
        self._on_refused("answered")

    def _head_late(self, handler: ConnectionHandler) -> None:
        self._on_closed("head_timeout")
        handler.head_late()

    def _evict(self, *tiers: dict[ConnectionHandler, None]) -> bool:
        """Close the oldest waiting connection of the first tier that has one, freeing its
        place."""
        for waiting in tiers:
            if waiting:
                victim = next(iter(waiting))
                self.release(victim)
                victim.force_close()
                self._on_closed("evicted")
                return True
        return False


class ConnectionHandler(RequestHandler):
    """aiohttp's protocol for one connection, with the head deadline and a place in the cap."""

    __slots__ = (
        "_body",
        "_book",
        "_early",
        "_heading",
        "_waiting",
        "booked",
        "served",
        "slot",
        "tier",
    )

    def __init__(self, manager: web.Server, book: Connections, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._book = book
        self._heading = False  # in one of the book's Deadlines
        self._waiting = False
        self._body: StreamReader | None = None  # the request's, while busy
        self._early = False  # the next request began while this one was busy
        self.booked = False
        self.served = False
        self.slot: Slot | None = None
        self.tier: dict[ConnectionHandler, None] | None = None  # the book's, while waiting

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.slot = self._book.admit(self)
        if self.slot is None:
            # Before aiohttp starts its task: a refusal costs no more. A reset, not a close:
            # no TIME_WAIT left on this side by a flood.
            cast(asyncio.Transport, transport).abort()
            return
        self.booked = True
        super().connection_made(transport)
        if self._book.limits.keepalive_s >= self._book.limits.head_timeout_s:
            # aiohttp starts its keep-alive timer at the accept, lest a connection that never
            # sends stay open; the head deadline closes that one first, and the timer (~0.6
            # KiB) would stay for as long as the keep-alive time, an hour by default, through
            # the stream this connection serves.
            self.keep_alive(True)
        self._wait_for_head()
        self._start_head_timer()  # a new connection: from the accept

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.slot is None:
            return  # refused: aiohttp never saw it
        self._book.release(self)
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._waiting:
            if not self._heading:
                self._start_head_timer()  # a keep-alive connection's next request begins
        elif self._body is not None and self._body.is_eof():
            # Past the body: a pipelined next request. Its head deadline starts when this
            # answer is sent (a timer now could cut a long answer).
            self._early = True
        super().data_received(data)

    def head_received(self, body: StreamReader) -> None:
        """A complete request head: busy until its answer is sent."""
        self._waiting = False
        self.served = True
        self._body = body
        self._cancel_head_timer()
        self._book.busy(self)
        # Not idle until the answer is sent, when aiohttp starts its keep-alive timer again:
        # the one it started after the last answer would stay until it fires (an hour, by
        # default), through this request's whole stream. (The mode itself stays on: a
        # connection that was not kept alive gets no next request.)
        self.keep_alive(True)

    def log_access(
        self, request: BaseRequest, response: web.StreamResponse, time: float | None
    ) -> None:
        """The end of an answer: ``finish_response`` calls this once per answer, sent or not
        (a synchronous hook; overriding that coroutine would cost one more per request)."""
        super().log_access(request, response, time)
        self._body = None
        if response.keep_alive and self.booked and self.transport is not None:
            self._wait_for_head()  # idle: aiohttp's keep-alive timer runs
            if self._early:
                self._early = False
                self._start_head_timer()  # part of the next head is here already

    def _wait_for_head(self) -> None:
        self._waiting = True
        self._book.waiting(self)

    def _start_head_timer(self) -> None:
        self._heading = True
        book = self._book
        (book.probe_heads if self.slot is Slot.PROBE else book.heads).start(self)

    def _cancel_head_timer(self) -> None:
        if self._heading:
            self._heading = False
            book = self._book
            (book.probe_heads if self.slot is Slot.PROBE else book.heads).stop(self)

    def head_late(self) -> None:
        """Its head did not come in time (``Deadlines``)."""
        self._heading = False
        self.force_close()


class ConnectionServer(web.Server):
    """aiohttp's server, making ``ConnectionHandler``s; a probe-only connection's request is
    routed here before the application sees it."""

    def __init__(
        self,
        handler: Handler,
        request_factory: RequestFactory,
        book: Connections,
        *,
        handler_cancellation: bool,
        loop: asyncio.AbstractEventLoop,
        logger: Any = None,
    ) -> None:
        self._app_handler = handler
        self._app_request_factory = request_factory
        self._book = book
        self._handler_loop = loop
        self._handler_kwargs: dict[str, Any] = {
            "keepalive_timeout": book.limits.keepalive_s,
            "access_log": None,
            # A body is read as its bytes came: inflating a compressed one here would make what
            # the sidecar reads differ from what its framing declared (sidecar.framing).
            "auto_decompress": False,
        }
        if logger is not None:
            self._handler_kwargs["logger"] = logger
        super().__init__(
            self._route,
            request_factory=self._request_started,
            handler_cancellation=handler_cancellation,
            loop=loop,
            **self._handler_kwargs,
        )

    def __call__(self) -> RequestHandler:
        return ConnectionHandler(self, self._book, loop=self._handler_loop, **self._handler_kwargs)

    def _request_started(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: Any,
        task: asyncio.Task[None],
    ) -> BaseRequest:
        cast(ConnectionHandler, protocol).head_received(payload)
        return self._app_request_factory(message, payload, protocol, writer, task)

    def _route(self, request: BaseRequest) -> Awaitable[web.StreamResponse]:
        # A plain function, not a coroutine: a request in full service costs one call more.
        if cast(ConnectionHandler, request.protocol).slot is Slot.PROBE:
            return self._probe_only(request)
        return self._app_handler(request)

    async def _probe_only(self, request: BaseRequest) -> web.StreamResponse:
        if request.path in PROBE_PATHS:
            response = await self._app_handler(request)
        else:
            self._book.refused()
            response = error_response(
                TooManyConnections(
                    "the sidecar holds as many client connections as it may "
                    "(SIDECAR_MAX_CONNECTIONS); try again later"
                ),
                None,
            )
        response.force_close()
        return response


class ListenerRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are ``ConnectionHandler``s booked in ``book``."""

    def __init__(
        self,
        app: web.Application,
        book: Connections,
        *,
        handler_cancellation: bool = False,
        shutdown_timeout: float,
        logger: Any = None,
    ) -> None:
        """``logger``: what stands for aiohttp's server logger on these connections (parse
        errors, exceptions escaping a handler; ``sidecar.server.serverlog.ServerLog``), else its
        own."""
        super().__init__(
            app,
            handler_cancellation=handler_cancellation,
            access_log=None,
            shutdown_timeout=shutdown_timeout,
        )
        self.book = book
        self._handler_cancellation = handler_cancellation
        self._logger = logger

    async def _make_server(self) -> web.Server:
        # aiohttp's own: starts the application (its cleanup_ctx) and freezes it; only its
        # handler and request factory are kept.
        server = await super()._make_server()
        return ConnectionServer(
            server.request_handler,
            server.request_factory,
            self.book,
            handler_cancellation=self._handler_cancellation,
            loop=asyncio.get_running_loop(),
            logger=self._logger,
        )


def connection_budget(wanted: int, overflow: int = OVERFLOW_CONNECTIONS) -> int:
    """``wanted``, or fewer when the open-files limit could not hold them: each client
    connection may hold one to an engine too, and FD_RESERVE stay for the rest. A cap the limit
    cannot hold would let accept() fail first, and then every new connection is reset, probes
    included."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    fits = max(1, (soft - FD_RESERVE) // 2 - overflow - ADMIN_MAX_CONNECTIONS)
    if fits < wanted:
        logger.warning(
            "the open-files limit (%d) holds %d client connections, not SIDECAR_MAX_CONNECTIONS"
            "=%d: the cap is %d",
            soft,
            fits,
            wanted,
            fits,
        )
        return fits
    return wanted


def raise_open_files_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit, as Go programs do at start (a
    container runtime may set the soft one as low as 1024); the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
    return hard
