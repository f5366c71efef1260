"""Engine clients: pooled keep-alive sessions, and the one boundary where aiohttp and asyncio
exceptions become the sidecar's own (``sidecar.errors``).

aiohttp stops here: callers pass timeouts in seconds and get an ``EngineAnswer`` back.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Mapping, Sequence
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import hdrs
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from sidecar.body import Pieces, Wire
from sidecar.caches import BoundedCache
from sidecar.defaults import ENGINE_KEEPALIVE_S
from sidecar.errors import (
    EngineAnswerTooLarge,
    EngineBadResponse,
    EngineConnectTimeout,
    EngineError,
    EngineNotConnected,
    EngineRefused,
    EngineStreamBroken,
    EngineStreamIdle,
    EngineTimeout,
    EngineUnreachable,
    EngineUntrusted,
)
from sidecar.fleet.endpoints import Endpoint

# The exceptions an engine call can raise on its way to a response or through its body.
_TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)
# aiohttp writes a bytes body in one go (and warns above 1 MiB); a large one goes out as Pieces,
# in slices that yield to the event loop between them, so a long prompt does not stall other
# streams. (A BytesIO did so too, but copied the whole body first.)
_LARGE_BODY = 1 << 20


class Streamed:
    """A body passed on as it arrives, framed by the sidecar: ``size`` bytes under a
    ``Content-Length`` of its own (None: chunked). A source that ends short of ``size`` or runs
    past it fails the send, and the engine's connection is closed rather than pooled: the
    engine never frames the next request from the wrong byte."""

    __slots__ = ("size", "source")

    def __init__(self, source: AsyncIterable[bytes], size: int | None) -> None:
        self.source = source
        self.size = size


Body = Wire | Streamed | None


class _PiecesPayload(aiohttp.payload.Payload):
    """``Pieces`` written slice by slice (``Pieces.chunks``), with a turn of the event loop
    between slices; nothing is copied on the way to the socket."""

    _value: Pieces

    def __init__(self, pieces: Pieces) -> None:
        super().__init__(pieces)
        self._size = pieces.nbytes

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytes(self._value).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        left = self._value.nbytes if content_length is None else content_length
        for index, chunk in enumerate(self._value.chunks()):
            if left <= 0:
                return
            if index:
                await asyncio.sleep(0)
            await writer.write(chunk[:left])
            left -= len(chunk)


class BodyLengthMismatch(Exception):
    """A ``Streamed`` body's source gave other than its ``size`` bytes."""


class _StreamedPayload(aiohttp.payload.Payload):
    """A ``Streamed`` body: its chunks as they come, counted against its size."""

    _value: Streamed

    def __init__(self, body: Streamed) -> None:
        super().__init__(body, content_type="application/octet-stream")
        self._size = body.size

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a streamed body is read once, as it is sent")

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        size = self._value.size
        sent = 0
        async for chunk in self._value.source:
            sent += len(chunk)
            if size is not None and sent > size:
                raise BodyLengthMismatch(f"the body ran past its {size} bytes")
            await writer.write(chunk)
        if size is not None and sent != size:
            raise BodyLengthMismatch(f"the body ended after {sent} of its {size} bytes")


POLL_CONNECTIONS_PER_ENGINE = 2
"""Health and metrics polls have a pool of their own, capped at this many connections per engine:
all an idle sidecar keeps open to its decode engine (bench/cluster.py checks it)."""


