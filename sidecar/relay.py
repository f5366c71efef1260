"""Engine answer → client, as it arrives.

The body is relayed byte for byte, one write per chunk the engine sent, with no parsing — except
when the prefill reported ``usage.prompt_tokens_details.cached_tokens``: the decode engine counts
all pulled KV as cached, so its figure is replaced by the prefill's (llm-d #916). Only the events or
the JSON body that carry the field are parsed then.

Once the status line went out it cannot change: a broken engine stream ends an SSE answer with an
error event (no ``[DONE]``) and truncates any other answer by closing the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from sidecar.errors import (
    REQUEST_ID_HEADER,
    EngineStreamBroken,
    EngineTimeout,
    SidecarError,
    sse_error_event,
)
from sidecar.headers import client_response_headers
from sidecar.tracking import Phase, RequestRecord, State
from sidecar.upstream import chunks, read_body, set_idle_timeout

_CACHED_TOKENS = b'"cached_tokens"'
_EVENT_END = b"\n\n"
_SSE = "text/event-stream"


async def relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    record: RequestRecord,
    *,
    request_id: str | None,
    cached_tokens: int | None,
    on_first_byte: Callable[[], None] | None = None,
    first_byte_by: float | None = None,
    idle_timeout_s: float | None = None,
    deadline: float | None = None,
) -> web.StreamResponse:
    """Write ``upstream`` to the client; the caller closes ``upstream`` whatever happens.

    Until the engine's first body byte nothing is sent, so a failure up to then (``EngineTimeout``
    past ``first_byte_by``, a broken answer) still gets a proper error status. After it, a
    stream the engine breaks, or that stays silent for ``idle_timeout_s``, or that outlives
    ``deadline`` (loop time), is recorded as failed on ``record`` and ended as the module
    docstring says. A client that disconnects mid-answer leaves ``record`` cancelled (usually
    the handler is cancelled first; a failed write is the other way to notice).
    """
    headers = client_response_headers(upstream.headers)
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    rewrite = cached_tokens is not None and "content-encoding" not in upstream.headers
    is_sse = upstream.content_type == _SSE
    source = chunks(upstream)
    try:
        async with asyncio.timeout_at(first_byte_by):
            if rewrite and upstream.content_type == "application/json":
                whole = _rewrite_json(await read_body(upstream), cached_tokens)
                record.mark(Phase.FIRST_BYTE)
                if on_first_byte is not None:
                    on_first_byte()
                return web.Response(status=upstream.status, headers=headers, body=whole)
            first = await anext(source, b"")
    except TimeoutError:
        raise EngineTimeout("the engine sent no answer within its first-byte timeout") from None
    record.mark(Phase.FIRST_BYTE)
    if on_first_byte is not None:
        on_first_byte()
    if idle_timeout_s:
        set_idle_timeout(upstream, idle_timeout_s)

    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        upstream.close()  # the pending read fails: the loop below ends the stream

    timer = asyncio.get_running_loop().call_at(deadline, expire) if deadline else None
    out = web.StreamResponse(status=upstream.status, headers=headers)
    if not rewrite and upstream.content_length is not None:
        out.content_length = upstream.content_length
    rewriter = _EventRewriter(cached_tokens) if rewrite and is_sse else None
    try:
        await out.prepare(request)
        try:
            if rewriter is None:
                await out.write(first)
                async for chunk in source:
                    await out.write(chunk)
            else:
                await out.write(rewriter.feed(first))
                async for chunk in source:
                    await out.write(rewriter.feed(chunk))
                await out.write(rewriter.rest())
        except EngineStreamBroken as broken:
            error: SidecarError = broken
            if expired:
                error = EngineTimeout("the request exceeded SIDECAR_REQUEST_TIMEOUT_S")
            record.state = State.FAILED
            record.error = error.message
            if not is_sse:
                # Nothing but the connection itself can mark a truncated body as broken.
                if request.transport is not None:
                    request.transport.close()
                return out
            # The engine may have broken off mid-event: a blank line first ends whatever was
            # pending (SSE ignores empty events), so the error event always parses. An event
            # the rewriter still holds is incomplete and is dropped.
            await out.write(_EVENT_END + sse_error_event(error))
        await out.write_eof()
    except ConnectionResetError:
        record.state = State.CANCELLED
    finally:
        if timer is not None:
            timer.cancel()
    return out


def _rewrite_json(body: bytes, cached_tokens: int | None) -> bytes:
    if _CACHED_TOKENS not in body:
        return body
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    return orjson.dumps(answer) if _replace_cached(answer, cached_tokens) else body


def _replace_cached(answer: Any, cached_tokens: int | None) -> bool:
    """Set ``usage.prompt_tokens_details.cached_tokens`` where the engine reported it."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict) or "cached_tokens" not in details:
        return False
    details["cached_tokens"] = cached_tokens
    return True


class _EventRewriter:
    """Rewrites ``cached_tokens`` in SSE events; events without the field pass untouched.

    Holds back only an incomplete trailing event (engines write whole events per chunk, so in
    practice nothing waits), never an event the engine already finished.
    """

    def __init__(self, cached_tokens: int | None) -> None:
        self._cached_tokens = cached_tokens
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(_EVENT_END)
        if cut < 0:
            self._pending = data
            return b""
        cut += len(_EVENT_END)
        self._pending = data[cut:]
        complete = data[:cut]
        if _CACHED_TOKENS not in complete:
            return complete
        return b"".join(self._rewrite_event(event) for event in complete.split(_EVENT_END)[:-1])

    def rest(self) -> bytes:
        data, self._pending = self._pending, b""
        return data

    def _rewrite_event(self, event: bytes) -> bytes:
        if _CACHED_TOKENS in event:
            lines = event.split(b"\n")
            for index, line in enumerate(lines):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    try:
                        answer = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        continue
                    if _replace_cached(answer, self._cached_tokens):
                        lines[index] = b"data: " + orjson.dumps(answer)
            event = b"\n".join(lines)
        return event + _EVENT_END
