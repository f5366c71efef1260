"""A small client of the Kubernetes API: GET (one object or a list) and watch, with the pod's
service-account credentials.

In a pod, the API is at ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``
(``sidecar.config`` resolves it), its CA at ``.../serviceaccount/ca.crt`` and the bearer token at
``.../serviceaccount/token``. Bound tokens rotate (the kubelet rewrites the file well before they
expire), so the token is read again once it is ``TOKEN_MAX_AGE_S`` old, and at once after a
``401``. Files are read in a worker thread: the event loop never waits for a disk.

A watch is one long ``GET ...?watch=true`` whose chunked body carries one JSON event per line,
``{"type": "ADDED" | "MODIFIED" | "DELETED" | "BOOKMARK" | "ERROR", "object": {...}}``. The API
ends it by itself after ``timeoutSeconds``; a ``resourceVersion`` it no longer has is answered by
an ``ERROR`` event (or a ``410``) with code 410: ``KubeGone``, the caller lists again.

Every failure becomes one of this module's errors, whose ``kind`` is a metric label.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

logger = logging.getLogger("sidecar.kube")

TOKEN_MAX_AGE_S = 60.0
"""The token file is read again when the copy in memory is this old."""
MAX_EVENT_BYTES = 8 << 20
"""Longest watch event (one line) accepted; a longer one ends the watch as ``KubeBadResponse``."""
REQUEST_TIMEOUT_S = 30.0
"""Longest GET (a list of a few thousand pods is well within it)."""
WATCH_READ_MARGIN_S = 30.0
"""A watch silent this long past its ``timeoutSeconds`` is taken for a dead connection."""


class KubeError(Exception):
    kind = "unreachable"
    """The label of ``pd_sidecar_inference_pool_errors_total``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class KubeUnreachable(KubeError):
    """No answer: connection refused or reset, timed out, the stream broke."""


class KubeRefused(KubeError):
    """The API answered with an error (401, 403, 404, 5xx) or an ``ERROR`` event."""

    kind = "refused"

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class KubeGone(KubeError):
    """410: the resource version asked for is too old; list again."""

    kind = "expired"


class KubeBadResponse(KubeError):
    """An answer that is not what the API sends (not JSON, no items, a line too long)."""

    kind = "invalid"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: str
    object: dict[str, Any]


