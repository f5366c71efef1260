"""One generation request, the same for every protocol: parse → place → run → relay → record.

The connector runs the whole exchange with the engines (``sidecar.connectors``), the relay
streams the answer (``sidecar.relay``); this module reads the request, asks the scheduler where it
prefills, and is the only writer of the request's lifecycle record — from the connector's
``Progress`` milestones and the outcomes the parts return (docs/behavior.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

import orjson
from aiohttp import web

from sidecar.body import Bodies, Held
from sidecar.config import Settings
from sidecar.connectors import Connector
from sidecar.connectors.exchange import Answer, Exchange, Refused
from sidecar.errors import (
    REQUEST_ID_HEADER,
    BadRequest,
    DecodeDown,
    SidecarError,
    error_response,
)
from sidecar.headers import GatewayHeaders, engine_request_id, request_id_from
from sidecar.observability.metrics import ROUTES, Metrics
from sidecar.observability.tracing import NO_TRACING, NoTracing, RequestTrace, Tracing
from sidecar.observability.tracking import (
    Decision,
    Phase,
    RequestRecord,
    State,
    Tracker,
    name_this_task,
)
from sidecar.relay import Relayed, relay
from sidecar.scheduling.placement import Placement
from sidecar.scheduling.ranks import RankPorts
from sidecar.scheduling.scheduler import Scheduler
from sidecar.security.trust import PrefillGuard
from sidecar.tasks import OnFailure

logger = logging.getLogger("sidecar.pipeline")


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    """The settings the pipeline uses, under their own names (``from_settings``)."""

    request_timeout_s: float
    """0: no limit."""
    stream_idle_timeout_s: float
    log_requests: bool
    decode_down_retry_after_s: int = 1
    """``Retry-After`` of the 503 sent while the decode engine is known down: the time the
    ``/health`` polls that could find it back take."""

    @classmethod
    def from_settings(cls, settings: Settings) -> PipelineOptions:
        polls_s = settings.ready_interval_s * settings.ready_success_threshold
        return cls(
            request_timeout_s=settings.request_timeout_s,
            stream_idle_timeout_s=settings.stream_idle_timeout_s,
            log_requests=settings.log_requests,
            decode_down_retry_after_s=max(1, math.ceil(polls_s)),
        )


class Pipeline:
    def __init__(
        self,
        options: PipelineOptions,
        *,
        connector: Connector,
        scheduler: Scheduler,
        guard: PrefillGuard,
        gateway: GatewayHeaders,
        tracker: Tracker,
        metrics: Metrics,
        bodies: Bodies,
        tracing: Tracing | NoTracing = NO_TRACING,
        rank_ports: RankPorts | None = None,
    ) -> None:
        self._options = options
        self._bodies = bodies
        self._rank_ports = RankPorts() if rank_ports is None else rank_ports
        self._tracing = tracing
        self._connector = connector
        self._scheduler = scheduler
        self._guard = guard
        self._gateway = gateway
        self._tracker = tracker
        self._metrics = metrics

    async def handle(self, request: web.Request) -> web.StreamResponse:
        request_id = request_id_from(request.headers)
        name_this_task(request_id, "handler")
        key, record = self._tracker.start(request_id, request.path, engine_request_id(request_id))
        headers, method, path = request.headers, request.method, request.path
        trace = self._tracing.request(headers, method, path, request_id, route=path)
        options = self._options
        deadline = (
            asyncio.get_running_loop().time() + options.request_timeout_s
            if options.request_timeout_s
            else None
        )
        # The exchange's outcome is relayed from this frame, not from one of its own: a frame
        # more is held for a stream's whole life (memory per open stream,
        # bench/stream_memory.py).
        try:
            with self._bodies.budget.hold() as held:
                placement, progress, answer = await self._exchange(
                    request, record, request_id, trace, deadline, held
                )
            # Returned to the budget: no leg is built from the body again, and nothing still
            # refers to it (``_exchange``'s frame is gone), so a long stream does not keep it
            # alive.
            try:
                if isinstance(answer, Refused):
                    return _refusal(record, answer, request_id)
                relaying = trace.phase("relay")
                try:
                    relayed = await relay(
                        request,
                        answer,
                        request_id=request_id,
                        idle_timeout_s=options.stream_idle_timeout_s,
                        deadline=deadline,
                        status_sent=progress.status_sent,
                    )
                finally:
                    answer.upstream.close()
                trace.done(relaying, {"pd_sidecar.client_gone": relayed.client_gone or None})
                _record_relayed(record, relayed, request_id)
                return relayed.response
            finally:
                placement.rank.end()  # the decode rank's slot, held from the placement on
        except SidecarError as exc:  # raised before any byte of an answer went out
            _fail(record, exc)
            return error_response(exc, request_id)
        except orjson.JSONEncodeError as exc:  # parsed, but nested too deeply to send on
            error = BadRequest(f"request body cannot be forwarded: {exc}")
            _fail(record, error)
            return error_response(error, request_id)
        except asyncio.CancelledError:
            record.state = State.CANCELLED
            raise
        except Exception as exc:
            logger.exception("request %s failed", request_id, extra={"request_id": request_id})
            _fail(record, SidecarError(f"internal error: {type(exc).__name__}"))
            return error_response(SidecarError("internal error in the sidecar"), request_id)
        finally:
            record.mark(Phase.DONE)
            self._tracker.finish(key)
            self._metrics.observe_request(ROUTES[request.path], record)
            if self._options.log_requests:
                _log_summary(record)
            trace.end(record)

    async def _exchange(
        self,
        request: web.Request,
        record: RequestRecord,
        request_id: str,
        trace: RequestTrace,
        deadline: float | None,
        held: Held,
    ) -> tuple[Placement, _Progress, Answer | Refused]:
        """Read the body, place the request and run the connector: its answer, once the decode
        engine's has started (or a refusal)."""
        parsed = await self._bodies.read(request, held)
        body = parsed.body
        rank = self._rank_ports.rank_for(request)
        down = self._scheduler.ranks.down(rank)
        if down is not None:  # before any prefill: KV staged now could only be stranded
            raise DecodeDown(
                f"the decode engine is down, nothing was sent: {down}",
                self._options.decode_down_retry_after_s,
            )
        placing = trace.phase("placement")
        header = self._gateway.prefill_target(request.headers)
        if header is not None:
            header = await self._guard.check(header)
        sanitized = self._connector.sanitize(body)
        placement, exact = await self._scheduler.place_request(
            body,
            header,
            local_reason=self._connector.unsupported(body),
            text=parsed.messages,
            rank=rank,
        )
        trace.placed(placing, placement)
        with OnFailure(placement.rank.end):  # the rank is the relay's once it answers
            _record_placement(record, placement)
            progress = _Progress(record, self._scheduler, placement)
            exchange = Exchange(
                request_id=request_id,
                path=request.path,
                body=body,
                raw=None if sanitized else parsed.raw,
                headers=self._gateway.engine_leg(request.headers, record.engine_id),
                placement=placement,
                deadline=deadline,
                progress=progress,
                trace=trace,
                members=parsed.members,
                exact=exact,
            )
            del parsed, body
            try:
                answer = await self._connector.run(exchange)
            finally:
                progress.exchange_ended()
        return placement, progress, answer


