"""One generation request, read like the spec: parse → decide → prefill → decode → relay.

Wire details live in the connector, streaming in ``relay``, engine I/O in ``upstream``, the
prefill leg and its failure policy in ``prefill``; this module orders the steps, applies the
deadlines and records the lifecycle (docs/behavior.md):

- prefill answered 4xx → that answer goes to the client as is;
- prefill failed → retried when transient, then a local decode (or 503 with fallback ``fail``);
- decode unreachable → 503, silent past its first-byte timeout → 504, broken after the first byte
  → the relay ends the stream;
- client gone (or decode failed) after the prefill but before the decode answer started → the
  staged KV is released at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from sidecar.connectors import Connector
from sidecar.errors import (
    BadRequest,
    EngineTimeout,
    EngineUnreachable,
    PayloadTooLarge,
    RequestTimeout,
    SidecarError,
    error_response,
)
from sidecar.headers import engine_leg_headers, gateway_prefill_target, request_id_from
from sidecar.metrics import ROUTES, Metrics
from sidecar.prefill import Prefilled, PrefillLeg
from sidecar.relay import relay
from sidecar.scheduling.scheduler import Placement, Scheduler
from sidecar.tracking import Decision, Phase, RequestRecord, State, Tracker
from sidecar.trust import PrefillGuard
from sidecar.upstream import Engines, read_body

logger = logging.getLogger("sidecar.pipeline")

MAX_PENDING_RELEASES = 1024
"""KV releases in the background at once; beyond it the engine's own expiry has to do."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int
    client_body_timeout_s: float
    connect_timeout_s: float
    first_byte_timeout_s: float
    stream_idle_timeout_s: float
    request_timeout_s: float
    """0: no limit."""