class KubeClient:
    def __init__(
        self,
        base_url: str,
        *,
        token_file: str,
        ca_file: str,
        connect_timeout_s: float,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token_file = token_file
        self._ca_file = ca_file
        self._connect_timeout_s = connect_timeout_s
        self._token: str | None = None
        self._token_read_at = float("-inf")
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        context: ssl.SSLContext | bool = True
        if self.base_url.startswith("https://"):
            context = await asyncio.to_thread(self._ssl_context)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context, limit=4, enable_cleanup_closed=True),
            headers={"Accept": "application/json"},
        )

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        try:
            context.load_verify_locations(cafile=self._ca_file)
        except FileNotFoundError:
            logger.warning("no CA file at %s: the API's certificate is verified with the "
                           "system's CAs", self._ca_file)  # fmt: skip
        return context

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _headers(self) -> dict[str, str]:
        now = time.monotonic()
        if now - self._token_read_at >= TOKEN_MAX_AGE_S:
            self._token = await asyncio.to_thread(_read_token, self._token_file)
            self._token_read_at = now
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def _forget_token(self) -> None:
        self._token_read_at = float("-inf")

    async def _open(
        self, path: str, params: Mapping[str, str], limits: aiohttp.ClientTimeout
    ) -> aiohttp.ClientResponse:
        """The answer's status line is in and is 200; otherwise the matching error. A 401 is
        tried once more with the token read again (it may just have been rotated)."""
        if self._session is None:
            raise RuntimeError("KubeClient.open() was not awaited")
        url = self.base_url + path
        for attempt in (1, 2):
            try:
                response = await self._session.get(
                    url, params=params, headers=await self._headers(), timeout=limits
                )
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise KubeUnreachable(
                    f"the Kubernetes API at {self.base_url}: {_describe(exc)}"
                ) from exc
            if response.status == 200:
                return response
            body = await _read_small(response)
            if response.status == 401 and attempt == 1:
                self._forget_token()
                continue
            raise _status_error(response.status, body, path, self._token_file)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One object or a list, as JSON."""
        timeout = aiohttp.ClientTimeout(
            total=REQUEST_TIMEOUT_S, sock_connect=self._connect_timeout_s
        )
        response = await self._open(path, params or {}, timeout)
        try:
            body = await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise KubeUnreachable(f"the Kubernetes API broke its answer: {_describe(exc)}") from exc
        finally:
            response.release()
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise KubeBadResponse(f"GET {path}: the answer is not JSON") from None
        if not isinstance(answer, dict):
            raise KubeBadResponse(f"GET {path}: the answer is not an object")
        return answer

    async def watch(
        self, path: str, params: Mapping[str, str], *, timeout_s: float
    ) -> AsyncGenerator[WatchEvent]:
        """Events of a watch from ``params["resourceVersion"]`` on, until the API ends it (about
        ``timeout_s``); ``KubeGone`` for a 410, ``KubeRefused`` for another ``ERROR`` event."""
        query = {**params, "watch": "true", "timeoutSeconds": str(max(1, round(timeout_s)))}
        limits = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self._connect_timeout_s,
            sock_read=timeout_s + WATCH_READ_MARGIN_S,
        )
        response = await self._open(path, query, limits)
        try:
            buffered = bytearray()
            while True:
                try:
                    chunk = await response.content.readany()
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    raise KubeUnreachable(f"the watch of {path} broke: {_describe(exc)}") from exc
                if not chunk:
                    return  # the API ended the watch
                searched = len(buffered)
                buffered += chunk
                end = buffered.find(b"\n", searched)
                while end >= 0:
                    line = bytes(buffered[:end])
                    del buffered[: end + 1]
                    if line.strip():
                        yield _event(line, path)
                    end = buffered.find(b"\n")
                if len(buffered) > MAX_EVENT_BYTES:
                    raise KubeBadResponse(f"the watch of {path} sent an event over 8 MiB")
        finally:
            response.close()


def _read_token(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


async def _read_small(response: aiohttp.ClientResponse) -> bytes:
    try:
        return (await response.content.read(4096))[:4096]
    except (aiohttp.ClientError, TimeoutError, OSError):
        return b""
    finally:
        response.release()


def _status_error(status: int, body: bytes, path: str, token_file: str) -> KubeError:
    message = _status_message(body) or f"answered {status}"
    if status == 410:
        return KubeGone(f"GET {path}: {message}")
    if status == 401:
        message += f" (the token is read from {token_file})"
    return KubeRefused(f"GET {path}: {status}: {message}", status)


def _status_message(body: bytes) -> str | None:
    """The ``message`` of a ``Status`` object, the API's error body."""
    try:
        status = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    message = status.get("message") if isinstance(status, dict) else None
    return str(message) if message else None


def _event(line: bytes, path: str) -> WatchEvent:
    try:
        event = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise KubeBadResponse(f"the watch of {path} sent a line that is not JSON") from None
    kind = event.get("type") if isinstance(event, dict) else None
    obj = event.get("object") if isinstance(event, dict) else None
    if not isinstance(kind, str) or not isinstance(obj, dict):
        raise KubeBadResponse(f"the watch of {path} sent an event without type or object")
    if kind == "ERROR":
        code = obj.get("code")
        message = f"the watch of {path} ended with an error: {obj.get('message') or code}"
        if code == 410:
            raise KubeGone(message)
        raise KubeRefused(message, code if isinstance(code, int) else 500)
    return WatchEvent(kind, obj)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError) and exc.os_error.errno:
        return os.strerror(exc.os_error.errno).lower()  # e.g. "connection refused"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