class EngineAnswer:
    """An engine's answer whose body has not been read yet; ``close()`` it when done.

    Body errors surface as ``EngineStreamBroken`` (or ``EngineTimeout`` for a one-shot read).
    """

    __slots__ = ("_idle", "_response", "engine")

    def __init__(
        self, response: aiohttp.ClientResponse, engine: str, idle: IdleWatches | None = None
    ) -> None:
        """``idle``: the idle watches ``chunks`` joins (its client's; None: one of its own)."""
        self._response = response
        self.engine = engine
        """``host:port`` of the engine, for messages."""
        self._idle = idle

    @property
    def status(self) -> int:
        return self._response.status

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self._response.headers

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters (``text/event-stream``), or
        ``application/octet-stream`` when the engine sent none, as aiohttp's ``content_type``
        says; read off the header rather than through aiohttp's parser, whose parsed
        parameters stay on the response as long as its stream (~1.5 KiB a stream,
        bench/stream_memory.py)."""
        raw = self._response.headers.get(hdrs.CONTENT_TYPE)
        if not raw:
            return "application/octet-stream"
        return raw.partition(";")[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        return self._response.content_length

    @property
    def complete(self) -> bool:
        """The whole body has been read (what ``first_chunk`` returned was all of it)."""
        return self._response.content.at_eof()

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body of a (small, non-streamed) answer; the connection goes back to the
        pool. Over ``limit`` bytes (None: no limit) it raises ``EngineAnswerTooLarge`` as soon
        as that is known — by ``Content-Length`` before a byte of the body, else once what
        arrived passes it — having kept at most ``limit`` bytes, and drops the connection."""
        try:
            if limit is None:
                return await self._response.read()
            length = self._response.content_length
            if length is not None and length > limit:
                raise self._too_large(limit)
            parts: list[bytes] = []
            size = 0
            async for chunk in self._response.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise self._too_large(limit)
                parts.append(chunk)
            return b"".join(parts)
        except _TRANSPORT_ERRORS as exc:
            raise _translate(exc, f"{self.engine} broke its answer") from exc
        finally:
            self._response.release()

    async def drain(self) -> int:
        """Read the body to its end, keeping none of it (an answer whose content nobody needs,
        but whose end does); returns its size. The connection goes back to the pool."""
        size = 0
        try:
            async for chunk in self._response.content.iter_any():
                size += len(chunk)
        except _TRANSPORT_ERRORS as exc:
            raise _translate(exc, f"{self.engine} broke its answer") from exc
        finally:
            self._response.release()
        return size

    def _too_large(self, limit: int) -> EngineAnswerTooLarge:
        self._response.close()  # the rest is never read: the connection cannot be reused
        return EngineAnswerTooLarge(f"{self.engine} answered more than {limit} bytes")

    async def first_chunk(self) -> bytes:
        """The first piece of the body as soon as it arrives; ``b""`` for an empty body."""
        try:
            return await self._response.content.readany()
        except _TRANSPORT_ERRORS as exc:
            raise self._broken(exc) from exc

    async def chunks(self, idle_timeout_s: float | None = None) -> AsyncGenerator[bytes]:
        """The rest of the body as it arrives, chunk by chunk; fails when a read waits
        ``idle_timeout_s`` for a byte (None: no limit)."""
        content = self._response.content
        if idle_timeout_s is None:
            try:
                async for chunk in content.iter_any():
                    yield chunk
            except _TRANSPORT_ERRORS as exc:
                raise self._broken(exc) from exc
            return
        if self._idle is None:
            self._idle = IdleWatches()
        loop = asyncio.get_running_loop()
        watch = self._idle.watch(idle_timeout_s, self._response.close)
        try:
            while True:
                watch.since = loop.time()
                chunk = await content.readany()
                watch.since = None
                if not chunk:
                    return
                yield chunk
        except _TRANSPORT_ERRORS as exc:
            raise self._broken(TimeoutError() if watch.fired else exc) from exc
        finally:
            watch.stop()

    def close(self) -> None:
        """Drop the connection (an answer not read to its end cannot be reused)."""
        self._response.close()

    def _broken(self, exc: BaseException) -> EngineStreamBroken:
        if isinstance(exc, TimeoutError):
            return EngineStreamIdle(
                f"{self.engine} broke the stream: no data within the idle timeout"
            )
        return EngineStreamBroken(f"{self.engine} broke the stream: {_describe(exc)}")


