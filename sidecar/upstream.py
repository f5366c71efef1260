"""Engine clients: pooled keep-alive sessions, and the one boundary where aiohttp and asyncio
exceptions become the sidecar's own (``sidecar.errors``)."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from sidecar.errors import (
    EngineBadResponse,
    EngineError,
    EngineStreamBroken,
    EngineTimeout,
    EngineUnreachable,
)

# The exceptions an engine call can raise on its way to a response or through its body.
_TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)
# aiohttp writes a bytes body in one go (and warns above 1 MiB); a BytesIO goes out in slices
# that yield to the event loop between them, so a long prompt does not stall other streams.
_LARGE_BODY = 1 << 20


class Engines:
    """HTTP access to the engines: one keep-alive pool for requests, one small one for polls.

    Health and metrics polls have a pool of their own: going through the request pool, a poll
    every second or two would reuse its idle connections in turn and keep every one of them
    alive, so the pool would never shrink back after a burst.
    """

    def __init__(self, *, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._polls: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self._session = self._new_session(
            # In-flight requests bound the connections; a cap here would queue silently.
            aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True)
        )
        self._polls = self._new_session(
            aiohttp.TCPConnector(limit_per_host=2, keepalive_timeout=30, enable_cleanup_closed=True)
        )

    def _new_session(self, connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s),
            auto_decompress=False,  # relay bytes as the engine wrote them
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        for session in (self._session, self._polls):
            if session is not None:
                await session.close()
        self._session = self._polls = None

    def _pick(self, poll: bool) -> aiohttp.ClientSession:
        session = self._polls if poll else self._session
        if session is None:
            raise RuntimeError("Engines.open() was not awaited")
        return session

    async def send(
        self,
        method: str,
        url: str,
        *,
        headers: CIMultiDict[str] | Mapping[str, str],
        data: bytes | io.BytesIO | AsyncIterable[bytes] | None = None,
        client_timeout: aiohttp.ClientTimeout | None = None,
        role: str = "engine",
        poll: bool = False,
    ) -> aiohttp.ClientResponse:
        """Send a request; the caller owns the response (``release()`` or ``close()`` it).

        ``role`` names the engine in error messages ("the decode engine"); ``poll`` sends a
        health or metrics poll through the poll pool.
        """
        session = self._pick(poll)
        if isinstance(data, bytes) and len(data) > _LARGE_BODY:
            data = io.BytesIO(data)
        try:
            if client_timeout is None:
                return await session.request(
                    method, url, headers=headers, data=data, allow_redirects=False
                )
            return await session.request(
                method,
                url,
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=client_timeout,
            )
        except _TRANSPORT_ERRORS as exc:
            raise _translate(exc, f"{role} at {_engine_name(url)} is unreachable") from exc


async def read_body(response: aiohttp.ClientResponse) -> bytes:
    """The whole body of a (small, non-streamed) engine answer."""
    try:
        return await response.read()
    except _TRANSPORT_ERRORS as exc:
        raise _translate(exc, f"{_engine_name(str(response.url))} broke its answer") from exc
    finally:
        response.release()


def set_idle_timeout(response: aiohttp.ClientResponse, seconds: float) -> None:
    """From now on, fail the body when no byte arrives for ``seconds``.

    aiohttp's ``sock_read`` would also bound the wait for the first byte, which has its own,
    usually longer, limit; so the per-read timer is armed only once the first byte is in.
    """
    connection = response.connection
    if connection is not None and connection.protocol is not None:
        connection.protocol.read_timeout = seconds
        connection.protocol.start_timeout()


def _translate(exc: BaseException, what: str) -> EngineError:
    """A connect timeout means unreachable; any other timeout, too slow."""
    if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
        return EngineTimeout(f"{what}: timed out")
    return EngineUnreachable(f"{what}: {_describe(exc)}")


def parse_json(body: bytes, what: str) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise EngineBadResponse(f"{what} answered with invalid JSON") from exc


async def chunks(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body as it arrives, chunk by chunk, without waiting for more."""
    try:
        async for chunk in response.content.iter_any():
            yield chunk
    except _TRANSPORT_ERRORS as exc:
        detail = "no data within the idle timeout" if isinstance(exc, TimeoutError) else None
        raise EngineStreamBroken(
            f"{_engine_name(str(response.url))} broke the stream: {detail or _describe(exc)}"
        ) from exc


def _engine_name(url: str) -> str:
    return url.split("/", 3)[2] if "://" in url else url


def _describe(exc: BaseException) -> str:
    """A short reason for people, not aiohttp's wording."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno:
        return os.strerror(exc.os_error.errno).lower()  # e.g. "connection refused"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the connection was closed without an answer"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