class _Progress:
    """The connector's milestones, written into the record (and the scheduler's local view)."""

    __slots__ = ("_placement", "_prefilling", "_record", "_scheduler", "_told")

    def __init__(self, record: RequestRecord, scheduler: Scheduler, placement: Placement) -> None:
        self._record = record
        self._scheduler = scheduler
        self._placement = placement
        self._told = False
        self._prefilling = False

    def prefill_sent(self, placement: Placement, attempt: int) -> None:
        record = self._record
        record.state = State.PREFILLING
        record.mark(Phase.PREFILL_SENT)
        record.prefill_attempts = attempt
        _record_prefill(record, placement)  # a retry's endpoint, and what was predicted of it
        self._prefilling = True

    def prefill_ended(self) -> None:
        record = self._record
        record.phases[Phase.PREFILL_DONE] = record.elapsed()
        self._prefilling = False
        if Phase.DECODE_SENT in record.phases and record.state == State.PREFILLING:
            record.state = State.DECODING  # legs sent at once (SGLang): the decode goes on

    def fell_back(self, reason: str, *, local: bool) -> None:
        self._record.fallback_reason = reason
        if local:
            self._record.decision = Decision.LOCAL

    def decode_sent(self) -> None:
        # With legs sent at once, the record says "prefilling" until the prefill ends.
        if not self._prefilling:
            self._record.state = State.DECODING
        self._record.mark(Phase.DECODE_SENT)
        # Sent again to another rank when its rank could not be connected to: the last one.
        _record_rank(self._record, self._placement)

    def first_byte(self) -> None:
        self._record.state = State.DECODING
        self._record.mark(Phase.FIRST_BYTE)
        self._tell(self._record.span(None, Phase.FIRST_BYTE))

    def status_sent(self, status: int) -> None:
        self._record.status = status

    def exchange_ended(self) -> None:
        """The exchange ended: a local prefill that produced no first byte still leaves the
        scheduler's local queue."""
        self._tell(None)

    def _tell(self, seconds: float | None) -> None:
        if not self._told:
            self._told = True
            self._scheduler.local_first_byte(self._placement, seconds)


