"""An engine's started answer → the client, as it arrives.

The body is relayed byte for byte, one write per chunk the engine sent, with no parsing — except
where the connector asked for a ``Patch`` (e.g. the prefill's ``cached_tokens``): then the JSON
body, or the SSE events whose bytes hold the patch's marker, are parsed and rewritten.

Once the status line went out it cannot change: a broken engine stream ends an SSE answer with an
error event (no ``[DONE]``) and truncates any other answer by closing the connection. The relay
reports what happened (``Relayed``); it writes no record.

A client that leaves mid-answer ends the relay either way: a write that fails returns
``client_gone``, and aiohttp's handler cancellation raises ``CancelledError`` in the relay. The
handler records both as ``cancelled`` and closes the engine's answer; what becomes of the engine
work before the answer started is ``sidecar.connectors.disconnect``'s to decide.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from sidecar.connectors.exchange import Answer, Patch
from sidecar.errors import (
    REQUEST_ID_HEADER,
    EngineStreamBroken,
    EngineTimeout,
    SidecarError,
    sse_error_event,
)
from sidecar.headers import client_response_headers

_EVENT_END = b"\n\n"
_SSE = "text/event-stream"


@dataclass(frozen=True, slots=True)
class Relayed:
    response: web.StreamResponse
    status: int
    """The status the client was sent."""
    error: SidecarError | None = None
    """Why the answer was cut after it started (engine broke it, idle, deadline)."""
    client_gone: bool = False


async def relay(
    request: web.Request,
    answer: Answer,
    *,
    request_id: str | None,
    idle_timeout_s: float | None = None,
    deadline: float | None = None,
    status_sent: Callable[[int], None] | None = None,
) -> Relayed:
    """Write ``answer`` to the client; the caller closes ``answer.upstream`` whatever happens.

    ``status_sent`` is told the status as soon as the status line went out, so that a relay
    cancelled midway (the client left, the drain cut it) is still known to have sent it.

    A JSON body to patch is read whole first, so a failure while reading it (``SidecarError``)
    still gets a proper error status. Otherwise the status line goes out at once, and a stream the
    engine breaks, or that stays silent for ``idle_timeout_s``, or that outlives ``deadline``
    (loop time), ends as the module docstring says.
    """
    upstream = answer.upstream
    headers = client_response_headers(upstream.headers)
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    patch = answer.patch if "content-encoding" not in upstream.headers else None
    is_sse = upstream.content_type == _SSE
    if patch is not None and upstream.content_type == "application/json":
        whole = await _read_rest(answer, idle_timeout_s, deadline)
        body = _patch_json(whole, patch)
        return Relayed(
            web.Response(status=upstream.status, headers=headers, body=body), upstream.status
        )

    if patch is None and not is_sse and upstream.complete:
        # The whole answer came with its first chunk (a non-streamed completion, typically):
        # one response written at once, with no timers, no per-chunk loop.
        response = web.Response(status=upstream.status, headers=headers, body=answer.take_first())
        return Relayed(response, upstream.status)

    # What a stream keeps for its whole life is memory per open stream (bench/stream_memory.py):
    # the response copies the headers (the local copy goes), and the deadline's timer exists
    # only when there is a deadline.
    out = web.StreamResponse(status=upstream.status, headers=headers)
    del headers
    expiry = _Expiry(upstream.close, deadline) if deadline else None
    if patch is None and upstream.content_length is not None:
        out.content_length = upstream.content_length
    rewriter = _EventRewriter(patch) if patch is not None and is_sse else None
    error: SidecarError | None = None
    try:
        await out.prepare(request)
        if status_sent is not None:
            status_sent(upstream.status)
        try:
            async with contextlib.aclosing(upstream.chunks(idle_timeout_s)) as source:
                if rewriter is None:
                    await out.write(answer.take_first())
                    async for chunk in source:
                        await out.write(chunk)
                else:
                    await out.write(rewriter.feed(answer.take_first()))
                    async for chunk in source:
                        await out.write(rewriter.feed(chunk))
                    await out.write(rewriter.rest())
        except EngineStreamBroken as broken:
            error = broken
            if expiry is not None and expiry.fired:
                error = EngineTimeout("the request exceeded SIDECAR_REQUEST_TIMEOUT_S")
            if not is_sse:
                # Nothing but the connection itself can mark a truncated body as broken.
                if request.transport is not None:
                    request.transport.close()
                return Relayed(out, upstream.status, error)
            # The engine may have broken off mid-event: a blank line first ends whatever was
            # pending (SSE ignores empty events), so the error event always parses. An event
            # the rewriter still holds is incomplete and is dropped.
            await out.write(_EVENT_END + sse_error_event(error, request_id))
        await out.write_eof()
    except ConnectionResetError:
        return Relayed(out, upstream.status, error, client_gone=True)
    finally:
        if expiry is not None:
            expiry.cancel()
    return Relayed(out, upstream.status, error)


class _Expiry:
    """Closes the engine's answer at ``deadline`` (loop time): the pending read fails, and the
    relay ends the stream."""

    __slots__ = ("_close", "_timer", "fired")

    def __init__(self, close: Callable[[], None], deadline: float) -> None:
        self._close = close
        self.fired = False
        self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        self.fired = True
        self._close()

    def cancel(self) -> None:
        self._timer.cancel()


async def _read_rest(answer: Answer, idle_timeout_s: float | None, deadline: float | None) -> bytes:
    try:
        if deadline is None:  # no timer to set (SIDECAR_REQUEST_TIMEOUT_S=0, the default)
            return await _joined(answer, idle_timeout_s)
        async with asyncio.timeout_at(deadline):
            return await _joined(answer, idle_timeout_s)
    except TimeoutError:
        raise EngineTimeout("the request exceeded SIDECAR_REQUEST_TIMEOUT_S") from None


async def _joined(answer: Answer, idle_timeout_s: float | None) -> bytes:
    parts = [answer.take_first()]
    async with contextlib.aclosing(answer.upstream.chunks(idle_timeout_s)) as source:
        async for chunk in source:
            parts.append(chunk)
    return b"".join(parts)


def _patch_json(body: bytes, patch: Patch) -> bytes:
    if patch.marker not in body:
        return body
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    return orjson.dumps(answer) if patch.apply(answer) else body


class _EventRewriter:
    """Applies a patch to SSE events; events without its marker pass untouched.

    Holds back only an incomplete trailing event (engines write whole events per chunk, so in
    practice nothing waits), never an event the engine already finished.
    """

    def __init__(self, patch: Patch) -> None:
        self._patch = patch
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
        if self._patch.marker not in complete:
            return complete
        return b"".join(self._rewrite_event(event) for event in complete.split(_EVENT_END)[:-1])

    def rest(self) -> bytes:
        data, self._pending = self._pending, b""
        return data

    def _rewrite_event(self, event: bytes) -> bytes:
        if self._patch.marker in event:
            lines = event.split(b"\n")
            for index, line in enumerate(lines):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    try:
                        answer = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        continue
                    if self._patch.apply(answer):
                        lines[index] = b"data: " + orjson.dumps(answer)
            event = b"\n".join(lines)
        return event + _EVENT_END
