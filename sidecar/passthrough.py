"""Every path the sidecar does not own goes to the decode engine unchanged, streaming both ways.

With data-parallel ranks, to the ready rank with the least load (no prompt to match); a rank that
cannot be connected to passes it on to another, like a generation request's decode leg.

The engines' other generation routes (``sidecar.paths.GUARDED_ROUTES``: ``/v1/responses``,
``/generate``, ...) read the same KV fields the pipeline owns. Their bodies are read whole (under
the pipeline's size, time and budget limits, ``sidecar.body``) and refused with 400 when they
carry a client's ``kv_transfer_params`` or SGLang bootstrap field; otherwise the bytes go on
unchanged. Refusing rather than stripping keeps passthrough's one rule — what reaches the engine
is what the client sent — and needs no re-serialization.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import orjson
from aiohttp import web

from sidecar.body import Bodies, Held
from sidecar.config import Settings
from sidecar.connectors.decode import on_a_rank
from sidecar.connectors.exchange import Answer
from sidecar.engines.upstream import Body, Engines, Streamed
from sidecar.errors import REQUEST_ID_HEADER, BadRequest, SidecarError, error_response
from sidecar.headers import GatewayHeaders, request_id_from
from sidecar.observability.metrics import Metrics
from sidecar.observability.tracing import NO_TRACING, NoTracing, Tracing
from sidecar.observability.tracking import name_this_task
from sidecar.paths import GUARDED_ROUTES
from sidecar.relay import relay
from sidecar.sanitize import client_kv_field
from sidecar.scheduling.ranks import DecodeRanks, RankPorts


@dataclass(frozen=True, slots=True)
class PassthroughOptions:
    """The settings a passthrough uses, under their own names (``from_settings``)."""

    decode_first_byte_timeout_s: float
    stream_idle_timeout_s: float

    @classmethod
    def from_settings(cls, settings: Settings) -> PassthroughOptions:
        return cls(
            decode_first_byte_timeout_s=settings.decode_first_byte_timeout_s,
            stream_idle_timeout_s=settings.stream_idle_timeout_s,
        )


class Passthrough:
    def __init__(
        self,
        options: PassthroughOptions,
        *,
        engines: Engines,
        ranks: DecodeRanks,
        gateway: GatewayHeaders,
        metrics: Metrics,
        bodies: Bodies,
        tracing: Tracing | NoTracing = NO_TRACING,
        rank_ports: RankPorts | None = None,
    ) -> None:
        self._ranks = ranks
        self._rank_ports = RankPorts() if rank_ports is None else rank_ports
        self._bodies = bodies
        self._tracing = tracing
        self._first_byte_timeout_s = options.decode_first_byte_timeout_s
        self._idle_timeout_s = options.stream_idle_timeout_s
        self._engines = engines
        self._gateway = gateway
        self._metrics = metrics

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Not tracked in /debug/requests; counted in the requests metric as route ``other``.
        The engine and the client see the same ``x-request-id`` (the client's, or a new one)."""
        status: int | None = None
        cancelled = False
        error: str | None = None
        request_id = request_id_from(request.headers)
        name_this_task(request_id, "passthrough")
        headers = self._gateway.passthrough(request.headers)
        headers[REQUEST_ID_HEADER] = request_id
        # One span: the engine's traceparent names it.
        trace = self._tracing.request(request.headers, request.method, request.path, request_id)
        headers = trace.headers(headers)
        claim = None
        held = self._bodies.budget.hold()  # a guarded route's body, until the engine answers
        try:
            data: Body = None
            if request.path in GUARDED_ROUTES and request.body_exists:
                data = await self._checked_body(request, held)
            elif request.body_exists:
                data = Streamed(request.content.iter_any(), request.content_length)
            claim = self._ranks.claim_any(self._rank_ports.rank_for(request))
            upstream, first = await on_a_rank(
                self._ranks,
                claim,
                self._engines,
                self._metrics,
                request.method,
                request.raw_path,
                headers=headers,
                data=data,
                by=asyncio.get_running_loop().time() + self._first_byte_timeout_s,
                limit=f"{self._first_byte_timeout_s:g}s (SIDECAR_DECODE_FIRST_BYTE_TIMEOUT_S)",
            )
            held.release()
            data = None
            try:
                relayed = await relay(
                    request,
                    Answer(upstream, first),
                    request_id=request_id,
                    idle_timeout_s=self._idle_timeout_s,
                )
            finally:
                upstream.close()
            cancelled = relayed.client_gone
            if relayed.error is None and not relayed.client_gone:
                status = relayed.status
            elif relayed.error is not None:
                error = relayed.error.message
            return relayed.response
        except SidecarError as exc:
            status, error = exc.status, exc.message
            return error_response(exc, request_id)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            held.release()
            if claim is not None:
                claim.end()
            self._metrics.observe_passthrough(status, cancelled)
            if error is None and status is not None and status >= 500:
                error = f"the engine answered {status}"
            state = "cancelled" if cancelled else "failed" if error else "completed"
            # A 4xx is the client's: not the span's error (HTTP server convention).
            client_fault = status is not None and status < 500
            trace.finish(status, state, None if cancelled or client_fault else error)

    async def _checked_body(self, request: web.Request, held: Held) -> bytes:
        """The body of a request to a guarded generation route, as the client sent it; raises
        ``BadRequest`` when it carries KV fields only the sidecar may set, or when it is not JSON
        (the engine's parser accepts what orjson refuses, ``NaN`` say: unread is unchecked)."""
        raw = bytes(await self._bodies.read_raw(request, held))
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise BadRequest(f"the body of {request.path} is not valid JSON") from None
        field = client_kv_field(body)
        if field is not None:
            raise BadRequest(
                f"'{field}' is set by the sidecar only: a client may not send it "
                f"(to {request.path} or any other generation route)"
            )
        return raw
