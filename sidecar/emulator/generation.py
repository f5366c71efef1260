"""One generation request, in order: parse -> fault -> admit -> prompt (pull or compute) ->
generate -> stage (prefill) -> answer, plus the injected faults that break the answer mid-way.

The answer depends only on the prompt (see text.py). Streaming writes one SSE event per output
token and choice, each flushed on its own.
"""

from __future__ import annotations

import logging
import time
import uuid

import orjson
from aiohttp import web

from sidecar.emulator.errors import EmulatorError
from sidecar.emulator.faults import FaultBoard, FaultKind, FaultSpec
from sidecar.emulator.keys import ENGINE, FAULTS, REQUEST_ID
from sidecar.emulator.parse import Endpoint, parse_generation
from sidecar.emulator.responses import SSE_DONE, Envelope, sse
from sidecar.emulator.text import OutputText

log = logging.getLogger("sidecar.emulator.generation")


class _Dropped(Exception):
    """The connection was dropped on purpose (fault) or by the client; nothing more to send."""


def drop_connection(request: web.Request) -> None:
    """Abort the TCP connection without a response (the client sees a disconnect)."""
    transport = request.transport
    if transport is not None:
        transport.abort()


async def read_json(request: web.Request) -> object:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise EmulatorError(400, f"Invalid JSON body: {exc}") from exc


async def handle_generation(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    engine = request.app[ENGINE]
    faults = request.app[FAULTS]
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    request[REQUEST_ID] = request_id
    body = await read_json(request)
    req = parse_generation(endpoint, body, request_id, engine.config)
    remote = engine.resolve_remote(req)

    fault = faults.take(is_prefill=req.is_prefill, is_decode=req.is_decode)
    if fault is not None:
        log.info("injecting fault %s into %s request %s", fault.kind, req.role, request_id)
        if fault.kind is FaultKind.STATUS:
            raise EmulatorError(fault.status, f"Injected fault: status {fault.status}")
        if fault.kind is FaultKind.RESET:
            drop_connection(request)
            return web.Response()  # never written: aiohttp sees the closed transport

    started = time.perf_counter()
    with engine.abortable(req.rid):
        async with engine.admit(req):
            if fault is not None and fault.kind is FaultKind.HANG:
                # A stuck engine: the request counts as running. A client disconnect or close()
                # cancels the wait.
                await faults.wait_released()
                fault = None
            cached = await engine.load_prompt(req, remote)
            await engine.serve_room(req)  # sglang prefill: until a decode claims the room
            envelope = Envelope(req, engine.config.model, int(time.time()))
            if req.stream:
                response = await _stream(request, envelope, cached, fault, faults)
            else:
                response = await _respond(request, envelope, cached, fault, faults)
    log.debug(
        "%s %s request %s: %d prompt tokens (%d cached), %d x %d output tokens in %.3fs",
        req.endpoint,
        req.role,
        request_id,
        req.prompt.num_tokens,
        cached,
        req.n,
        req.output_tokens,
        time.perf_counter() - started,
    )
    return response


async def _respond(
    request: web.Request,
    envelope: Envelope,
    cached: int,
    fault: FaultSpec | None,
    faults: FaultBoard,
) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = envelope.request
    for _ in range(req.output_tokens - 1):
        await engine.decode_step()
    kv_transfer_params = engine.finish(req)
    output = OutputText(req.prompt.text)
    texts = [output.text(k, req.output_tokens) for k in range(req.n)]
    body = orjson.dumps(envelope.full_body(texts, engine.usage(req, cached), kv_transfer_params))
    if fault is not None and fault.kind is FaultKind.BLOAT:
        return await _bloated(request, body, fault.size, faults)
    if fault is not None and fault.kind is FaultKind.STALL:
        if fault.after_chunks == 0:
            await faults.wait_released()  # finished, staged, not a byte sent yet
        else:
            return await _stall_after_status(request, body, faults)
    if fault is not None and fault.kind is FaultKind.DISCONNECT:
        # Promise the whole body, deliver half of it, then drop: a truncated JSON answer.
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(body)
        try:
            await response.prepare(request)
            await response.write(body[: len(body) // 2])
        except ConnectionResetError:
            return response
        drop_connection(request)
        return response
    return web.Response(body=body, content_type="application/json")


BLOAT_PIECE = 64 * 1024


async def _bloated(
    request: web.Request, body: bytes, size: int, faults: FaultBoard
) -> web.StreamResponse:
    """The answer with a ``padding`` field of ``size`` bytes before its own fields, chunked (no
    ``Content-Length``), written piece by piece as the client reads it; every piece written is
    counted in ``faults.padding_sent``. A client that stops reading stops it."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    piece = b"x" * BLOAT_PIECE
    try:
        await response.prepare(request)
        await response.write(b'{"padding": "')
        left = size
        while left > 0:
            chunk = piece[: min(left, BLOAT_PIECE)]
            await response.write(chunk)
            faults.padding_sent += len(chunk)
            left -= len(chunk)
        await response.write(b'", ' + body[1:])
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client went away
    return response


async def _stall_after_status(
    request: web.Request, body: bytes, faults: FaultBoard
) -> web.StreamResponse:
    """Send the status line and headers, pause until released, then the body: the answer is
    on its way but not complete."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = len(body)
    try:
        await response.prepare(request)
        await response.write(b"")  # aiohttp holds headers back until the first write
        await faults.wait_released()
        await response.write(body)
    except ConnectionResetError:
        pass  # the client went away
    return response


class _EventWriter:
    """Writes SSE events one by one and applies a disconnect/stall fault after N of them."""

    def __init__(
        self,
        request: web.Request,
        response: web.StreamResponse,
        fault: FaultSpec | None,
        faults: FaultBoard,
    ) -> None:
        self._request = request
        self._response = response
        self._fault = (
            fault if fault and fault.kind in (FaultKind.DISCONNECT, FaultKind.STALL) else None
        )
        self._faults = faults
        self.sent = 0

    async def send(self, event: bytes) -> None:
        fault = self._fault
        if fault is not None and self.sent >= fault.after_chunks:
            self._fault = None
            if fault.kind is FaultKind.DISCONNECT:
                drop_connection(self._request)
                raise _Dropped
            await self._faults.wait_released()
        try:
            await self._response.write(event)
        except ConnectionResetError as exc:  # the client went away
            raise _Dropped from exc
        self.sent += 1


async def _stream(
    request: web.Request,
    envelope: Envelope,
    cached: int,
    fault: FaultSpec | None,
    faults: FaultBoard,
) -> web.StreamResponse:
    engine = request.app[ENGINE]
    req = envelope.request
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await response.prepare(request)
        events = _EventWriter(request, response, fault, faults)
        output = OutputText(req.prompt.text)
        last = req.output_tokens - 1
        for i in range(req.output_tokens):
            if i > 0:
                await engine.decode_step()
            for k in range(req.n):
                if i == 0 and envelope.is_chat:
                    await events.send(sse(envelope.role_chunk(k)))
                await events.send(sse(envelope.token_chunk(k, output.word(k, i), i == last)))
        engine.finish(req)  # a streamed prefill stages its blocks but reports no params
        if req.include_usage:
            await events.send(sse(envelope.usage_chunk(engine.usage(req, cached))))
        await events.send(SSE_DONE)
        await response.write_eof()
    except (_Dropped, ConnectionResetError):
        log.info("stream of request %s ended early (disconnect)", req.request_id)
    return response
