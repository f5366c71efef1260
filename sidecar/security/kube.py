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
import contextlib
import logging
import ssl
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from yarl import URL

from sidecar.engines.upstream import EngineAnswer, HttpClient
from sidecar.errors import EngineError

logger = logging.getLogger("sidecar.security.kube")

TOKEN_MAX_AGE_S = 60.0
"""The token file is read again when the copy in memory is this old."""
MAX_EVENT_BYTES = 8 << 20
"""Longest watch event (one line) accepted; a longer one ends the watch as ``KubeBadResponse``."""
REQUEST_TIMEOUT_S = 30.0
"""Longest GET (a list of a few thousand pods is well within it)."""
WATCH_READ_MARGIN_S = 30.0
"""A watch silent this long past its ``timeoutSeconds`` is taken for a dead connection."""
_API = "the Kubernetes API"
"""Who answers, in error messages."""


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
    """The API's client, on the engines' HTTP boundary (``sidecar.engines.upstream.HttpClient``):
    its errors arrive as the sidecar's own, and become this module's here."""

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
        self._http: HttpClient | None = None

    async def open(self) -> None:
        context: ssl.SSLContext | None = None
        if self.base_url.startswith("https://"):
            context = await asyncio.to_thread(self._ssl_context)
        self._http = HttpClient(
            connect_timeout_s=self._connect_timeout_s,
            limit=4,
            tls=None if context is None else (lambda _url: context),
            headers={"Accept": "application/json"},
        )
        await self._http.open()

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        try:
            context.load_verify_locations(cafile=self._ca_file)
        except FileNotFoundError:
            logger.warning("no CA file at %s: the API's certificate is verified with the "
                           "system's CAs", self._ca_file)  # fmt: skip
        return context

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _headers(self) -> dict[str, str]:
        now = time.monotonic()
        if now - self._token_read_at >= TOKEN_MAX_AGE_S:
            self._token = await asyncio.to_thread(_read_token, self._token_file)
            self._token_read_at = now
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def _forget_token(self) -> None:
        self._token_read_at = float("-inf")

    async def _open(
        self, path: str, params: Mapping[str, str], total_s: float | None
    ) -> EngineAnswer:
        """The answer's status line is in and is 200; otherwise the matching error. A 401 is
        tried once more with the token read again (it may just have been rotated)."""
        if self._http is None:
            raise RuntimeError("KubeClient.open() was not awaited")
        url = str(URL(self.base_url + path).with_query(params))
        for attempt in (1, 2):
            try:
                answer = await self._http.send(
                    "GET", url, headers=await self._headers(), total_s=total_s, role=_API
                )
            except EngineError as exc:
                raise KubeUnreachable(exc.message) from exc
            if answer.status == 200:
                return answer
            body = await _read_small(answer)
            if answer.status == 401 and attempt == 1:
                self._forget_token()
                continue
            raise _status_error(answer.status, body, path, self._token_file)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One object or a list, as JSON."""
        answer = await self._open(path, params or {}, REQUEST_TIMEOUT_S)
        try:
            body = await answer.read()
        except EngineError as exc:
            raise KubeUnreachable(exc.message) from exc
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise KubeBadResponse(f"GET {path}: the answer is not JSON") from None
        if not isinstance(parsed, dict):
            raise KubeBadResponse(f"GET {path}: the answer is not an object")
        return parsed

    async def watch(
        self, path: str, params: Mapping[str, str], *, timeout_s: float
    ) -> AsyncGenerator[WatchEvent]:
        """Events of a watch from ``params["resourceVersion"]`` on, until the API ends it (about
        ``timeout_s``); ``KubeGone`` for a 410, ``KubeRefused`` for another ``ERROR`` event."""
        query = {**params, "watch": "true", "timeoutSeconds": str(max(1, round(timeout_s)))}
        answer = await self._open(path, query, None)
        idle_s = timeout_s + WATCH_READ_MARGIN_S
        try:
            async with contextlib.aclosing(answer.chunks(idle_timeout_s=idle_s)) as chunks:
                buffered = bytearray()
                while True:
                    try:
                        chunk = await anext(chunks, b"")
                    except EngineError as exc:
                        raise KubeUnreachable(f"the watch of {path}: {exc.message}") from exc
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
            answer.close()


def _read_token(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


async def _read_small(answer: EngineAnswer) -> bytes:
    """An error answer's body, for its message: at most 4 KiB, else nothing."""
    try:
        return await answer.read(4096)
    except EngineError:
        return b""


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