class IdleWatches:
    """Engine answers being read, each closed once a read of it has waited its timeout for
    data, under one timer per timeout (``IdleQueue``) rather than one per stream (memory per
    open stream, bench/stream_memory.py). One per ``HttpClient``; a stream's timeout is the one
    setting, so there is one queue, bounded by the settings' values."""

    __slots__ = ("_queues",)

    def __init__(self) -> None:
        self._queues: dict[float, IdleQueue] = {}

    def watch(self, seconds: float, close: Callable[[], None]) -> IdleWatch:
        """A watch for one answer's reads, until its ``stop()``."""
        queue = self._queues.get(seconds)
        if queue is None:
            queue = self._queues[seconds] = IdleQueue(seconds, asyncio.get_running_loop())
        watch = IdleWatch(queue, close)
        queue.add(watch)
        return watch


class IdleQueue:
    """The watches of one timeout, under one timer set for the earliest moment a pending read
    can have waited the timeout; when it fires it closes the reads that have, and is set again
    for the next earliest. A reader only stamps ``since`` around each read (as cheap per chunk
    as a timer of its own was): a read that starts later is due later than the timer, never
    earlier, so the timer is exact. A sweep visits every watch, and happens about once per
    timeout while the streams flow."""

    __slots__ = ("_loop", "_seconds", "_timer", "_watches")

    def __init__(self, seconds: float, loop: asyncio.AbstractEventLoop) -> None:
        self._seconds = seconds
        self._loop = loop
        self._watches: set[IdleWatch] = set()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, watch: IdleWatch) -> None:
        self._watches.add(watch)
        if self._timer is None:
            self._timer = self._loop.call_at(self._loop.time() + self._seconds, self._sweep)

    def remove(self, watch: IdleWatch) -> None:
        self._watches.discard(watch)  # the timer stays: it finds nothing due and stops

    def _sweep(self) -> None:
        self._timer = None
        seconds = self._seconds
        now = self._loop.time()
        earliest = now + seconds  # a read starting from now on is due no earlier
        late = []
        for watch in self._watches:
            since = watch.since
            if since is None:
                continue
            if now - since >= seconds:
                late.append(watch)
            elif since + seconds < earliest:
                earliest = since + seconds
        for watch in late:
            self._watches.discard(watch)
            watch.expire()
        if self._watches:
            self._timer = self._loop.call_at(earliest, self._sweep)


class IdleWatch:
    """One answer's reads: its reader sets ``since`` (loop time) when a read starts and None
    when it ends. A read that waits the queue's timeout closes the answer (the pending read
    fails) and sets ``fired``. Only time spent waiting for the engine counts, not time the
    caller spends writing what it read."""

    __slots__ = ("_close", "_queue", "fired", "since")

    def __init__(self, queue: IdleQueue, close: Callable[[], None]) -> None:
        self._queue = queue
        self._close = close
        self.fired = False
        self.since: float | None = None

    def stop(self) -> None:
        self._queue.remove(self)

    def expire(self) -> None:
        self.fired = True
        self._close()