class Pipeline:
    def __init__(
        self,
        *,
        decode_url: str,
        limits: Limits,
        connector: Connector,
        engines: Engines,
        scheduler: Scheduler,
        prefill: PrefillLeg,
        guard: PrefillGuard,
        tracker: Tracker,
        metrics: Metrics,
        release_on_disconnect: bool,
        log_requests: bool,
    ) -> None:
        self._decode_url = decode_url
        self._limits = limits
        self._connector = connector
        self._engines = engines
        self._scheduler = scheduler
        self._prefill = prefill
        self._guard = guard
        self._tracker = tracker
        self._metrics = metrics
        self._release_on_disconnect = release_on_disconnect
        self._log_requests = log_requests
        self._releases: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Let KV releases under way finish (each is bounded by its own timeout)."""
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        request_id = request_id_from(request.headers)
        route = ROUTES[request.path]
        key, record = self._tracker.start(request_id, request.path)
        self._metrics.inflight.inc()
        loop = asyncio.get_running_loop()
        deadline = (
            loop.time() + self._limits.request_timeout_s if self._limits.request_timeout_s else None
        )
        try:
            answer = await self._serve(request, route, record, request_id, deadline)
            record.status = answer.status
            if record.state not in (State.FAILED, State.CANCELLED):
                if answer.status < 400:
                    record.state = State.COMPLETED
                else:
                    record.state = State.FAILED
                    record.error = record.error or f"engine answered {answer.status}"
            return answer
        except SidecarError as exc:  # raised before any byte of an answer went out
            _fail(record, exc)
            return error_response(exc, request_id)
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
            self._metrics.inflight.dec()
            self._metrics.observe_request(route, record)
            if self._log_requests:
                _log_summary(record)

    async def _serve(
        self,
        request: web.Request,
        route: str,
        record: RequestRecord,
        request_id: str,
        deadline: float | None,
    ) -> web.StreamResponse:
        raw = await _read_limited(
            request, self._limits.max_body_bytes, self._limits.client_body_timeout_s
        )
        body = _parse_object(raw)
        header = gateway_prefill_target(request.headers)
        if header is not None:
            header = await self._guard.check(header)
        client_set_params = self._connector.sanitize(body)
        placement = await self._scheduler.place(
            body, header, local_reason=self._connector.unsupported(body)
        )
        _record_placement(record, placement)
        headers = engine_leg_headers(request.headers, request_id)

        prefilled: Prefilled | None = None
        if placement.endpoint is not None:
            outcome = await self._prefill.run(
                request.path,
                route,
                body,
                headers,
                placement,
                record,
                deadline,
                orphaned=lambda done: self._release(request.path, route, body, headers, done),
            )
            if isinstance(outcome, web.Response):
                return outcome
            prefilled = outcome

        if prefilled is not None:
            data = orjson.dumps(self._connector.decode_body(body, prefilled.kv_params))
        else:
            # Unchanged body: send the client's own bytes, no re-serialization.
            data = orjson.dumps(body) if client_set_params else raw
        try:
            return await self._decode(
                request, data, headers, record, placement, prefilled, request_id, deadline
            )
        except (asyncio.CancelledError, SidecarError) as exc:
            # The client left, or the decode leg failed, before the decode answer started:
            # whether the engine pulled the KV is unknowable, so release it (a second pull of
            # pulled KV fails harmlessly) rather than strand it on the prefill engine. An
            # unreachable decode engine got nothing and would not take the release either.
            unreachable = isinstance(exc, EngineUnreachable)
            if prefilled is not None and Phase.FIRST_BYTE not in record.phases and not unreachable:
                self._release(request.path, route, body, headers, prefilled)
            raise

    async def _decode(
        self,
        request: web.Request,
        data: bytes,
        headers: CIMultiDict[str],
        record: RequestRecord,
        placement: Placement,
        prefilled: Prefilled | None,
        request_id: str,
        deadline: float | None,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        first_byte_by = _earliest(loop.time() + self._limits.first_byte_timeout_s, deadline)
        first_byte_seen = False

        def first_byte() -> None:
            nonlocal first_byte_seen
            first_byte_seen = True
            self._scheduler.local_first_byte(placement, record.span(None, Phase.FIRST_BYTE))

        record.state = State.DECODING
        record.mark(Phase.DECODE_SENT)
        try:
            try:
                async with asyncio.timeout_at(first_byte_by):
                    upstream = await self._engines.send(
                        "POST",
                        self._decode_url + request.path,
                        headers=headers,
                        data=data,
                        client_timeout=aiohttp.ClientTimeout(
                            total=None, sock_connect=self._limits.connect_timeout_s
                        ),
                        role="the decode engine",
                    )
            except TimeoutError:
                raise _first_byte_timeout(self._limits.first_byte_timeout_s) from None
            try:
                return await relay(
                    request,
                    upstream,
                    record,
                    request_id=request_id,
                    cached_tokens=prefilled.cached_tokens if prefilled else None,
                    on_first_byte=first_byte,
                    first_byte_by=first_byte_by,
                    idle_timeout_s=self._limits.stream_idle_timeout_s,
                    deadline=deadline,
                )
            finally:
                upstream.close()
        finally:
            if not first_byte_seen:
                self._scheduler.local_first_byte(placement, None)

    def _release(
        self,
        path: str,
        route: str,
        body: dict[str, Any],
        headers: CIMultiDict[str],
        prefilled: Prefilled,
    ) -> None:
        """Free KV staged for a client who left before its decode leg: off the request path."""
        if not self._release_on_disconnect:
            return
        release = self._connector.release_body(body, prefilled.kv_params, route)
        if release is None:
            return
        if len(self._releases) >= MAX_PENDING_RELEASES:
            self._metrics.kv_releases.labels("skipped").inc()
            return
        task = asyncio.create_task(self._send_release(path, headers, orjson.dumps(release)))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _send_release(self, path: str, headers: CIMultiDict[str], data: bytes) -> None:
        timeout = aiohttp.ClientTimeout(
            total=self._limits.first_byte_timeout_s, sock_connect=self._limits.connect_timeout_s
        )
        try:
            upstream = await self._engines.send(
                "POST",
                self._decode_url + path,
                headers=headers,
                data=data,
                client_timeout=timeout,
                role="the decode engine",
            )
            await read_body(upstream)
        except SidecarError as exc:
            self._metrics.kv_releases.labels("failed").inc()
            logger.warning("releasing staged KV failed: %s", exc.message)
            return
        self._metrics.kv_releases.labels("sent" if upstream.status < 400 else "failed").inc()


def _earliest(when: float, deadline: float | None) -> float:
    return when if deadline is None else min(when, deadline)


def _first_byte_timeout(seconds: float) -> EngineTimeout:
    return EngineTimeout(
        f"the decode engine sent nothing within {seconds:g}s "
        "(SIDECAR_DECODE_FIRST_BYTE_TIMEOUT_S or SIDECAR_REQUEST_TIMEOUT_S)"
    )


async def _read_limited(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit``."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body exceeds {limit} bytes")
                parts.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout_s:g}s") from None
    return b"".join(parts)


# Types of the fields the sidecar itself reads (the engine validates everything else).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "messages": (list,),
    "prompt": (str, list),
    "stream": (bool,),
    "stream_options": (dict, type(None)),
    "n": (int,),
    "max_tokens": (int, type(None)),
    "max_completion_tokens": (int, type(None)),
    "kv_transfer_params": (dict, type(None)),
}


def _parse_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    for name, types in _FIELD_TYPES.items():
        if name in body:
            value = body[name]
            bad_bool = isinstance(value, bool) and bool not in types
            if bad_bool or not isinstance(value, types):
                expected = " or ".join(_TYPE_NAMES[t] for t in types)
                raise BadRequest(f"'{name}' must be {expected}")
    return body


_TYPE_NAMES = {
    list: "an array",
    str: "a string",
    bool: "a boolean",
    dict: "an object",
    int: "an integer",
    type(None): "null",
}


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
