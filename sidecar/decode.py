"""The decode send: a shared part of every connector.

Sends one body to the local decode engine and returns once the engine's answer has started —
status line, headers and the first body byte — so that a connector knows, when ``send`` returns,
whether the engine took the request (and, for KV-pulling protocols, the KV) or refused it. The
wait is bounded by ``SIDECAR_DECODE_FIRST_BYTE_TIMEOUT_S`` and the request's deadline (504).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from sidecar.config import Settings
from sidecar.errors import EngineTimeout
from sidecar.exchange import Answer, Exchange, Patch
from sidecar.upstream import Body, EngineAnswer, Engines


class DecodeSend:
    def __init__(self, settings: Settings, *, engines: Engines) -> None:
        self._url = settings.decode_url
        self._first_byte_timeout_s = settings.decode_first_byte_timeout_s
        self._engines = engines

    @property
    def url(self) -> str:
        return self._url

    async def send(self, ex: Exchange, data: bytes, patch: Patch | None = None) -> Answer:
        ex.progress.decode_sent()
        loop = asyncio.get_running_loop()
        by = loop.time() + self._first_byte_timeout_s
        if ex.deadline is not None:
            by = min(by, ex.deadline)
        upstream, first = await started(
            self._engines,
            "POST",
            self._url + ex.path,
            headers=ex.headers,
            data=data,
            by=by,
            limit=f"{self._first_byte_timeout_s:g}s "
            "(SIDECAR_DECODE_FIRST_BYTE_TIMEOUT_S or SIDECAR_REQUEST_TIMEOUT_S)",
        )
        ex.progress.first_byte()
        return Answer(upstream, first, patch)


async def started(
    engines: Engines,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    data: Body,
    by: float,
    limit: str,
) -> tuple[EngineAnswer, bytes]:
    """Send to the decode engine; its answer and first body chunk by loop time ``by``, else
    ``EngineTimeout`` naming ``limit`` (the time and the setting that set it)."""
    try:
        async with asyncio.timeout_at(by):
            upstream = await engines.send(
                method, url, headers=headers, data=data, role="the decode engine"
            )
            try:
                first = await upstream.first_chunk()
            except BaseException:
                upstream.close()
                raise
    except TimeoutError:
        raise EngineTimeout(f"the decode engine sent nothing within {limit}") from None
    return upstream, first