class HttpClient:
    """One keep-alive pool, and the boundary where aiohttp's and asyncio's exceptions become the
    sidecar's own: the engines' pools (``Engines``) and the Kubernetes API's
    (``sidecar.security.kube``).

    ``https://`` URLs are verified with ``tls(url)``'s context (asked at each request: a
    watched CA bundle may be replaced, and the engines' stages differ; None: the system's CAs).
    """

    __slots__ = (
        "_headers",
        "_idle",
        "_keepalive_s",
        "_limit",
        "_limit_per_host",
        "_session",
        "_timeouts",
        "_tls",
        "connect_timeout_s",
    )

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        keepalive_s: float = ENGINE_KEEPALIVE_S,
        limit: int = 100,
        limit_per_host: int = 0,
        tls: Callable[[str], ssl.SSLContext] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """``limit``, ``limit_per_host``: connections at most (0: no cap; 100 in all is
        aiohttp's default)."""
        self.connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._limit = limit
        self._limit_per_host = limit_per_host
        self._tls = tls
        self._headers = headers
        self._idle = IdleWatches()
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: BoundedCache[float | None, aiohttp.ClientTimeout] = BoundedCache(
            _TIMEOUTS_KEPT
        )
        """One ``ClientTimeout`` per ``total_s`` asked for (immutable, so shared)."""

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self._limit,
                limit_per_host=self._limit_per_host,
                keepalive_timeout=self._keepalive_s,
                enable_cleanup_closed=True,
            ),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
            headers=self._headers,
            auto_decompress=False,  # relay bytes as the engine wrote them
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self,
        method: str,
        url: str,
        *,
        headers: CIMultiDict[str] | Mapping[str, str],
        data: Body = None,
        total_s: float | None = None,
        role: str = "engine",
        server_name: str | None = None,
    ) -> EngineAnswer:
        """Send a request and return once the status line and headers are in.

        ``total_s`` bounds the whole exchange, body included (None: no bound here; callers
        bound the wait with their own deadlines). Connecting is bounded by the connect timeout.
        ``url`` is sent as written: its path is the canonical one the request was routed on
        (``sidecar.paths``), which yarl would otherwise re-normalise (resolving dot segments,
        decoding escapes such as ``%3B``). ``role`` names the engine in error messages ("the
        decode engine"). ``server_name``: for ``https://``, the name the certificate is
        verified against and sent as SNI (None: the URL's host).
        """
        session = self._session
        if session is None:
            raise RuntimeError("open() was not awaited")
        if isinstance(data, bytes) and len(data) > _LARGE_BODY:
            data = Pieces((data,))
        payload: aiohttp.payload.Payload | bytes | None
        if isinstance(data, Pieces):
            payload = _PiecesPayload(data)
        elif isinstance(data, Streamed):
            payload = _StreamedPayload(data)
        else:
            payload = data
        timeout = self._timeout(total_s)
        tls: dict[str, Any] = {}
        if url.startswith("https://"):
            if self._tls is not None:
                tls["ssl"] = self._tls(url)
            if server_name is not None:
                tls["server_hostname"] = server_name
        name = _engine_name(url)
        try:
            response = await session.request(
                method,
                URL(url, encoded=True),
                headers=headers,
                data=payload,
                allow_redirects=False,
                timeout=timeout,
                **tls,
            )
        except aiohttp.ClientConnectorCertificateError as exc:
            raise EngineUntrusted(
                f"the certificate of {role} at {name} did not verify: "
                f"{_certificate_problem(exc, server_name)}"
            ) from exc
        except _TRANSPORT_ERRORS as exc:
            raise _translate(exc, f"{role} at {name} is unreachable") from exc
        return EngineAnswer(response, name, self._idle)

    def _timeout(self, total_s: float | None) -> aiohttp.ClientTimeout:
        # The settings give a few values; a deadline-bounded prefill gives a new one per
        # request, which pushes the oldest out.
        timeout = self._timeouts.get(total_s)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=total_s, sock_connect=self.connect_timeout_s)
            self._timeouts.put(total_s, timeout)
        return timeout


class ClientContexts(Protocol):
    """The TLS contexts of engine connections (``sidecar.security.tls.ClientTls``)."""

    def context(self, insecure: bool) -> ssl.SSLContext:
        """The context of a stage that skips verification (``insecure``) or verifies."""
        ...


