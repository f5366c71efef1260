"""One generation request, read like the spec: parse → decide → prefill → decode → relay.

Wire details live in the connector, streaming in ``relay``, engine I/O in ``upstream``; this module
orders the steps, records the lifecycle and applies the failure policy:

- prefill answered 4xx → that answer goes to the client as is;
- prefill unreachable, 5xx, or no usable KV params → decode locally (a recorded fallback);
- decode unreachable → 503; decode broken after the first byte → the relay ends the stream.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from sidecar.connectors import Connector
from sidecar.endpoints import Endpoint
from sidecar.errors import (
    REQUEST_ID_HEADER,
    BadRequest,
    EngineError,
    EngineUnreachable,
    PayloadTooLarge,
    SidecarError,
    error_response,
)
from sidecar.headers import engine_leg_headers, gateway_prefill_target, request_id_from
from sidecar.metrics import ROUTES, Metrics
from sidecar.relay import ClientGone, relay
from sidecar.scheduling.scheduler import Placement, Scheduler
from sidecar.tracking import Decision, Phase, RequestRecord, State, Tracker
from sidecar.upstream import Engines, parse_json, read_body

logger = logging.getLogger("sidecar.pipeline")


@dataclass(frozen=True, slots=True)
class _Prefilled:
    kv_params: dict[str, Any]
    cached_tokens: int | None


class Pipeline:
    def __init__(
        self,
        *,
        decode_url: str,
        max_body_bytes: int,
        connector: Connector,
        engines: Engines,
        scheduler: Scheduler,
        tracker: Tracker,
        metrics: Metrics,
        log_requests: bool,
    ) -> None:
        self._decode_url = decode_url
        self._max_body_bytes = max_body_bytes
        self._connector = connector
        self._engines = engines
        self._scheduler = scheduler
        self._tracker = tracker
        self._metrics = metrics
        self._log_requests = log_requests

    async def handle(self, request: web.Request) -> web.StreamResponse:
        request_id = request_id_from(request.headers)
        route = ROUTES[request.path]
        key, record = self._tracker.start(request_id, request.path)
        self._metrics.inflight.inc()
        try:
            answer = await self._serve(request, route, record, request_id)
            record.status = answer.status
            if record.state != State.FAILED:
                if answer.status < 400:
                    record.state = State.COMPLETED
                else:
                    record.state = State.FAILED
                    record.error = f"decode engine answered {answer.status}"
            return answer
        except SidecarError as exc:  # raised before any byte of an answer went out
            _fail(record, exc)
            return error_response(exc, request_id)
        except (asyncio.CancelledError, ClientGone):
            record.state = State.CANCELLED
            raise
        except Exception as exc:
            logger.exception("request %s failed", request_id, extra={"request_id": request_id})
            _fail(record, SidecarError(f"internal error: {type(exc).__name__}"))
            return error_response(SidecarError("internal error in the sidecar"), request_id)
        finally:
            record.mark(Phase.DONE)
            self._tracker.finish(key)
            self._metrics.inflight.dec()
            self._metrics.observe_request(route, record)
            if self._log_requests:
                _log_summary(record)

    async def _serve(
        self, request: web.Request, route: str, record: RequestRecord, request_id: str
    ) -> web.StreamResponse:
        raw = await _read_limited(request, self._max_body_bytes)
        body = _parse_object(raw)
        header = gateway_prefill_target(request.headers)
        client_set_params = self._connector.sanitize(body)
        placement = await self._scheduler.place(body, header)
        _record_placement(record, placement)
        headers = engine_leg_headers(request.headers, request_id)

        prefilled: _Prefilled | None = None
        if placement.endpoint is not None:
            outcome = await self._prefill(request.path, route, body, headers, placement, record)
            if isinstance(outcome, web.Response):
                return outcome
            prefilled = outcome

        if prefilled is not None:
            data = orjson.dumps(self._connector.decode_body(body, prefilled.kv_params))
        else:
            # Unchanged body: send the client's own bytes, no re-serialization.
            data = orjson.dumps(body) if client_set_params else raw
        record.state = State.DECODING
        record.mark(Phase.DECODE_SENT)
        first_byte_seen = False

        def first_byte() -> None:
            nonlocal first_byte_seen
            first_byte_seen = True
            self._scheduler.local_first_byte(placement, record.span(None, Phase.FIRST_BYTE))

        try:
            upstream = await self._engines.send(
                "POST", self._decode_url + request.path, headers=headers, data=data
            )
            try:
                return await relay(
                    request,
                    upstream,
                    record,
                    request_id=request_id,
                    cached_tokens=prefilled.cached_tokens if prefilled else None,
                    on_first_byte=first_byte,
                )
            finally:
                upstream.close()
        finally:
            if not first_byte_seen:
                self._scheduler.local_first_byte(placement, None)

    async def _prefill(
        self,
        path: str,
        route: str,
        body: dict[str, Any],
        headers: CIMultiDict[str],
        placement: Placement,
        record: RequestRecord,
    ) -> _Prefilled | web.Response | None:
        """The prefill leg: KV params, the prefill's own 4xx answer, or None after a fallback.

        Tells the scheduler how it went (the endpoint's health and speed) whatever happens.
        """
        assert placement.endpoint is not None
        endpoint_ok: bool | None = None  # None: cancelled, or the client's fault
        record.state = State.PREFILLING
        record.mark(Phase.PREFILL_SENT)
        try:
            outcome = await self._prefill_leg(
                path, route, body, headers, placement.endpoint, record
            )
            endpoint_ok = outcome is not None if not isinstance(outcome, web.Response) else None
            return outcome
        finally:
            self._scheduler.prefill_finished(
                placement,
                ok=endpoint_ok,
                seconds=record.span(Phase.PREFILL_SENT, Phase.PREFILL_DONE),
            )

    async def _prefill_leg(
        self,
        path: str,
        route: str,
        body: dict[str, Any],
        headers: CIMultiDict[str],
        endpoint: Endpoint,
        record: RequestRecord,
    ) -> _Prefilled | web.Response | None:
        data = orjson.dumps(self._connector.prefill_body(body, route))
        try:
            upstream = await self._engines.send(
                "POST", endpoint.url + path, headers=headers, data=data
            )
            answer = await read_body(upstream)
        except EngineUnreachable as exc:
            self._fall_back(record, "prefill_unreachable", "unreachable", exc.message)
            return None
        finally:
            record.mark(Phase.PREFILL_DONE)

        if 400 <= upstream.status < 500:
            self._metrics.prefill_requests.labels("client_error").inc()
            record.state = State.FAILED
            record.error = f"prefill answered {upstream.status}"
            return web.Response(
                status=upstream.status,
                body=answer,
                headers={
                    "content-type": upstream.headers.get("content-type", "application/json"),
                    REQUEST_ID_HEADER: headers[REQUEST_ID_HEADER],
                },
            )
        if upstream.status >= 300:
            self._fall_back(
                record, "prefill_error", "server_error", f"prefill answered {upstream.status}"
            )
            return None
        try:
            parsed = parse_json(answer, "prefill")
        except EngineError as exc:
            self._fall_back(record, "prefill_bad_response", "bad_response", exc.message)
            return None
        kv_params = self._connector.kv_params(parsed, endpoint)
        if kv_params is None:
            self._fall_back(
                record, "no_kv_params", "bad_response", "prefill answer has no usable KV params"
            )
            return None
        self._metrics.prefill_requests.labels("success").inc()
        return _Prefilled(kv_params, _cached_tokens(parsed))

    def _fall_back(
        self, record: RequestRecord, reason: str, prefill_outcome: str, detail: str
    ) -> None:
        """Record why the prefill was abandoned; the caller decodes locally (returns None)."""
        self._metrics.prefill_requests.labels(prefill_outcome).inc()
        self._metrics.fallbacks.labels(reason).inc()
        record.decision = Decision.LOCAL
        record.fallback_reason = reason
        logger.warning(
            "request %s: prefill on %s failed (%s), decoding locally",
            record.id,
            record.prefill_endpoint,
            detail,
            extra={"request_id": record.id},
        )


async def _read_limited(request: web.Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit``."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    parts: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


def _parse_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _cached_tokens(answer: Any) -> int | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _record_placement(record: RequestRecord, placement: Placement) -> None:
    record.reason = placement.decision.reason
    record.predicted_prefill_s = placement.decision.predicted_s
    if placement.endpoint is None:
        record.decision = Decision.LOCAL
    else:
        record.decision = Decision.REMOTE
        record.prefill_endpoint = str(placement.endpoint)


def _fail(record: RequestRecord, exc: SidecarError) -> None:
    record.state = State.FAILED
    record.status = record.status or exc.status
    record.error = exc.message


def _log_summary(record: RequestRecord) -> None:
    durations = record.durations()
    logger.info(
        "%s %s decision=%s reason=%s prefill=%s fallback=%s status=%s state=%s ttft=%s total=%s",
        record.id,
        record.path,
        record.decision,
        record.reason,
        record.prefill_endpoint,
        record.fallback_reason,
        record.status,
        record.state,
        _ms(durations["ttft"]),
        _ms(durations["total"]),
        extra={"request_id": record.id},
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}ms"