def _refusal(record: RequestRecord, refused: Refused, request_id: str) -> web.Response:
    record.state, record.status, record.error = State.FAILED, refused.status, refused.error
    return web.Response(
        status=refused.status,
        body=refused.body,
        headers={"content-type": refused.content_type, REQUEST_ID_HEADER: request_id},
    )


def _record_relayed(record: RequestRecord, relayed: Relayed, request_id: str) -> None:
    if relayed.error is not None and not relayed.client_gone:
        # The client was told a stable sentence (sidecar.errors): the why is here, and in the
        # record.
        logger.warning(
            "request %s: the answer was cut after it started: %s",
            request_id,
            relayed.error.message,
            extra={"request_id": request_id},
        )
    record.status = relayed.status
    if relayed.client_gone:
        record.state = State.CANCELLED
    elif relayed.error is not None:
        record.state, record.error = State.FAILED, relayed.error.message
    elif relayed.status >= 400:
        record.state, record.error = State.FAILED, f"engine answered {relayed.status}"
    else:
        record.state = State.COMPLETED


def _record_placement(record: RequestRecord, placement: Placement) -> None:
    _record_rank(record, placement)
    record.reason = placement.decision.reason
    record.predicted_prefill_s = placement.decision.predicted_s
    record.tokenize_s = placement.tokenize_s
    if placement.endpoint is None:
        record.decision = Decision.LOCAL
        record.cached_source = placement.cached_source
    else:
        record.decision = Decision.REMOTE
        _record_prefill(record, placement)


def _record_prefill(record: RequestRecord, placement: Placement) -> None:
    record.prefill_endpoint = str(placement.endpoint)
    record.predicted_cached_tokens = placement.decision.remote_cached_tokens
    record.cached_source = placement.cached_source


def _record_rank(record: RequestRecord, placement: Placement) -> None:
    record.decode_rank, record.decode_url = placement.rank.index, placement.rank.url


def _fail(record: RequestRecord, exc: SidecarError) -> None:
    record.state = State.FAILED
    record.status = record.status or exc.status
    record.error = exc.message


def _log_summary(record: RequestRecord) -> None:
    durations = record.durations()
    logger.info(
        "%s %s decision=%s reason=%s prefill=%s rank=%s fallback=%s status=%s state=%s ttft=%s "
        "total=%s engine_id=%s",
        record.id,
        record.path,
        record.decision,
        record.reason,
        record.prefill_endpoint,
        record.decode_rank,
        record.fallback_reason,
        record.status,
        record.state,
        _ms(durations["ttft"]),
        _ms(durations["total"]),
        record.engine_id,
        extra={"request_id": record.id},
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}ms"