class Engines:
    """HTTP access to the engines: one keep-alive pool for requests (``requests``), one small one
    for health and metrics polls (``polls``).

    Health and metrics polls have a pool of their own: going through the request pool, a poll
    every second or two would reuse its idle connections in turn and keep every one of them
    alive, so the pool would never shrink back after a burst.

    ``https://`` URLs are verified with ``tls`` (``sidecar.security.tls.ClientTls``; None: the
    system's CAs). Prefill engines are named by ``host:port`` alone: ``prefill_url`` gives them the
    scheme ``SIDECAR_PREFILL_TLS`` says, and ``prefill_server_name`` the name their certificate is
    checked against.

    Verification is skipped per stage: for the decode ranks (``decode_urls``) when
    ``decode_insecure``, for any other engine (the prefill engines) when ``prefill_insecure``.
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        keepalive_s: float = ENGINE_KEEPALIVE_S,
        tls: ClientContexts | None = None,
        prefill_tls: bool = False,
        prefill_server_name: str | None = None,
        decode_urls: Sequence[str] = (),
        prefill_insecure: bool = False,
        decode_insecure: bool = False,
    ) -> None:
        self._prefill_scheme = "https" if prefill_tls else "http"
        self._prefill_server_name = prefill_server_name
        decode_origins = frozenset(_origin(url) for url in decode_urls)

        def insecure(url: str) -> bool:
            return decode_insecure if _origin(url) in decode_origins else prefill_insecure

        context = None if tls is None else (lambda url: tls.context(insecure(url)))
        # In-flight requests bound the connections; a cap here would queue silently.
        self.requests = HttpClient(
            connect_timeout_s=connect_timeout_s, keepalive_s=keepalive_s, limit=0, tls=context
        )
        self.polls = HttpClient(
            connect_timeout_s=connect_timeout_s,
            keepalive_s=keepalive_s,
            limit_per_host=POLL_CONNECTIONS_PER_ENGINE,
            tls=context,
        )

    def prefill_url(self, endpoint: Endpoint) -> str:
        """The base URL of a prefill engine."""
        return f"{self._prefill_scheme}://{endpoint}"

    def prefill_server_name(self, endpoint: Endpoint) -> str | None:
        """The name a prefill engine's certificate must carry (and its SNI): the configured one,
        else the host name the endpoint was pinned from (``sidecar.security.trust``), else None —
        the URL's host itself, a name or an IP address."""
        if self._prefill_scheme != "https":
            return None
        return self._prefill_server_name or endpoint.tls_name

    async def open(self) -> None:
        await self.requests.open()
        await self.polls.open()

    async def close(self) -> None:
        await self.requests.close()
        await self.polls.close()


_TIMEOUTS_KEPT = 16


def _translate(exc: BaseException, what: str) -> EngineError:
    """A connect timeout means unreachable; any other timeout, too slow. A connection that was
    never opened means nothing was sent."""
    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
        return EngineTimeout(f"{what}: timed out")
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(
        exc.os_error, ConnectionRefusedError
    ):
        return EngineRefused(f"{what}: {_describe(exc)}")
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return EngineConnectTimeout(f"{what}: no connection within SIDECAR_CONNECT_TIMEOUT_S")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return EngineNotConnected(f"{what}: {_describe(exc)}")
    return EngineUnreachable(f"{what}: {_describe(exc)}")


def _certificate_problem(
    exc: aiohttp.ClientConnectorCertificateError, server_name: str | None
) -> str:
    error = exc.certificate_error
    reason = getattr(error, "verify_message", None) or str(error)
    reason = str(reason).rstrip(".")
    if server_name and server_name not in reason:
        return f"{reason} (verified as {server_name})"
    return reason


def parse_json(body: bytes, what: str) -> object:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise EngineBadResponse(f"{what} answered with invalid JSON") from exc


def _origin(url: str) -> str:
    """``scheme://host:port`` of an engine URL."""
    return "/".join(url.split("/", 3)[:3])


def _engine_name(url: str) -> str:
    return url.split("/", 3)[2] if "://" in url else url


def _describe(exc: BaseException) -> str:
    """A short reason for people, not aiohttp's wording."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        # getaddrinfo's errors are not errno values: os.strerror(-2) says "unknown error -2".
        reason = exc.os_error.strerror or str(exc.os_error)
        return f"the name {exc.host} did not resolve ({reason})"
    if isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno:
        return os.strerror(exc.os_error.errno).lower()  # e.g. "connection refused"
    if isinstance(exc, aiohttp.ClientConnectorSSLError):
        return f"the TLS handshake failed ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the connection was closed without an answer"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
